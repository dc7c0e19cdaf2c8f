package lifecycle_test

import (
	"context"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/bettercompute/bettercompute/pkg/bus"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
	"github.com/bettercompute/bettercompute/services/lifecycle"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func newPool(t *testing.T, ids ...string) *pgxpool.Pool {
	t.Helper()
	pool, err := db.Open(t.Context(), db.Config{URL: pgtest.NewDB(t), MaxConns: 8})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	fixture.Pool(t, pool, fixture.PoolOpts{ID: "pool_a"})
	for _, id := range ids {
		fixture.Node(t, pool, fixture.NodeOpts{ID: id, Pool: "pool_a", Gateway: "gw-1"})
	}
	return pool
}

// seenAgo stands in for the clock: node id was last heard from d ago.
func seenAgo(t *testing.T, pool *pgxpool.Pool, d time.Duration, ids ...string) {
	t.Helper()
	if _, err := pool.Exec(t.Context(), `UPDATE nodes SET last_seen_at = now() - $2::interval WHERE id = ANY($1)`, ids, d); err != nil {
		t.Fatal(err)
	}
}

// heartbeat is what a gateway's liveness write does.
func heartbeat(t *testing.T, pool *pgxpool.Pool, ids ...string) {
	t.Helper()
	ls := make([]nodes.Liveness, len(ids))
	for i, id := range ids {
		ls[i] = nodes.Liveness{NodeID: id, Epoch: 1, Seen: true}
	}
	if _, err := nodes.WriteLiveness(t.Context(), pool, ls); err != nil {
		t.Fatal(err)
	}
}

func ready(t *testing.T, pool *pgxpool.Pool, id string) nodes.Condition {
	t.Helper()
	n, err := nodes.Lookup(t.Context(), pool, id)
	if err != nil {
		t.Fatal(err)
	}
	return n.ReadyCondition()
}

func readyValue(t *testing.T, pool *pgxpool.Pool, id string) string {
	t.Helper()
	var v string
	if err := pool.QueryRow(t.Context(), `SELECT ready FROM nodes WHERE id = $1`, id).Scan(&v); err != nil {
		t.Fatal(err)
	}
	return v
}

// eventsOf returns the types of the events about node id, in order.
func eventsOf(t *testing.T, pool *pgxpool.Pool, id string) []string {
	t.Helper()
	rows, err := pool.Query(t.Context(), `SELECT type FROM outbox WHERE resource_id = $1 AND type LIKE 'node.%' ORDER BY id`, id)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var s string
		_ = rows.Scan(&s)
		out = append(out, s)
	}
	return out
}

