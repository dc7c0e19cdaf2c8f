package lifecycle_test

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/encoding/protojson"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/bus"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	nodelife "github.com/bettercompute/bettercompute/pkg/lifecycle"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
	"github.com/bettercompute/bettercompute/services/inventory"
	"github.com/bettercompute/bettercompute/services/lifecycle"
)

// hw is what a node's inventory report says of its hardware.
type hw struct {
	gpus           int
	model          string
	driver, cuda   string
	noHostSection  bool
	unhealthyIndex int // -1: none
}

var baseHW = hw{gpus: 8, model: "NVIDIA H200", driver: "550.54.15", cuda: "12.4", unhealthyIndex: -1}

// driftEnv is a database with pools of adopted nodes that reported their
// inventory, the inventory controller and fleet.drift on one runtime with
// a fake clock.
type driftEnv struct {
	pool  *pgxpool.Pool
	rt    *reconcile.Runtime
	clock *clock
}

func newDriftEnv(t *testing.T, pools map[string][]string) *driftEnv {
	t.Helper()
	pool, err := db.Open(t.Context(), db.Config{URL: pgtest.NewDB(t), MaxConns: 8})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	e := &driftEnv{pool: pool, clock: &clock{t: time.Now()}}
	rt, err := reconcile.New(pool, nil, reconcile.Config{Roles: []string{reconcile.RoleControllers}, Heartbeat: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range slices.Concat(inventory.Reconcilers(), lifecycle.Drift(lifecycle.DriftConfig{Now: e.clock.Now})) {
		if err := rt.Register(r); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(rt.Stop)
	e.rt = rt
	for p, ids := range pools {
		fixture.Pool(t, pool, fixture.PoolOpts{ID: p})
		for _, id := range ids {
			fixture.Node(t, pool, fixture.NodeOpts{ID: id, Pool: p, Gateway: "gw-1", State: nodes.StateAdopted})
			e.report(t, id, baseHW)
		}
	}
	return e
}

// report stores node's inventory report as the gateway would and runs the
// inventory controller.
func (e *driftEnv) report(t *testing.T, node string, h hw) {
	t.Helper()
	rep := &agentv1.InventoryReport{Sections: []string{"gpus", "host"}}
	if !h.noHostSection {
		rep.Host = &agentv1.Host{Hostname: node, DriverVersion: h.driver, CudaVersion: h.cuda}
	} else {
		rep.Sections = []string{"gpus"}
	}
	for i := range h.gpus {
		rep.Gpus = append(rep.Gpus, &agentv1.GPU{Index: uint32(i), Uuid: uuid(node, i), Model: h.model, MemoryBytes: 141 << 30,
			Healthy: i != h.unhealthyIndex})
	}
	b, err := protojson.Marshal(rep)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(t.Context(), `
		INSERT INTO node_inventory (node_id, session_epoch, report) VALUES ($1, 1, $2)
		ON CONFLICT (node_id) DO UPDATE SET report = EXCLUDED.report, received_at = clock_timestamp()`, node, json.RawMessage(b)); err != nil {
		t.Fatal(err)
	}
	if err := workqueue.Enqueue(t.Context(), e.pool, nodelife.KindInventory, node); err != nil {
		t.Fatal(err)
	}
	if tr, err := e.rt.Jobs()[nodelife.KindInventory].Tick(t.Context()); err != nil || tr.Failed > 0 {
		t.Fatalf("tick inventory: %+v %v", tr, err)
	}
}

// observe stores node's section status as the gateway does (session epoch
// 1), each section "name=STATE[:reason]" with STATE CONVERGED, PROGRESSING,
// FAILED or FAILED_TERMINAL.
func (e *driftEnv) observe(t *testing.T, node string, sections ...string) {
	t.Helper()
	var ss []nodes.SectionStatus
	for _, s := range sections {
		name, rest, _ := strings.Cut(s, "=")
		state, reason, _ := strings.Cut(rest, ":")
		ss = append(ss, nodes.SectionStatus{Section: name, State: "SECTION_STATE_" + state, Reason: strings.TrimSpace(reason), Generation: 1})
	}
	b, err := json.Marshal(ss)
	if err != nil {
		t.Fatal(err)
	}
	st, err := nodes.RecordObserved(t.Context(), e.pool, []nodes.Observation{{NodeID: node, Epoch: 1, Generation: 1, SectionStatus: b}})
	if err != nil || !st[0].Stored {
		t.Fatalf("observe %s: %+v %v", node, st, err)
	}
}

// pass runs fleet.drift once over every pool with nodes (the sweep, then
// the pools).
func (e *driftEnv) pass(t *testing.T) {
	t.Helper()
	if err := workqueue.Enqueue(t.Context(), e.pool, lifecycle.DriftSweepKind, "all"); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{lifecycle.DriftSweepKind, nodelife.KindDrift} {
		if tr, err := e.rt.Jobs()[k].Tick(t.Context()); err != nil || tr.Failed > 0 {
			t.Fatalf("tick %s: %+v %v", k, tr, err)
		}
	}
}

// drifted returns node's Drifted condition; ok false when it has none.
func (e *driftEnv) drifted(t *testing.T, node string) (nodes.Condition, bool) {
	t.Helper()
	n, err := nodes.Lookup(t.Context(), e.pool, node)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range n.Conditions {
		if c.Type == nodes.ConditionDrifted {
			return c, true
		}
	}
	return nodes.Condition{}, false
}

// listDrifted lists the nodes nodes.list condition=Drifted returns.
func (e *driftEnv) listDrifted(t *testing.T, cond string) []string {
	t.Helper()
	ns, err := nodes.List(t.Context(), e.pool, nodes.Filter{TenantID: fixture.DefaultTenant, Condition: cond}, "", 100)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, n := range ns {
		out = append(out, n.ID)
	}
	return out
}

// wantDrifted fails unless node's Drifted holds with exactly one reason
// containing want, or (want empty) is stored and does not hold.
func (e *driftEnv) wantDrifted(t *testing.T, node, want string) {
	t.Helper()
	c, ok := e.drifted(t, node)
	if !ok {
		t.Fatalf("%s has no Drifted condition", node)
	}
	if want == "" {
		if c.Status || len(c.Reasons) > 0 {
			t.Fatalf("%s: Drifted %+v, want False", node, c)
		}
		return
	}
	if !c.Status || len(c.Reasons) != 1 || !strings.Contains(c.Reasons[0], want) || c.Reason != c.Reasons[0] {
		t.Fatalf("%s: Drifted %+v, want True with one reason containing %q", node, c, want)
	}
}

// driftEvents returns the node.drifted and node.drift_cleared events of
// node, in order.
func driftEvents(t *testing.T, pool *pgxpool.Pool, node string) []string {
	t.Helper()
	var out []string
	for _, e := range eventsOf(t, pool, node) {
		if strings.HasPrefix(e, "node.drift") {
			out = append(out, e)
		}
	}
	return out
}

// TestDriftEachReasonRaisesAndClears: each reason — an inventory value
// that differs from the pool's baseline (driver version, CUDA version, GPU
// count, GPU model), a section not converged for longer than
// fleet.stuckAfter, a section the daemon reports drifted — raises Drifted
// on exactly that node, with the reason, node.drifted and the condition
// filter listing it; back to normal, it clears (node.drift_cleared).
func TestDriftEachReasonRaisesAndClears(t *testing.T) {
	ids := []string{"node_1", "node_2", "node_3", "node_4", "node_5"}
	e := newDriftEnv(t, map[string][]string{"pool_a": ids})
	for _, id := range ids {
		e.observe(t, id, "devices=CONVERGED", "runtime=CONVERGED")
	}
	e.pass(t)
	for _, id := range ids {
		e.wantDrifted(t, id, "")
	}
	if got := e.listDrifted(t, "Drifted"); len(got) != 0 {
		t.Fatalf("drifted nodes of a uniform pool: %v", got)
	}
	if got := e.listDrifted(t, "Drifted=False"); !slices.Equal(got, ids) {
		t.Fatalf("Drifted=False: %v", got)
	}

	check := func(name, node string, raise func(), want string, mend func()) {
		t.Helper()
		raise()
		e.pass(t)
		e.wantDrifted(t, node, want)
		for _, id := range ids {
			if id != node {
				e.wantDrifted(t, id, "")
			}
		}
		if got := e.listDrifted(t, "Drifted"); !slices.Equal(got, []string{node}) {
			t.Fatalf("%s: condition=Drifted lists %v, want [%s]", name, got, node)
		}
		if got := e.listDrifted(t, "!Drifted"); len(got) != len(ids)-1 || slices.Contains(got, node) {
			t.Fatalf("%s: !Drifted lists %v", name, got)
		}
		n, err := nodes.CountDrifted(t.Context(), e.pool, "pool_a")
		if err != nil || n != 1 {
			t.Fatalf("%s: CountDrifted %d %v", name, n, err)
		}
		// The gauge bettercompute_node_conditions counts it too.
		census, err := nodes.CountByCondition(t.Context(), e.pool)
		if err != nil {
			t.Fatal(err)
		}
		counted := map[bool]int{}
		for _, c := range census {
			if c.PoolID == "pool_a" && c.Type == nodes.ConditionDrifted {
				counted[c.Status] = c.Nodes
			}
		}
		if counted[true] != 1 || counted[false] != len(ids)-1 {
			t.Fatalf("%s: condition census %v", name, counted)
		}
		// A second pass changes nothing and writes no second event.
		before := driftEvents(t, e.pool, node)
		e.pass(t)
		if got := driftEvents(t, e.pool, node); !slices.Equal(got, before) || got[len(got)-1] != "node.drifted" {
			t.Fatalf("%s: events after a quiet pass %v (before %v)", name, got, before)
		}
		mend()
		e.pass(t)
		e.wantDrifted(t, node, "")
		if got := driftEvents(t, e.pool, node); got[len(got)-1] != "node.drift_cleared" || len(got) != len(before)+1 {
			t.Fatalf("%s: events after clearing %v", name, got)
		}
		if got := e.listDrifted(t, "Drifted"); len(got) != 0 {
			t.Fatalf("%s: still listed %v", name, got)
		}
	}

	// Inventory: one node's driver, CUDA, GPU count, GPU model differ.
	odd := func(f func(*hw)) func() {
		return func() {
			h := baseHW
			f(&h)
			e.report(t, "node_4", h)
		}
	}
	back := func() { e.report(t, "node_4", baseHW) }
	check("driver", "node_4", odd(func(h *hw) { h.driver = "535.104.05" }),
		"driver version 535.104.05 differs from the pool's baseline 550.54.15", back)
	check("cuda", "node_4", odd(func(h *hw) { h.cuda = "12.2" }), "CUDA version 12.2 differs from the pool's baseline 12.4", back)
	check("gpu count", "node_4", odd(func(h *hw) { h.gpus = 7 }), "GPU count 7 differs from the pool's baseline 8", back)
	check("gpu model", "node_4", odd(func(h *hw) { h.model = "NVIDIA H100 80GB HBM3" }),
		"GPU model NVIDIA H100 80GB HBM3 differs from the pool's baseline NVIDIA H200", back)

	// The inventory controller, rewriting a Drifted node's conditions,
	// keeps its Drifted.
	odd(func(h *hw) { h.driver = "535.104.05"; h.unhealthyIndex = 3 })()
	e.pass(t)
	e.report(t, "node_4", hw{gpus: 8, model: "NVIDIA H200", driver: "535.104.05", cuda: "12.4", unhealthyIndex: 2})
	e.wantDrifted(t, "node_4", "driver version 535.104.05")
	// A report without the host section compares nothing of it.
	e.report(t, "node_4", hw{gpus: 8, model: "NVIDIA H200", noHostSection: true, unhealthyIndex: -1})
	e.pass(t)
	e.wantDrifted(t, "node_4", "")
	back()
	e.pass(t)

	// A section not converged: not Drifted before fleet.stuckAfter (15m),
	// Drifted after it, whether it stays progressing or fails and retries.
	check("stuck", "node_2", func() {
		e.observe(t, "node_2", "devices=CONVERGED", "runtime=PROGRESSING")
		e.pass(t)
		e.wantDrifted(t, "node_2", "")
		e.clock.Add(10 * time.Minute)
		e.observe(t, "node_2", "devices=CONVERGED", "runtime=FAILED: containerd restart failed")
		e.pass(t)
		e.wantDrifted(t, "node_2", "")
		e.clock.Add(6 * time.Minute)
	}, "section runtime not converged for longer than 15m0s", func() {
		e.observe(t, "node_2", "devices=CONVERGED", "runtime=CONVERGED")
	})
	// A section failed terminally is settled: never stuck.
	e.observe(t, "node_2", "devices=CONVERGED", "runtime=FAILED_TERMINAL: unsupported")
	e.pass(t)
	e.clock.Add(time.Hour)
	e.pass(t)
	e.wantDrifted(t, "node_2", "")

	// The daemon reports a section drifted (a CDI spec edited by hand,
	// restored: still CONVERGED); the next report is plain.
	check("reported", "node_3", func() {
		e.observe(t, "node_3", "devices=CONVERGED: drifted: /var/run/cdi/bettercompute.io-gpu.json was edited or removed by hand, restored; 8 GPUs", "runtime=CONVERGED")
	}, "section devices reports drifted: /var/run/cdi/bettercompute.io-gpu.json was edited or removed by hand", func() {
		e.observe(t, "node_3", "devices=CONVERGED: 8 GPUs", "runtime=CONVERGED")
	})

	// Two reasons at once: both listed, sorted; one clears, the other
	// stays (node.drifted again, with the one left).
	e.report(t, "node_5", hw{gpus: 8, model: "NVIDIA H200", driver: "535.104.05", cuda: "12.4", unhealthyIndex: -1})
	e.observe(t, "node_5", "devices=CONVERGED: drifted: mig layout changed", "runtime=CONVERGED")
	e.pass(t)
	c, _ := e.drifted(t, "node_5")
	if !c.Status || len(c.Reasons) != 2 || !strings.HasPrefix(c.Reasons[0], "driver version") || !strings.HasPrefix(c.Reasons[1], "section devices") ||
		c.Reason != c.Reasons[0]+"; "+c.Reasons[1] {
		t.Fatalf("two reasons: %+v", c)
	}
	since := c.Since
	e.observe(t, "node_5", "devices=CONVERGED", "runtime=CONVERGED")
	e.clock.Add(time.Minute)
	e.pass(t)
	c, _ = e.drifted(t, "node_5")
	if !c.Status || len(c.Reasons) != 1 || !c.Since.Equal(since) {
		t.Fatalf("one reason left: %+v (since %s)", c, since)
	}
	if got := driftEvents(t, e.pool, "node_5"); !slices.Equal(got, []string{"node.drifted", "node.drifted"}) {
		t.Fatalf("node_5 events %v", got)
	}
	var reasons []string
	if err := e.pool.QueryRow(t.Context(), `SELECT payload->'reasons' FROM outbox WHERE resource_id = 'node_5' ORDER BY id DESC LIMIT 1`).Scan(&reasons); err != nil {
		t.Fatal(err)
	}
	if len(reasons) != 1 || !strings.HasPrefix(reasons[0], "driver version") {
		t.Fatalf("node.drifted reasons %v", reasons)
	}
}

// TestDriftBaselineIsThePoolsMode: the baseline is per pool and is the
// value most of its nodes report; two values equally common make no
// baseline (nothing is Drifted for it), and a commissioning node is
// neither judged nor counted.
func TestDriftBaselineIsThePoolsMode(t *testing.T) {
	e := newDriftEnv(t, map[string][]string{"pool_a": {"node_a1", "node_a2", "node_a3"}, "pool_b": {"node_b1", "node_b2"}})
	old := baseHW
	old.driver = "535.104.05"
	// pool_b: every node on the old driver; its own baseline, so none
	// drifted although pool_a's differs.
	e.report(t, "node_b1", old)
	e.report(t, "node_b2", old)
	e.pass(t)
	for _, id := range []string{"node_a1", "node_a2", "node_a3", "node_b1", "node_b2"} {
		e.wantDrifted(t, id, "")
	}
	// pool_b split one to one: no baseline for the driver.
	e.report(t, "node_b2", baseHW)
	e.pass(t)
	e.wantDrifted(t, "node_b1", "")
	e.wantDrifted(t, "node_b2", "")
	// Commissioning nodes (no desired state yet) with another driver, more
	// of them than the adopted ones: not judged, not counted.
	for _, id := range []string{"node_c1", "node_c2", "node_c3", "node_c4"} {
		fixture.Node(t, e.pool, fixture.NodeOpts{ID: id, Pool: "pool_a", Gateway: "gw-1", State: nodes.StateCommissioning})
		e.report(t, id, old)
	}
	e.pass(t)
	if _, ok := e.drifted(t, "node_c1"); ok {
		t.Fatal("a commissioning node got a Drifted condition")
	}
	for _, id := range []string{"node_a1", "node_a2", "node_a3"} {
		e.wantDrifted(t, id, "")
	}
}

// TestDriftBusStopped: with NATS down, the started runtime still computes
// Drifted from the database (the sweep's period, the pools' runs).
func TestDriftBusStopped(t *testing.T) {
	pool, err := db.Open(t.Context(), db.Config{URL: pgtest.NewDB(t), MaxConns: 8})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	fixture.Pool(t, pool, fixture.PoolOpts{ID: "pool_a"})
	for _, id := range []string{"node_1", "node_2"} {
		fixture.Node(t, pool, fixture.NodeOpts{ID: id, Pool: "pool_a", Gateway: "gw-1", State: nodes.StateAdopted})
	}
	ns := natstest.New(t)
	nc, err := bus.Connect(ns.URL(), "drift", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	poll.Until(t, 10*time.Second, "the bus to connect", nc.IsConnected)
	ns.Stop()
	poll.Until(t, 15*time.Second, "the client to notice", func() bool { return !nc.IsConnected() })

	rt, err := reconcile.New(pool, nc, reconcile.Config{
		Roles: []string{reconcile.RoleControllers}, Heartbeat: 200 * time.Millisecond,
		Poll: time.Hour, PollBusDown: 50 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range lifecycle.Drift(lifecycle.DriftConfig{Every: 100 * time.Millisecond}) {
		if err := rt.Register(r); err != nil {
			t.Fatal(err)
		}
	}
	if err := rt.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rt.Stop)
	e := &driftEnv{pool: pool}
	e.observe(t, "node_1", "devices=CONVERGED: drifted: /var/run/cdi/bettercompute.io-gpu.json was edited or removed by hand, restored")
	e.observe(t, "node_2", "devices=CONVERGED")
	holds := func(node string) func() bool {
		return func() bool { c, ok := e.drifted(t, node); return ok && c.Status }
	}
	poll.Until(t, 20*time.Second, "node_1 to be Drifted with the bus down", holds("node_1"))
	e.observe(t, "node_1", "devices=CONVERGED")
	poll.Until(t, 20*time.Second, "node_1's Drifted to clear with the bus down", func() bool {
		c, ok := e.drifted(t, "node_1")
		return ok && !c.Status
	})
	if c, _ := e.drifted(t, "node_2"); c.Status {
		t.Fatalf("node_2 Drifted: %+v", c)
	}
	if got := driftEvents(t, pool, "node_1"); !slices.Equal(got, []string{"node.drifted", "node.drift_cleared"}) {
		t.Fatalf("events %v", got)
	}
}

// BenchmarkDriftPass: one fleet.drift run over a pool of 10,000 adopted
// nodes (8 GPUs, an inventory report and 8 section statuses each), 1 %
// of them on another driver. The first run writes every node's condition;
// b.N runs after it write nothing but what changed (here: nothing), which
// is the steady state of the sweep's every-minute pass.
func BenchmarkDriftPass(b *testing.B) {
	const n = 10000
	pool, err := db.Open(b.Context(), db.Config{URL: pgtest.NewDB(b), MaxConns: 8})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	fixture.Pool(b, pool, fixture.PoolOpts{ID: "pool_a"})
	sections := `[{"section":"identity","state":"SECTION_STATE_CONVERGED","reason":"","generation":1},
		{"section":"site","state":"SECTION_STATE_CONVERGED","reason":"","generation":1},
		{"section":"runtime","state":"SECTION_STATE_CONVERGED","reason":"","generation":1},
		{"section":"devices","state":"SECTION_STATE_CONVERGED","reason":"exposes 0 GPUs","generation":1},
		{"section":"mig","state":"SECTION_STATE_CONVERGED","reason":"","generation":1},
		{"section":"instances","state":"SECTION_STATE_CONVERGED","reason":"","generation":1},
		{"section":"health","state":"SECTION_STATE_CONVERGED","reason":"","generation":1},
		{"section":"agent","state":"SECTION_STATE_CONVERGED","reason":"","generation":1}]`
	for _, q := range []string{
		`INSERT INTO nodes (id, tenant_id, pool_id, state, shard, labels, hostname, hardware_key, generation, observed_generation, section_status)
		 SELECT 'node_' || lpad(i::text, 5, '0'), 'root', 'pool_a', 'adopted', i % 256, '{}', 'h' || i, 'hw' || i, 1, 1, $1::jsonb
		   FROM generate_series(1, ` + fmt.Sprint(n) + `) i`,
		`INSERT INTO devices (node_id, id, index, model)
		 SELECT n.id, 'GPU-' || n.id || '-' || g, g, 'NVIDIA H200' FROM nodes n, generate_series(0, 7) g`,
		`INSERT INTO node_inventory (node_id, session_epoch, report)
		 SELECT id, 1, jsonb_build_object('host', jsonb_build_object('driverVersion',
		        CASE WHEN right(id, 2) = '00' THEN '535.104.05' ELSE '550.54.15' END, 'cudaVersion', '12.4')) FROM nodes`,
	} {
		args := []any{}
		if strings.Contains(q, "$1") {
			args = append(args, sections)
		}
		if _, err := pool.Exec(b.Context(), q, args...); err != nil {
			b.Fatal(err)
		}
	}
	rt, err := reconcile.New(pool, nil, reconcile.Config{Roles: []string{reconcile.RoleControllers}, Heartbeat: time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	for _, r := range lifecycle.Drift(lifecycle.DriftConfig{}) {
		if err := rt.Register(r); err != nil {
			b.Fatal(err)
		}
	}
	b.Cleanup(rt.Stop)
	run := func() {
		if err := workqueue.Enqueue(b.Context(), pool, nodelife.KindDrift, "pool_a"); err != nil {
			b.Fatal(err)
		}
		if tr, err := rt.Jobs()[nodelife.KindDrift].Tick(b.Context()); err != nil || tr.Done != 1 {
			b.Fatalf("tick: %+v %v", tr, err)
		}
	}
	start := time.Now()
	run()
	first := time.Since(start)
	d, err := nodes.CountDrifted(b.Context(), pool, "pool_a")
	if err != nil || d != n/100 {
		b.Fatalf("%d drifted, want %d (%v)", d, n/100, err)
	}
	for b.Loop() {
		run()
	}
	b.ReportMetric(float64(first.Milliseconds()), "first-pass-ms")
}
