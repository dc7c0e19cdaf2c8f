package config_test

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/capacity"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/fault"
)

func writeFile(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "bc.yaml")
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func env(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

// fields returns the field of every INVALID_CONFIG fault in err and fails
// the test on any other kind of error.
func fields(t *testing.T, err error) []string {
	t.Helper()
	var out []string
	for _, fe := range fault.All(err) {
		if fe.Code != fault.InvalidConfig {
			t.Errorf("code = %s, want INVALID_CONFIG (%v)", fe.Code, fe)
		}
		out = append(out, fe.Field)
	}
	if err != nil && len(out) == 0 {
		t.Fatalf("error carries no fault: %v", err)
	}
	return out
}

func TestLoad(t *testing.T) {
	t.Parallel()

	t.Run("defaults fill every unset field", func(t *testing.T) {
		t.Parallel()
		c, err := config.Load(config.LoadOptions{LookupEnv: env(nil)})
		if err != nil {
			t.Fatal(err)
		}
		c.Defaults()
		if err := c.Validate(); err != nil {
			t.Fatalf("defaults do not validate: %v", err)
		}
		if *c.Server.Port != config.DefaultPort || c.Server.Host != "0.0.0.0" || c.Log.Format != "json" || c.Server.ShutdownTimeout.Std() != 15*time.Second {
			t.Fatalf("unexpected defaults: %+v", c)
		}
	})

	t.Run("file, then env override, BC_ name beats the alias", func(t *testing.T) {
		t.Parallel()
		p := writeFile(t, `
roles: [api]
database:
  url: postgres://file@db:5432/bc
  maxConns: 7
server:
  port: 9000
  shutdownTimeout: 3s
log: {level: debug}
`)
		c, err := config.Load(config.LoadOptions{Path: p, LookupEnv: env(map[string]string{
			"DATABASE_URL":          "postgres://alias@db/bc",
			"BC_DATABASE_URL":       "postgres://env@db/bc",
			"BC_SERVER_PORT":        "9100",
			"NATS_URL":              "nats://127.0.0.1:4222",
			"BC_ROLES":              "api, controllers",
			"BC_GATEWAY_ADMIT_RATE": "250.5",
		})})
		if err != nil {
			t.Fatal(err)
		}
		c.Defaults()
		if err := c.Validate(); err != nil {
			t.Fatal(err)
		}
		if c.Database.URL != "postgres://env@db/bc" {
			t.Errorf("database.url = %q", c.Database.URL)
		}
		if *c.Server.Port != 9100 || c.Database.MaxConns != 7 || c.Server.ShutdownTimeout.Std() != 3*time.Second {
			t.Errorf("port=%d maxConns=%d shutdown=%s", *c.Server.Port, c.Database.MaxConns, c.Server.ShutdownTimeout.Std())
		}
		if c.NATS.URL != "nats://127.0.0.1:4222" || c.Log.Level != "debug" {
			t.Errorf("nats=%q level=%q", c.NATS.URL, c.Log.Level)
		}
		if !slices.Equal(c.Roles, []string{"api", "controllers"}) {
			t.Errorf("roles = %v", c.Roles)
		}
		if c.Gateway.AdmitRate != 250.5 || c.Gateway.AdmitBurst != 200 {
			t.Errorf("gateway.admitRate = %g, admitBurst = %d", c.Gateway.AdmitRate, c.Gateway.AdmitBurst)
		}
	})

	t.Run("the alias applies when the BC_ name is unset", func(t *testing.T) {
		t.Parallel()
		c, err := config.Load(config.LoadOptions{LookupEnv: env(map[string]string{"DATABASE_URL": "postgres://alias@db/bc"})})
		if err != nil {
			t.Fatal(err)
		}
		if c.Database.URL != "postgres://alias@db/bc" {
			t.Errorf("database.url = %q", c.Database.URL)
		}
	})
}

func TestLoadErrorsNameTheField(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		file string
		env  map[string]string
		want []string
	}{
		{"unknown top-level field", "databse:\n  url: x\n", nil, []string{"databse"}},
		{"unknown nested field", "server:\n  prot: 80\n", nil, []string{"server.prot"}},
		{"wrong type", "server:\n  port: eighty\n", nil, []string{"server.port"}},
		{"bad duration", "server:\n  shutdownTimeout: soon\n", nil, []string{"server.shutdownTimeout"}},
		{"section is not a mapping", "log: loud\n", nil, []string{"log"}},
		{"several at once", "log:\n  levl: x\nserver:\n  port: [1]\n", nil, []string{"log.levl", "server.port"}},
		{"not YAML", "server: [\n", nil, []string{"config"}},
		{"env integer", "", map[string]string{"BC_SERVER_PORT": "http"}, []string{"server.port"}},
		{"env bool", "", map[string]string{"BC_DATABASE_PGBOUNCER": "maybe"}, []string{"database.pgbouncer"}},
		{"env duration", "", map[string]string{"BC_SERVER_SHUTDOWN_TIMEOUT": "10"}, []string{"server.shutdownTimeout"}},
		{"env nested camel case", "", map[string]string{"BC_RUNTIME_LEASE_TTL": "soon"}, []string{"runtime.leaseTTL"}},
		{"env number", "", map[string]string{"BC_GATEWAY_ADMIT_RATE": "fast"}, []string{"gateway.admitRate"}},
		{"wrong type number", "gateway:\n  admitRate: fast\n", nil, []string{"gateway.admitRate"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			opts := config.LoadOptions{LookupEnv: env(tc.env)}
			if tc.file != "" {
				opts.Path = writeFile(t, tc.file)
			}
			_, err := config.Load(opts)
			if err == nil {
				t.Fatal("Load succeeded")
			}
			if got := fields(t, err); !slices.Equal(got, tc.want) {
				t.Fatalf("fields = %v, want %v (%v)", got, tc.want, err)
			}
		})
	}

	t.Run("missing file", func(t *testing.T) {
		t.Parallel()
		_, err := config.Load(config.LoadOptions{Path: filepath.Join(t.TempDir(), "nope.yaml")})
		if got := fields(t, err); !slices.Equal(got, []string{"config"}) {
			t.Fatalf("fields = %v", got)
		}
	})
}

