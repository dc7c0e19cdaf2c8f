package capacity

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Rollup recounts every GPU pool's atoms per model ("" for the whole pool)
// into capacity_rollup: quarantined (by the health job, booked or not:
// counted apart from the rest), and of the others booked (an active
// booking), free (bookable and not booked), unavailable (unhealthy,
// missing, MIG-enabled, or on a node that is not schedulable or unseen for
// lostAfter). The four add up to the pool's GPUs.
func Rollup(ctx context.Context, q Querier, lostAfter time.Duration) error {
	if _, err := q.Exec(ctx, `DELETE FROM capacity_rollup`); err != nil {
		return fmt.Errorf("capacity rollup: %w", err)
	}
	_, err := q.Exec(ctx, `
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
		  FROM atoms GROUP BY GROUPING SETS ((pool_id, model), (pool_id))`, lostAfter)
	if err != nil {
		return fmt.Errorf("capacity rollup: %w", err)
	}
	return nil
}

// Usage recomputes the GPU-hours (booked GPUs times bound time, a MIG
// slice weighing its compute slices over 7: bookings.compute_slices) of live
// reservations and of those finished within recent (reservations.gpu_hours),
// then what each tenant has booked and used per pool
// (capacity_tenant_usage).
func Usage(ctx context.Context, q Querier, recent time.Duration) error {
	_, err := q.Exec(ctx, `
		UPDATE reservations r SET gpu_hours = u.h FROM (
			SELECT b.reservation_id,
			       sum(greatest(0, extract(epoch FROM coalesce(b.released_at, now()) - greatest(r2.bound_at, b.created_at))) * b.compute_slices / 7.0) / 3600 AS h
			  FROM bookings b JOIN reservations r2 ON r2.id = b.reservation_id
			 WHERE r2.bound_at IS NOT NULL
			   AND (r2.state IN ('placed', 'bound') OR r2.finished_at > now() - $1::interval)
			 GROUP BY b.reservation_id) u
		 WHERE r.id = u.reservation_id AND r.gpu_hours IS DISTINCT FROM u.h`, recent)
	if err != nil {
		return fmt.Errorf("capacity usage: %w", err)
	}
	if _, err := q.Exec(ctx, `DELETE FROM capacity_tenant_usage`); err != nil {
		return fmt.Errorf("capacity usage: %w", err)
	}
	_, err = q.Exec(ctx, `
		INSERT INTO capacity_tenant_usage (pool_id, tenant_id, booked, gpu_hours)
		SELECT r.pool_id, r.tenant_id,
		       (SELECT count(*) FROM bookings b WHERE b.pool_id = r.pool_id AND b.tenant_id = r.tenant_id AND b.active),
		       sum(r.gpu_hours)
		  FROM reservations r GROUP BY r.pool_id, r.tenant_id`)
	if err != nil {
		return fmt.Errorf("capacity usage: %w", err)
	}
	return nil
}

// Counts is one row of the last rollup: a pool's atoms of a model ("" for
// the whole pool) by state.
type Counts struct {
	PoolID, Model                          string
	Free, Booked, Unavailable, Quarantined int32
	ComputedAt                             time.Time
}

// RolledUp returns the last rollup's rows of pool, or of every pool when
// pool is "", by pool and model.
func RolledUp(ctx context.Context, q Querier, pool string) ([]Counts, error) {
	rows, err := q.Query(ctx, `SELECT pool_id, model, free, booked, unavailable, quarantined, computed_at FROM capacity_rollup
		WHERE $1 = '' OR pool_id = $1 ORDER BY pool_id, model`, pool)
	if err != nil {
		return nil, fmt.Errorf("read capacity rollup: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Counts])
	if err != nil {
		return nil, fmt.Errorf("read capacity rollup: %w", err)
	}
	return out, nil
}

// TenantUsage is one row of the last usage count: what a tenant has
// booked in a pool and the GPU-hours its reservations used there.
type TenantUsage struct {
	PoolID, TenantID string
	Booked           int32
	GPUHours         float64
}

// UsageOf returns the last usage count's rows of pool, or of every pool
// when pool is "", by pool and tenant.
func UsageOf(ctx context.Context, q Querier, pool string) ([]TenantUsage, error) {
	rows, err := q.Query(ctx, `SELECT pool_id, tenant_id, booked, gpu_hours FROM capacity_tenant_usage
		WHERE $1 = '' OR pool_id = $1 ORDER BY pool_id, tenant_id`, pool)
	if err != nil {
		return nil, fmt.Errorf("read capacity usage: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[TenantUsage])
	if err != nil {
		return nil, fmt.Errorf("read capacity usage: %w", err)
	}
	return out, nil
}
