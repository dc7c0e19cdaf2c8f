package app_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/migrate"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/services/app"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func testConfig(url string) *config.Config {
	port := 0
	c := &config.Config{Database: config.Database{URL: url}, Server: config.Server{Host: "127.0.0.1", Port: &port}}
	c.Defaults()
	return c
}

func start(t *testing.T, cfg *config.Config) *app.App {
	t.Helper()
	a, err := app.New(cfg, app.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Stop(context.Background()) })
	return a
}

func TestResolveRoles(t *testing.T) {
	t.Parallel()
	run, notBuilt, err := app.ResolveRoles(nil)
	if err != nil || !slices.Equal(run, []config.Role{config.RoleAPI, config.RoleJoinService, config.RoleGateway, config.RoleNodeSpecController, config.RolePlacer, config.RoleCommandSweeper, config.RoleOutboxRelay, config.RoleControllers, config.RoleMetal, config.RoleVPS, config.RoleScheduler, config.RoleSinks, config.RoleIAM}) || len(notBuilt) != 0 {
		t.Fatalf("all: run=%v notBuilt=%v err=%v", run, notBuilt, err)
	}
	if len(run)+len(notBuilt) != len(config.AllRoles) {
		t.Fatalf("all must account for every role: %v + %v", run, notBuilt)
	}

	// The spec's worker mode, by its name or by its four roles: every
	// worker part, no api, gateway or joinservice.
	for _, in := range []string{"worker", "controllers,scheduler,sinks,iam"} {
		run, _, err = app.ResolveRoles([]string{in})
		if err != nil || !slices.Equal(run, []config.Role{config.RoleNodeSpecController, config.RolePlacer, config.RoleCommandSweeper, config.RoleOutboxRelay, config.RoleControllers, config.RoleMetal, config.RoleVPS, config.RoleScheduler, config.RoleSinks, config.RoleIAM}) {
			t.Fatalf("%s: run=%v err=%v", in, run, err)
		}
	}

	_, _, err = app.ResolveRoles([]string{"bogus"})
	if fe, ok := fault.As(err); !ok || fe.Code != fault.InvalidConfig || !strings.Contains(fe.Message, "bogus") {
		t.Fatalf("unknown role: %v", err)
	}
}

// TestAllRunsTheGatewayPerHostGateway: `all` runs a gateway when
// host.gateway is set (listening there), none when nothing says so, and
// still one on gateway.listen alone (the old key, for a release); a named
// gateway role listens on :8443 by default.
func TestAllRunsTheGatewayPerHostGateway(t *testing.T) {
	t.Parallel()
	hasGateway := func(a *app.App) bool { return slices.Contains(a.Roles(), config.RoleGateway) }
	for _, c := range []struct {
		name         string
		roles        []string
		host, listen string
		want         bool
		wantListen   string
	}{
		{"all, nothing set", nil, "", "", false, ""},
		{"all, host.gateway", []string{"all"}, "127.0.0.1:9443", "", true, "127.0.0.1:9443"},
		{"all, host.gateway and gateway.listen", nil, "gw.example:443", "127.0.0.1:9443", true, "127.0.0.1:9443"},
		{"all, gateway.listen alone", nil, "", "127.0.0.1:9443", true, "127.0.0.1:9443"},
		{"gateway named", []string{"gateway"}, "", "", true, ":8443"},
	} {
		cfg := testConfig("postgres://nobody@127.0.0.1:1/none")
		cfg.Roles, cfg.Host.Gateway, cfg.Gateway.Listen = c.roles, c.host, c.listen
		cfg.JoinService.KeyDir = t.TempDir()
		a, err := app.New(cfg, app.Options{})
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if hasGateway(a) != c.want || (c.want && cfg.Gateway.Listen != c.wantListen) {
			t.Errorf("%s: gateway %v listening on %q, want %v on %q", c.name, hasGateway(a), cfg.Gateway.Listen, c.want, c.wantListen)
		}
	}
	cfg := testConfig("postgres://nobody@127.0.0.1:1/none")
	cfg.Host.Gateway = "9443"
	if fe, ok := fault.As(cfg.Validate()); !ok || fe.Field != "host.gateway" {
		t.Errorf("host.gateway without a port: %v", cfg.Validate())
	}
}

