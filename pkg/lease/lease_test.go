package lease_test

import (
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/lease"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestLeaseLifecycle(t *testing.T) {
	t.Parallel()
	pool := pgtest.New(t)
	ctx := t.Context()
	names := []string{lease.Shard("controllers", 1), lease.Shard("scheduler", 1), lease.Singleton("sweeper")}
	if names[0] != "shard:1" || names[1] != "scheduler/shard:1" || names[2] != "singleton:sweeper" {
		t.Fatalf("names %v", names)
	}

	a, err := lease.Acquire(ctx, pool, "a", time.Minute, names)
	if err != nil || len(a) != 3 || a[0].Fence != 1 {
		t.Fatalf("a acquires free leases: %v %v", a, err)
	}
	if b, err := lease.Acquire(ctx, pool, "b", time.Minute, names); err != nil || len(b) != 0 {
		t.Fatalf("b took held leases: %v %v", b, err)
	}
	if again, _ := lease.Acquire(ctx, pool, "a", time.Minute, names); len(again) != 0 {
		t.Fatalf("re-acquiring a held lease must not bump its fence: %v", again)
	}
	renewed, err := lease.Renew(ctx, pool, "a", time.Minute, a)
	if err != nil || len(renewed) != 3 || renewed[0].Fence != 1 {
		t.Fatalf("renew: %v %v", renewed, err)
	}

	// Released: another takes it at once, with the next fence. (Acquire
	// takes leases in name order, not the order asked.)
	first := slices.IndexFunc(a, func(h lease.Held) bool { return h.Name == names[0] })
	a[0], a[first] = a[first], a[0]
	if n, err := lease.Release(ctx, pool, "a", a[:1]); err != nil || n != 1 {
		t.Fatalf("release: %d, %v; want 1 released", n, err)
	} else if n, err := lease.Release(ctx, pool, "a", a[:1]); err != nil || n != 0 {
		t.Fatalf("releasing it again: %d, %v; want 0 released", n, err)
	}
	b, err := lease.Acquire(ctx, pool, "b", time.Minute, names[:1])
	if err != nil || len(b) != 1 || b[0].Fence != 2 {
		t.Fatalf("b after release: %v %v", b, err)
	}
	if got, _ := lease.Renew(ctx, pool, "a", time.Minute, a[:1]); len(got) != 0 {
		t.Fatalf("a renewed a released lease: %v", got)
	}

	// Expired by database time: taken with the next fence; the old holder's
	// fenced write changes nothing.
	if _, err := pool.Exec(ctx, `UPDATE leases SET expires_at = now() - interval '1 ms' WHERE name = $1`, names[1]); err != nil {
		t.Fatal(err)
	}
	b2, err := lease.Acquire(ctx, pool, "b", time.Minute, names[1:2])
	if err != nil || len(b2) != 1 || b2[0].Fence != 2 {
		t.Fatalf("b after expiry: %v %v", b2, err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE t (v int); INSERT INTO t VALUES (0)`); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		holder string
		fence  int64
		rows   int64
	}{{"a", 1, 0}, {"b", 1, 0}, {"b", 2, 1}} {
		tag, err := pool.Exec(ctx, `UPDATE t SET v = v + 1 WHERE `+lease.Clause(1, 2, 3), names[1], tc.holder, tc.fence)
		if err != nil || tag.RowsAffected() != tc.rows {
			t.Errorf("write as %s fence %d affected %d rows, want %d (%v)", tc.holder, tc.fence, tag.RowsAffected(), tc.rows, err)
		}
	}
}

// TestRenewReleaseAndFencedRunsDoNotDeadlock: a holder renewing and
// releasing many leases while its runs hold them FOR SHARE in name order
// (reconcile's fenced transactions) never deadlocks: every writer of many
// leases locks them in name order, whatever order it was handed them in.
func TestRenewReleaseAndFencedRunsDoNotDeadlock(t *testing.T) {
	t.Parallel()
	pool := pgtest.New(t)
	ctx := t.Context()
	var names []string
	for i := range 24 {
		names = append(names, lease.Shard("controllers", i))
	}
	held, err := lease.Acquire(ctx, pool, "w", time.Minute, names)
	if err != nil || len(held) != len(names) {
		t.Fatalf("acquire %v %v", held, err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := range 4 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(w), 3))
			for range 25 {
				shuffled := slices.Clone(held)
				r.Shuffle(len(shuffled), func(a, b int) { shuffled[a], shuffled[b] = shuffled[b], shuffled[a] })
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					if w%2 == 0 { // a fenced run: FOR SHARE in name order
						_, err := tx.Exec(ctx, `SELECT 1 FROM leases WHERE name = ANY($1) ORDER BY name FOR SHARE`, names)
						time.Sleep(time.Millisecond)
						return err
					}
					if _, err := lease.Renew(ctx, tx, "w", time.Minute, shuffled); err != nil {
						return err
					}
					_, err := lease.Release(ctx, tx, "nobody", shuffled) // locks, changes nothing
					return err
				})
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}
