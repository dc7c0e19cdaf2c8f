package reconcile_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/lease"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/shard"
)

// batcher records RunBatch calls and the writes they commit.
type batcher struct {
	mu      sync.Mutex
	batches [][]string
	single  []string
	fail    func(keys []string) error
}

func (b *batcher) reconciler(name string) reconcile.Reconciler {
	return reconcile.Reconciler{
		Name: name, ShardBy: reconcile.ShardByNode, BatchSize: 16,
		Run: func(ctx context.Context, rc *reconcile.RunContext, key string) (reconcile.Result, error) {
			b.mu.Lock()
			b.single = append(b.single, key)
			b.mu.Unlock()
			return reconcile.Done, rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
				_, err := tx.Exec(ctx, `INSERT INTO event_cursors (name, seq) VALUES ($1, 1)
					ON CONFLICT (name) DO UPDATE SET seq = event_cursors.seq + 1`, "ran:"+key)
				return err
			})
		},
		RunBatch: func(ctx context.Context, bc *reconcile.BatchContext, keys []string) error {
			b.mu.Lock()
			b.batches = append(b.batches, append([]string(nil), keys...))
			fail := b.fail
			b.mu.Unlock()
			return bc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
				for _, k := range keys {
					if _, err := tx.Exec(ctx, `INSERT INTO event_cursors (name, seq) VALUES ($1, 1)
						ON CONFLICT (name) DO UPDATE SET seq = event_cursors.seq + 1`, "ran:"+k); err != nil {
						return err
					}
				}
				if fail != nil {
					return fail(keys)
				}
				return nil
			})
		},
	}
}

// ranCounts reports every key's committed run count.
func ranCounts(t *testing.T, pool interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}) map[string]int64 {
	t.Helper()
	rows, err := pool.Query(t.Context(), `SELECT name, seq FROM event_cursors WHERE name LIKE 'ran:%'`)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int64{}
	for rows.Next() {
		var n string
		var s int64
		if err := rows.Scan(&n, &s); err != nil {
			t.Fatal(err)
		}
		out[n[len("ran:"):]] = s
	}
	return out
}

func TestRunBatchRunsClaimedKeysTogether(t *testing.T) {
	t.Parallel()
	pool := newPool(t)
	b := &batcher{}
	rt := newRuntime(t, pool, reconcile.Config{Concurrency: 2}, b.reconciler("batchy"))
	var keys []string
	for i := range 100 {
		keys = append(keys, fmt.Sprintf("k%03d", i))
	}
	enqueue(t, pool, "batchy", keys...)
	tr := tick(t, rt, "batchy")
	if tr.Done != 100 || tr.Failed != 0 {
		t.Fatalf("tick %+v, want 100 done", tr)
	}
	got := ranCounts(t, pool)
	for _, k := range keys {
		if got[k] != 1 {
			t.Fatalf("key %s committed %d runs, want 1 (%v)", k, got[k], got)
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.single) != 0 {
		t.Fatalf("%d keys ran alone", len(b.single))
	}
	for _, batch := range b.batches {
		if len(batch) > 16 || len(batch) < 2 {
			t.Fatalf("batch of %d keys: want 2 to 16", len(batch))
		}
	}
	if queued(t, pool, "batchy") != 0 {
		t.Fatal("keys left in the queue")
	}
}

func TestRunBatchFailureFallsBackToEachKeyAlone(t *testing.T) {
	t.Parallel()
	pool := newPool(t)
	b := &batcher{fail: func([]string) error { return errors.New("one bad key spoils the batch") }}
	rt := newRuntime(t, pool, reconcile.Config{Concurrency: 1}, b.reconciler("fallback"))
	enqueue(t, pool, "fallback", "a", "b", "c", "d")
	tr := tick(t, rt, "fallback")
	if tr.Done != 4 {
		t.Fatalf("tick %+v, want 4 done by Run", tr)
	}
	// The failed batch wrote nothing; each key committed once, alone.
	got := ranCounts(t, pool)
	for _, k := range []string{"a", "b", "c", "d"} {
		if got[k] != 1 {
			t.Fatalf("key %s committed %d runs, want 1: the failed batch's writes must roll back (%v)", k, got[k], got)
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.single) != 4 {
		t.Fatalf("%v ran alone, want all four", b.single)
	}
}

func TestRunBatchIsFencedByEveryLease(t *testing.T) {
	t.Parallel()
	pool := newPool(t)
	var mu sync.Mutex
	var outcomes []error
	rec := reconcile.Reconciler{
		Name: "fenced", ShardBy: reconcile.ShardByNode,
		Run: func(ctx context.Context, rc *reconcile.RunContext, key string) (reconcile.Result, error) {
			return reconcile.Done, rc.InTx(ctx, func(pgx.Tx, *reconcile.Queue) error { return nil })
		},
		RunBatch: func(ctx context.Context, bc *reconcile.BatchContext, keys []string) error {
			// Another worker takes the shard of the batch's first key meanwhile.
			if _, err := pool.Exec(ctx, `UPDATE leases SET holder = 'thief', fence = fence + 1 WHERE name = $1`,
				lease.Shard(reconcile.RoleControllers, shard.Of(keys[0]))); err != nil {
				return err
			}
			err := bc.InTx(ctx, func(pgx.Tx, *reconcile.Queue) error { return nil })
			mu.Lock()
			outcomes = append(outcomes, err)
			mu.Unlock()
			return err
		},
	}
	rt := newRuntime(t, pool, reconcile.Config{Concurrency: 1}, rec)
	var keys []string
	for i := range 300 {
		keys = append(keys, fmt.Sprint("n", i)) // spread over many shards
	}
	enqueue(t, pool, "fenced", keys...)
	if _, err := rt.Jobs()["fenced"].Tick(t.Context()); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(outcomes) == 0 {
		t.Fatal("no batch ran")
	}
	for _, err := range outcomes {
		if !errors.Is(err, reconcile.ErrFenced) {
			t.Fatalf("InTx with one of its leases stolen: %v, want ErrFenced", err)
		}
	}
}