func TestNewRejectsBadConfigBeforeTouchingTheDatabase(t *testing.T) {
	t.Parallel()
	// Port 1 refuses connections: reaching for the database would be
	// UNAVAILABLE, not INVALID_CONFIG.
	cfg := testConfig("postgres://nobody@127.0.0.1:1/none")
	cfg.Roles = []string{"api", "bogus"}
	cfg.Log.Level = "loud"
	_, err := app.New(cfg, app.Options{})
	var got []string
	for _, fe := range fault.All(err) {
		if fe.Code != fault.InvalidConfig {
			t.Errorf("code %s: %v", fe.Code, fe)
		}
		got = append(got, fe.Field)
	}
	if !slices.Equal(got, []string{"roles", "log.level"}) {
		t.Fatalf("fields = %v (%v)", got, err)
	}

	cfg = testConfig("")
	if _, err := app.New(cfg, app.Options{}); fault.CodeOf(err) != fault.InvalidConfig {
		t.Fatalf("no database: %v", err)
	}
}

func TestStartRefusesSchemaBehind(t *testing.T) {
	t.Parallel()
	cfg := testConfig(pgtest.NewEmptyDB(t))
	cfg.Server.NoMigrate = true
	a, err := app.New(cfg, app.Options{})
	if err != nil {
		t.Fatal(err)
	}
	err = a.Start(t.Context())
	a.Stop(context.Background())
	if !errors.Is(err, migrate.ErrSchemaBehind) {
		t.Fatalf("Start = %v, want ErrSchemaBehind", err)
	}
	if !strings.Contains(err.Error(), "run `better-compute migrate`") || !strings.Contains(err.Error(), "version 0") {
		t.Fatalf("the message must say what to run: %v", err)
	}
	if a.Addr() != "" {
		// Addr is only set once listening; a refused start never listens.
		t.Fatalf("a refused start is listening on %s", a.Addr())
	}
}

func TestServeAnswersOverGRPCAndREST(t *testing.T) {
	t.Parallel()
	u := pgtest.NewEmptyDB(t)
	a := start(t, testConfig(u)) // migrates: no --no-migrate
	base := "http://" + a.Addr()

	t.Run("readyz reports the checks", func(t *testing.T) {
		status, body := get(t, base+"/readyz")
		if status != http.StatusOK {
			t.Fatalf("readyz %d: %s", status, body)
		}
		var rep struct {
			Ready  bool
			Checks []struct{ Name string }
		}
		if err := json.Unmarshal(body, &rep); err != nil || !rep.Ready || len(rep.Checks) != 3 {
			t.Fatalf("readyz body %s (%v)", body, err)
		}
	})

	t.Run("healthz and metrics", func(t *testing.T) {
		if status, _ := get(t, base+"/healthz"); status != http.StatusOK {
			t.Fatalf("healthz %d", status)
		}
		if _, body := get(t, "http://"+a.AdminAddr()+"/metrics"); !strings.Contains(string(body), "bettercompute_build_info{") {
			t.Fatalf("metrics lack build info:\n%.500s", body)
		}
	})

	t.Run("REST version", func(t *testing.T) {
		status, body := post(t, base+"/api/compute/system/version", `{}`)
		if status != http.StatusOK {
			t.Fatalf("%d %s", status, body)
		}
		var v struct {
			Version               string
			SchemaVersion         string // int64 is a string in proto3 JSON
			RequiredSchemaVersion string
		}
		if err := json.Unmarshal(body, &v); err != nil {
			t.Fatal(err)
		}
		if v.Version == "" || v.SchemaVersion != v.RequiredSchemaVersion || v.SchemaVersion == "0" {
			t.Fatalf("version body %s", body)
		}
	})

	t.Run("gRPC version, health and the health protocol", func(t *testing.T) {
		conn, err := grpc.NewClient(a.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = conn.Close() }()
		sys := computev1.NewSystemServiceClient(conn)
		v, err := sys.Version(t.Context(), &computev1.VersionRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if v.GetSchemaVersion() != migrate.Latest() || v.GetRequiredSchemaVersion() != migrate.Latest() || v.GetGoVersion() == "" {
			t.Fatalf("Version = %v", v)
		}
		h, err := sys.Health(t.Context(), &computev1.HealthRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if h.GetStatus() != computev1.HealthStatus_HEALTH_STATUS_OK || len(h.GetChecks()) != 3 {
			t.Fatalf("Health = %v", h)
		}
		hc, err := healthpb.NewHealthClient(conn).Check(t.Context(), &healthpb.HealthCheckRequest{})
		if err != nil || hc.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("grpc health = %v, %v", hc, err)
		}
	})

	t.Run("REST errors use the envelope", func(t *testing.T) {
		cases := []struct {
			method, path, body string
			status             int
			code               fault.Code
		}{
			{http.MethodPost, "/api/compute/system/nope", `{}`, http.StatusNotFound, fault.NotFound},
			{http.MethodGet, "/api/compute/system/version", ``, http.StatusBadRequest, fault.Unsupported},
			{http.MethodPost, "/api/compute/system/version", `{"bogus":1}`, http.StatusBadRequest, fault.InvalidInput},
			{http.MethodPost, "/api/compute/system/version", `{`, http.StatusBadRequest, fault.InvalidInput},
		}
		for _, tc := range cases {
			req, _ := http.NewRequestWithContext(t.Context(), tc.method, base+tc.path, strings.NewReader(tc.body))
			status, body := do(t, req)
			var env struct {
				Code    fault.Code
				Message string
			}
			if err := json.Unmarshal(body, &env); err != nil {
				t.Fatalf("%s %s: not an envelope: %s", tc.method, tc.path, body)
			}
			if status != tc.status || env.Code != tc.code || env.Message == "" {
				t.Errorf("%s %s %s: %d %s, want %d %s", tc.method, tc.path, tc.body, status, body, tc.status, tc.code)
			}
		}
	})

	t.Run("openapi", func(t *testing.T) {
		status, body := get(t, base+"/api/compute/openapi.json")
		if status != http.StatusOK || !strings.Contains(string(body), "/api/compute/system/version") {
			t.Fatalf("openapi %d %.200s", status, body)
		}
	})

	t.Run("the start migrated the empty database", func(t *testing.T) {
		pool, err := pgxpool.New(t.Context(), u)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		var root string
		if err := pool.QueryRow(t.Context(), `SELECT id FROM tenants WHERE parent_id IS NULL`).Scan(&root); err != nil || root != "root" {
			t.Fatalf("root tenant: %q %v", root, err)
		}
	})
}

func TestStopIsIdempotent(t *testing.T) {
	t.Parallel()
	a, err := app.New(testConfig(pgtest.NewDB(t)), app.Options{})
	if err != nil {
		t.Fatal(err)
	}
	a.Stop(context.Background()) // before Start
	a.Stop(context.Background())
	if err := a.Start(t.Context()); err == nil {
		t.Fatal("Start after Stop succeeded")
	}

	b := start(t, testConfig(pgtest.NewDB(t)))
	addr := b.Addr()
	b.Stop(context.Background())
	b.Stop(context.Background())
	if resp, err := http.Get("http://" + addr + "/healthz"); err == nil {
		_ = resp.Body.Close()
		t.Fatal("still serving after Stop")
	}
}

func get(t *testing.T, url string) (int, []byte) {
	t.Helper()
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, url, nil)
	return do(t, req)
}