func TestValidateNamesTheField(t *testing.T) {
	t.Parallel()
	port := func(p int) *int { return &p }
	cases := []struct {
		name  string
		mod   func(*config.Config)
		field string
	}{
		{"unknown role", func(c *config.Config) { c.Roles = []string{"api,bogus"} }, "roles"},
		{"database url scheme", func(c *config.Config) { c.Database.URL = "mysql://db/bc" }, "database.url"},
		{"database url garbage", func(c *config.Config) { c.Database.URL = "postgres://db:notaport/bc" }, "database.url"},
		{"max conns", func(c *config.Config) { c.Database.MaxConns = -1 }, "database.maxConns"},
		{"nats scheme", func(c *config.Config) { c.NATS.URL = "http://127.0.0.1:4222" }, "nats.url"},
		{"nats second url", func(c *config.Config) { c.NATS.URL = "nats://a:4222,b" }, "nats.url"},
		{"port range", func(c *config.Config) { c.Server.Port = port(70000) }, "server.port"},
		{"negative shutdown", func(c *config.Config) { c.Server.ShutdownTimeout = -1 }, "server.shutdownTimeout"},
		{"log level", func(c *config.Config) { c.Log.Level = "loud" }, "log.level"},
		{"log format", func(c *config.Config) { c.Log.Format = "xml" }, "log.format"},
		{"otlp endpoint", func(c *config.Config) { c.Telemetry.OTLPEndpoint = "collector" }, "telemetry.otlpEndpoint"},
		{"otlp url scheme", func(c *config.Config) { c.Telemetry.OTLPEndpoint = "grpc://collector:4317" }, "telemetry.otlpEndpoint"},
		{"lease shorter than two heartbeats", func(c *config.Config) { c.Runtime.LeaseTTL = c.Runtime.Heartbeat }, "runtime.leaseTTL"},
		{"negative poll", func(c *config.Config) { c.Runtime.Poll = -1 }, "runtime.poll"},
		{"negative jitter", func(c *config.Config) { c.Runtime.ResyncJitter = -1 }, "runtime.resyncJitter"},
		{"concurrency", func(c *config.Config) { c.Runtime.Concurrency = 0 }, "runtime.concurrency"},
		{"batch", func(c *config.Config) { c.Runtime.Batch = 20000 }, "runtime.batch"},
		{"gateway listen", func(c *config.Config) { c.Gateway.Listen = "8443" }, "gateway.listen"},
		{"stuck after too short", func(c *config.Config) { c.Fleet.StuckAfter = config.Duration(time.Second) }, "fleet.stuckAfter"},
		{"stuck after too long", func(c *config.Config) { c.Fleet.StuckAfter = config.Duration(200 * time.Hour) }, "fleet.stuckAfter"},
		{"drift every", func(c *config.Config) { c.Fleet.DriftEvery = -1 }, "fleet.driftEvery"},
		{"gateway id", func(c *config.Config) { c.Gateway.ID = "GW 1" }, "gateway.id"},
		{"gateway liveness", func(c *config.Config) { c.Gateway.LivenessInterval = -1 }, "gateway.livenessInterval"},
		{"gateway admit rate", func(c *config.Config) { c.Gateway.AdmitRate = -5 }, "gateway.admitRate"},
		{"oldest agent not a version", func(c *config.Config) { c.Gateway.AgentVersions.Oldest = "latest" }, "gateway.agentVersions.oldest"},
		{"newest agent not a version", func(c *config.Config) { c.Gateway.AgentVersions.Newest = "v1.2" }, "gateway.agentVersions.newest"},
		{"agent window inverted", func(c *config.Config) {
			c.Gateway.AgentVersions = config.AgentVersions{Oldest: "v0.4.0", Newest: "v0.3.9"}
		}, "gateway.agentVersions.newest"},
		{"server read timeout", func(c *config.Config) { c.Server.ReadTimeout = -1 }, "server.readTimeout"},
		{"server idle timeout", func(c *config.Config) { c.Server.IdleTimeout = -1 }, "server.idleTimeout"},
		{"admin address", func(c *config.Config) { c.Server.AdminAddr = "metrics" }, "server.adminAddr"},
		{"tls key without cert", func(c *config.Config) { c.Server.TLS.KeyFile = "k.pem" }, "server.tls"},
		{"client CA without tls", func(c *config.Config) { c.Server.TLS.ClientCAFile = "ca.pem" }, "server.tls.clientCAFile"},
		{"gateway admit burst", func(c *config.Config) { c.Gateway.AdmitBurst = -1 }, "gateway.admitBurst"},
		{"gateway admit wait", func(c *config.Config) { c.Gateway.AdmitWait = -1 }, "gateway.admitWait"},
		{"command sweep interval", func(c *config.Config) { c.Commands.SweepInterval = -1 }, "commands.sweepInterval"},
		{"capacity lost-node policy", func(c *config.Config) { c.Capacity.LostNode = "panic" }, "capacity.lostNode"},
		{"capacity tick", func(c *config.Config) { c.Capacity.TickEvery = -1 }, "capacity.tickEvery"},
		{"not ready after", func(c *config.Config) { c.Nodes.NotReadyAfter = -1 }, "nodes.notReadyAfter"},
		{"lost before not ready", func(c *config.Config) {
			c.Nodes.LostAfter, c.Capacity.LostAfter = config.Duration(time.Second), config.Duration(time.Second)
		}, "nodes.lostAfter"},
		{"liveness every", func(c *config.Config) { c.Nodes.LivenessEvery = -1 }, "nodes.livenessEvery"},
		{"lost after alias disagrees", func(c *config.Config) { c.Capacity.LostAfter = config.Duration(time.Hour) }, "capacity.lostAfter"},
		{"eviction rate", func(c *config.Config) { c.Nodes.EvictionRate = -0.1 }, "nodes.evictionRate"},
		{"eviction burst", func(c *config.Config) { c.Nodes.EvictionBurst = -1 }, "nodes.evictionBurst"},
		{"unhealthy threshold above 1", func(c *config.Config) { c.Nodes.UnhealthyThreshold = 55 }, "nodes.unhealthyThreshold"},
		{"unhealthy threshold negative", func(c *config.Config) { c.Nodes.UnhealthyThreshold = -0.5 }, "nodes.unhealthyThreshold"},
		{"previous secrets keys without a key", func(c *config.Config) { c.Secrets.PreviousKeyFiles = []string{"old.key"} }, "secrets.previousKeyFiles"},
		{"previous secrets key is the key", func(c *config.Config) {
			c.Secrets.KeyFile, c.Secrets.PreviousKeyFiles = "k", []string{"k"}
		}, "secrets.previousKeyFiles"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := &config.Config{}
			c.Defaults()
			tc.mod(c)
			err := c.Validate()
			if got := fields(t, err); !slices.Equal(got, []string{tc.field}) {
				t.Fatalf("fields = %v, want [%s] (%v)", got, tc.field, err)
			}
		})
	}

	t.Run("valid values pass", func(t *testing.T) {
		t.Parallel()
		c := &config.Config{
			Roles:     []string{"api", "controllers,scheduler"},
			Database:  config.Database{URL: "host=127.0.0.1 dbname=bc"},
			NATS:      config.NATS{URL: "nats://a:4222, tls://b:4222"},
			Telemetry: config.Telemetry{OTLPEndpoint: "http://collector:4318"},
			Gateway:   config.Gateway{AgentVersions: config.AgentVersions{Oldest: "v0.3.0", Newest: "v0.3.0"}},
		}
		c.Defaults()
		if err := c.Validate(); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("database is required where it cannot be resolved", func(t *testing.T) {
		t.Parallel()
		c := &config.Config{}
		err := c.RequireDatabase()
		if got := fields(t, err); !slices.Equal(got, []string{"database.url"}) {
			t.Fatalf("fields = %v", got)
		}
	})
}

func TestParseRoles(t *testing.T) {
	t.Parallel()
	cases := []struct {
		in   []string
		want []config.Role
	}{
		{nil, []config.Role{config.RoleAll}},
		{[]string{""}, []config.Role{config.RoleAll}},
		// The spec's controllers: reconcilers, workflows (metal, vps) and
		// the CommandSweeper, each still a membership of its own.
		{[]string{"controllers,api", "api"}, []config.Role{config.RoleAPI, config.RoleNodeSpecController, config.RoleCommandSweeper, config.RoleControllers, config.RoleMetal, config.RoleVPS}},
		{[]string{"API", " gateway "}, []config.Role{config.RoleAPI, config.RoleGateway}},
		{[]string{"api", "all"}, []config.Role{config.RoleAll}},
		// Finer roles alone stay alone: that is how a part scales apart.
		{[]string{"nodespec-controller", "placer"}, []config.Role{config.RoleNodeSpecController, config.RolePlacer}},
		{[]string{"scheduler"}, []config.Role{config.RolePlacer, config.RoleScheduler}},
		{[]string{"sinks"}, []config.Role{config.RoleOutboxRelay, config.RoleSinks}},
		{[]string{"iam"}, []config.Role{config.RoleIAM}},
	}
	worker := []config.Role{config.RoleNodeSpecController, config.RolePlacer, config.RoleCommandSweeper, config.RoleOutboxRelay, config.RoleControllers, config.RoleMetal, config.RoleVPS, config.RoleScheduler, config.RoleSinks, config.RoleIAM}
	for _, in := range [][]string{{"worker"}, {"controllers,scheduler,sinks,iam"}, {"WORKER", "iam"}} {
		cases = append(cases, struct {
			in   []string
			want []config.Role
		}{in, worker})
	}
	for _, tc := range cases {
		got, err := config.ParseRoles(tc.in)
		if err != nil {
			t.Fatalf("ParseRoles(%q): %v", tc.in, err)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("ParseRoles(%q) = %v, want %v", tc.in, got, tc.want)
		}
	}
	_, err := config.ParseRoles([]string{"api", "bogus"})
	fe, ok := fault.As(err)
	if !ok || fe.Code != fault.InvalidConfig || fe.Field != "roles" {
		t.Fatalf("unknown role: %v", err)
	}
	if !strings.Contains(fe.Message, `"bogus"`) || !strings.Contains(fe.Message, "controllers") {
		t.Fatalf("message should name the role and the choices: %q", fe.Message)
	}
}

func TestEnvName(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"database.url":           "BC_DATABASE_URL",
		"server.shutdownTimeout": "BC_SERVER_SHUTDOWN_TIMEOUT",
		"telemetry.otlpEndpoint": "BC_TELEMETRY_OTLP_ENDPOINT",
		"roles":                  "BC_ROLES",
	} {
		if got := config.EnvName(in); got != want {
			t.Errorf("EnvName(%q) = %q, want %q", in, got, want)
		}
	}
	if len(config.EnvVars()) < 10 {
		t.Errorf("EnvVars lists too few fields: %v", config.EnvVars())
	}
}

