package capacity_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/capacity"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
)

// setup opens a fresh database with pool "pool_p" (root) holding n nodes
// adopted and schedulable, each with gpus H200s.
func setup(t *testing.T, n, gpus int) *pgxpool.Pool {
	t.Helper()
	ctx := t.Context()
	pool, err := db.Open(ctx, db.Config{URL: pgtest.NewDB(t), MaxConns: 60})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	fixture.Pool(t, pool, fixture.PoolOpts{ID: "pool_p"})
	for i := range n {
		addNode(t, pool, fmt.Sprintf("node_%02d", i), nodes.StateAdopted, true, gpus)
	}
	return pool
}

// addNode adds node id in state to pool_p with gpus H200s, seen now: live
// (it applied its desired state), or not yet converged.
func addNode(t *testing.T, pool *pgxpool.Pool, id, state string, live bool, gpus int) {
	t.Helper()
	fixture.Node(t, pool, fixture.NodeOpts{ID: id, Pool: "pool_p", State: state, Live: live, Gateway: "gw-1", GPUs: gpus})
}

func mustExec(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	if _, err := pool.Exec(t.Context(), sql, args...); err != nil {
		t.Fatal(err)
	}
}

// create inserts and places a reservation in one transaction, as admission's
// transaction 2 does.
func create(ctx context.Context, pool *pgxpool.Pool, id, tenant string, n int, c capacity.Constraints) (capacity.Reservation, error) {
	r := capacity.Reservation{ID: id, TenantID: tenant, PoolID: "pool_p", GPUCount: n, Constraints: c}
	err := db.InTx(ctx, pool, db.TxOptions{}, func(tx pgx.Tx) error {
		if err := capacity.Insert(ctx, tx, r); err != nil {
			return err
		}
		_, err := capacity.Place(ctx, tx, &r, capacity.PlaceOptions{})
		return err
	})
	return r, err
}

