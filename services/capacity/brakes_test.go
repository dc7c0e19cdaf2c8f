package capacity_test

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/brakes"
	capstore "github.com/bettercompute/bettercompute/pkg/capacity"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/services/capacity"
	"github.com/bettercompute/bettercompute/services/lifecycle"
)

// clock is the placer's fake clock (Config.Now).
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }

func (c *clock) Add(d time.Duration) { c.mu.Lock(); c.t = c.t.Add(d); c.mu.Unlock() }

// braked is a fleet of pool_p (setup's) run by one process hosting the
// placer (scheduler role) and the liveness job (controllers role), which
// marks nodes Lost and opens the breakers.
type braked struct {
	*harness
	rt    *reconcile.Runtime
	clock *clock
}

func newBraked(t *testing.T, nodes, gpus int, policy string) *braked {
	t.Helper()
	f := setup(t, nodes, gpus)
	rt, err := reconcile.New(f.db, nil, reconcile.Config{
		Roles: []string{reconcile.RoleScheduler, reconcile.RoleControllers}, Heartbeat: time.Hour, LeaseTTL: 3 * time.Hour,
	})
	if err != nil {
		t.Fatal(err)
	}
	c := &clock{t: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)}
	// One tenant's fleet: its bucket as large as the fleet's, so these
	// tests see the fleet's rate (pkg/brakes tests the tenants' share).
	recs, err := capacity.Reconcilers(capacity.Config{LostNode: policy, Now: c.Now, Brakes: brakes.Config{TenantRate: brakes.DefaultRate}})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range append(recs, lifecycle.Liveness(lifecycle.Config{})) {
		if err := rt.Register(r); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(rt.Stop)
	return &braked{harness: f, rt: rt, clock: c}
}

func ids(ns ...int) []string {
	out := make([]string, len(ns))
	for i, n := range ns {
		out[i] = fmt.Sprintf("node_%02d", n)
	}
	return out
}

// book places reservation id of n GPUs on exactly the nodes on (the
// others are made unschedulable meanwhile).
func (b *braked) book(t *testing.T, id string, n int, on ...string) {
	t.Helper()
	b.exec(t, `UPDATE nodes SET state = 'adopting' WHERE NOT (id = ANY($1)) AND state = 'adopted'`, on)
	b.pending(t, id, n, nil)
	b.enqueue(t, capstore.KindReservations, "pool_p")
	tick(t, b.rt, capstore.KindReservations)
	b.exec(t, `UPDATE nodes SET state = 'adopted' WHERE state = 'adopting'`)
	r := state(t, b.harness, id)
	if r.State != capstore.StatePlaced {
		t.Fatalf("%s: %s %s", id, r.State, r.Reason)
	}
	for _, bk := range r.Bookings {
		if !slices.Contains(on, bk.NodeID) {
			t.Fatalf("%s booked on %s, not on %v", id, bk.NodeID, on)
		}
	}
}

// lose makes nodes unseen for 3 minutes (past nodes.lostAfter) and runs a
// liveness pass: they are Lost, the breakers recomputed.
func (b *braked) lose(t *testing.T, nodes ...string) {
	t.Helper()
	b.exec(t, `UPDATE nodes SET last_seen_at = now() - interval '3 minutes' WHERE id = ANY($1)`, nodes)
	b.liveness(t)
}

// back makes nodes heard from again and runs a liveness pass.
func (b *braked) back(t *testing.T, nodes ...string) {
	t.Helper()
	b.exec(t, `UPDATE nodes SET last_seen_at = now() WHERE id = ANY($1)`, nodes)
	b.liveness(t)
}

func (b *braked) liveness(t *testing.T) {
	t.Helper()
	b.enqueue(t, lifecycle.LivenessKind, "all")
	tick(t, b.rt, lifecycle.LivenessKind)
}

// pass is one placer tick and pass over every pool with due work.
func (b *braked) pass(t *testing.T) {
	t.Helper()
	b.enqueue(t, capstore.KindTick, "all")
	tick(t, b.rt, capstore.KindTick, capstore.KindReservations)
}

// on counts the active bookings on nodes.
func (b *braked) on(t *testing.T, nodes ...string) int {
	t.Helper()
	return b.count(t, `SELECT count(*) FROM bookings WHERE active AND node_id = ANY($1)`, nodes)
}

func (b *braked) events(t *testing.T, typ string) int {
	t.Helper()
	return b.count(t, `SELECT count(*) FROM outbox WHERE type = $1`, typ)
}

