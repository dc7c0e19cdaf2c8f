package capacity_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	capstore "github.com/bettercompute/bettercompute/pkg/capacity"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
	"github.com/bettercompute/bettercompute/services/capacity"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type harness struct {
	db *pgxpool.Pool
}

// setup opens a database with pool "pool_p" of n nodes (adopted, schedulable,
// live) with gpus H200s each.
func setup(t *testing.T, n, gpus int) *harness {
	t.Helper()
	pool, err := db.Open(t.Context(), db.Config{URL: pgtest.NewDB(t), MaxConns: 20})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	f := &harness{db: pool}
	fixture.Pool(t, pool, fixture.PoolOpts{ID: "pool_p"})
	for i := range n {
		fixture.Node(t, pool, fixture.NodeOpts{ID: fmt.Sprintf("node_%02d", i), Pool: "pool_p", State: nodes.StateAdopted, Live: true, GPUs: gpus})
	}
	return f
}

func (f *harness) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	if _, err := f.db.Exec(t.Context(), sql, args...); err != nil {
		t.Fatal(err)
	}
}

func (f *harness) count(t *testing.T, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := f.db.QueryRow(t.Context(), sql, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// runtime is one scheduler process: the capacity reconcilers on their own
// membership, driven by Tick.
func (f *harness) runtime(t *testing.T, cfg capacity.Config) *reconcile.Runtime {
	t.Helper()
	rt, err := reconcile.New(f.db, nil, reconcile.Config{Roles: []string{reconcile.RoleScheduler}, Heartbeat: time.Hour, LeaseTTL: 3 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	recs, err := capacity.Reconcilers(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range recs {
		if err := rt.Register(r); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(rt.Stop)
	return rt
}

func (f *harness) pending(t *testing.T, id string, n int, start *time.Time) {
	t.Helper()
	if err := capstore.Insert(t.Context(), f.db, capstore.Reservation{ID: id, TenantID: "root", PoolID: "pool_p", GPUCount: n, StartTime: start}); err != nil {
		t.Fatal(err)
	}
}

func (f *harness) enqueue(t *testing.T, kind, key string) {
	t.Helper()
	if err := workqueue.Enqueue(t.Context(), f.db, kind, key); err != nil {
		t.Fatal(err)
	}
}

func tick(t *testing.T, rt *reconcile.Runtime, kinds ...string) {
	t.Helper()
	for _, k := range kinds {
		if _, err := rt.Jobs()[k].Tick(t.Context()); err != nil {
			t.Fatalf("tick %s: %v", k, err)
		}
	}
}

func state(t *testing.T, f *harness, id string) capstore.Reservation {
	t.Helper()
	r, err := capstore.Get(t.Context(), f.db, "root", id)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestPlacerTwoSchedulersNeverDoublePlace runs two scheduler processes
// against one pool of 24 GPUs with 30 due reservations of one GPU: 24 are
// placed once each, no atom twice, and the rest stay pending saying why.
func TestPlacerTwoSchedulersNeverDoublePlace(t *testing.T) {
	t.Parallel()
	f := setup(t, 3, 8)
	past := time.Now().Add(-time.Minute)
	for i := range 30 {
		f.pending(t, fmt.Sprintf("rsv_%02d", i), 1, &past)
	}
	a, b := f.runtime(t, capacity.Config{}), f.runtime(t, capacity.Config{})
	for range 4 {
		f.enqueue(t, capstore.KindTick, "all")
		f.enqueue(t, capstore.KindReservations, "pool_p")
		var wg sync.WaitGroup
		for _, rt := range []*reconcile.Runtime{a, b} {
			wg.Go(func() {
				if err := rt.Heartbeat(context.Background()); err != nil {
					t.Error(err)
				}
				for _, k := range []string{capstore.KindTick, capstore.KindReservations} {
					if _, err := rt.Jobs()[k].Tick(context.Background()); err != nil {
						t.Error(err)
					}
				}
			})
		}
		wg.Wait()
	}
	if n := f.count(t, `SELECT count(*) FROM reservations WHERE state = 'placed'`); n != 24 {
		t.Fatalf("%d placed, want 24", n)
	}
	if n := f.count(t, `SELECT count(DISTINCT (node_id, device_id)) FROM bookings WHERE active`); n != 24 {
		t.Fatalf("%d distinct atoms booked", n)
	}
	if n := f.count(t, `SELECT count(*) FROM (SELECT reservation_id FROM bookings GROUP BY 1 HAVING count(*) <> 1) x`); n != 0 {
		t.Fatalf("%d reservations placed more than once", n)
	}
	if n := f.count(t, `SELECT count(*) FROM reservations WHERE state = 'pending' AND reason LIKE 'not placed yet: need 1 × GPU; 0 free%'`); n != 6 {
		t.Fatalf("%d pending with a reason, want 6", n)
	}
	// Each node's desired state was invalidated.
	if n := f.count(t, `SELECT count(DISTINCT key) FROM work_queue WHERE kind = 'nodespec'`); n != 3 {
		t.Fatalf("%d nodes invalidated, want 3", n)
	}
}

func TestPlacerLifecycle(t *testing.T) {
	t.Parallel()
	t.Run("a future start is placed once due; an end time expires it", func(t *testing.T) {
		t.Parallel()
		f := setup(t, 1, 8)
		rt := f.runtime(t, capacity.Config{})
		later := time.Now().Add(time.Hour)
		f.pending(t, "rsv_later", 2, &later)
		f.enqueue(t, capstore.KindTick, "all")
		tick(t, rt, capstore.KindTick, capstore.KindReservations)
		if r := state(t, f, "rsv_later"); r.State != "pending" || r.Reason != "" || capstore.Why(r, time.Now()) == "" {
			t.Fatalf("before its start: %+v", r)
		}
		f.exec(t, `UPDATE reservations SET start_time = now() - interval '1 second', end_time = now() + interval '1 hour'`)
		f.enqueue(t, capstore.KindTick, "all")
		tick(t, rt, capstore.KindTick, capstore.KindReservations)
		if r := state(t, f, "rsv_later"); r.State != "placed" || len(r.Bookings) != 2 {
			t.Fatalf("once due: %+v", r)
		}
		f.exec(t, `DELETE FROM work_queue WHERE kind = 'nodespec'`)
		f.exec(t, `UPDATE reservations SET end_time = now() - interval '1 second'`)
		f.enqueue(t, capstore.KindTick, "all")
		tick(t, rt, capstore.KindTick, capstore.KindReservations)
		if r := state(t, f, "rsv_later"); r.State != "expired" || r.FinishedAt == nil {
			t.Fatalf("after its end: %+v", r)
		}
		if f.count(t, `SELECT count(*) FROM bookings WHERE active`) != 0 || f.count(t, `SELECT count(*) FROM work_queue WHERE kind = 'nodespec' AND key = 'node_00'`) != 1 {
			t.Fatal("expiry must free the bookings and invalidate the node")
		}
	})
	for _, tc := range []struct {
		policy, state string
	}{{"replace", "placed"}, {"fail", "failed"}, {"wait", "placed"}} {
		t.Run("a lost node with policy "+tc.policy, func(t *testing.T) {
			t.Parallel()
			f := setup(t, 2, 8)
			rt := f.runtime(t, capacity.Config{LostNode: tc.policy})
			f.pending(t, "rsv_a", 3, nil)
			f.enqueue(t, capstore.KindReservations, "pool_p")
			tick(t, rt, capstore.KindReservations)
			lost := state(t, f, "rsv_a").Bookings[0].NodeID
			f.exec(t, `UPDATE nodes SET state = 'failed' WHERE id = $1`, lost)
			f.enqueue(t, capstore.KindTick, "all")
			f.enqueue(t, capstore.KindReservations, "pool_p")
			tick(t, rt, capstore.KindTick, capstore.KindReservations)
			r := state(t, f, "rsv_a")
			if r.State != tc.state {
				t.Fatalf("state %s (%s), want %s", r.State, r.Reason, tc.state)
			}
			switch tc.policy {
			case "replace":
				if len(r.Bookings) != 3 || r.Bookings[0].NodeID == lost {
					t.Fatalf("not re-placed: %+v", r.Bookings)
				}
			case "fail":
				if r.Reason == "" || f.count(t, `SELECT count(*) FROM bookings WHERE active`) != 0 {
					t.Fatalf("failed %+v", r)
				}
			case "wait":
				if len(r.Bookings) != 3 || r.Bookings[0].NodeID != lost {
					t.Fatalf("wait moved the bookings: %+v", r.Bookings)
				}
			}
		})
	}
	t.Run("bind waits until every booked node observed a spec that exposes it", func(t *testing.T) {
		t.Parallel()
		f := setup(t, 1, 8)
		rt := f.runtime(t, capacity.Config{})
		f.pending(t, "rsv_a", 2, nil)
		f.enqueue(t, capstore.KindReservations, "pool_p")
		tick(t, rt, capstore.KindReservations)
		r := state(t, f, "rsv_a")
		spec := fmt.Sprintf(`{"devices": {"assignments": [{"reservationId": "rsv_a", "gpuUuids": [%q, %q]}]}}`, r.Bookings[0].DeviceID, r.Bookings[1].DeviceID)
		// The spec exposes it but the node has not observed it yet.
		f.exec(t, `UPDATE nodes SET spec = $1::jsonb, generation = 2, observed_generation = 1`, spec)
		f.enqueue(t, capstore.KindBind, "node_00")
		tick(t, rt, capstore.KindBind)
		if state(t, f, "rsv_a").State != "placed" {
			t.Fatal("bound before the node observed the spec")
		}
		f.exec(t, `UPDATE nodes SET observed_generation = 2`)
		f.enqueue(t, capstore.KindBind, "node_00")
		tick(t, rt, capstore.KindBind)
		if r := state(t, f, "rsv_a"); r.State != "bound" || r.BoundAt == nil {
			t.Fatalf("after observing: %+v", r)
		}
		if f.count(t, `SELECT count(*) FROM outbox WHERE type = 'reservation.bound'`) != 1 {
			t.Fatal("no reservation.bound event")
		}
	})
	t.Run("rollup and usage count atoms and GPU-hours", func(t *testing.T) {
		t.Parallel()
		f := setup(t, 2, 8)
		rt := f.runtime(t, capacity.Config{})
		f.pending(t, "rsv_a", 3, nil)
		f.enqueue(t, capstore.KindReservations, "pool_p")
		tick(t, rt, capstore.KindReservations)
		f.exec(t, `UPDATE reservations SET state = 'bound', bound_at = now() - interval '2 hours'`)
		f.exec(t, `UPDATE bookings SET created_at = now() - interval '3 hours'`)
		f.exec(t, `UPDATE devices SET healthy = false WHERE node_id = 'node_01' AND index = 0`)
		f.enqueue(t, capstore.KindRollup, "all")
		f.enqueue(t, capstore.KindUsage, "all")
		tick(t, rt, capstore.KindRollup, capstore.KindUsage)
		var free, booked, unavailable int
		if err := f.db.QueryRow(t.Context(), `SELECT free, booked, unavailable FROM capacity_rollup WHERE pool_id = 'pool_p' AND model = ''`).Scan(&free, &booked, &unavailable); err != nil {
			t.Fatal(err)
		}
		if free != 12 || booked != 3 || unavailable != 1 {
			t.Fatalf("free %d booked %d unavailable %d", free, booked, unavailable)
		}
		var hours float64
		if err := f.db.QueryRow(t.Context(), `SELECT gpu_hours FROM capacity_tenant_usage WHERE pool_id = 'pool_p' AND tenant_id = 'root'`).Scan(&hours); err != nil {
			t.Fatal(err)
		}
		if hours < 5.99 || hours > 6.01 {
			t.Fatalf("gpu hours %f, want 6 (3 GPUs × 2 h bound)", hours)
		}
	})
}

// TestPlacerRespectsPoolSharing: the placer's later placements (a future
// start, a lost node's replacement) check the pool's sharing and default
// quota as reservations.create does: a descendant's reservation in an
// ancestor's pool is placed only while the pool is shared, within the
// default quota.
func TestPlacerRespectsPoolSharing(t *testing.T) {
	t.Parallel()
	f := setup(t, 2, 8)
	fixture.Tenant(t, f.db, fixture.TenantOpts{ID: "acme"})
	f.exec(t, `UPDATE pools SET sharing = 'descendants', default_quota = 4 WHERE id = 'pool_p'`)
	rt := f.runtime(t, capacity.Config{LostNode: capstore.LostNodeReplace})
	past := time.Now().Add(-time.Minute)
	insert := func(id string, n int) {
		t.Helper()
		if err := capstore.Insert(t.Context(), f.db, capstore.Reservation{ID: id, TenantID: "acme", PoolID: "pool_p", GPUCount: n, StartTime: &past}); err != nil {
			t.Fatal(err)
		}
		f.exec(t, `UPDATE reservations SET created_at = clock_timestamp() WHERE id = $1`, id)
	}
	get := func(id string) capstore.Reservation {
		t.Helper()
		r, err := capstore.Get(t.Context(), f.db, "acme", id)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	run := func() {
		t.Helper()
		f.enqueue(t, capstore.KindTick, "all")
		f.enqueue(t, capstore.KindReservations, "pool_p")
		tick(t, rt, capstore.KindTick, capstore.KindReservations)
	}
	insert("rsv_a", 3)
	insert("rsv_over", 2)
	run()
	if r := get("rsv_a"); r.State != "placed" || len(r.Bookings) != 3 {
		t.Fatalf("within the default quota: %+v", r)
	}
	if r := get("rsv_over"); r.State != "pending" || !strings.Contains(r.Reason, "default quota applies: 4 GPUs for acme") {
		t.Fatalf("over the default quota: %s %q", r.State, r.Reason)
	}
	// Unshared: nothing more is placed for acme; what it holds stays.
	f.exec(t, `UPDATE pools SET sharing = 'none' WHERE id = 'pool_p'`)
	insert("rsv_late", 1)
	run()
	if r := get("rsv_late"); r.State != "pending" || !strings.Contains(r.Reason, `no pool "pool_p" that tenant acme can book`) {
		t.Fatalf("after unsharing: %s %q", r.State, r.Reason)
	}
	a := get("rsv_a")
	if a.State != "placed" || len(a.Bookings) != 3 {
		t.Fatalf("unsharing must keep current bookings: %+v", a)
	}
	// A lost node's bookings are not re-placed in a pool no longer shared.
	f.exec(t, `UPDATE nodes SET state = 'failed' WHERE id = $1`, a.Bookings[0].NodeID)
	run()
	if r := get("rsv_a"); r.State != "failed" || !strings.Contains(r.Reason, "could not be re-placed: no pool") {
		t.Fatalf("replacement in an unshared pool: %s %q", r.State, r.Reason)
	}
	if n := f.count(t, `SELECT count(*) FROM bookings WHERE active AND tenant_id = 'acme'`); n != 0 {
		t.Fatalf("%d acme bookings left", n)
	}
}
