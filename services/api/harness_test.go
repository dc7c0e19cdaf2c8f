package api_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/bootstrap"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/services/api"
	"github.com/bettercompute/bettercompute/services/app"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// clock is a clock the test moves.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// counter counts the statements the server runs while serving an RPC.
type counter struct{ n, eventReads, eventReadNanos *atomic.Int64 }

type readStart struct{}

func (c counter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	// Only statements made while serving an RPC count: the harness runs every
	// role, and the runtime's heartbeats and claims are not the API's doing.
	_, rpc := grpc.Method(ctx)
	if rpc {
		c.n.Add(1)
	}
	// eventReads counts every read of the event log after a cursor, made
	// by anyone (watches, their tailer, the relay's fan-out);
	// eventReadNanos times those made in an RPC (a watch's own).
	if strings.Contains(d.SQL, "FROM outbox") && strings.Contains(d.SQL, "seq > $1") {
		c.eventReads.Add(1)
		if rpc {
			return context.WithValue(ctx, readStart{}, time.Now())
		}
	}
	return ctx
}

func (c counter) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	if t, ok := ctx.Value(readStart{}).(time.Time); ok {
		c.eventReadNanos.Add(int64(time.Since(t)))
	}
}

// harness is a real server (services/app, the api role, port 0) on its own
// database, with a root credential made by bootstrap.
type harness struct {
	base    string
	admin   string        // the admin listener (server.adminAddr): /metrics
	db      *pgxpool.Pool // the test's own view of the database
	clock   *clock
	queries *atomic.Int64
	// eventReads counts reads of the event log after a cursor.
	eventReads, eventReadNanos *atomic.Int64
	root                       string
	conn                       *grpc.ClientConn
}

func setup(t testing.TB, tune api.Tuning) *harness {
	t.Helper()
	return setupWith(t, tune, nil)
}

// setupWith is setup with a change to the configuration before start.
func setupWith(t testing.TB, tune api.Tuning, change func(*config.Config)) *harness {
	t.Helper()
	url := pgtest.NewDB(t)
	h := &harness{clock: &clock{t: time.Now()}, queries: &atomic.Int64{}, eventReads: &atomic.Int64{}, eventReadNanos: &atomic.Int64{}}
	tune.Now = h.clock.Now
	port := 0
	cfg := &config.Config{Database: config.Database{URL: url}, Server: config.Server{Host: "127.0.0.1", Port: &port, NoMigrate: true}}
	cfg.Defaults()
	if change != nil {
		change(cfg)
	}
	a, err := app.New(cfg, app.Options{API: tune, DBTracer: counter{h.queries, h.eventReads, h.eventReadNanos}})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Stop(context.Background()) })
	h.base = "http://" + a.Addr()
	h.admin = "http://" + a.AdminAddr()
	if h.db, err = pgxpool.New(context.Background(), url); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.db.Close)
	cred, err := bootstrap.Run(context.Background(), h.db)
	if err != nil {
		t.Fatal(err)
	}
	h.root = cred.Token
	if h.conn, err = grpc.NewClient(a.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials())); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.conn.Close() })
	return h
}

// rest POSTs body to /api/compute/<path> with token (none when empty) and
// returns the status and the decoded JSON body.
func (h *harness) rest(t testing.TB, token, path, body string) (int, map[string]any) {
	t.Helper()
	code, raw := h.restRaw(t, token, path, []byte(body))
	var out map[string]any
	if err := json.Unmarshal(raw, &out); err != nil {
		t.Fatalf("POST %s: not JSON (%d): %s", path, code, raw)
	}
	return code, out
}

func (h *harness) restRaw(t testing.TB, token, path string, body []byte) (int, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, h.base+"/api/compute/"+path, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, raw
}

// as returns a context whose gRPC calls carry token.
func as(token string) context.Context {
	return metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+token)
}

// envelope reads the code and field of a gRPC error.
func envelope(err error) (fault.Code, string) {
	if err == nil {
		return "", ""
	}
	env := api.FromStatus(status.Convert(err))
	return env.Code, env.Field
}

// restErr reads the code and field of a REST error body.
func restErr(body map[string]any) (fault.Code, string) {
	c, _ := body["code"].(string)
	f, _ := body["field"].(string)
	return fault.Code(c), f
}

func wantCode(t testing.TB, err error, code fault.Code, field string) {
	t.Helper()
	if c, f := envelope(err); c != code || f != field {
		t.Fatalf("got %s field %q (%v), want %s field %q", c, f, err, code, field)
	}
}

func wantREST(t testing.TB, status int, body map[string]any, code fault.Code, field string) {
	t.Helper()
	if c, f := restErr(body); c != code || f != field {
		t.Fatalf("got %d %v, want %s field %q", status, body, code, field)
	}
	info, _ := fault.Lookup(code)
	if status != info.HTTP {
		t.Fatalf("HTTP status %d, want %d for %s", status, info.HTTP, code)
	}
}

// member makes tenant (under its parent) with an identity and a key, as
// root, and returns the identity id and the key.
func (h *harness) member(t testing.TB, tenant, name string) (string, string) {
	t.Helper()
	ctx := as(h.root)
	parent := "root"
	if i := bytes.LastIndexByte([]byte(tenant), '.'); i >= 0 {
		parent = tenant[:i]
	}
	_, err := computev1.NewTenantsServiceClient(h.conn).Create(ctx, &computev1.TenantsServiceCreateRequest{TenantId: parent, ChildTenantId: tenant})
	if c, _ := envelope(err); err != nil && c != fault.Conflict {
		t.Fatal(err)
	}
	ident, err := computev1.NewIdentitiesServiceClient(h.conn).Create(ctx, &computev1.IdentitiesServiceCreateRequest{TenantId: tenant, Name: name})
	if err != nil {
		t.Fatal(err)
	}
	key, err := computev1.NewApiKeysServiceClient(h.conn).Create(ctx, &computev1.ApiKeysServiceCreateRequest{TenantId: tenant, IdentityId: ident.GetIdentity().GetId()})
	if err != nil {
		t.Fatal(err)
	}
	return ident.GetIdentity().GetId(), key.GetSecret()
}

// policy puts a policy as root.
func (h *harness) policy(t testing.TB, tenant, name, body string) {
	t.Helper()
	_, err := computev1.NewPoliciesServiceClient(h.conn).Put(as(h.root), &computev1.PoliciesServicePutRequest{TenantId: tenant, Name: name, Body: body})
	if err != nil {
		t.Fatal(err)
	}
}

// count returns the rows of a query's count(*).
func (h *harness) count(t testing.TB, query string, args ...any) int {
	t.Helper()
	var n int
	if err := h.db.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// rows counts the rows of the tables every mutation writes, to prove a
// refused request changed nothing.
func (h *harness) rows(t testing.TB) [5]int {
	t.Helper()
	return [5]int{
		h.count(t, `SELECT count(*) FROM pools`),
		h.count(t, `SELECT count(*) FROM audit`),
		h.count(t, `SELECT count(*) FROM outbox`),
		h.count(t, `SELECT count(*) FROM idempotency`),
		h.count(t, `SELECT count(*) FROM authz_projection`),
	}
}