func post(t *testing.T, url, body string) (int, []byte) {
	t.Helper()
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	return do(t, req)
}

func do(t *testing.T, req *http.Request) (int, []byte) {
	t.Helper()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, b
}

func TestServeRunsTheRuntimeForItsRoles(t *testing.T) {
	t.Parallel()
	u := pgtest.NewDB(t)
	cfg := testConfig(u)
	cfg.Roles = []string{"controllers", "scheduler", "nodespec-controller"}
	a := start(t, cfg)
	pool, err := pgxpool.New(t.Context(), u)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var memberships []string
	rows, err := pool.Query(t.Context(), `SELECT membership FROM workers WHERE expires_at > now() ORDER BY membership`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var m string
		_ = rows.Scan(&m)
		memberships = append(memberships, m)
	}
	rows.Close()
	// controllers brings the spec's workflows and the sweeper, each its
	// own membership.
	if !slices.Equal(memberships, []string{"command-sweeper", "controllers", "metal", "nodespec-controller", "scheduler", "vps"}) {
		t.Fatalf("workers = %v, want one per runtime role", memberships)
	}
	var janitor string
	if err := pool.QueryRow(t.Context(), `SELECT holder FROM leases WHERE name = 'singleton:runtime.janitor'`).Scan(&janitor); err != nil || !strings.HasPrefix(janitor, "controllers/") {
		t.Fatalf("the janitor's lease is held by %q (%v)", janitor, err)
	}
	a.Stop(context.Background())
	var left int
	_ = pool.QueryRow(t.Context(), `SELECT count(*) FROM workers`).Scan(&left)
	if left != 0 {
		t.Fatalf("%d worker rows left after a clean stop", left)
	}
	if err := pool.QueryRow(t.Context(), `SELECT coalesce(holder, '') FROM leases WHERE name = 'singleton:runtime.janitor'`).Scan(&janitor); err != nil || janitor != "" {
		t.Fatalf("a clean stop must release its leases; holder %q (%v)", janitor, err)
	}
}