func eq(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestLivenessTransitions(t *testing.T) {
	pool := newPool(t, "node_1", "node_2", "node_3")
	rt, err := reconcile.New(pool, nil, reconcile.Config{Roles: []string{reconcile.RoleControllers}, Heartbeat: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	// Limit 2: a pass with more changes runs again (SyncAgain).
	if err := rt.Register(lifecycle.Liveness(lifecycle.Config{Limit: 2})); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rt.Stop)
	tick := func() reconcile.TickResult {
		t.Helper()
		if err := workqueue.Enqueue(t.Context(), pool, lifecycle.LivenessKind, "all"); err != nil {
			t.Fatal(err)
		}
		tr, err := rt.Jobs()[lifecycle.LivenessKind].Tick(t.Context())
		if err != nil || tr.Failed > 0 {
			t.Fatalf("tick: %+v %v", tr, err)
		}
		return tr
	}

	tick()
	if c := ready(t, pool, "node_1"); !c.Status || c.Type != "Ready" {
		t.Fatalf("a node just seen: %+v", c)
	}
	seenAgo(t, pool, 41*time.Second, "node_1", "node_2", "node_3")
	if tr := tick(); tr.SyncAgain != 1 {
		t.Fatalf("three changes with limit 2: %+v", tr)
	}
	tick()
	for _, id := range []string{"node_1", "node_2", "node_3"} {
		if c := ready(t, pool, id); c.Status || readyValue(t, pool, id) != nodes.ReadyUnknown || c.Reason == "" {
			t.Fatalf("%s after 41s: %+v", id, c)
		}
	}
	seenAgo(t, pool, 3*time.Minute, "node_1")
	tick()
	if v := readyValue(t, pool, "node_1"); v != nodes.ReadyLost {
		t.Fatalf("node_1 after 3m: %s", v)
	}
	heartbeat(t, pool, "node_1", "node_2")
	tick()
	tick() // nothing more to change: no more events
	if v := readyValue(t, pool, "node_1"); v != nodes.ReadyTrue {
		t.Fatalf("node_1 after a heartbeat: %s", v)
	}
	if got := eventsOf(t, pool, "node_1"); !eq(got, []string{"node.not_ready", "node.lost", "node.ready"}) {
		t.Fatalf("node_1 events: %v", got)
	}
	if got := eventsOf(t, pool, "node_2"); !eq(got, []string{"node.not_ready", "node.ready"}) {
		t.Fatalf("node_2 events: %v", got)
	}
	if got := eventsOf(t, pool, "node_3"); !eq(got, []string{"node.not_ready"}) {
		t.Fatalf("node_3 events: %v", got)
	}
	// Found Lost straight from True (no pass while it was Unknown): it is
	// announced not ready first, in the same pass.
	seenAgo(t, pool, 3*time.Minute, "node_2")
	tick()
	if got := eventsOf(t, pool, "node_2"); !eq(got, []string{"node.not_ready", "node.ready", "node.not_ready", "node.lost"}) {
		t.Fatalf("node_2 events after jumping to Lost: %v", got)
	}
	var payload map[string]any
	if err := pool.QueryRow(t.Context(), `SELECT payload FROM outbox WHERE resource_id = 'node_1' AND type = 'node.lost'`).Scan(&payload); err != nil {
		t.Fatal(err)
	}
	if payload["from"] != "Unknown" || payload["to"] != "Lost" || payload["poolId"] != "pool_a" || payload["lastSeenAt"] == nil || payload["reason"] == "" {
		t.Fatalf("node.lost payload: %v", payload)
	}
}

// TestLivenessChaosBusStopped runs the job on the runtime's own timers with
// NATS stopped: the periodic key is enqueued and polled without pokes, and
// Ready still follows the heartbeats.
func TestLivenessChaosBusStopped(t *testing.T) {
	pool := newPool(t, "node_1")
	ns := natstest.New(t)
	nc, err := bus.Connect(ns.URL(), "liveness", slog.New(slog.DiscardHandler))
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
	if err := rt.Register(lifecycle.Liveness(lifecycle.Config{NotReadyAfter: 40 * time.Second, LostAfter: time.Minute, Every: 100 * time.Millisecond})); err != nil {
		t.Fatal(err)
	}
	if err := rt.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rt.Stop)

	seenAgo(t, pool, 45*time.Second, "node_1")
	poll.Until(t, 20*time.Second, "node_1 to go Unknown with the bus down", func() bool { return readyValue(t, pool, "node_1") == nodes.ReadyUnknown })
	seenAgo(t, pool, 2*time.Minute, "node_1")
	poll.Until(t, 20*time.Second, "node_1 to go Lost with the bus down", func() bool { return readyValue(t, pool, "node_1") == nodes.ReadyLost })
	heartbeat(t, pool, "node_1")
	poll.Until(t, 20*time.Second, "node_1 to be Ready again with the bus down", func() bool { return readyValue(t, pool, "node_1") == nodes.ReadyTrue })
	if got := eventsOf(t, pool, "node_1"); !eq(got, []string{"node.not_ready", "node.lost", "node.ready"}) {
		t.Fatalf("events: %v", got)
	}
}

// statements counts the statements on a pool that touch the tables the
// liveness job writes (nodes, brakes, outbox).
type statements struct{ n atomic.Int64 }

func (s *statements) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "nodes") || strings.Contains(d.SQL, "brakes") || strings.Contains(d.SQL, "outbox") {
		s.n.Add(1)
	}
	return ctx
}

