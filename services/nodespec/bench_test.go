package nodespec_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/db"
	desired "github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/services/nodespec"
)

// BenchmarkPoolChange is the nodespec controller's share of a fleet-wide
// change: a pool of BC_BENCH_NODES adopted nodes (default 2,000) whose site
// settings change, invalidated in one transaction, recomputed and stored by
// a running runtime (its dispatch loop, as in production: claims of
// runtime.batch, split into batches over runtime.concurrency slots;
// BC_BENCH_BATCH and BC_BENCH_CONCURRENCY change them) until every node's
// generation moved. nodes/s is the rate.
//
//	cd services && BC_BENCH_NODES=10000 go test ./nodespec -run '^$' -bench PoolChange -benchtime 3x
func BenchmarkPoolChange(b *testing.B) {
	n := benchEnv(b, "BC_BENCH_NODES", 2000)
	pool, err := db.Open(b.Context(), db.Config{URL: pgtest.NewDB(b)})
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close()
	rt, err := reconcile.New(pool, nil, reconcile.Config{Roles: []string{reconcile.RoleNodeSpec},
		Batch: benchEnv(b, "BC_BENCH_BATCH", 0), Concurrency: benchEnv(b, "BC_BENCH_CONCURRENCY", 0)})
	if err != nil {
		b.Fatal(err)
	}
	if err := rt.Register(nodespec.Reconciler(nodespec.Config{})); err != nil {
		b.Fatal(err)
	}
	if _, err := pool.Exec(b.Context(), `INSERT INTO pools (id, tenant_id, name, class) VALUES ('pool_a', 'root', 'a', 'gpu')`); err != nil {
		b.Fatal(err)
	}
	if _, err := pool.Exec(b.Context(), `INSERT INTO nodes (id, tenant_id, pool_id, shard, hardware_key, state)
		SELECT 'node_' || g, 'root', 'pool_a', g % 256, 'hw_' || g, 'adopted' FROM generate_series(1, $1) g`, n); err != nil {
		b.Fatal(err)
	}
	if err := rt.Start(b.Context()); err != nil {
		b.Fatal(err)
	}
	defer rt.Stop()
	change := func(i int) time.Duration {
		start := time.Now()
		err := rt.InTx(b.Context(), func(tx pgx.Tx, q *reconcile.Queue) error {
			if _, err := tx.Exec(b.Context(), `UPDATE pools SET site = jsonb_build_object('logLevel', $1::text) WHERE id = 'pool_a'`, fmt.Sprint("level-", i)); err != nil {
				return err
			}
			return desired.InvalidatePool(b.Context(), tx, q, "pool_a")
		})
		if err != nil {
			b.Fatal(err)
		}
		for {
			var left int
			if err := pool.QueryRow(b.Context(), `SELECT count(*) FROM work_queue WHERE kind = $1`, desired.Kind).Scan(&left); err != nil {
				b.Fatal(err)
			}
			if left == 0 {
				return time.Since(start)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	change(-1) // the first specs
	b.ResetTimer()
	var total time.Duration
	for i := range b.N {
		total += change(i)
	}
	b.StopTimer()
	var gen int64
	if err := pool.QueryRow(context.Background(), `SELECT min(generation) FROM nodes`).Scan(&gen); err != nil || gen != int64(b.N)+1 {
		b.Fatalf("lowest generation %d (%v), want %d: every change moves every node once", gen, err, b.N+1)
	}
	b.ReportMetric(float64(n*b.N)/total.Seconds(), "nodes/s")
}

func benchEnv(b *testing.B, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		b.Fatalf("%s=%q: want a positive integer", name, v)
	}
	return n
}
