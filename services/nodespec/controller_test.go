package nodespec_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	nodelife "github.com/bettercompute/bettercompute/pkg/lifecycle"
	desired "github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/wake"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
	"github.com/bettercompute/bettercompute/services/inventory"
	"github.com/bettercompute/bettercompute/services/nodespec"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// env is a controllers runtime with the inventory and nodespec controllers
// on a database with pool_a and node_1 (adopting) in it.
type env struct {
	pool *pgxpool.Pool
	rt   *reconcile.Runtime
	mu   sync.Mutex
	// delivered counts, by node, the desired-state wakes this process's
	// gateway (a recorder) was handed after the controller's commits.
	delivered map[string]int
	// statements counts the statements on pool; batches the deliveries
	// (one per transaction that moved nodes).
	statements, batches atomic.Int64
}

// recorder is the process's gateway as the waker sees it: it holds every
// node and records the desired-state deliveries it is handed.
type recorder struct{ e *env }

func (r recorder) Holds(string) bool                          { return true }
func (r recorder) Dispatch(context.Context, string) error     { return nil }
func (r recorder) DispatchSite(context.Context, string) error { return nil }
func (r recorder) Deliver(_ context.Context, nodeIDs ...string) error {
	r.e.mu.Lock()
	defer r.e.mu.Unlock()
	for _, id := range nodeIDs {
		r.e.delivered[id]++
	}
	r.e.batches.Add(1)
	return nil
}

// counter counts statements.
type counter struct{ n *atomic.Int64 }