func (b *braked) paused(t *testing.T, scope string) bool {
	t.Helper()
	return b.count(t, `SELECT count(*) FROM brakes WHERE scope = $1 AND paused`, scope) == 1
}

// TestPlacerBrakesPausePool: 6 of a pool's 10 nodes lost at once (a rack
// switch) → the pool's breaker opens with fleet.eviction_paused, and the
// placer moves and fails nothing however many passes; once enough nodes
// return, fleet.eviction_resumed, and the lost nodes' bookings are
// replaced, one node per token.
func TestPlacerBrakesPausePool(t *testing.T) {
	t.Parallel()
	b := newBraked(t, 10, 2, capstore.LostNodeReplace)
	booked := ids(0, 1, 2)
	b.book(t, "rsv_a", 6, booked...)

	b.lose(t, ids(0, 1, 2, 3, 4, 5)...)
	if !b.paused(t, "pool:pool_p") || b.events(t, "fleet.eviction_paused") != 1 {
		t.Fatal("6 of 10 lost: the pool's breaker must open, with one fleet.eviction_paused")
	}
	for range 3 {
		b.clock.Add(time.Minute) // tokens are not what holds it
		b.pass(t)
	}
	if r := state(t, b.harness, "rsv_a"); r.State != capstore.StatePlaced || b.on(t, booked...) != 6 {
		t.Fatalf("paused, yet the placer acted: %s %s, %d on the lost nodes", r.State, r.Reason, b.on(t, booked...))
	}
	if n := b.events(t, "reservation.replaced") + b.events(t, "reservation.failed"); n != 0 {
		t.Fatalf("%d replaced or failed while paused", n)
	}

	// Three unbooked nodes return: 3 of 10 lost, resumed.
	b.back(t, ids(3, 4, 5)...)
	if b.paused(t, "pool:pool_p") || b.events(t, "fleet.eviction_resumed") != 1 {
		t.Fatal("3 of 10 lost: the breaker must close, with one fleet.eviction_resumed")
	}
	// The bucket is full (burst 1): one node now, one per 10 s after.
	for i, want := range []int{4, 2, 0} {
		b.pass(t)
		if got := b.on(t, booked...); got != want {
			t.Fatalf("pass %d: %d bookings left on the lost nodes, want %d", i, got, want)
		}
		b.clock.Add(10 * time.Second)
	}
	if r := state(t, b.harness, "rsv_a"); r.State != capstore.StatePlaced || len(r.Bookings) != 6 || b.events(t, "reservation.replaced") != 3 {
		t.Fatalf("after resuming: %+v", r)
	}
}

// TestPlacerBrakesPauseGateway: the nodes one gateway last held, spread
// over two pools neither of which is mostly lost, go at once → the
// gateway's breaker holds the placer; when they return it resumes.
func TestPlacerBrakesPauseGateway(t *testing.T) {
	t.Parallel()
	b := newBraked(t, 10, 2, capstore.LostNodeReplace)
	fixture.Pool(t, b.db, fixture.PoolOpts{ID: "pool_q"})
	b.exec(t, `UPDATE nodes SET pool_id = 'pool_q' WHERE id = ANY($1)`, ids(5, 6, 7, 8, 9))
	// gw-1 last held 0, 1 (pool_p) and 5, 6 (pool_q); gw-2 the rest.
	b.exec(t, `UPDATE nodes SET gateway_id = CASE WHEN id = ANY($1) THEN 'gw-1' ELSE 'gw-2' END`, ids(0, 1, 5, 6))
	b.book(t, "rsv_a", 4, ids(0, 1)...)

	gw1 := ids(0, 1, 5, 6)
	gw1Scope := brakes.GatewayScope("gw-1", "root") // the nodes' tenant's part of gw-1
	b.lose(t, gw1...)
	if !b.paused(t, gw1Scope) || b.paused(t, "pool:pool_p") || b.paused(t, "pool:pool_q") {
		t.Fatal("gw-1's 4 nodes lost (2 of 5 per pool): only gw-1's breaker must open")
	}
	var tenant string
	if err := b.db.QueryRow(t.Context(), `SELECT tenant_id FROM outbox WHERE type = 'fleet.eviction_paused' AND payload->>'scope' = $1`, gw1Scope).Scan(&tenant); err != nil || tenant != "root" {
		t.Fatalf("gw-1's fleet.eviction_paused: tenant %q, %v", tenant, err)
	}
	for range 3 {
		b.clock.Add(time.Minute)
		b.pass(t)
	}
	if n := b.on(t, ids(0, 1)...); n != 4 {
		t.Fatalf("gateway paused, yet %d of 4 bookings left the lost nodes", 4-n)
	}
	// Two of gw-1's nodes (pool_q's) return: 2 of 4, not more than 55 %.
	b.back(t, ids(5, 6)...)
	if b.paused(t, gw1Scope) || b.events(t, "fleet.eviction_resumed") != 1 {
		t.Fatal("gw-1 at 2 of 4 lost: its breaker must close")
	}
	b.pass(t)
	b.clock.Add(10 * time.Second)
	b.pass(t)
	if n := b.on(t, ids(0, 1)...); n != 0 || b.events(t, "reservation.replaced") != 2 {
		t.Fatalf("after resuming: %d bookings left on the lost nodes, %d replaced", n, b.events(t, "reservation.replaced"))
	}
}