func TestCapacityDefaultsAndNotBuiltPlacer(t *testing.T) {
	t.Parallel()
	c := &config.Config{}
	c.Defaults()
	if c.Capacity.Placer != config.PlacerPoolLease || c.Capacity.LostNode != capacity.LostNodeWait || c.Capacity.TickEvery.Std() != 5*time.Second {
		t.Fatalf("capacity defaults %+v", c.Capacity)
	}
	c.Capacity.Placer = "global"
	err := c.Validate()
	if fault.CodeOf(err) != fault.Unsupported || !strings.Contains(err.Error(), "not built yet") {
		t.Fatalf("a placer not built: %v", err)
	}
}

func TestRoleLists(t *testing.T) {
	t.Parallel()
	if len(config.AllRoles) != 13 || slices.Contains(config.AllRoles, config.RoleAll) {
		t.Fatalf("all roles: %v", config.AllRoles)
	}
	want := []config.Role{config.RoleAPI, config.RoleJoinService, config.RoleGateway, config.RoleNodeSpecController, config.RolePlacer, config.RoleCommandSweeper, config.RoleOutboxRelay, config.RoleControllers, config.RoleMetal, config.RoleVPS, config.RoleScheduler, config.RoleSinks, config.RoleIAM}
	if !slices.Equal(config.BuiltRoles, want) {
		t.Errorf("built roles %v, want %v", config.BuiltRoles, want)
	}
	if slices.Contains(config.AllRoles, config.RoleWorker) {
		t.Error("worker is a name for roles, not a role")
	}
	want = []config.Role{config.RoleNodeSpecController, config.RoleCommandSweeper, config.RoleControllers, config.RoleMetal, config.RoleVPS, config.RoleScheduler, config.RoleIAM}
	if !slices.Equal(config.RuntimeRoles, want) {
		t.Errorf("runtime roles %v, want %v", config.RuntimeRoles, want)
	}
	for _, r := range config.RuntimeRoles {
		if !slices.Contains(config.BuiltRoles, r) {
			t.Errorf("runtime role %s is not built", r)
		}
	}
}