func (c counter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (counter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// setup registers reg (Builtin when nil) and, with state "adopted", adopts
// node_1 directly.
func setup(t *testing.T, reg *desired.Registry, state string) *env {
	t.Helper()
	e := &env{delivered: map[string]int{}}
	pool, err := db.Open(t.Context(), db.Config{URL: pgtest.NewDB(t), MaxConns: 8, Tracer: counter{&e.statements}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	waker := wake.New(nil, nil, nil)
	waker.SetGateway(recorder{e})
	rt, err := reconcile.New(pool, nil, reconcile.Config{Roles: []string{reconcile.RoleControllers, reconcile.RoleNodeSpec}, Heartbeat: time.Hour, Waker: waker})
	if err != nil {
		t.Fatal(err)
	}
	e.pool, e.rt = pool, rt
	rs := append(inventory.Reconcilers(), nodespec.Reconciler(nodespec.Config{Registry: reg}))
	for _, r := range rs {
		if err := rt.Register(r); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(rt.Stop)
	fixture.Pool(t, e.pool, fixture.PoolOpts{ID: "pool_a"})
	fixture.Node(t, e.pool, fixture.NodeOpts{ID: "node_1", Pool: "pool_a", Labels: map[string]string{"rack": "r1"}, State: state})
	return e
}

func (e *env) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	if _, err := e.pool.Exec(t.Context(), sql, args...); err != nil {
		t.Fatal(err)
	}
}

// change runs sql and invalidates node_1 in one transaction, as a module
// changing desired state does.
func (e *env) change(t *testing.T, sql string, args ...any) {
	t.Helper()
	err := reconcile.InTx(t.Context(), e.pool, nil, func(tx pgx.Tx, q *reconcile.Queue) error {
		if sql != "" {
			if _, err := tx.Exec(t.Context(), sql, args...); err != nil {
				return err
			}
		}
		return desired.Invalidate(t.Context(), q, "node_1")
	})
	if err != nil {
		t.Fatal(err)
	}
}

func (e *env) tick(t *testing.T, kind string) reconcile.TickResult {
	t.Helper()
	tr, err := e.rt.Jobs()[kind].Tick(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if tr.Failed > 0 {
		var last string
		_ = e.pool.QueryRow(t.Context(), `SELECT coalesce(last_error, '') FROM work_queue WHERE kind = $1`, kind).Scan(&last)
		t.Fatalf("%s failed: %s", kind, last)
	}
	return tr
}

// spec reads node_1's spec, generation and spec error.
func (e *env) spec(t *testing.T) (*agentv1.NodeSpec, int64, string) {
	t.Helper()
	var raw []byte
	var gen int64
	var specErr string
	err := e.pool.QueryRow(t.Context(), `SELECT spec::text, generation, coalesce(spec_error, '') FROM nodes WHERE id = 'node_1'`).Scan(&raw, &gen, &specErr)
	if err != nil {
		t.Fatal(err)
	}
	var s agentv1.NodeSpec
	if err := protojson.Unmarshal(raw, &s); err != nil {
		t.Fatalf("stored spec %s: %v", raw, err)
	}
	return &s, gen, specErr
}

// deliveries waits until node's gateway was woken want times for its
// desired state (deliveries run after commit, off the controller's path)
// and fails if it was woken more often.
func (e *env) deliveries(t *testing.T, node string, want int) {
	t.Helper()
	count := func() int {
		e.mu.Lock()
		defer e.mu.Unlock()
		return e.delivered[node]
	}
	poll.Until(t, 10*time.Second, fmt.Sprintf("%d desired-state wakes of %s", want, node), func() bool { return count() >= want })
	if got := count(); got != want {
		t.Fatalf("%s's gateway woken %d times for its desired state, want %d", node, got, want)
	}
}

func TestAdoptionWritesGenerationOne(t *testing.T) {
	t.Parallel()
	e := setup(t, nil, "adopting")

	// An adopting node has no desired state yet.
	e.change(t, "")
	e.tick(t, desired.Kind)
	if _, gen, _ := e.spec(t); gen != 0 {
		t.Fatalf("adopting node has generation %d", gen)
	}

	// Inventory adopts the node and invalidates it in the same transaction.
	b, err := protojson.Marshal(&agentv1.InventoryReport{Sections: []string{"gpus"}, Gpus: []*agentv1.GPU{{Uuid: "GPU-0", Healthy: true}}})
	if err != nil {
		t.Fatal(err)
	}
	e.exec(t, `INSERT INTO node_inventory (node_id, session_epoch, report) VALUES ('node_1', 1, $1)`, json.RawMessage(b))
	if err := workqueue.Enqueue(t.Context(), e.pool, nodelife.KindInventory, "node_1"); err != nil {
		t.Fatal(err)
	}
	e.tick(t, nodelife.KindInventory)
	if tr := e.tick(t, desired.Kind); tr.Done != 1 {
		t.Fatalf("adoption enqueued no nodespec work: %+v", tr)
	}
	spec, gen, _ := e.spec(t)
	want := &agentv1.NodeIdentity{NodeId: "node_1", TenantId: "root", PoolId: "pool_a", Labels: map[string]string{"rack": "r1"}}
	if gen != 1 || !proto.Equal(spec.GetIdentity(), want) {
		t.Fatalf("after adoption: generation %d, spec %v", gen, spec)
	}
	e.deliveries(t, "node_1", 1)
}

func TestGenerationMovesOnlyOnChange(t *testing.T) {
	t.Parallel()
	e := setup(t, nil, "adopted")
	e.change(t, "")
	e.tick(t, desired.Kind)
	first, gen, _ := e.spec(t)
	if gen != 1 || first.GetRuntime() != nil {
		t.Fatalf("first spec: generation %d, runtime %v (a pool without runtime settings gives none)", gen, first.GetRuntime())
	}

	steps := []struct {
		name  string
		sql   string
		gen   int64
		check func(*agentv1.NodeSpec) bool
	}{
		{"identical recomputation does not bump", "", 1, nil},
		{"a pool site setting bumps once", `UPDATE pools SET site = '{"ntpServers": {"values": ["ntp1"]}, "logLevel": "debug"}' WHERE id = 'pool_a'`, 2,
			func(s *agentv1.NodeSpec) bool {
				return s.GetSite().GetLogLevel() == "debug" && len(s.GetSite().GetNtpServers().GetValues()) == 1
			}},
		{"the same setting written again does not bump", `UPDATE pools SET site = '{"logLevel": "debug", "ntpServers": {"values": ["ntp1"]}}' WHERE id = 'pool_a'`, 2, nil},
		{"a pool health setting bumps once", `UPDATE pools SET health = '{"checkInterval": "30s", "diagnosticsLevel": "quick"}' WHERE id = 'pool_a'`, 3,
			func(s *agentv1.NodeSpec) bool { return s.GetHealth().GetCheckInterval().AsDuration() == 30*time.Second }},
		{"a pool runtime setting bumps once", `UPDATE pools SET runtime = '{"engines": ["containerd", "podman"], "cdiSpecDirs": ["/var/run/cdi"]}' WHERE id = 'pool_a'`, 4,
			func(s *agentv1.NodeSpec) bool {
				return slices.Equal(s.GetRuntime().GetEngines(), []string{"containerd", "podman"}) &&
					slices.Equal(s.GetRuntime().GetCdiSpecDirs(), []string{"/var/run/cdi"}) && s.GetSite().GetLogLevel() == "debug"
			}},
		{"the same runtime written in another key order does not bump", `UPDATE pools SET runtime = '{"cdiSpecDirs": ["/var/run/cdi"], "engines": ["containerd", "podman"]}' WHERE id = 'pool_a'`, 4, nil},
		{"clearing the runtime bumps once and the section goes", `UPDATE pools SET runtime = '{}' WHERE id = 'pool_a'`, 5,
			func(s *agentv1.NodeSpec) bool { return s.GetRuntime() == nil && s.GetHealth() != nil }},
		{"a node label bumps once", `UPDATE nodes SET labels = '{"rack":"r2"}' WHERE id = 'node_1'`, 6,
			func(s *agentv1.NodeSpec) bool { return s.GetIdentity().GetLabels()["rack"] == "r2" }},
		{"replacing the labels bumps once", `UPDATE nodes SET labels = '{"b":"2","a":"1"}' WHERE id = 'node_1'`, 7, nil},
		{"the same labels written in another order do not bump", `UPDATE nodes SET labels = '{"a":"1","b":"2"}' WHERE id = 'node_1'`, 7, nil},
	}
	for _, st := range steps {
		t.Run(st.name, func(t *testing.T) {
			// Invalidate twice: the key runs once and recomputes twice at
			// most, and the generation still moves at most once.
			e.change(t, st.sql)
			e.change(t, "")
			e.tick(t, desired.Kind)
			e.change(t, "")
			e.tick(t, desired.Kind)
			spec, gen, specErr := e.spec(t)
			if gen != st.gen || specErr != "" {
				t.Fatalf("generation %d (%q), want %d", gen, specErr, st.gen)
			}
			if st.check != nil && !st.check(spec) {
				t.Fatalf("spec %v", spec)
			}
		})
	}
	var want []int64
	for g := int64(1); g <= 7; g++ {
		want = append(want, g)
	}
	e.deliveries(t, "node_1", len(want)) // one per generation
	// Each bump wrote one node.spec.changed event in its transaction.
	rows, err := e.pool.Query(t.Context(), `SELECT (payload->>'generation')::bigint FROM outbox WHERE type = 'node.spec.changed' ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	events, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil || !slices.Equal(events, want) {
		t.Fatalf("node.spec.changed events %v (%v), want %v", events, err, want)
	}
}

func TestConflictIsReportedWithoutBump(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	metalNTP := "ntp-metal"
	reg := nodespec.Builtin()
	err := reg.Register("metal", func(context.Context, reconcile.Querier, desired.Node) (*agentv1.NodeSpec, error) {
		mu.Lock()
		defer mu.Unlock()
		return &agentv1.NodeSpec{Site: &agentv1.SiteSettings{NtpServers: &agentv1.StringList{Values: []string{metalNTP}}, Gateways: &agentv1.StringList{Values: []string{"gw-metal:8443"}}}}, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := reg.Register("metal", nil); err == nil {
		t.Fatal("a module registered twice must fail")
	}
	e := setup(t, reg, "adopted")
	e.exec(t, `UPDATE pools SET site = '{"logLevel": "warn"}' WHERE id = 'pool_a'`)
	e.change(t, "")
	e.tick(t, desired.Kind)
	spec, gen, specErr := e.spec(t)
	if gen != 1 || specErr != "" || spec.GetSite().GetLogLevel() != "warn" || spec.GetSite().GetNtpServers().GetValues()[0] != "ntp-metal" {
		t.Fatalf("fields of two modules merge: generation %d (%q), %v", gen, specErr, spec)
	}

	e.change(t, `UPDATE pools SET site = '{"logLevel": "warn", "ntpServers": {"values": ["ntp-pool"]}}' WHERE id = 'pool_a'`)
	e.tick(t, desired.Kind)
	spec, gen, specErr = e.spec(t)
	if gen != 1 || !strings.Contains(specErr, "site.ntp_servers") || !strings.Contains(specErr, `"pool"`) || !strings.Contains(specErr, `"metal"`) {
		t.Fatalf("conflict: generation %d, spec error %q", gen, specErr)
	}
	if spec.GetSite().GetNtpServers().GetValues()[0] != "ntp-metal" {
		t.Fatalf("the last good spec must stay: %v", spec)
	}

	// Agreeing resolves it: the error clears and the generation moves once.
	mu.Lock()
	metalNTP = "ntp-pool"
	mu.Unlock()
	e.change(t, "")
	e.tick(t, desired.Kind)
	if _, gen, specErr = e.spec(t); gen != 2 || specErr != "" {
		t.Fatalf("resolved: generation %d, spec error %q", gen, specErr)
	}
	e.deliveries(t, "node_1", 2)
}

func TestResyncFindsAdoptedNodes(t *testing.T) {
	t.Parallel()
	e := setup(t, nil, "adopted")
	fixture.Node(t, e.pool, fixture.NodeOpts{ID: "node_2", Pool: "pool_a"})
	if err := e.rt.Heartbeat(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := e.rt.Resync(t.Context()); err != nil {
		t.Fatal(err)
	}
	rows, err := e.pool.Query(t.Context(), `SELECT key FROM work_queue WHERE kind = $1 ORDER BY key`, desired.Kind)
	if err != nil {
		t.Fatal(err)
	}
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(keys) != 1 || keys[0] != "node_1" {
		t.Fatalf("resynced %v %v, want only the adopted node_1", keys, err)
	}
	e.tick(t, desired.Kind)
	if _, gen, _ := e.spec(t); gen != 1 {
		t.Fatalf("generation %d after resync", gen)
	}
}
