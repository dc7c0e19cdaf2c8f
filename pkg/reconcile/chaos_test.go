package reconcile_test

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/bettercompute/bettercompute/pkg/bus"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/reconcile/reconciletest"
	"github.com/bettercompute/bettercompute/pkg/shard"
)

func TestChaosBus(t *testing.T) {
	t.Parallel()
	pool := newPool(t)
	ns := natstest.New(t)
	nc, err := bus.Connect(ns.URL(), "chaos", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	poll.Until(t, 10*time.Second, "the bus to connect", nc.IsConnected)

	reg := prometheus.NewRegistry()
	c := &counter{}
	rt, err := reconcile.New(pool, nc, reconcile.Config{
		Roles:     []string{reconcile.RoleControllers},
		Heartbeat: 200 * time.Millisecond,
		// While the bus is up only pokes wake the worker; while it is down
		// it polls fast.
		Poll: time.Hour, PollBusDown: 50 * time.Millisecond,
		Registerer: reg,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := rt.Register(c.reconciler("thing")); err != nil {
		t.Fatal(err)
	}
	if err := rt.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rt.Stop)
	poll.Until(t, 10*time.Second, "every shard to be owned", func() bool { return len(rt.Owned(reconcile.RoleControllers)) == shard.Count })

	pokes := func() float64 { return pokesReceived(t, reg) }
	change := func(keys ...string) {
		t.Helper()
		err := rt.InTx(t.Context(), func(_ pgx.Tx, q *reconcile.Queue) error {
			for _, k := range keys {
				if err := q.Enqueue(t.Context(), "thing", k); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}

	t.Run("a poke wakes the owner", func(t *testing.T) {
		before := pokes()
		change("up-1")
		poll.Until(t, 10*time.Second, "the poked key to run", func() bool { return c.count("up-1") == 1 })
		if pokes() <= before {
			t.Fatal("the key ran without a poke arriving")
		}
	})

	t.Run("with the bus stopped every key still runs", func(t *testing.T) {
		ns.Stop()
		poll.Until(t, 15*time.Second, "the client to notice", func() bool { return !nc.IsConnected() })
		keys := make([]string, 50)
		for i := range keys {
			keys[i] = fmt.Sprintf("down-%d", i)
		}
		change(keys...)
		poll.Until(t, 30*time.Second, "every key to run by polling", func() bool {
			for _, k := range keys {
				if c.count(k) != 1 {
					return false
				}
			}
			return true
		})
	})

	t.Run("after the bus restarts empty pokes resume", func(t *testing.T) {
		ns.RestartEmpty()
		poll.Until(t, 15*time.Second, "the client to reconnect", nc.IsConnected)
		before := pokes()
		// The subscription is re-established just after the reconnect: keep
		// changing state until a poke arrives and wakes the worker.
		i := 0
		poll.Until(t, 15*time.Second, "a poke to wake the worker", func() bool {
			i++
			change(fmt.Sprintf("after-%d", i))
			time.Sleep(50 * time.Millisecond)
			return pokes() > before
		})
		key := fmt.Sprintf("after-%d", i)
		poll.Until(t, 10*time.Second, "the poked key to run", func() bool { return c.count(key) == 1 })
	})
}

// pokesReceived reads the runtime's pokes counter from its registry.
func pokesReceived(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "bettercompute_reconcile_pokes_received_total" {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatal("no pokes metric")
	return 0
}

func TestChaosResyncReachesEveryKeyWithoutPokes(t *testing.T) {
	t.Parallel()
	pool := newPool(t)
	if _, err := pool.Exec(t.Context(), `CREATE TABLE things (id text PRIMARY KEY, shard int NOT NULL, done bool NOT NULL DEFAULT false)`); err != nil {
		t.Fatal(err)
	}
	// State changes whose enqueues were all lost: nothing is queued.
	for i := range 100 {
		id := fmt.Sprintf("thing-%d", i)
		if _, err := pool.Exec(t.Context(), `INSERT INTO things (id, shard) VALUES ($1, $2)`, id, shard.Of(id)); err != nil {
			t.Fatal(err)
		}
	}
	rt, err := reconcile.New(pool, nil, reconcile.Config{
		Roles: []string{reconcile.RoleControllers}, Heartbeat: 100 * time.Millisecond,
		ResyncEvery: 200 * time.Millisecond, ResyncJitter: -1, PollBusDown: 50 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	err = rt.Register(reconcile.Reconciler{
		Name: "thing", ShardBy: reconcile.ShardByNode,
		Keys: func(ctx context.Context, q reconcile.Querier, shards []int) ([]string, error) {
			rows, err := q.Query(ctx, `SELECT id FROM things WHERE shard = ANY($1)`, shards)
			if err != nil {
				return nil, err
			}
			return pgx.CollectRows(rows, pgx.RowTo[string])
		},
		Run: func(ctx context.Context, rc *reconcile.RunContext, key string) (reconcile.Result, error) {
			return reconcile.Done, rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
				_, err := tx.Exec(ctx, `UPDATE things SET done = true WHERE id = $1`, key)
				return err
			})
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := rt.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rt.Stop)
	poll.Until(t, 30*time.Second, "resync to reach every thing", func() bool {
		var left int
		_ = pool.QueryRow(t.Context(), `SELECT count(*) FROM things WHERE NOT done`).Scan(&left)
		return left == 0
	})
}

func TestChaosWorkerKilledMidRunLosesNoKey(t *testing.T) {
	t.Parallel()
	pool := newPool(t)
	if _, err := pool.Exec(t.Context(), `CREATE TABLE effects (worker text, key text)`); err != nil {
		t.Fatal(err)
	}
	started := make(chan struct{}, 1)
	cfg := reconcile.Config{Roles: []string{reconcile.RoleControllers}, Heartbeat: 100 * time.Millisecond, PollBusDown: 20 * time.Millisecond}
	runner := func(block bool) reconcile.Reconciler {
		return reconcile.Reconciler{Name: "thing", ShardBy: reconcile.ShardByNode,
			Run: func(ctx context.Context, rc *reconcile.RunContext, key string) (reconcile.Result, error) {
				return reconcile.Done, rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
					if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1, $2)`, rc.Worker, key); err != nil {
						return err
					}
					if block {
						started <- struct{}{}
						<-ctx.Done() // dies here, mid-transaction
						return ctx.Err()
					}
					return nil
				})
			}}
	}
	a, err := reconcile.New(pool, nil, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Register(runner(true)); err != nil {
		t.Fatal(err)
	}
	if err := a.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	enqueue(t, pool, "thing", "k")
	select {
	case <-started:
	case <-time.After(30 * time.Second):
		t.Fatal("the run never started")
	}
	reconciletest.Kill(a)
	expire(t, pool, a.WorkerID(reconcile.RoleControllers))

	b, err := reconcile.New(pool, nil, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Register(runner(false)); err != nil {
		t.Fatal(err)
	}
	if err := b.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Stop)
	poll.Until(t, 30*time.Second, "the survivor to run the key", func() bool { return queued(t, pool, "thing") == 0 })
	rows, err := pool.Query(t.Context(), `SELECT worker FROM effects`)
	if err != nil {
		t.Fatal(err)
	}
	workers, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if len(workers) != 1 || workers[0] != b.WorkerID(reconcile.RoleControllers) {
		t.Fatalf("effects by %v: the dead run's transaction must roll back and the survivor's commit once", workers)
	}
}

// TestChaosSettleLostToTheDatabaseDoesNotStrandTheKey: a settle that fails
// (here a trigger refuses it, as a terminated connection would) leaves the
// key claimed by a worker that is not running it; the next pass releases
// the claim and runs the key, instead of leaving it unrun for ClaimTTL.
func TestChaosSettleLostToTheDatabaseDoesNotStrandTheKey(t *testing.T) {
	t.Parallel()
	pool := newPool(t)
	if _, err := pool.Exec(t.Context(), `
		CREATE TABLE fail_settle (on_ boolean NOT NULL);
		INSERT INTO fail_settle VALUES (false);
		CREATE FUNCTION fail_settle() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF (SELECT on_ FROM fail_settle) THEN
				RAISE EXCEPTION 'settle refused (the test''s stand-in for a terminated connection)';
			END IF;
			IF TG_OP = 'DELETE' THEN
				RETURN OLD;
			END IF;
			RETURN NEW;
		END $$;
		CREATE TRIGGER fail_settle BEFORE DELETE OR UPDATE OF claimed_by ON work_queue
			FOR EACH ROW WHEN (OLD.claimed_by IS NOT NULL) EXECUTE FUNCTION fail_settle();`); err != nil {
		t.Fatal(err)
	}
	var runs int
	rt, err := reconcile.New(pool, nil, reconcile.Config{Roles: []string{reconcile.RoleControllers}, ClaimTTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := rt.Register(reconcile.Reconciler{Name: "thing", ShardBy: reconcile.ShardByNode,
		Run: func(ctx context.Context, rc *reconcile.RunContext, key string) (reconcile.Result, error) {
			runs++
			if runs == 1 {
				// The run commits; its settle will be refused.
				_, err := rc.DB().Exec(ctx, `UPDATE fail_settle SET on_ = true`)
				return reconcile.Done, err
			}
			return reconcile.Done, nil
		}}); err != nil {
		t.Fatal(err)
	}
	enqueue(t, pool, "thing", "k")
	job := rt.Jobs()["thing"]
	if _, err := job.Tick(t.Context()); err == nil {
		t.Fatal("the first pass's settle was refused, yet the pass reported no error")
	}
	if _, err := pool.Exec(t.Context(), `UPDATE fail_settle SET on_ = false`); err != nil {
		t.Fatal(err)
	}
	if err := rt.Heartbeat(t.Context()); err != nil { // keep the leases, however slow the first pass was
		t.Fatal(err)
	}
	tr, err := job.Tick(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if tr.Done != 1 || runs != 2 || queued(t, pool, "thing") != 0 {
		t.Fatalf("after the lost settle: second pass %+v, %d runs, %d queued; want the key released, run again and settled",
			tr, runs, queued(t, pool, "thing"))
	}
}