func TestNodesDefaultsAndLostAfterAlias(t *testing.T) {
	t.Parallel()
	c := &config.Config{}
	c.Defaults()
	if c.Nodes.NotReadyAfter.Std() != 40*time.Second || c.Nodes.LostAfter.Std() != 2*time.Minute ||
		c.Capacity.LostAfter != c.Nodes.LostAfter || c.Nodes.LivenessEvery.Std() != 5*time.Second {
		t.Fatalf("defaults: %+v %+v", c.Nodes, c.Capacity)
	}
	// The deprecated capacity.lostAfter alone sets nodes.lostAfter.
	c = &config.Config{Capacity: config.Capacity{LostAfter: config.Duration(5 * time.Minute)}}
	c.Defaults()
	if c.Nodes.LostAfter.Std() != 5*time.Minute || c.Validate() != nil {
		t.Fatalf("alias: %+v %v", c.Nodes, c.Validate())
	}
	// nodes.lostAfter alone sets both.
	c = &config.Config{Nodes: config.Nodes{LostAfter: config.Duration(3 * time.Minute)}}
	c.Defaults()
	if c.Capacity.LostAfter.Std() != 3*time.Minute || c.Validate() != nil {
		t.Fatalf("nodes.lostAfter: %+v %v", c.Capacity, c.Validate())
	}
}

