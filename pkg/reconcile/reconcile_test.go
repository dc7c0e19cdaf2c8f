package reconcile_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/lease"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/reconcile/reconciletest"
	"github.com/bettercompute/bettercompute/pkg/shard"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func newPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool, err := db.Open(t.Context(), db.Config{URL: pgtest.NewDB(t), MaxConns: 16})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func newRuntime(t *testing.T, pool *pgxpool.Pool, cfg reconcile.Config, recs ...reconcile.Reconciler) *reconcile.Runtime {
	t.Helper()
	if cfg.Roles == nil {
		cfg.Roles = []string{reconcile.RoleControllers}
	}
	rt, err := reconcile.New(pool, nil, cfg)
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

// counter is a reconciler that counts runs per key and does what hook says.
type counter struct {
	mu   sync.Mutex
	runs map[string]int
	hook func(ctx context.Context, rc *reconcile.RunContext, key string, n int) (reconcile.Result, error)
}

func (c *counter) reconciler(name string) reconcile.Reconciler {
	c.runs = map[string]int{}
	return reconcile.Reconciler{Name: name, ShardBy: reconcile.ShardByNode, Run: func(ctx context.Context, rc *reconcile.RunContext, key string) (reconcile.Result, error) {
		c.mu.Lock()
		c.runs[key]++
		n := c.runs[key]
		c.mu.Unlock()
		if c.hook != nil {
			return c.hook(ctx, rc, key, n)
		}
		return reconcile.Done, nil
	}}
}

func (c *counter) count(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.runs[key]
}

func enqueue(t *testing.T, pool *pgxpool.Pool, kind string, keys ...string) {
	t.Helper()
	items := make([]workqueue.Item, len(keys))
	for i, k := range keys {
		items[i] = workqueue.Item{Kind: kind, Key: k}
	}
	if err := workqueue.EnqueueMany(t.Context(), pool, items); err != nil {
		t.Fatal(err)
	}
}

func queued(t *testing.T, pool *pgxpool.Pool, kind string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(t.Context(), `SELECT count(*) FROM work_queue WHERE kind = $1`, kind).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func tick(t *testing.T, rt *reconcile.Runtime, name string) reconcile.TickResult {
	t.Helper()
	tr, err := rt.Jobs()[name].Tick(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

// makeDue pretends time passed: every queued key of kind is due now.
func makeDue(t *testing.T, pool *pgxpool.Pool, kind string) {
	t.Helper()
	if _, err := pool.Exec(t.Context(), `UPDATE work_queue SET run_after = now() WHERE kind = $1`, kind); err != nil {
		t.Fatal(err)
	}
}

func TestWorkQueueGenerations(t *testing.T) {
	t.Parallel()

	t.Run("a key enqueued twice before a run runs once", func(t *testing.T) {
		t.Parallel()
		pool := newPool(t)
		c := &counter{}
		rt := newRuntime(t, pool, reconcile.Config{}, c.reconciler("thing"))
		enqueue(t, pool, "thing", "a")
		enqueue(t, pool, "thing", "a", "b")
		tr := tick(t, rt, "thing")
		if c.count("a") != 1 || c.count("b") != 1 || tr.Done != 2 {
			t.Fatalf("runs a=%d b=%d, tick %+v", c.count("a"), c.count("b"), tr)
		}
		if n := queued(t, pool, "thing"); n != 0 {
			t.Fatalf("%d keys left queued", n)
		}
	})

	t.Run("a key enqueued during its own run runs again", func(t *testing.T) {
		t.Parallel()
		pool := newPool(t)
		c := &counter{}
		c.hook = func(ctx context.Context, rc *reconcile.RunContext, key string, n int) (reconcile.Result, error) {
			if n == 1 { // the state changes under the run
				return reconcile.Done, rc.InTx(ctx, func(_ pgx.Tx, q *reconcile.Queue) error { return q.Enqueue(ctx, "thing", key) })
			}
			return reconcile.Done, nil
		}
		rt := newRuntime(t, pool, reconcile.Config{}, c.reconciler("thing"))
		enqueue(t, pool, "thing", "a")
		tick(t, rt, "thing")
		if c.count("a") != 1 || queued(t, pool, "thing") != 1 {
			t.Fatalf("after the first run: runs=%d queued=%d; the dirtied key must stay", c.count("a"), queued(t, pool, "thing"))
		}
		tick(t, rt, "thing") // due at once, no waiting
		if c.count("a") != 2 || queued(t, pool, "thing") != 0 {
			t.Fatalf("after the second run: runs=%d queued=%d", c.count("a"), queued(t, pool, "thing"))
		}
	})
}

func TestOutcomes(t *testing.T) {
	t.Parallel()

	// dbNow reads the database's clock.
	dbNow := func(t *testing.T, pool *pgxpool.Pool) time.Time {
		t.Helper()
		var now time.Time
		if err := pool.QueryRow(t.Context(), `SELECT now()`).Scan(&now); err != nil {
			t.Fatal(err)
		}
		return now
	}
	// delay returns the delay a run settled after before (database time)
	// gave key, as the bounds that can be measured without knowing when the
	// settle ran: at least lo (the time from now to its due time) and at most
	// hi (from before), so that a stall between the settle and this read
	// counts for neither bound; and its attempts and last error.
	delay := func(t *testing.T, pool *pgxpool.Pool, key string, before time.Time) (lo, hi time.Duration, attempts int, lastErr *string) {
		t.Helper()
		var loUS, hiUS int64
		err := pool.QueryRow(t.Context(), `
			SELECT (extract(epoch FROM run_after - now()) * 1e6)::bigint, (extract(epoch FROM run_after - $2::timestamptz) * 1e6)::bigint,
			       attempts, last_error
			  FROM work_queue WHERE key = $1`, key, before).Scan(&loUS, &hiUS, &attempts, &lastErr)
		if err != nil {
			t.Fatal(err)
		}
		return time.Duration(loUS) * time.Microsecond, time.Duration(hiUS) * time.Microsecond, attempts, lastErr
	}

	t.Run("SYNC_AGAIN brings the key back after about a second", func(t *testing.T) {
		t.Parallel()
		pool := newPool(t)
		c := &counter{hook: func(context.Context, *reconcile.RunContext, string, int) (reconcile.Result, error) {
			return reconcile.SyncAgain, nil
		}}
		rt := newRuntime(t, pool, reconcile.Config{}, c.reconciler("thing"))
		enqueue(t, pool, "thing", "a")
		before := dbNow(t, pool)
		if tr := tick(t, rt, "thing"); tr.SyncAgain != 1 {
			t.Fatalf("tick %+v", tr)
		}
		lo, hi, attempts, lastErr := delay(t, pool, "a", before)
		if hi < 500*time.Millisecond || lo > time.Second || attempts != 0 || lastErr != nil {
			t.Fatalf("due in %s to %s, attempts %d, error %v", lo, hi, attempts, lastErr)
		}
		if tr := tick(t, rt, "thing"); tr.Claimed != 0 {
			t.Fatalf("a key not yet due was claimed: %+v", tr)
		}
		makeDue(t, pool, "thing")
		tick(t, rt, "thing")
		if c.count("a") != 2 {
			t.Fatalf("runs = %d", c.count("a"))
		}
	})

	t.Run("errors back off doubling and are visible", func(t *testing.T) {
		t.Parallel()
		pool := newPool(t)
		c := &counter{hook: func(_ context.Context, _ *reconcile.RunContext, _ string, n int) (reconcile.Result, error) {
			if n <= 4 {
				return reconcile.Done, fmt.Errorf("boom %d", n)
			}
			return reconcile.Done, nil
		}}
		rt := newRuntime(t, pool, reconcile.Config{}, c.reconciler("thing"))
		enqueue(t, pool, "thing", "a")
		for attempt := 1; attempt <= 4; attempt++ {
			before := dbNow(t, pool)
			if tr := tick(t, rt, "thing"); tr.Failed != 1 {
				t.Fatalf("attempt %d: tick %+v", attempt, tr)
			}
			lo, hi, attempts, lastErr := delay(t, pool, "a", before)
			want := workqueue.BackoffBase << (attempt - 1)
			if hi < want*7/10 || lo > want*12/10 {
				t.Errorf("attempt %d: due in %s to %s, want about %s", attempt, lo, hi, want)
			}
			if attempts != attempt || lastErr == nil || *lastErr != fmt.Sprintf("boom %d", attempt) {
				t.Errorf("attempt %d: attempts=%d last_error=%v", attempt, attempts, lastErr)
			}
			makeDue(t, pool, "thing")
		}
		if tr := tick(t, rt, "thing"); tr.Done != 1 || queued(t, pool, "thing") != 0 {
			t.Fatalf("the fifth run succeeds and removes the key: %+v", tr)
		}
	})

	t.Run("a panic is an error", func(t *testing.T) {
		t.Parallel()
		pool := newPool(t)
		c := &counter{hook: func(context.Context, *reconcile.RunContext, string, int) (reconcile.Result, error) {
			panic("oops")
		}}
		rt := newRuntime(t, pool, reconcile.Config{}, c.reconciler("thing"))
		enqueue(t, pool, "thing", "a")
		before := dbNow(t, pool)
		tick(t, rt, "thing")
		if _, _, attempts, lastErr := delay(t, pool, "a", before); attempts != 1 || lastErr == nil || *lastErr != "panic: oops" {
			t.Fatalf("attempts=%d err=%v", attempts, lastErr)
		}
	})
}

func TestBackoff(t *testing.T) {
	t.Parallel()
	prev := time.Duration(0)
	for n := 1; n <= 12; n++ {
		lo, hi := workqueue.Backoff(n, 0), workqueue.Backoff(n, 0.999999)
		mid := workqueue.Backoff(n, 0.5)
		if lo > mid || mid > hi || hi > workqueue.BackoffMax {
			t.Fatalf("n=%d: jitter range %s..%s", n, lo, hi)
		}
		if n <= 8 && mid != workqueue.BackoffBase<<(n-1) {
			t.Errorf("n=%d: %s, want %s", n, mid, workqueue.BackoffBase<<(n-1))
		}
		if mid < prev {
			t.Errorf("n=%d: backoff shrank", n)
		}
		prev = mid
	}
	if got := workqueue.Backoff(40, 0.5); got != workqueue.BackoffMax {
		t.Errorf("cap: %s", got)
	}
}

func TestPeriodicAndJanitor(t *testing.T) {
	t.Parallel()
	pool := newPool(t)
	var runs atomic.Int32
	rt := newRuntime(t, pool, reconcile.Config{}, reconcile.Reconciler{
		Name: "sweeper", ShardBy: reconcile.ShardByNone,
		Periodic: []reconcile.Periodic{{Key: "all", Every: time.Hour}},
		Run: func(_ context.Context, rc *reconcile.RunContext, key string) (reconcile.Result, error) {
			if key != "all" || rc.Lease != lease.Singleton("sweeper") {
				return reconcile.Done, fmt.Errorf("key %q under %q", key, rc.Lease)
			}
			runs.Add(1)
			return reconcile.Done, nil
		},
	})
	// A long-dead worker, for the janitor.
	if _, err := pool.Exec(t.Context(), `INSERT INTO workers (id, membership, expires_at) VALUES ('controllers/dead', 'controllers', now() - interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	if tr := tick(t, rt, "sweeper"); tr.Done != 1 || runs.Load() != 1 {
		t.Fatalf("the periodic key runs after the first membership pass: %+v", tr)
	}
	if tr := tick(t, rt, "sweeper"); tr.Claimed != 0 {
		t.Fatalf("not due again for an hour: %+v", tr)
	}
	tick(t, rt, "runtime.janitor")
	var n int
	_ = pool.QueryRow(t.Context(), `SELECT count(*) FROM workers WHERE id = 'controllers/dead'`).Scan(&n)
	if n != 0 {
		t.Fatal("the janitor left a dead worker's row")
	}
}

// settleMembership runs heartbeats on every runtime until the leases are
// stable, and fails if any shard is ever held twice.
func settleMembership(t *testing.T, rts ...*reconcile.Runtime) {
	t.Helper()
	for round := 0; round < 6; round++ {
		for _, rt := range rts {
			if err := rt.Heartbeat(t.Context()); err != nil {
				t.Fatal(err)
			}
			checkNoOverlap(t, rts...)
		}
	}
}

func checkNoOverlap(t *testing.T, rts ...*reconcile.Runtime) {
	t.Helper()
	seen := map[int]int{}
	for i, rt := range rts {
		for _, s := range rt.Owned(reconcile.RoleControllers) {
			if j, dup := seen[s]; dup {
				t.Fatalf("shard %d held by workers %d and %d", s, j, i)
			}
			seen[s] = i
		}
	}
}

func ownedCount(rts ...*reconcile.Runtime) (int, []int) {
	total := 0
	per := make([]int, len(rts))
	for i, rt := range rts {
		per[i] = len(rt.Owned(reconcile.RoleControllers))
		total += per[i]
	}
	return total, per
}

func TestShardsSplitAndMove(t *testing.T) {
	t.Parallel()
	pool := newPool(t)
	cfg := reconcile.Config{Heartbeat: time.Hour} // heartbeats are driven by hand
	var rts []*reconcile.Runtime
	for range 3 {
		c := &counter{}
		rts = append(rts, newRuntime(t, pool, cfg, c.reconciler("thing")))
	}

	settleMembership(t, rts[0], rts[1])
	if total, per := ownedCount(rts[0], rts[1]); total != shard.Count || per[0] == 0 || per[1] == 0 {
		t.Fatalf("two workers own %d shards (%v)", total, per)
	}

	settleMembership(t, rts...)
	if total, per := ownedCount(rts...); total != shard.Count || slices.Contains(per, 0) {
		t.Fatalf("three workers own %d shards (%v)", total, per)
	}

	// A worker dies: its rows expire (database time) and the others take
	// its shards.
	dead := rts[2]
	reconciletest.Kill(dead)
	expire(t, pool, dead.WorkerID(reconcile.RoleControllers))
	settleMembership(t, rts[0], rts[1])
	if total, per := ownedCount(rts[0], rts[1]); total != shard.Count {
		t.Fatalf("after a death the survivors own %d shards (%v)", total, per)
	}

	// A worker that leaves cleanly hands over at once.
	rts[1].Stop()
	settleMembership(t, rts[0])
	if total, _ := ownedCount(rts[0]); total != shard.Count {
		t.Fatalf("the last worker owns %d shards", total)
	}
}

// expire makes a worker's row and leases expire now, as missed heartbeats
// would.
func expire(t *testing.T, pool *pgxpool.Pool, worker string) {
	t.Helper()
	if _, err := pool.Exec(t.Context(), `
		UPDATE workers SET expires_at = now() - interval '1 second' WHERE id = $1;`, worker); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(t.Context(), `UPDATE leases SET expires_at = now() - interval '1 second' WHERE holder = $1`, worker); err != nil {
		t.Fatal(err)
	}
}

func TestPausedHolderIsFenced(t *testing.T) {
	t.Parallel()
	pool := newPool(t)
	cfg := reconcile.Config{Heartbeat: time.Hour}
	ca, cb := &counter{}, &counter{}
	a := newRuntime(t, pool, cfg, ca.reconciler("thing"))
	if err := a.Heartbeat(t.Context()); err != nil {
		t.Fatal(err)
	}
	aID := a.WorkerID(reconcile.RoleControllers)
	name := lease.Shard(reconcile.RoleControllers, shard.Of("k"))
	oldFence := a.HeldLeases(reconcile.RoleControllers)[name]
	if oldFence == 0 {
		t.Fatalf("a holds no lease %s", name)
	}

	// a claims the key, then pauses past its lease.
	enqueue(t, pool, "thing", "k")
	claimed, err := workqueue.Claim(t.Context(), pool, aID, time.Minute,
		[]workqueue.Lease{{Name: name, Fence: oldFence, Shard: shard.Of("k"), Kinds: []string{"thing"}}}, 10)
	if err != nil || len(claimed) != 1 {
		t.Fatalf("claim: %v %v", claimed, err)
	}
	reconciletest.Kill(a)
	expire(t, pool, aID)

	b := newRuntime(t, pool, cfg, cb.reconciler("thing"))
	if err := b.Heartbeat(t.Context()); err != nil {
		t.Fatal(err)
	}
	newFence := b.HeldLeases(reconcile.RoleControllers)[name]
	if newFence != oldFence+1 {
		t.Fatalf("b took %s with fence %d, want %d", name, newFence, oldFence+1)
	}

	// a wakes up and writes under its old fence: nothing changes.
	st, err := workqueue.Settle(t.Context(), pool, aID, []workqueue.Result{{Claimed: claimed[0], Outcome: workqueue.Done}})
	if err != nil || st.Fenced != 1 || st.Deleted != 0 {
		t.Fatalf("settle under a lost lease: %+v %v", st, err)
	}
	tag, err := pool.Exec(t.Context(), `UPDATE work_queue SET last_error = 'stale' WHERE key = 'k' AND `+lease.Clause(1, 2, 3), name, aID, oldFence)
	if err != nil || tag.RowsAffected() != 0 {
		t.Fatalf("a fenced write affected %d rows (%v)", tag.RowsAffected(), err)
	}
	if got, _ := lease.Renew(t.Context(), pool, aID, time.Minute, []lease.Held{{Name: name, Fence: oldFence}}); len(got) != 0 {
		t.Fatalf("a renewed a lease it lost: %v", got)
	}

	// The key is not lost: b reclaims it at once (a newer fence) and runs it.
	if tr := tick(t, b, "thing"); tr.Done != 1 || cb.count("k") != 1 || queued(t, pool, "thing") != 0 {
		t.Fatalf("b: %+v runs=%d queued=%d", tr, cb.count("k"), queued(t, pool, "thing"))
	}
}

func TestRunContextInTxIsFenced(t *testing.T) {
	t.Parallel()
	pool := newPool(t)
	if _, err := pool.Exec(t.Context(), `CREATE TABLE effects (key text)`); err != nil {
		t.Fatal(err)
	}
	var fenced atomic.Bool
	c := &counter{}
	c.hook = func(ctx context.Context, rc *reconcile.RunContext, key string, _ int) (reconcile.Result, error) {
		// The lease is lost while the run is in progress.
		if _, err := rc.DB().Exec(ctx, `UPDATE leases SET expires_at = now() - interval '1 second' WHERE name = $1`, rc.Lease); err != nil {
			return reconcile.Done, err
		}
		err := rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, key)
			return err
		})
		fenced.Store(errors.Is(err, reconcile.ErrFenced))
		return reconcile.Done, err
	}
	rt := newRuntime(t, pool, reconcile.Config{Heartbeat: time.Hour}, c.reconciler("thing"))
	enqueue(t, pool, "thing", "k")
	tr := tick(t, rt, "thing")
	var n int
	_ = pool.QueryRow(t.Context(), `SELECT count(*) FROM effects`).Scan(&n)
	if !fenced.Load() || n != 0 || tr.Fenced != 1 {
		t.Fatalf("fenced=%v effects=%d tick=%+v", fenced.Load(), n, tr)
	}
	if queued(t, pool, "thing") != 1 {
		t.Fatal("a fenced run lost its key")
	}
}

func TestRegisterValidates(t *testing.T) {
	t.Parallel()
	pool := newPool(t)
	rt := newRuntime(t, pool, reconcile.Config{})
	run := func(context.Context, *reconcile.RunContext, string) (reconcile.Result, error) {
		return reconcile.Done, nil
	}
	bad := []reconcile.Reconciler{
		{Name: "Bad Name", ShardBy: reconcile.ShardByNode, Run: run},
		{Name: "x", ShardBy: "rack", Run: run},
		{Name: "x", ShardBy: reconcile.ShardByNode},
		{Name: "x", ShardBy: reconcile.ShardByNode, Run: run, Role: "scheduler"}, // not hosted
		{Name: "x", ShardBy: reconcile.ShardByNone, Run: run, Periodic: []reconcile.Periodic{{Key: "all"}}},
		{Name: "runtime.janitor", ShardBy: reconcile.ShardByNone, Run: run}, // taken
	}
	for _, r := range bad {
		if err := rt.Register(r); err == nil {
			t.Errorf("Register(%+v) succeeded", r)
		}
	}
	if _, err := reconcile.New(pool, nil, reconcile.Config{Roles: []string{"bogus"}}); err == nil {
		t.Error("an unknown role was accepted")
	}
}

func TestSchedulerMembershipIsSeparate(t *testing.T) {
	t.Parallel()
	pool := newPool(t)
	cfg := reconcile.Config{Heartbeat: time.Hour}
	c := &counter{}
	ctrl := newRuntime(t, pool, cfg, c.reconciler("node"))
	placer := reconcile.Reconciler{Name: "capacity.placer", ShardBy: reconcile.ShardByPool, Role: reconcile.RoleScheduler,
		Run: func(context.Context, *reconcile.RunContext, string) (reconcile.Result, error) {
			return reconcile.Done, nil
		}}
	cfg.Roles = []string{reconcile.RoleScheduler}
	sched := newRuntime(t, pool, cfg, placer)

	settleMembership(t, ctrl, sched)
	if got := len(ctrl.Owned(reconcile.RoleControllers)); got != shard.Count {
		t.Fatalf("the controller owns %d controllers shards: a scheduler must not take them", got)
	}
	if got := len(sched.Owned(reconcile.RoleScheduler)); got != shard.Count {
		t.Fatalf("the scheduler owns %d scheduler shards", got)
	}
	for name := range sched.HeldLeases(reconcile.RoleScheduler) {
		if !strings.HasPrefix(name, "scheduler/shard:") {
			t.Errorf("scheduler lease %q", name)
		}
	}
	if id := sched.WorkerID(reconcile.RoleScheduler); !strings.HasPrefix(id, "scheduler/") {
		t.Errorf("scheduler worker id %q", id)
	}
	enqueue(t, pool, "capacity.placer", "pool_1")
	if tr := tick(t, sched, "capacity.placer"); tr.Done != 1 {
		t.Fatalf("the placer ran %+v", tr)
	}
}
