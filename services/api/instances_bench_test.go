package api_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/fieldmaskpb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/instances"
	"github.com/bettercompute/bettercompute/services/api"
)

// BenchmarkInstancesCreate measures instances.create through the whole
// admission sequence (authentication, tx 1, the decision, tx 2 with quota
// and placement that claims every dimension on one host, audit, outbox,
// invalidation) over gRPC, $BENCH_IN_FLIGHT (default 16) in flight, against
// a vps-host pool of 1,000 schedulable hosts (rows in the database) with
// 64 vCPUs, 256 GiB and 2,000 GiB each. It reports creates per second and
// the p50 and p99 latency. Each create takes 2 vCPUs, so run at most
// 32,000: go test -run x -bench InstancesCreate -benchtime 2000x.
func BenchmarkInstancesCreate(b *testing.B) {
	h := setup(b, api.Tuning{RatePerSecond: 1e9, RateBurst: 1 << 30})
	ctx := context.Background()
	pc := computev1.NewPoolsServiceClient(h.conn)
	p, err := pc.Create(as(h.root), &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "bench", Class: "vps-host"})
	if err != nil {
		b.Fatal(err)
	}
	pool := p.GetPool().GetId()
	_, err = pc.Update(as(h.root), &computev1.PoolsServiceUpdateRequest{TenantId: "root", PoolId: pool,
		UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"vps"}},
		Vps:        &computev1.VpsSettings{Host: &computev1.VpsSize{Vcpus: 64, MemoryMib: 262144, DiskGib: 2000}}})
	if err != nil {
		b.Fatal(err)
	}
	const hosts = 1000
	if _, err := h.db.Exec(ctx, `
		INSERT INTO nodes (id, tenant_id, pool_id, state, shard, hardware_key, generation, observed_generation, last_seen_at)
		SELECT 'node_v' || i, 'root', $1, 'adopted', i % 256, 'hk_v' || i, 1, 1, now() + interval '1 hour' FROM generate_series(1, $2) i`, pool, hosts); err != nil {
		b.Fatal(err)
	}
	if n, err := instances.SyncHosts(ctx, h.db, pool); err != nil || n != hosts {
		b.Fatalf("seeded %d host_capacity rows (%v), want %d", n, err, hosts)
	}
	// No ANALYZE: with autovacuum off placement must be fast on tables
	// the planner has no statistics for.
	if b.N > hosts*32 {
		b.Fatalf("at most %d creates (2 vCPUs each)", hosts*32)
	}
	c := computev1.NewInstancesServiceClient(h.conn)
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
				out, err := c.Create(rctx, &computev1.InstancesServiceCreateRequest{TenantId: "root", PoolId: pool, Vcpus: 2, MemoryMib: 8192,
					DiskGib: 60, Image: "ubuntu-24.04", IdempotencyKey: fmt.Sprintf("bench-%d", i)})
				lat[i] = time.Since(t0)
				if err != nil {
					b.Error(err)
					return
				}
				if out.GetInstance().GetNodeId() == "" {
					b.Errorf("create %d was not placed: %v", i, out.GetInstance())
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