// TestFleetDefaultsAndEnv: fleet.stuckAfter and fleet.driftEvery default
// to 15m and 1m and are read from their environment variables.
func TestFleetDefaultsAndEnv(t *testing.T) {
	t.Parallel()
	c := &config.Config{}
	c.Defaults()
	if c.Fleet.StuckAfter.Std() != 15*time.Minute || c.Fleet.DriftEvery.Std() != time.Minute || c.Validate() != nil {
		t.Fatalf("defaults: %+v %v", c.Fleet, c.Validate())
	}
	if got := config.EnvName("fleet.stuckAfter"); got != "BC_FLEET_STUCK_AFTER" {
		t.Fatalf("env name %s", got)
	}
}

// TestNodesEvictionBrakes: the brakes' defaults, their environment
// variables, and a file's bad value refused naming the key.
func TestNodesEvictionBrakes(t *testing.T) {
	t.Parallel()
	c := &config.Config{}
	c.Defaults()
	if n := c.Nodes; n.EvictionRate != 0.1 || n.EvictionBurst != 1 || n.UnhealthyThreshold != 0.55 {
		t.Fatalf("defaults: %+v", n)
	}
	c, err := config.Load(config.LoadOptions{LookupEnv: env(map[string]string{
		"BC_NODES_EVICTION_RATE": "0.5", "BC_NODES_EVICTION_BURST": "3", "BC_NODES_UNHEALTHY_THRESHOLD": "1",
	})})
	if err != nil {
		t.Fatal(err)
	}
	if n := c.Nodes; n.EvictionRate != 0.5 || n.EvictionBurst != 3 || n.UnhealthyThreshold != 1 {
		t.Fatalf("from the environment: %+v", n)
	}
	c, err = config.Load(config.LoadOptions{Path: writeFile(t, "nodes:\n  unhealthyThreshold: 1.2\n  evictionRate: -1\n"), LookupEnv: env(nil)})
	if err != nil {
		t.Fatal(err)
	}
	c.Defaults()
	err = c.Validate()
	if got := fields(t, err); !slices.Equal(got, []string{"nodes.evictionRate", "nodes.unhealthyThreshold"}) {
		t.Fatalf("fields = %v (%v)", got, err)
	}
	if err == nil || !strings.Contains(err.Error(), "at most 1") {
		t.Fatalf("error %v does not say the range", err)
	}
}

