package dev_test

import (
	"context"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/rollouts"
	"github.com/bettercompute/bettercompute/services/lifecycle"
	"github.com/bettercompute/bettercompute/services/nodespec"
)

// BenchmarkRollout is a rollout of a health change over BC_BENCH_NODES
// nodes (default 10,000, behind 5 gateways) in 10 batches with a 5 s bake,
// run by the real runtime, rollout job and nodespec controller; the nodes
// are rows whose "daemon" (one statement every 250 ms) reports every
// desired generation as converged, so what is measured is the control
// plane's share. It reports the rollout job's decision time per run (p50,
// max), the total rollout time and its part beyond the ten bakes.
//
//	cd services && go test ./dev -run '^$' -bench 'Rollout$' -benchtime 1x
func BenchmarkRollout(b *testing.B) {
	pool, rt, decisions := rolloutBenchEnv(b)
	b.ResetTimer()
	for i := range b.N {
		id := "rol_bench" + strconv.Itoa(i)
		start := time.Now()
		createBenchRollout(b, rt, id, i)
		for {
			r, err := rollouts.Get(b.Context(), pool, "root", id)
			if err != nil {
				b.Fatal(err)
			}
			if r.State == rollouts.Succeeded {
				break
			}
			if r.State != rollouts.Pending && r.State != rollouts.Progressing {
				b.Fatalf("rollout %s: %s", r.State, r.Message)
			}
			time.Sleep(100 * time.Millisecond)
		}
		total := time.Since(start)
		b.ReportMetric(total.Seconds(), "s/rollout")
		b.ReportMetric((total - 10*5*time.Second).Seconds(), "s/rollout-beyond-bake")
	}
	b.StopTimer()
	if runs := decisions(); len(runs) > 0 {
		b.ReportMetric(float64(runs[len(runs)/2].Microseconds())/1000, "ms/decision-p50")
		b.ReportMetric(float64(runs[len(runs)-1].Microseconds())/1000, "ms/decision-max")
		b.ReportMetric(float64(len(runs)), "decisions")
	}
}

// rolloutBenchEnv starts the runtime with the nodespec controller and the
// rollout job over BC_BENCH_NODES node rows (default 10,000) of pool_a,
// whose "daemons" report every generation converged every 250 ms. The
// returned func gives the rollout job's run times so far, sorted.
func rolloutBenchEnv(b *testing.B) (*pgxpool.Pool, *reconcile.Runtime, func() []time.Duration) {
	n := 10000
	if v, err := strconv.Atoi(os.Getenv("BC_BENCH_NODES")); err == nil && v > 0 {
		n = v
	}
	pool, err := db.Open(b.Context(), db.Config{URL: pgtest.NewDB(b)})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	rt, err := reconcile.New(pool, nil, reconcile.Config{Roles: []string{reconcile.RoleControllers, reconcile.RoleNodeSpec}})
	if err != nil {
		b.Fatal(err)
	}
	if err := rt.Register(nodespec.Reconciler(nodespec.Config{})); err != nil {
		b.Fatal(err)
	}
	var mu sync.Mutex
	var runs []time.Duration
	job := lifecycle.Rollout(lifecycle.RolloutConfig{})
	run := job.Run
	job.Run = func(ctx context.Context, rc *reconcile.RunContext, key string) (reconcile.Result, error) {
		start := time.Now()
		res, err := run(ctx, rc, key)
		mu.Lock()
		runs = append(runs, time.Since(start))
		mu.Unlock()
		return res, err
	}
	if err := rt.Register(job); err != nil {
		b.Fatal(err)
	}
	if _, err := pool.Exec(b.Context(), `INSERT INTO pools (id, tenant_id, name, class) VALUES ('pool_a', 'root', 'a', 'gpu')`); err != nil {
		b.Fatal(err)
	}
	if _, err := pool.Exec(b.Context(), `INSERT INTO nodes (id, tenant_id, pool_id, shard, hardware_key, state, gateway_id, generation, observed_generation)
		SELECT 'node_' || g, 'root', 'pool_a', g % 256, 'hw_' || g, 'adopted', 'gw-' || g % 5, 1, 1 FROM generate_series(1, $1) g`, n); err != nil {
		b.Fatal(err)
	}
	if err := rt.Start(b.Context()); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(rt.Stop)
	// The daemons: every desired generation reported converged.
	ctx, cancel := context.WithCancel(b.Context())
	var wg sync.WaitGroup
	wg.Go(func() {
		for ctx.Err() == nil {
			_, _ = pool.Exec(ctx, `UPDATE nodes SET observed_generation = generation WHERE pool_id = 'pool_a' AND observed_generation < generation`)
			select {
			case <-ctx.Done():
			case <-time.After(250 * time.Millisecond):
			}
		}
	})
	b.Cleanup(func() { cancel(); wg.Wait() })

	return pool, rt, func() []time.Duration {
		mu.Lock()
		defer mu.Unlock()
		out := slices.Clone(runs)
		slices.Sort(out)
		return out
	}
}