func TestPlace(t *testing.T) {
	t.Parallel()
	t.Run("books whole GPUs, packing", func(t *testing.T) {
		t.Parallel()
		pool := setup(t, 2, 8)
		ctx := t.Context()
		if _, err := create(ctx, pool, "rsv_a", "root", 3, capacity.Constraints{}); err != nil {
			t.Fatal(err)
		}
		if _, err := create(ctx, pool, "rsv_b", "root", 5, capacity.Constraints{}); err != nil {
			t.Fatal(err)
		}
		a, _ := capacity.Get(ctx, pool, "root", "rsv_a")
		b, _ := capacity.Get(ctx, pool, "root", "rsv_b")
		if a.State != capacity.StatePlaced || len(a.Bookings) != 3 || len(b.Bookings) != 5 {
			t.Fatalf("a %+v b %+v", a, b)
		}
		if a.Bookings[0].NodeID != b.Bookings[0].NodeID {
			t.Fatalf("b should fill a's node: a on %s, b on %s", a.Bookings[0].NodeID, b.Bookings[0].NodeID)
		}
	})
	t.Run("no capacity says what is missing", func(t *testing.T) {
		t.Parallel()
		pool := setup(t, 2, 8)
		_, err := create(t.Context(), pool, "rsv_x", "root", 9, capacity.Constraints{SameNode: true, Model: "NVIDIA H200"})
		if fault.CodeOf(err) != fault.NoCapacity || fieldOf(err) != "gpuCount" {
			t.Fatalf("want NO_CAPACITY on gpuCount, got %v", err)
		}
		if want := "need 9 × NVIDIA H200 on one node; the best node has 8 free"; !contains(err.Error(), want) {
			t.Fatalf("message %q lacks %q", err, want)
		}
		_, err = create(t.Context(), pool, "rsv_y", "root", 1, capacity.Constraints{Model: "NVIDIA B200"})
		if fault.CodeOf(err) != fault.NoCapacity {
			t.Fatalf("another model: want NO_CAPACITY, got %v", err)
		}
		_, err = create(t.Context(), pool, "rsv_z", "root", 1, capacity.Constraints{NodeLabels: map[string]string{"rack": "r9"}})
		if fault.CodeOf(err) != fault.NoCapacity {
			t.Fatalf("labels no node has: want NO_CAPACITY, got %v", err)
		}
	})
	t.Run("never books an unschedulable, draining or unhealthy node", func(t *testing.T) {
		t.Parallel()
		pool := setup(t, 0, 0)
		addNode(t, pool, "node_new", nodes.StateAdopted, false, 8)   // observedGeneration 0
		addNode(t, pool, "node_drain", nodes.StateDraining, true, 8) // draining
		addNode(t, pool, "node_ok", nodes.StateAdopted, true, 2)
		mustExec(t, pool, `UPDATE devices SET healthy = false WHERE node_id = 'node_ok' AND index = 1`)
		_, err := create(t.Context(), pool, "rsv_a", "root", 2, capacity.Constraints{})
		if fault.CodeOf(err) != fault.NoCapacity {
			t.Fatalf("want NO_CAPACITY, got %v", err)
		}
		r, err := create(t.Context(), pool, "rsv_b", "root", 1, capacity.Constraints{})
		if err != nil {
			t.Fatal(err)
		}
		r, _ = capacity.Get(t.Context(), pool, "root", r.ID)
		if r.Bookings[0].DeviceID != "GPU-node_ok-0" {
			t.Fatalf("booked %+v", r.Bookings)
		}
	})
	t.Run("quota is enforced across the tenant's subtree", func(t *testing.T) {
		t.Parallel()
		pool := setup(t, 2, 8)
		fixture.Tenant(t, pool, fixture.TenantOpts{ID: "acme"})
		fixture.Tenant(t, pool, fixture.TenantOpts{ID: "acme.ml"})
		mustExec(t, pool, `UPDATE pools SET sharing = 'descendants' WHERE id = 'pool_p'`)
		if _, _, err := capacity.SetQuota(t.Context(), pool, capacity.Quota{PoolID: "pool_p", TenantID: "acme", GPULimit: 4}); err != nil {
			t.Fatal(err)
		}
		if _, err := create(t.Context(), pool, "rsv_a", "acme.ml", 3, capacity.Constraints{}); err != nil {
			t.Fatal(err)
		}
		_, err := create(t.Context(), pool, "rsv_b", "acme", 2, capacity.Constraints{})
		if fault.CodeOf(err) != fault.QuotaExceeded || fieldOf(err) != "gpuCount" || !contains(err.Error(), "is 4 GPUs; 3 in use") {
			t.Fatalf("want QUOTA_EXCEEDED naming the limit, got %v", err)
		}
		var n int
		_ = pool.QueryRow(t.Context(), `SELECT count(*) FROM bookings WHERE active`).Scan(&n)
		if n != 3 {
			t.Fatalf("a refused create left bookings: %d active", n)
		}
		if _, err := create(t.Context(), pool, "rsv_c", "acme", 1, capacity.Constraints{}); err != nil {
			t.Fatalf("within the quota: %v", err)
		}
	})
	t.Run("descendants book an ancestor's pool only when it is shared, under its default quota", func(t *testing.T) {
		t.Parallel()
		pool := setup(t, 2, 8)
		ctx := t.Context()
		for _, id := range []string{"acme", "acme.ml", "beta"} {
			fixture.Tenant(t, pool, fixture.TenantOpts{ID: id})
		}
		_, err := create(ctx, pool, "rsv_unshared", "acme", 1, capacity.Constraints{})
		if fault.CodeOf(err) != fault.NotFound || fieldOf(err) != "poolId" {
			t.Fatalf("unshared: want NOT_FOUND on poolId, got %v", err)
		}
		mustExec(t, pool, `UPDATE pools SET sharing = 'descendants' WHERE id = 'pool_p'`)
		_, err = create(ctx, pool, "rsv_zero", "acme", 1, capacity.Constraints{})
		if fault.CodeOf(err) != fault.QuotaExceeded || fieldOf(err) != "gpuCount" || !contains(err.Error(), "default quota is 0 GPUs") {
			t.Fatalf("default 0: want QUOTA_EXCEEDED naming the default, got %v", err)
		}
		mustExec(t, pool, `UPDATE pools SET default_quota = 3 WHERE id = 'pool_p'`)
		// acme.ml counts against acme's default: a child tenant cannot
		// multiply it by making tenants below it.
		if _, err := create(ctx, pool, "rsv_ml", "acme.ml", 2, capacity.Constraints{}); err != nil {
			t.Fatal(err)
		}
		_, err = create(ctx, pool, "rsv_acme", "acme", 2, capacity.Constraints{})
		if fault.CodeOf(err) != fault.QuotaExceeded || !contains(err.Error(), "3 GPUs for acme and its descendants; 2 in use, this reservation asks for 2 more") {
			t.Fatalf("over the default: %v", err)
		}
		if _, err := create(ctx, pool, "rsv_beta", "beta", 3, capacity.Constraints{}); err != nil {
			t.Fatalf("each child tenant has its own default: %v", err)
		}
		// A quota for one model does not replace the default; one for
		// every model does, for the tenant and those below it.
		if _, _, err := capacity.SetQuota(ctx, pool, capacity.Quota{PoolID: "pool_p", TenantID: "acme", Model: "NVIDIA H200", GPULimit: 8}); err != nil {
			t.Fatal(err)
		}
		if _, err := create(ctx, pool, "rsv_acme2", "acme", 2, capacity.Constraints{}); fault.CodeOf(err) != fault.QuotaExceeded {
			t.Fatalf("a model quota replaced the default: %v", err)
		}
		if _, _, err := capacity.SetQuota(ctx, pool, capacity.Quota{PoolID: "pool_p", TenantID: "acme", GPULimit: 6}); err != nil {
			t.Fatal(err)
		}
		if _, err := create(ctx, pool, "rsv_ml2", "acme.ml", 4, capacity.Constraints{}); err != nil {
			t.Fatalf("under acme's explicit quota: %v", err)
		}
		if _, err := create(ctx, pool, "rsv_acme3", "acme", 1, capacity.Constraints{}); fault.CodeOf(err) != fault.QuotaExceeded || !contains(err.Error(), "quota of tenant acme in pool pool_p is 6 GPUs") {
			t.Fatalf("over acme's explicit quota: %v", err)
		}
		var n int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM bookings WHERE active`).Scan(&n)
		if n != 9 {
			t.Fatalf("%d active bookings, want 9 (refused creates book nothing)", n)
		}
	})
	t.Run("concurrent places never book an atom twice", func(t *testing.T) {
		t.Parallel()
		pool := setup(t, 3, 8) // 24 GPUs
		var wg sync.WaitGroup
		errs := make([]error, 40)
		for i := range 40 {
			wg.Go(func() {
				_, errs[i] = create(t.Context(), pool, fmt.Sprintf("rsv_%02d", i), "root", 1+i%3, capacity.Constraints{})
			})
		}
		wg.Wait()
		booked := 0
		for i, err := range errs {
			switch fault.CodeOf(err) {
			case "":
				booked += 1 + i%3
			case fault.NoCapacity:
			default:
				t.Fatalf("create %d: %v", i, err)
			}
		}
		var active, distinct int
		_ = pool.QueryRow(t.Context(), `SELECT count(*), count(DISTINCT (node_id, device_id)) FROM bookings WHERE active`).Scan(&active, &distinct)
		if active != booked || distinct != active || active > 24 {
			t.Fatalf("bookings %d, distinct atoms %d, successful creates booked %d (of 24)", active, distinct, booked)
		}
		if 24-booked >= 3 {
			t.Fatalf("%d atoms left free while creates were refused", 24-booked)
		}
	})
	t.Run("finish frees the atoms and reports the nodes", func(t *testing.T) {
		t.Parallel()
		pool := setup(t, 1, 8)
		if _, err := create(t.Context(), pool, "rsv_a", "root", 8, capacity.Constraints{}); err != nil {
			t.Fatal(err)
		}
		nodes, changed, err := capacity.Finish(t.Context(), pool, "rsv_a", capacity.StateReleased, "")
		if err != nil || !changed || len(nodes) != 1 || nodes[0] != "node_00" {
			t.Fatalf("finish: %v %v %v", nodes, changed, err)
		}
		if _, changed, _ := capacity.Finish(t.Context(), pool, "rsv_a", capacity.StateReleased, ""); changed {
			t.Fatal("finishing twice changed something")
		}
		r, _ := capacity.Get(t.Context(), pool, "root", "rsv_a")
		if r.State != capacity.StateReleased || len(r.Bookings) != 8 || r.FinishedAt == nil {
			t.Fatalf("released reservation %+v", r)
		}
		if _, err := create(t.Context(), pool, "rsv_b", "root", 8, capacity.Constraints{}); err != nil {
			t.Fatalf("the freed node: %v", err)
		}
	})
}

func contains(s, sub string) bool { return strings.Contains(s, sub) }

// fieldOf is the field a fault names.
func fieldOf(err error) string {
	if fe, ok := fault.As(err); ok {
		return fe.Field
	}
	return ""
}

func TestPlaceConcurrentCreatesNeverExceedAQuota(t *testing.T) {
	t.Parallel()
	pool := setup(t, 4, 8)
	if _, _, err := capacity.SetQuota(t.Context(), pool, capacity.Quota{PoolID: "pool_p", TenantID: "root", Model: "NVIDIA H200", GPULimit: 10}); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make([]error, 20)
	for i := range 20 {
		wg.Go(func() {
			_, errs[i] = create(t.Context(), pool, fmt.Sprintf("rsv_%02d", i), "root", 1, capacity.Constraints{})
		})
	}
	wg.Wait()
	ok := 0
	for i, err := range errs {
		switch fault.CodeOf(err) {
		case "":
			ok++
		case fault.QuotaExceeded:
		default:
			t.Fatalf("create %d: %v", i, err)
		}
	}
	var active int
	_ = pool.QueryRow(t.Context(), `SELECT count(*) FROM bookings WHERE active`).Scan(&active)
	if ok != 10 || active != 10 {
		t.Fatalf("%d creates succeeded, %d GPUs booked; the quota is 10", ok, active)
	}
}

// countsDrift lists where node_capacity and node_capacity_free differ from
// the bookings and devices they count (none when they agree).
func countsDrift(t *testing.T, pool *pgxpool.Pool) []string {
	t.Helper()
	rows, err := pool.Query(t.Context(), `
		WITH truth_booked AS (
			SELECT n.id AS node_id, (SELECT count(*) FROM bookings b WHERE b.node_id = n.id AND b.active)::int AS booked
			  FROM nodes n),
		truth_free AS (
			SELECT d.node_id, d.model, d.memory_bytes, count(*)::int AS free FROM devices d
			 WHERE d.kind = 'gpu' AND d.healthy AND d.missing_since IS NULL AND d.quarantined_at IS NULL AND NOT d.mig_enabled
			   AND NOT EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = d.node_id AND b.device_id = d.id AND b.active)
			 GROUP BY 1, 2, 3),
		counted_booked AS (
			SELECT n.id AS node_id, coalesce(c.booked, 0) AS booked FROM nodes n LEFT JOIN node_capacity c ON c.node_id = n.id)
		(SELECT 'booked ' || node_id || ' truth ' || booked FROM (TABLE truth_booked EXCEPT TABLE counted_booked) x)
		UNION ALL
		(SELECT 'booked ' || node_id || ' counted ' || booked FROM (TABLE counted_booked EXCEPT TABLE truth_booked) x)
		UNION ALL
		(SELECT 'free ' || node_id || ' ' || model || ' truth ' || free
		   FROM (TABLE truth_free EXCEPT SELECT node_id, model, memory_bytes, free FROM node_capacity_free) x)
		UNION ALL
		(SELECT 'free ' || node_id || ' ' || model || ' counted ' || free
		   FROM (SELECT node_id, model, memory_bytes, free FROM node_capacity_free EXCEPT TABLE truth_free) x)`)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestCountsEqualTheTruth: the per-node counts placement reads stay equal to
// the bookings and devices under concurrent creates, releases and device
// changes (health, a device going missing and coming back, a new device).
func TestCountsEqualTheTruth(t *testing.T) {
	t.Parallel()
	pool := setup(t, 6, 8)
	ctx := t.Context()
	if d := countsDrift(t, pool); len(d) > 0 {
		t.Fatalf("after setup: %v", d)
	}
	var wg sync.WaitGroup
	errs := make([]error, 60)
	for i := range 60 {
		wg.Go(func() {
			id := fmt.Sprintf("rsv_%02d", i)
			_, err := create(ctx, pool, id, "root", 1+i%4, capacity.Constraints{SameNode: i%3 == 0})
			if fault.CodeOf(err) == fault.NoCapacity {
				err = nil
			}
			if err == nil && i%2 == 0 {
				_, _, err = capacity.Finish(ctx, pool, id, capacity.StateReleased, "")
			}
			errs[i] = err
		})
	}
	for i := range 12 {
		wg.Go(func() {
			node, dev := fmt.Sprintf("node_%02d", i%6), fmt.Sprintf("GPU-node_%02d-%d", i%6, i%8)
			var err error
			switch i % 3 {
			case 0:
				_, err = pool.Exec(ctx, `UPDATE devices SET healthy = NOT healthy WHERE node_id = $1 AND id = $2`, node, dev)
			case 1:
				_, err = pool.Exec(ctx, `UPDATE devices SET missing_since = now() WHERE node_id = $1 AND id = $2`, node, dev)
				if err == nil {
					_, err = pool.Exec(ctx, `UPDATE devices SET missing_since = NULL WHERE node_id = $1 AND id = $2`, node, dev)
				}
			default:
				_, err = pool.Exec(ctx, `INSERT INTO devices (node_id, id, index, model, memory_bytes) VALUES ($1, $2, 8, 'NVIDIA H100', 80000000000)`,
					node, fmt.Sprintf("GPU-%s-extra%d", node, i))
			}
			if err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("create %d: %v", i, err)
		}
	}
	var active int
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM bookings WHERE active`).Scan(&active)
	if active == 0 {
		t.Fatal("nothing stayed booked: the comparison would be empty")
	}
	if d := countsDrift(t, pool); len(d) > 0 {
		t.Fatalf("counts differ from the truth: %v", d)
	}
	// Each kind of change counts on its own too.
	mustExec(t, pool, `UPDATE devices SET healthy = NOT healthy WHERE id = 'GPU-node_00-0'`)
	mustExec(t, pool, `UPDATE devices SET missing_since = coalesce(missing_since, now()) WHERE id = 'GPU-node_01-1'`)
	mustExec(t, pool, `UPDATE devices SET mig_enabled = true WHERE id = 'GPU-node_02-2'`)
	if d := countsDrift(t, pool); len(d) > 0 {
		t.Fatalf("after device changes: %v", d)
	}
	mustExec(t, pool, `DELETE FROM devices WHERE id = 'GPU-node_05-extra5'`)
	mustExec(t, pool, `UPDATE bookings SET active = false, released_at = now() WHERE active`)
	if d := countsDrift(t, pool); len(d) > 0 {
		t.Fatalf("after deleting and releasing: %v", d)
	}
}

