package api_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/services/api"
)

// inFlight is how many creates the benchmark keeps in flight:
// $BENCH_IN_FLIGHT, default 16.
func inFlight() int {
	if n, err := strconv.Atoi(os.Getenv("BENCH_IN_FLIGHT")); err == nil && n > 0 {
		return n
	}
	return 16
}

// BenchmarkReservationsCreate measures reservations.create through the whole
// admission sequence (authentication, tx 1, the decision, tx 2 with quota,
// inline placement, bookings, audit, outbox, invalidation) over gRPC, 16 in
// flight, against a pool of 1,000 schedulable nodes of 8 GPUs (rows in the
// database; every other role of the process runs too). It reports creates
// per second and the p50 and p99 latency. Each create books one GPU, so
// run at most 8,000: go test -run x -bench ReservationsCreate -benchtime 2000x.
func BenchmarkReservationsCreate(b *testing.B) {
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
		INSERT INTO devices (node_id, id, index, model, memory_bytes)
		SELECT 'node_b' || i, 'GPU-b' || i || '-' || g, g, 'NVIDIA H200', 150000000000
		  FROM generate_series(1, $1) i, generate_series(0, 7) g`, nodes); err != nil {
		b.Fatal(err)
	}
	// What autovacuum would have done after a bulk load.
	if _, err := h.db.Exec(ctx, `ANALYZE nodes; ANALYZE devices; ANALYZE bookings`); err != nil {
		b.Fatal(err)
	}
	if b.N > nodes*8 {
		b.Fatalf("at most %d creates (one GPU each)", nodes*8)
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
				_, err := c.Create(rctx, &computev1.ReservationsServiceCreateRequest{TenantId: "root", PoolId: pool, GpuCount: 1,
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
	slices.Sort(lat)
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "creates/s")
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99-ms")
}