// createBenchRollout starts a rollout of pool_a: 10 batches of 10 %, a 5 s
// bake, failing at one node.
func createBenchRollout(b *testing.B, rt *reconcile.Runtime, id string, i int) {
	err := rt.InTx(b.Context(), func(tx pgx.Tx, q *reconcile.Queue) error {
		batches := make([]rollouts.BatchSize, 10)
		for j := range batches {
			batches[j] = rollouts.BatchSize{Percent: 10}
		}
		c := rollouts.Change{Mask: []string{"health"}, Health: []byte(`{"maxGpuTemperatureCelsius":` + strconv.Itoa(80+i) + `}`)}
		if _, err := rollouts.Create(b.Context(), tx, rollouts.Rollout{ID: id, TenantID: "root", PoolID: "pool_a", Change: c,
			Strategy: rollouts.Strategy{Batches: batches, BakeMs: 5000}}); err != nil {
			return err
		}
		return q.Enqueue(b.Context(), rollouts.Kind, "pool_a")
	})
	if err != nil {
		b.Fatal(err)
	}
}

// BenchmarkRolloutPause is the time from a failure in the first batch (a
// released, healthy node's NeedsRepair set) to the rollout paused, over
// the same fleet as BenchmarkRollout.
//
//	cd services && go test ./dev -run '^$' -bench RolloutPause -benchtime 3x
func BenchmarkRolloutPause(b *testing.B) {
	pool, rt, decisions := rolloutBenchEnv(b)
	b.ResetTimer()
	var total time.Duration
	for i := range b.N {
		id := "rol_pause" + strconv.Itoa(i)
		createBenchRollout(b, rt, id, i)
		var node string
		for {
			err := pool.QueryRow(b.Context(), `SELECT node_id FROM rollout_nodes WHERE rollout_id = $1 AND state = 'healthy' LIMIT 1`, id).Scan(&node)
			if err == nil {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		start := time.Now()
		if _, err := pool.Exec(b.Context(), `UPDATE nodes SET needs_repair = true, needs_repair_reason = 'bench' WHERE id = $1`, node); err != nil {
			b.Fatal(err)
		}
		for {
			r, err := rollouts.Get(b.Context(), pool, "root", id)
			if err != nil {
				b.Fatal(err)
			}
			if r.State == rollouts.Paused {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		total += time.Since(start)
		b.StopTimer()
		if _, err := pool.Exec(b.Context(), `UPDATE nodes SET needs_repair = false WHERE id = $1`, node); err != nil {
			b.Fatal(err)
		}
		if _, err := rollouts.Transition(b.Context(), pool, "root", id, rollouts.Active, rollouts.Cancelled, "bench"); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	b.ReportMetric(float64(total.Milliseconds())/float64(b.N), "ms/failure-to-pause")
	if runs := decisions(); len(runs) > 0 {
		b.ReportMetric(float64(runs[len(runs)/2].Microseconds())/1000, "ms/decision-p50")
	}
}
