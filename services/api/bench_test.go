package api_test

import (
	"fmt"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/services/api"
)

// latencies collects per-call durations and reports their p99.
type latencies struct {
	mu sync.Mutex
	d  []time.Duration
}

func (l *latencies) time(f func()) {
	start := time.Now()
	f()
	el := time.Since(start)
	l.mu.Lock()
	l.d = append(l.d, el)
	l.mu.Unlock()
}

func (l *latencies) report(b *testing.B) {
	if len(l.d) == 0 {
		return
	}
	slices.Sort(l.d)
	b.ReportMetric(float64(l.d[len(l.d)*99/100].Microseconds()), "p99-µs")
	b.ReportMetric(float64(len(l.d))/b.Elapsed().Seconds(), "calls/s")
}

// BenchmarkAPI measures authenticated, authorised calls through the real
// server: a no-op (system.whoAmI), pools.get, and pools.create through the
// whole admission sequence, over REST and gRPC, with 8 callers in parallel.
func BenchmarkAPI(b *testing.B) {
	h := setup(b, api.Tuning{RatePerSecond: 1e9, RateBurst: 1 << 30})
	ctx := as(h.root)
	sys := computev1.NewSystemServiceClient(h.conn)
	pools := computev1.NewPoolsServiceClient(h.conn)
	p, err := pools.Create(ctx, &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "bench", Class: "gpu"})
	if err != nil {
		b.Fatal(err)
	}
	getBody := fmt.Sprintf(`{"tenantId":"root","poolId":%q}`, p.GetPool().GetId())
	var n atomic.Int64

	run := func(b *testing.B, call func() error) {
		var l latencies
		b.SetParallelism(1) // GOMAXPROCS callers
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				var err error
				l.time(func() { err = call() })
				if err != nil {
					b.Error(err)
					return
				}
			}
		})
		b.StopTimer()
		l.report(b)
	}
	rest := func(path string, body func() string) func() error {
		return func() error {
			code, raw := h.restRaw(b, h.root, path, []byte(body()))
			if code != http.StatusOK {
				return fmt.Errorf("%s: %d %s", path, code, raw)
			}
			return nil
		}
	}

	b.Run("noop/gRPC", func(b *testing.B) {
		run(b, func() error { _, err := sys.WhoAmI(ctx, &computev1.WhoAmIRequest{}); return err })
	})
	b.Run("noop/REST", func(b *testing.B) {
		run(b, rest("system/whoAmI", func() string { return `{}` }))
	})
	b.Run("pools.get/gRPC", func(b *testing.B) {
		run(b, func() error {
			_, err := pools.Get(ctx, &computev1.PoolsServiceGetRequest{TenantId: "root", PoolId: p.GetPool().GetId()})
			return err
		})
	})
	b.Run("pools.get/REST", func(b *testing.B) {
		run(b, rest("pools/get", func() string { return getBody }))
	})
	b.Run("pools.create/gRPC", func(b *testing.B) {
		run(b, func() error {
			i := n.Add(1)
			_, err := pools.Create(ctx, &computev1.PoolsServiceCreateRequest{
				TenantId: "root", Name: fmt.Sprintf("p%d", i), Class: "gpu", IdempotencyKey: fmt.Sprintf("k%d", i),
			})
			return err
		})
	})
	b.Run("pools.create/REST", func(b *testing.B) {
		run(b, rest("pools/create", func() string {
			i := n.Add(1)
			return fmt.Sprintf(`{"tenantId":"root","name":"p%d","class":"gpu","idempotencyKey":"k%d"}`, i, i)
		}))
	})
}
