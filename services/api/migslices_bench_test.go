package api_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/services/api"
)

// BenchmarkReservationsCreateMigSlices is BenchmarkReservationsCreate for
// MIG slices: reservations.create {migProfile: 1g.18gb, count: 1} over
// gRPC, $BENCH_IN_FLIGHT (16) in flight, against a pool of 1,000
// schedulable nodes of 8 H200s in MIG mode with seven 1g.18gb slices each
// (56,000 slices; rows in the database, every other role of the process
// running). It reports creates per second and the p50 and p99 latency.
// Each create books one slice: go test -run x -bench MigSlices -benchtime 2000x.
func BenchmarkReservationsCreateMigSlices(b *testing.B) {
	h := setup(b, api.Tuning{RatePerSecond: 1e9, RateBurst: 1 << 30})
	ctx := context.Background()
	p, err := computev1.NewPoolsServiceClient(h.conn).Create(as(h.root), &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "bench", Class: "gpu"})
	if err != nil {
		b.Fatal(err)
	}
	pool := p.GetPool().GetId()
	const nodes = 1000
	if _, err := h.db.Exec(ctx, `
		INSERT INTO nodes (id, tenant_id, pool_id, state, shard, hardware_key, generation, observed_generation, last_seen_at)
		SELECT 'node_b' || i, 'root', $1, 'adopted', i % 256, 'hk_b' || i, 1, 1, now() + interval '1 hour' FROM generate_series(1, $2) i`, pool, nodes); err != nil {
		b.Fatal(err)
	}
	if _, err := h.db.Exec(ctx, `
		INSERT INTO devices (node_id, id, index, model, memory_bytes, mig_enabled)
		SELECT 'node_b' || i, 'GPU-b' || i || '-' || g, g, 'NVIDIA H200 141GB HBM3e', 151397597184, true
		  FROM generate_series(1, $1) i, generate_series(0, 7) g`, nodes); err != nil {
		b.Fatal(err)
	}
	if _, err := h.db.Exec(ctx, `
		INSERT INTO devices (node_id, id, kind, index, model, memory_bytes, parent_id, profile, mig_start, compute_slices, gpu_instance_id)
		SELECT 'node_b' || i, 'MIG-b' || i || '-' || g || '-' || s, 'mig', g, 'NVIDIA H200 141GB HBM3e', 18 << 30,
		       'GPU-b' || i || '-' || g, '1g.18gb', s, 1, s + 7
		  FROM generate_series(1, $1) i, generate_series(0, 7) g, generate_series(0, 6) s`, nodes); err != nil {
		b.Fatal(err)
	}
	if _, err := h.db.Exec(ctx, `ANALYZE nodes; ANALYZE devices; ANALYZE bookings`); err != nil {
		b.Fatal(err)
	}
	if b.N > nodes*8*7 {
		b.Fatalf("at most %d creates (one slice each)", nodes*8*7)
	}
	c := computev1.NewReservationsServiceClient(h.conn)
	rctx := as(h.root)
	lat := make([]time.Duration, b.N)
	var next atomic.Int64
	var wg sync.WaitGroup
	b.ResetTimer()
	start := time.Now()
	for range inFlight() {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= b.N {
					return
				}
				t0 := time.Now()
				_, err := c.Create(rctx, &computev1.ReservationsServiceCreateRequest{TenantId: "root", PoolId: pool, MigProfile: "1g.18gb", Count: 1,
					IdempotencyKey: fmt.Sprintf("bench-%d", i)})
				lat[i] = time.Since(t0)
				if err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	if n := h.count(b, `SELECT count(DISTINCT device_id) FROM bookings WHERE active AND mig_profile = '1g.18gb'`); n != b.N {
		b.Fatalf("%d distinct slices booked by %d creates", n, b.N)
	}
	slices.Sort(lat)
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "creates/s")
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99-ms")
}