// TestPlaceReadsOnlyTheNodesPlanCanPick: planning from the nodes Place reads
// (the first few of each kind) picks what planning from every node picks,
// and reports the same shortage.
func TestPlaceReadsOnlyTheNodesPlanCanPick(t *testing.T) {
	t.Parallel()
	pool := setup(t, 80, 8)
	ctx := t.Context()
	// Nodes of many kinds: 1 to 7 booked, some unhealthy GPUs.
	for i := range 60 {
		if _, err := create(ctx, pool, fmt.Sprintf("rsv_%02d", i), "root", 1+i%7, capacity.Constraints{SameNode: true}); err != nil {
			t.Fatal(err)
		}
	}
	mustExec(t, pool, `UPDATE devices SET healthy = false WHERE index = 7 AND node_id > 'node_70'`)
	byID := func(ns []capacity.NodeFree) []capacity.NodeFree {
		slices.SortFunc(ns, func(a, b capacity.NodeFree) int { return strings.Compare(a.NodeID, b.NodeID) })
		return ns
	}
	all, err := capacity.FreeCounts(ctx, pool, "pool_p", capacity.Constraints{}, capacity.DefaultLostAfter)
	if err != nil {
		t.Fatal(err)
	}
	byID(all)
	for count := 1; count <= 400; count += 1 + count/8 {
		some, err := capacity.FreeCountsFor(ctx, pool, "pool_p", capacity.Constraints{}, capacity.DefaultLostAfter, nil, count)
		if err != nil {
			t.Fatal(err)
		}
		byID(some)
		if count < 8 && len(some) >= len(all) {
			t.Fatalf("count %d: read %d nodes of %d", count, len(some), len(all))
		}
		for _, same := range []bool{false, true} {
			want, wantShort := capacity.Plan(all, count, same)
			got, gotShort := capacity.Plan(some, count, same)
			if fmt.Sprint(want, wantShort) != fmt.Sprint(got, gotShort) {
				t.Fatalf("count %d sameNode %v: from all nodes %v %v, from those read %v %v", count, same, want, wantShort, got, gotShort)
			}
		}
	}
}