// TestSecretsKeyFiles: secrets.keyFile is BC_SECRETS_KEY_FILE, older keys
// follow it in KeyFiles, and none configured is nil (metal.enroll then says
// UNSUPPORTED).
func TestSecretsKeyFiles(t *testing.T) {
	t.Parallel()
	if got := config.EnvName("secrets.keyFile"); got != "BC_SECRETS_KEY_FILE" {
		t.Fatalf("env name %s", got)
	}
	env := map[string]string{"BC_SECRETS_KEY_FILE": "/k/new.key", "BC_SECRETS_PREVIOUS_KEY_FILES": "/k/old1.key, /k/old2.key"}
	c, err := config.Load(config.LoadOptions{LookupEnv: func(k string) (string, bool) { v, ok := env[k]; return v, ok }})
	if err != nil {
		t.Fatal(err)
	}
	c.Defaults()
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if got := c.Secrets.KeyFiles(); !slices.Equal(got, []string{"/k/new.key", "/k/old1.key", "/k/old2.key"}) {
		t.Fatalf("key files %v", got)
	}
	if got := (config.Secrets{}).KeyFiles(); got != nil {
		t.Fatalf("no key: %v", got)
	}
}

// TestTenantEvictionBrakes: the tenants' buckets default to half the
// fleet's, nodes.longLostAfter to 1h, health.maxRepairClearsPerNode to 3;
// a tenant's bucket above the fleet's ceiling is refused naming its key.
func TestTenantEvictionBrakes(t *testing.T) {
	t.Parallel()
	c := &config.Config{}
	c.Defaults()
	if n := c.Nodes; n.TenantEvictionRate != 0.05 || n.TenantEvictionBurst != 1 || n.LongLostAfter.Std() != time.Hour || c.Health.MaxRepairClearsPerNode != 3 {
		t.Fatalf("defaults: %+v %+v", n, c.Health)
	}
	c, err := config.Load(config.LoadOptions{Path: writeFile(t, "nodes:\n  tenantEvictionRate: 0.5\n  tenantEvictionBurst: 2\n  longLostAfter: 1m\nhealth:\n  maxRepairClearsPerNode: 101\n"), LookupEnv: env(nil)})
	if err != nil {
		t.Fatal(err)
	}
	c.Defaults()
	err = c.Validate()
	if got := fields(t, err); !slices.Equal(got, []string{"nodes.tenantEvictionRate", "nodes.tenantEvictionBurst", "nodes.longLostAfter", "health.maxRepairClearsPerNode"}) {
		t.Fatalf("fields = %v (%v)", got, err)
	}
}
