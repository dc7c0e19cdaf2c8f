package capacity

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	capstore "github.com/bettercompute/bettercompute/pkg/capacity"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// rollup recounts every GPU pool's atoms per model (” for the whole pool):
// quarantined (by the health job, booked or not: counted apart from the
// rest), and of the others booked (an active booking), free (bookable and
// not booked), unavailable (unhealthy, missing, MIG-enabled, or on a node
// that is not schedulable). The four add up to the pool's GPUs.
func (p *placer) rollup(ctx context.Context, rc *reconcile.RunContext, _ string) (reconcile.Result, error) {
	err := rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
		return capstore.Rollup(ctx, tx, p.cfg.LostAfter)
	})
	return reconcile.Done, err
}

// usage recomputes GPU-hours (booked GPUs times bound time) of live
// reservations and of those finished recently, then what each tenant has
// booked and used per pool.
func (p *placer) usage(ctx context.Context, rc *reconcile.RunContext, _ string) (reconcile.Result, error) {
	err := rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
		return capstore.Usage(ctx, tx, 3*p.cfg.RollupEvery+time.Minute)
	})
	return reconcile.Done, err
}

// Collector exports the last rollup as Prometheus gauges, read from the
// database at scrape time: bettercompute_capacity_atoms{pool, model, state}
// (model "" is the whole pool) and bettercompute_capacity_tenant_booked and
// _gpu_hours{pool, tenant}.
type Collector struct{ Pool *pgxpool.Pool }

var (
	atomsDesc = prometheus.NewDesc("bettercompute_capacity_atoms",
		"Bookable atoms (whole GPUs) per pool, model ('' for all) and state (free, booked, unavailable, quarantined), as capacity.rollup last counted them.",
		[]string{"pool", "model", "state"}, nil)
	tenantBookedDesc = prometheus.NewDesc("bettercompute_capacity_tenant_booked",
		"GPUs a tenant has booked in a pool, as capacity.usage last counted them.", []string{"pool", "tenant"}, nil)
	tenantHoursDesc = prometheus.NewDesc("bettercompute_capacity_tenant_gpu_hours",
		"GPU-hours a tenant's reservations used in a pool, as capacity.usage last computed them.", []string{"pool", "tenant"}, nil)
)

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- atomsDesc
	ch <- tenantBookedDesc
	ch <- tenantHoursDesc
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if counts, err := capstore.RolledUp(ctx, c.Pool, ""); err == nil {
		for _, r := range counts {
			ch <- prometheus.MustNewConstMetric(atomsDesc, prometheus.GaugeValue, float64(r.Quarantined), r.PoolID, r.Model, "quarantined")
			ch <- prometheus.MustNewConstMetric(atomsDesc, prometheus.GaugeValue, float64(r.Free), r.PoolID, r.Model, "free")
			ch <- prometheus.MustNewConstMetric(atomsDesc, prometheus.GaugeValue, float64(r.Booked), r.PoolID, r.Model, "booked")
			ch <- prometheus.MustNewConstMetric(atomsDesc, prometheus.GaugeValue, float64(r.Unavailable), r.PoolID, r.Model, "unavailable")
		}
	}
	if usage, err := capstore.UsageOf(ctx, c.Pool, ""); err == nil {
		for _, u := range usage {
			ch <- prometheus.MustNewConstMetric(tenantBookedDesc, prometheus.GaugeValue, float64(u.Booked), u.PoolID, u.TenantID)
			ch <- prometheus.MustNewConstMetric(tenantHoursDesc, prometheus.GaugeValue, u.GPUHours, u.PoolID, u.TenantID)
		}
	}
}
