package capacity

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// rollup recounts every GPU pool's atoms per model (” for the whole pool):
// quarantined (by the health job, booked or not: counted apart from the
// rest), and of the others booked (an active booking), free (bookable and
// not booked), unavailable (unhealthy, missing, MIG-enabled, or on a node
// that is not schedulable). The four add up to the pool's GPUs.
func (p *placer) rollup(ctx context.Context, rc *reconcile.RunContext, _ string) (reconcile.Result, error) {
	err := rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
		if _, err := tx.Exec(ctx, `DELETE FROM capacity_rollup`); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `
			WITH atoms AS (
				SELECT p.id AS pool_id, coalesce(nullif(d.model, ''), 'unknown') AS model,
				       EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = d.node_id AND b.device_id = d.id AND b.active) AS booked,
				       (n.state = 'adopted' AND n.observed_generation >= 1 AND n.last_seen_at > now() - $1::interval
				        AND d.healthy AND d.missing_since IS NULL AND NOT d.mig_enabled) AS ok,
				       d.quarantined_at IS NOT NULL AS quarantined
				  FROM pools p JOIN nodes n ON n.pool_id = p.id JOIN devices d ON d.node_id = n.id
				 WHERE p.class = 'gpu' AND d.kind = 'gpu')
			INSERT INTO capacity_rollup (pool_id, model, free, booked, unavailable, quarantined)
			SELECT pool_id, coalesce(model, ''),
			       count(*) FILTER (WHERE ok AND NOT booked AND NOT quarantined), count(*) FILTER (WHERE booked AND NOT quarantined),
			       count(*) FILTER (WHERE NOT ok AND NOT booked AND NOT quarantined), count(*) FILTER (WHERE quarantined)
			  FROM atoms GROUP BY GROUPING SETS ((pool_id, model), (pool_id))`, p.cfg.LostAfter)
		return err
	})
	return reconcile.Done, err
}

// usage recomputes GPU-hours (booked GPUs times bound time) of live
// reservations and of those finished recently, then what each tenant has
// booked and used per pool.
func (p *placer) usage(ctx context.Context, rc *reconcile.RunContext, _ string) (reconcile.Result, error) {
	err := rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
		_, err := tx.Exec(ctx, `
			UPDATE reservations r SET gpu_hours = u.h FROM (
				SELECT b.reservation_id,
				       sum(greatest(0, extract(epoch FROM coalesce(b.released_at, now()) - greatest(r2.bound_at, b.created_at)))) / 3600 AS h
				  FROM bookings b JOIN reservations r2 ON r2.id = b.reservation_id
				 WHERE r2.bound_at IS NOT NULL
				   AND (r2.state IN ('placed', 'bound') OR r2.finished_at > now() - $1::interval)
				 GROUP BY b.reservation_id) u
			 WHERE r.id = u.reservation_id AND r.gpu_hours IS DISTINCT FROM u.h`, 3*p.cfg.RollupEvery+time.Minute)
		if err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `DELETE FROM capacity_tenant_usage`); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `
			INSERT INTO capacity_tenant_usage (pool_id, tenant_id, booked, gpu_hours)
			SELECT r.pool_id, r.tenant_id,
			       (SELECT count(*) FROM bookings b WHERE b.pool_id = r.pool_id AND b.tenant_id = r.tenant_id AND b.active),
			       sum(r.gpu_hours)
			  FROM reservations r GROUP BY r.pool_id, r.tenant_id`)
		return err
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
	rows, err := c.Pool.Query(ctx, `SELECT pool_id, model, free, booked, unavailable, quarantined FROM capacity_rollup`)
	if err == nil {
		for rows.Next() {
			var pool, model string
			var free, booked, unavailable, quarantined int
			if rows.Scan(&pool, &model, &free, &booked, &unavailable, &quarantined) == nil {
				ch <- prometheus.MustNewConstMetric(atomsDesc, prometheus.GaugeValue, float64(quarantined), pool, model, "quarantined")
				ch <- prometheus.MustNewConstMetric(atomsDesc, prometheus.GaugeValue, float64(free), pool, model, "free")
				ch <- prometheus.MustNewConstMetric(atomsDesc, prometheus.GaugeValue, float64(booked), pool, model, "booked")
				ch <- prometheus.MustNewConstMetric(atomsDesc, prometheus.GaugeValue, float64(unavailable), pool, model, "unavailable")
			}
		}
		rows.Close()
	}
	rows, err = c.Pool.Query(ctx, `SELECT pool_id, tenant_id, booked, gpu_hours FROM capacity_tenant_usage`)
	if err == nil {
		for rows.Next() {
			var pool, tenant string
			var booked int
			var hours float64
			if rows.Scan(&pool, &tenant, &booked, &hours) == nil {
				ch <- prometheus.MustNewConstMetric(tenantBookedDesc, prometheus.GaugeValue, float64(booked), pool, tenant)
				ch <- prometheus.MustNewConstMetric(tenantHoursDesc, prometheus.GaugeValue, hours, pool, tenant)
			}
		}
		rows.Close()
	}
}