// TestPlacerBrakesRate: 5 of 20 nodes lost (below the threshold) under
// policy fail, rate 0.1 nodes/s, burst 1, on a fake clock: a pass at t
// acts on one node, passes at t+1s … t+9s on none, t+10s on one more.
func TestPlacerBrakesRate(t *testing.T) {
	t.Parallel()
	b := newBraked(t, 20, 2, capstore.LostNodeFail)
	for i := range 5 {
		b.book(t, fmt.Sprintf("rsv_%d", i), 2, ids(i)...)
	}
	b.lose(t, ids(0, 1, 2, 3, 4)...)
	if b.count(t, `SELECT count(*) FROM brakes WHERE paused`) != 0 {
		t.Fatal("5 of 20 lost must pause nothing")
	}
	failed := func() int {
		return b.count(t, `SELECT count(*) FROM reservations WHERE state = 'failed'`)
	}
	b.pass(t)
	if n := failed(); n != 1 {
		t.Fatalf("at t: %d failed, want 1", n)
	}
	for s := 1; s <= 9; s++ {
		b.clock.Add(time.Second)
		b.pass(t)
		if n := failed(); n != 1 {
			t.Fatalf("at t+%ds: %d failed, want 1", s, n)
		}
	}
	b.clock.Add(time.Second)
	b.pass(t)
	if n := failed(); n != 2 {
		t.Fatalf("at t+10s: %d failed, want 2", n)
	}
	// The reason says which node; the others still wait their turn.
	if n := b.count(t, `SELECT count(*) FROM reservations WHERE state = 'failed' AND reason LIKE 'node node_0_ was lost%'`); n != 2 {
		t.Fatalf("%d failed with the lost node's reason", n)
	}
	if n := b.on(t, ids(0, 1, 2, 3, 4)...); n != 6 {
		t.Fatalf("%d bookings still on the lost nodes, want 6", n)
	}
}

// TestPlacerBrakesSpareIntent: failed and drained nodes are an operator's
// (or the control plane's) decision, not an inference: their bookings are
// acted on at once, even with the pool's breaker open and no token left.
func TestPlacerBrakesSpareIntent(t *testing.T) {
	t.Parallel()
	b := newBraked(t, 10, 2, capstore.LostNodeFail)
	b.book(t, "rsv_failed", 2, ids(0)...)
	b.book(t, "rsv_drained", 2, ids(1)...)
	b.book(t, "rsv_unseen", 2, ids(2)...)
	b.lose(t, ids(2, 3, 4, 5, 6, 7)...)
	if !b.paused(t, "pool:pool_p") {
		t.Fatal("6 of 10 lost: the pool must be paused")
	}
	// Spend the fleet's one token elsewhere.
	err := pgx.BeginFunc(t.Context(), b.db, func(tx pgx.Tx) error {
		d, err := brakes.Allow(t.Context(), tx, brakes.Config{}, brakes.Subject{NodeID: "node_x", PoolID: "pool_x"}, b.clock.Now())
		if err == nil && !d.Allowed {
			err = fmt.Errorf("no token to spend: %+v", d)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	b.exec(t, `UPDATE nodes SET state = 'failed' WHERE id = 'node_00'`)
	b.exec(t, `UPDATE nodes SET state = 'drained' WHERE id = 'node_01'`)
	b.pass(t)
	for id, want := range map[string]string{"rsv_failed": "failed", "rsv_drained": "failed", "rsv_unseen": "placed"} {
		if r := state(t, b.harness, id); r.State != want {
			t.Fatalf("%s: %s (%s), want %s", id, r.State, r.Reason, want)
		}
	}
}