func (*statements) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// fleetEvent is a fleet.eviction_* event as stored.
type fleetEvent struct {
	Type, Tenant string
	Payload      map[string]any
}

func fleetEvents(t *testing.T, pool *pgxpool.Pool) []fleetEvent {
	t.Helper()
	rows, err := pool.Query(t.Context(), `SELECT type, tenant_id, payload FROM outbox WHERE type LIKE 'fleet.%' ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[fleetEvent])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// gauge returns bc_eviction_paused by scope, as a scrape sees it.
func gauge(t *testing.T, pool *pgxpool.Pool) map[string]float64 {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(&lifecycle.BrakesCollector{Pool: pool}); err != nil {
		t.Fatal(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "bc_eviction_paused" {
			continue
		}
		for _, m := range mf.GetMetric() {
			out[m.GetLabel()[0].GetValue()] = m.GetGauge().GetValue()
		}
	}
	return out
}

// TestLivenessEvictionBrakes: when more than nodes.unhealthyThreshold of a
// pool's nodes, or of one gateway's, go Lost, the liveness pass that marks
// them opens the scope's breaker with a fleet.eviction_paused event (the
// pool's tenant; a gateway's per tenant, that tenant) and the gauge at 1; when they come
// back, fleet.eviction_resumed and 0. Each pass is at most three statements
// on nodes, brakes and outbox (readiness, breakers, events), breakers or not.
func TestLivenessEvictionBrakes(t *testing.T) {
	var count statements
	pool, err := db.Open(t.Context(), db.Config{URL: pgtest.NewDB(t), MaxConns: 8, Tracer: &count})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	fixture.Tenant(t, pool, fixture.TenantOpts{ID: "acme"})
	fixture.Pool(t, pool, fixture.PoolOpts{ID: "pool_a", Tenant: "acme"})
	fixture.Pool(t, pool, fixture.PoolOpts{ID: "pool_b"})
	// gw-1 holds a1 a2 a3 b1 b2 b3; gw-2 holds a4 a5 b4 b5.
	for _, n := range []struct{ id, pool, gw string }{
		{"a1", "pool_a", "gw-1"}, {"a2", "pool_a", "gw-1"}, {"a3", "pool_a", "gw-1"}, {"a4", "pool_a", "gw-2"}, {"a5", "pool_a", "gw-2"},
		{"b1", "pool_b", "gw-1"}, {"b2", "pool_b", "gw-1"}, {"b3", "pool_b", "gw-1"}, {"b4", "pool_b", "gw-2"}, {"b5", "pool_b", "gw-2"},
	} {
		tenant := fixture.DefaultTenant
		if n.pool == "pool_a" {
			tenant = "acme"
		}
		fixture.Node(t, pool, fixture.NodeOpts{ID: "node_" + n.id, Tenant: tenant, Pool: n.pool, Gateway: n.gw})
	}
	rt, err := reconcile.New(pool, nil, reconcile.Config{Roles: []string{reconcile.RoleControllers}, Heartbeat: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := rt.Register(lifecycle.Liveness(lifecycle.Config{})); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rt.Stop)
	tick := func() {
		t.Helper()
		if err := workqueue.Enqueue(t.Context(), pool, lifecycle.LivenessKind, "all"); err != nil {
			t.Fatal(err)
		}
		before := count.n.Load()
		tr, err := rt.Jobs()[lifecycle.LivenessKind].Tick(t.Context())
		if err != nil || tr.Failed > 0 {
			t.Fatalf("tick: %+v %v", tr, err)
		}
		if n := count.n.Load() - before; n < 2 || n > 3 {
			t.Fatalf("a liveness pass ran %d statements on nodes, brakes and outbox, want 2 or 3", n)
		}
	}
	paused := func(scope string) bool {
		t.Helper()
		var p bool
		if err := pool.QueryRow(t.Context(), `SELECT paused FROM brakes WHERE scope = $1`, scope).Scan(&p); err != nil {
			t.Fatalf("breaker %s: %v", scope, err)
		}
		return p
	}
	check := func(want []fleetEvent) {
		t.Helper()
		got := fleetEvents(t, pool)
		if len(got) != len(want) {
			t.Fatalf("fleet events %+v, want %+v", got, want)
		}
		for i := range want {
			g, w := got[i], want[i]
			if g.Type != w.Type || g.Tenant != w.Tenant || g.Payload["scope"] != w.Payload["scope"] ||
				g.Payload["notReady"] != w.Payload["notReady"] || g.Payload["total"] != w.Payload["total"] || g.Payload["threshold"] != 0.55 {
				t.Fatalf("fleet event %d: %+v, want %+v", i, g, w)
			}
		}
	}
	ev := func(typ, tenant, scope string, notReady, total float64) fleetEvent {
		return fleetEvent{typ, tenant, map[string]any{"scope": scope, "notReady": notReady, "total": total}}
	}

	tick()
	check(nil)

	// 3 of pool_a's 5 go Lost: pool_a is paused (60 %), and so is acme's
	// part of gw-1 (3 of its 3); root's part of gw-1 is not (a gateway's
	// breaker counts one tenant's nodes).
	seenAgo(t, pool, 3*time.Minute, "node_a1", "node_a2", "node_a3")
	tick()
	want := []fleetEvent{
		ev("fleet.eviction_paused", "acme", "gateway:gw-1/tenant:acme", 3, 3),
		ev("fleet.eviction_paused", "acme", "pool:pool_a", 3, 5),
	}
	check(want)
	if !paused("pool:pool_a") {
		t.Fatal("pool_a's breaker is not paused")
	}
	if g := gauge(t, pool); len(g) != 2 || g["pool:pool_a"] != 1 || g["gateway:gw-1/tenant:acme"] != 1 {
		t.Fatalf("gauge: %v", g)
	}
	tick() // still paused: no second event
	check(want)

	// They come back: resumed, once.
	heartbeat(t, pool, "node_a1", "node_a2", "node_a3")
	tick()
	tick()
	want = append(want, ev("fleet.eviction_resumed", "acme", "gateway:gw-1/tenant:acme", 0, 3),
		ev("fleet.eviction_resumed", "acme", "pool:pool_a", 0, 5))
	check(want)
	if paused("pool:pool_a") {
		t.Fatal("pool_a's breaker is still paused")
	}
	if g := gauge(t, pool); g["pool:pool_a"] != 0 {
		t.Fatalf("gauge after resuming: %v", g)
	}

	// gw-2's four nodes, spread over both pools, go Lost: gw-2 is paused
	// for each tenant (each its event), neither pool is (2 of 5 each).
	seenAgo(t, pool, 3*time.Minute, "node_a4", "node_a5", "node_b4", "node_b5")
	tick()
	want = append(want, ev("fleet.eviction_paused", "acme", "gateway:gw-2/tenant:acme", 2, 2),
		ev("fleet.eviction_paused", "root", "gateway:gw-2/tenant:root", 2, 2))
	check(want)
	if g := gauge(t, pool); g["gateway:gw-2/tenant:acme"] != 1 || g["gateway:gw-2/tenant:root"] != 1 || g["pool:pool_a"] != 0 || len(g) != 4 {
		t.Fatalf("gauge with gw-2 down: %v", g)
	}
	heartbeat(t, pool, "node_a4", "node_a5", "node_b4", "node_b5")
	tick()
	want = append(want, ev("fleet.eviction_resumed", "acme", "gateway:gw-2/tenant:acme", 0, 2),
		ev("fleet.eviction_resumed", "root", "gateway:gw-2/tenant:root", 0, 2))
	check(want)
}
