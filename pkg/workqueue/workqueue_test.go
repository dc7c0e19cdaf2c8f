package workqueue_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/shard"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// TestSettleReleasesAKeyDirtiedWhileSettling races an enqueue with the
// settle of the same key's run: the enqueue holds the row while the settle
// waits for it. However the race falls, the key must end up due to run
// again (its generation moved), never left claimed by a run that is over.
func TestSettleReleasesAKeyDirtiedWhileSettling(t *testing.T) {
	ctx := t.Context()
	pool, err := pgxpool.New(ctx, pgtest.NewDB(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	const worker, kind, key = "controllers/w1", "nodespec", "node_a"
	lease := workqueue.Lease{Name: "shard:x", Fence: 1, Shard: shard.Of(key), Kinds: []string{kind}}
	if _, err := pool.Exec(ctx, `INSERT INTO leases (name, holder, fence, acquired_at, expires_at) VALUES ($1, $2, 1, now(), now() + interval '1 hour')`, lease.Name, worker); err != nil {
		t.Fatal(err)
	}
	if err := workqueue.Enqueue(ctx, pool, kind, key); err != nil {
		t.Fatal(err)
	}
	claimed, err := workqueue.Claim(ctx, pool, worker, time.Hour, []workqueue.Lease{lease}, 10)
	if err != nil || len(claimed) != 1 {
		t.Fatalf("claimed %v %v", claimed, err)
	}

	// The key is dirtied by a transaction that is still open when the run
	// settles.
	dirty, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = dirty.Rollback(context.Background()) }()
	if err := workqueue.Enqueue(ctx, dirty, kind, key); err != nil {
		t.Fatal(err)
	}
	settled := make(chan workqueue.Settled, 1)
	failed := make(chan error, 1)
	go func() {
		var st workqueue.Settled
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) {
			st, err = workqueue.Settle(ctx, tx, worker, []workqueue.Result{{Claimed: claimed[0], Outcome: workqueue.Done}})
			return err
		})
		if err != nil {
			failed <- err
			return
		}
		settled <- st
	}()
	// Wait until the settle waits for the row lock, then let the enqueue
	// commit.
	poll.Until(t, 10*time.Second, "the settle to wait for the enqueue's row lock", func() bool {
		var waiting int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE NOT granted`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		return waiting > 0
	})
	if err := dirty.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var st workqueue.Settled
	select {
	case st = <-settled:
	case err := <-failed:
		t.Fatal(err)
	}
	var claimedBy *string
	var gen int64
	if err := pool.QueryRow(ctx, `SELECT claimed_by, generation FROM work_queue WHERE kind = $1 AND key = $2`, kind, key).Scan(&claimedBy, &gen); err != nil {
		t.Fatalf("the dirtied key is gone: %v", err)
	}
	if claimedBy != nil || gen != 2 || st.Requeued != 1 || st.Deleted != 0 {
		t.Fatalf("claimed by %v at generation %d, settled %+v; want released at generation 2", claimedBy, gen, st)
	}
	again, err := workqueue.Claim(ctx, pool, worker, time.Hour, []workqueue.Lease{lease}, 10)
	if err != nil || len(again) != 1 || again[0].Generation != 2 {
		t.Fatalf("the dirtied key is not due: %v %v", again, err)
	}
}
