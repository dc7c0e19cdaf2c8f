package instances_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/instances"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/shard"
)

// benchHosts is how many hosts the placement benchmark's pool has.
const benchHosts = 1000

// benchWorkers is how many goroutines create at once.
const benchWorkers = 4

// seedHosts opens a fresh database with the vps-host pool "pool_v" (root)
// of n adopted, schedulable, live nodes, each with 64 vCPUs, 256 GiB and
// 2,000 GiB of disk to give, and their host_capacity rows.
func seedHosts(b *testing.B, n int) *pgxpool.Pool {
	b.Helper()
	ctx := context.Background()
	pool, err := db.Open(ctx, db.Config{URL: pgtest.NewDB(b), MaxConns: 2 * benchWorkers})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	if _, err := pool.Exec(ctx, `INSERT INTO pools (id, tenant_id, name, class) VALUES ('pool_v', 'root', 'v', 'vps-host')`); err != nil {
		b.Fatal(err)
	}
	err = instances.SetSettings(ctx, pool, "pool_v", instances.Settings{Host: instances.Size{VCPUs: 64, MemoryMiB: 262144, DiskGiB: 2000}})
	if err != nil {
		b.Fatal(err)
	}
	batch := &pgx.Batch{}
	for i := range n {
		id := fmt.Sprintf("node_%04d", i)
		batch.Queue(`INSERT INTO nodes (id, tenant_id, pool_id, state, shard, hardware_key, generation, observed_generation, last_seen_at)
			VALUES ($1, 'root', 'pool_v', 'adopted', $2, $1, 1, 1, now() + interval '1 hour')`, id, shard.Of(id))
	}
	if err := pool.SendBatch(ctx, batch).Close(); err != nil {
		b.Fatal(err)
	}
	if got, err := instances.SyncHosts(ctx, pool, "pool_v"); err != nil || got != n {
		b.Fatalf("seeded %d host_capacity rows (%v), want %d", got, err, n)
	}
	// No ANALYZE: with autovacuum off the planner may take these fresh
	// tables for empty, and placement must stay fast all the same.
	return pool
}

// BenchmarkInstancesCreate measures instance creates (insert and
// placement in one transaction, as admission's second transaction does)
// in a hosted pool of 1,000 hosts, from benchWorkers goroutines at once.
// It reports the sustained creates/s and the p99 latency of one create.
// Every create must be placed; the hosts have room for 32,000.
func BenchmarkInstancesCreate(b *testing.B) {
	pool := seedHosts(b, benchHosts)
	ctx := context.Background()
	size := instances.Size{VCPUs: 2, MemoryMiB: 8192, DiskGiB: 60}
	if b.N > benchHosts*32 {
		b.Fatalf("b.N %d is more than the hosts hold (%d)", b.N, benchHosts*32)
	}
	lat := make([]time.Duration, b.N)
	var next atomic.Int64
	var failed atomic.Pointer[error]
	var wg sync.WaitGroup
	b.ResetTimer()
	start := time.Now()
	for range benchWorkers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= b.N || failed.Load() != nil {
					return
				}
				in := instances.Instance{ID: fmt.Sprintf("inst_b%07d", i), TenantID: "root", PoolID: "pool_v", Size: size, Image: "ubuntu-24.04"}
				t0 := time.Now()
				err := db.InTx(ctx, pool, db.TxOptions{}, func(tx pgx.Tx) error {
					_, err := instances.Create(ctx, tx, &in, instances.PlaceOptions{})
					return err
				})
				lat[i] = time.Since(t0)
				if err != nil {
					err = fmt.Errorf("create %d: %w", i, err)
					failed.CompareAndSwap(nil, &err)
					return
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	if err := failed.Load(); err != nil {
		b.Fatal(*err)
	}
	var placed int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM instances WHERE state = 'placed' AND node_id IS NOT NULL`).Scan(&placed); err != nil {
		b.Fatal(err)
	}
	if placed != b.N {
		b.Fatalf("%d of %d instances placed", placed, b.N)
	}
	slices.Sort(lat)
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "creates/s")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99-ms")
}
