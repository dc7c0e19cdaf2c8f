package instances

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
)

// checkQuotas fails with QUOTA_EXCEEDED naming the dimension if a quota of
// tenant or an ancestor in pool is over its limit in a dimension in which
// delta (what the create or resize adds, already written) is positive. The
// caller holds the quota rows' locks ([lockPool]).
func checkQuotas(ctx context.Context, tx pgx.Tx, tenant, pool string, delta Size) error {
	rows, err := tx.Query(ctx, `
		SELECT q.tenant_id, q.vcpus, q.memory_mib, q.disk_gib, q.gpus,
		       coalesce(sum(i.vcpus), 0), coalesce(sum(i.memory_mib), 0), coalesce(sum(i.disk_gib), 0), coalesce(sum(i.gpu_count), 0)
		  FROM instance_quotas q
		  LEFT JOIN instances i ON i.pool_id = q.pool_id AND i.state NOT IN ('deleting', 'deleted')
		       AND (q.tenant_id = 'root' OR i.tenant_id = q.tenant_id OR starts_with(i.tenant_id, q.tenant_id || '.'))
		 WHERE q.pool_id = $1 AND q.tenant_id = ANY($2)
		 GROUP BY q.tenant_id, q.vcpus, q.memory_mib, q.disk_gib, q.gpus
		 ORDER BY length(q.tenant_id) DESC`, pool, iam.Ancestors(tenant))
	if err != nil {
		return fmt.Errorf("check instance quotas: %w", err)
	}
	defer rows.Close()
	want := delta.vec()
	for rows.Next() {
		var t string
		var limit [4]*int64
		var used [4]int64
		if err := rows.Scan(&t, &limit[0], &limit[1], &limit[2], &limit[3], &used[0], &used[1], &used[2], &used[3]); err != nil {
			return err
		}
		for d := range dims {
			if want[d] > 0 && limit[d] != nil && used[d] > *limit[d] {
				return fault.New(fault.QuotaExceeded, dims[d].field,
					"instance quota of tenant %s in pool %s is %d %s; %d in use, this asks for %d more",
					t, pool, *limit[d], dims[d].unit, used[d]-want[d], want[d])
			}
		}
	}
	return rows.Err()
}

// Quota bounds what a tenant (with its descendants) holds in a pool; a nil
// dimension is unbounded.
type Quota struct {
	PoolID, TenantID                string
	VCPUs, MemoryMiB, DiskGiB, GPUs *int64
	UpdatedAt                       time.Time
}

// SetQuota sets a quota (all dimensions nil removes it; false then).
func SetQuota(ctx context.Context, q Querier, qt Quota) (Quota, bool, error) {
	if qt.VCPUs == nil && qt.MemoryMiB == nil && qt.DiskGiB == nil && qt.GPUs == nil {
		_, err := q.Exec(ctx, `DELETE FROM instance_quotas WHERE pool_id = $1 AND tenant_id = $2`, qt.PoolID, qt.TenantID)
		return Quota{}, false, err
	}
	for i, v := range []*int64{qt.VCPUs, qt.MemoryMiB, qt.DiskGiB, qt.GPUs} {
		if v != nil && *v < 0 {
			return Quota{}, false, fault.New(fault.InvalidInput, dims[i].field, "expected 0 or more, got %d", *v)
		}
	}
	err := q.QueryRow(ctx, `
		INSERT INTO instance_quotas (pool_id, tenant_id, vcpus, memory_mib, disk_gib, gpus) VALUES ($1, $2, $3, $4, $5, $6)
		ON CONFLICT (pool_id, tenant_id) DO UPDATE SET vcpus = EXCLUDED.vcpus, memory_mib = EXCLUDED.memory_mib,
			disk_gib = EXCLUDED.disk_gib, gpus = EXCLUDED.gpus, updated_at = now()
		RETURNING updated_at`, qt.PoolID, qt.TenantID, qt.VCPUs, qt.MemoryMiB, qt.DiskGiB, qt.GPUs).Scan(&qt.UpdatedAt)
	if err != nil {
		return Quota{}, false, fmt.Errorf("set instance quota: %w", err)
	}
	return qt, true, nil
}

// ListQuotas lists pool's instance quotas by tenant.
func ListQuotas(ctx context.Context, q Querier, pool string) ([]Quota, error) {
	rows, err := q.Query(ctx, `SELECT pool_id, tenant_id, vcpus, memory_mib, disk_gib, gpus, updated_at FROM instance_quotas
		WHERE pool_id = $1 ORDER BY tenant_id`, pool)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Quota, error) {
		var v Quota
		return v, r.Scan(&v.PoolID, &v.TenantID, &v.VCPUs, &v.MemoryMiB, &v.DiskGiB, &v.GPUs, &v.UpdatedAt)
	})
}

// TenantUsage is what a tenant holds in a pool and its instance-hours.
type TenantUsage struct {
	TenantID string
	Held     Size
	Usage    Usage
}

// UsageOf sums pool's instances per tenant: what the live ones hold and the
// instance-hours of all (pruned instances' hours are gone with them).
func UsageOf(ctx context.Context, q Querier, pool string) ([]TenantUsage, error) {
	rows, err := q.Query(ctx, `
		SELECT i.tenant_id,
		       coalesce(sum(i.vcpus) FILTER (WHERE i.state NOT IN ('deleting', 'deleted')), 0),
		       coalesce(sum(i.memory_mib) FILTER (WHERE i.state NOT IN ('deleting', 'deleted')), 0),
		       coalesce(sum(i.disk_gib) FILTER (WHERE i.state NOT IN ('deleting', 'deleted')), 0),
		       coalesce(sum(i.gpu_count) FILTER (WHERE i.state NOT IN ('deleting', 'deleted')), 0),
		       sum(i.vcpu_hours + i.vcpus * `+heldHours+`), sum(i.memory_mib_hours + i.memory_mib * `+heldHours+`),
		       sum(i.disk_gib_hours + i.disk_gib * `+heldHours+`), sum(i.gpu_hours + i.gpu_count * `+heldHours+`)
		  FROM instances i WHERE i.pool_id = $1 GROUP BY i.tenant_id ORDER BY i.tenant_id`, pool)
	if err != nil {
		return nil, fmt.Errorf("instance usage of %s: %w", pool, err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (TenantUsage, error) {
		var u TenantUsage
		return u, r.Scan(&u.TenantID, &u.Held.VCPUs, &u.Held.MemoryMiB, &u.Held.DiskGiB, &u.Held.GPUs,
			&u.Usage.VCPUHours, &u.Usage.MemoryMiBHours, &u.Usage.DiskGiBHours, &u.Usage.GPUHours)
	})
}