// TestPlaceAroundAHeldNode: a create plans around a node a concurrent
// transaction holds, and waits for it only when nothing else fits.
func TestPlaceAroundAHeldNode(t *testing.T) {
	t.Parallel()
	// hold locks node's counts in a transaction left open until release.
	hold := func(t *testing.T, pool *pgxpool.Pool, node string) (release func()) {
		tx, err := pool.Begin(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(t.Context(), `SELECT 1 FROM node_capacity WHERE node_id = $1 FOR UPDATE`, node); err != nil {
			t.Fatal(err)
		}
		return func() { _ = tx.Rollback(context.WithoutCancel(t.Context())) }
	}
	t.Run("plans around it", func(t *testing.T) {
		t.Parallel()
		pool := setup(t, 2, 8)
		if _, err := create(t.Context(), pool, "rsv_a", "root", 1, capacity.Constraints{}); err != nil {
			t.Fatal(err)
		}
		a, _ := capacity.Get(t.Context(), pool, "root", "rsv_a")
		release := hold(t, pool, a.Bookings[0].NodeID) // packing's pick for the next GPU
		defer release()
		b, err := create(t.Context(), pool, "rsv_b", "root", 1, capacity.Constraints{})
		if err != nil {
			t.Fatal(err)
		}
		b, _ = capacity.Get(t.Context(), pool, "root", b.ID)
		if len(b.Bookings) != 1 || b.Bookings[0].NodeID == a.Bookings[0].NodeID {
			t.Fatalf("want rsv_b off the held node %s, got %+v", a.Bookings[0].NodeID, b.Bookings)
		}
	})
	t.Run("waits when nothing else fits", func(t *testing.T) {
		t.Parallel()
		pool := setup(t, 1, 8)
		release := hold(t, pool, "node_00")
		done := make(chan error, 1)
		go func() {
			_, err := create(t.Context(), pool, "rsv_c", "root", 2, capacity.Constraints{})
			done <- err
		}()
		// Until the create waits on the held node's lock.
		for waiting := 0; waiting == 0; {
			if err := pool.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity
				WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting); err != nil {
				t.Fatal(err)
			}
		}
		release()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		c, _ := capacity.Get(t.Context(), pool, "root", "rsv_c")
		if c.State != capacity.StatePlaced || len(c.Bookings) != 2 {
			t.Fatalf("rsv_c %+v", c)
		}
	})
}
