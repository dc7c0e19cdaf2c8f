package lifecycle_test

import (
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/bus"
	"github.com/bettercompute/bettercompute/pkg/db"
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
	if _, err := pool.Exec(t.Context(), `INSERT INTO pools (id, tenant_id, name, class) VALUES ('pool_a', 'root', 'a', 'gpu')`); err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		if _, err := nodes.Create(t.Context(), pool, nodes.Node{ID: id, TenantID: "root", PoolID: "pool_a", HardwareKey: "hw-" + id}); err != nil {
			t.Fatal(err)
		}
		if _, err := nodes.OpenSession(t.Context(), pool, id, "gw-1", "boot", "journal"); err != nil {
			t.Fatal(err)
		}
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
