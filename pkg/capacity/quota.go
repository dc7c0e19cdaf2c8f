package capacity

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
)

// checkShared checks a booking of count atoms by r's tenant in a pool of
// another tenant, owner: owner must be an ancestor whose pool is shared
// with its descendants (else NOT_FOUND on poolId, as for another tenant's
// pool), and unless a quota for every model of r's tenant or of an ancestor
// below owner covers it, the pool's default quota bounds what the child of
// owner on that chain and its descendants book (QUOTA_EXCEEDED on
// gpuCount). It locks the pool row first: descendants' bookings in a
// shared pool are placed one at a time, so the count it reads stays true
// until commit, and a concurrent pools.update of the sharing waits.
func checkShared(ctx context.Context, tx pgx.Tx, r *Reservation, owner string, count int) error {
	chain := iam.Below(r.TenantID, owner)
	if chain == nil {
		return notBookable(r.TenantID, r.PoolID)
	}
	var sharing string
	var limit int
	err := tx.QueryRow(ctx, `SELECT sharing, default_quota FROM pools WHERE id = $1 FOR NO KEY UPDATE`, r.PoolID).Scan(&sharing, &limit)
	if errors.Is(err, pgx.ErrNoRows) {
		return notBookable(r.TenantID, r.PoolID)
	}
	if err != nil {
		return fmt.Errorf("lock pool: %w", err)
	}
	if sharing != sharingDescendants {
		return notBookable(r.TenantID, r.PoolID)
	}
	// A new statement after the lock, so it sees every booking committed
	// by the descendants' creates this one waited for.
	top := chain[len(chain)-1]
	var covered bool
	var used int
	err = tx.QueryRow(ctx, `
		SELECT EXISTS (SELECT 1 FROM quotas WHERE pool_id = $1 AND tenant_id = ANY($2) AND model = '' AND mig_profile = $4),
		       (SELECT count(*) FROM bookings
		         WHERE pool_id = $1 AND active AND (tenant_id = $3 OR starts_with(tenant_id, $3 || '.')))`,
		r.PoolID, chain, top, r.MigProfile).Scan(&covered, &used)
	if err != nil {
		return fmt.Errorf("check default quota: %w", err)
	}
	if covered || used+count <= limit {
		return nil
	}
	if limit == 0 {
		return fault.New(fault.QuotaExceeded, "gpuCount",
			"no quota for every model is set in pool %s for tenant %s or an ancestor below %s, and the pool's default quota is 0 GPUs: ask tenant %s for a quota",
			r.PoolID, r.TenantID, owner, owner)
	}
	return fault.New(fault.QuotaExceeded, "gpuCount",
		"no quota for every model is set in pool %s for tenant %s or an ancestor below %s, so the pool's default quota applies: %d GPUs for %s and its descendants; %d in use, this reservation asks for %d more",
		r.PoolID, r.TenantID, owner, limit, top, used, count)
}

// checkQuotas fails with QUOTA_EXCEEDED if, with r's bookings inserted, any
// quota of r's tenant or its ancestors in r's pool is over its limit. A
// quota with a MIG profile counts that profile's slices; one without
// counts whole GPUs (of its model, or all). The
// quota rows are locked by the caller, so concurrent creates under one quota
// see each other's bookings.
func checkQuotas(ctx context.Context, tx pgx.Tx, r *Reservation) error {
	rows, err := tx.Query(ctx, `
		SELECT q.tenant_id, q.model, q.mig_profile, q.gpu_limit,
		       (SELECT count(*) FROM bookings b
		         WHERE b.pool_id = q.pool_id AND b.active AND b.mig_profile = q.mig_profile
		           AND (q.tenant_id = 'root' OR b.tenant_id = q.tenant_id OR b.tenant_id LIKE q.tenant_id || '.%')
		           AND (q.model = '' OR b.model = q.model OR starts_with(b.model, q.model || ' '))) AS used,
		       (SELECT count(*) FROM bookings b
		         WHERE b.reservation_id = $3 AND b.active AND b.mig_profile = q.mig_profile
		           AND (q.model = '' OR b.model = q.model OR starts_with(b.model, q.model || ' '))) AS mine
		  FROM quotas q
		 WHERE q.pool_id = $1 AND q.tenant_id = ANY($2)
		 ORDER BY length(q.tenant_id) DESC, q.model, q.mig_profile`, r.PoolID, iam.Ancestors(r.TenantID), r.ID)
	if err != nil {
		return fmt.Errorf("check quotas: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var tenant, model, profile string
		var limit, used, mine int
		if err := rows.Scan(&tenant, &model, &profile, &limit, &used, &mine); err != nil {
			return err
		}
		if mine > 0 && used > limit {
			what, field := "GPUs", "gpuCount"
			if model != "" {
				what = model + " GPUs"
			}
			if profile != "" {
				what, field = profile+" MIG slices", "count"
			}
			return fault.New(fault.QuotaExceeded, field,
				"quota of tenant %s in pool %s is %d %s; %d in use, this reservation asks for %d more",
				tenant, r.PoolID, limit, what, used-mine, mine)
		}
	}
	return rows.Err()
}

// Quota bounds a tenant's bookings in a pool.
type Quota struct {
	PoolID, TenantID, Model string
	// MigProfile: the quota counts MIG slices of this profile (GPULimit
	// slices); whole GPUs when empty.
	MigProfile string
	GPULimit   int
	UpdatedAt  time.Time
}

// SetQuota sets (limit ≥ 0) or removes (limit < 0) a quota; removing
// returns false.
func SetQuota(ctx context.Context, q Querier, qt Quota) (Quota, bool, error) {
	if qt.GPULimit < 0 {
		_, err := q.Exec(ctx, `DELETE FROM quotas WHERE pool_id = $1 AND tenant_id = $2 AND model = $3 AND mig_profile = $4`,
			qt.PoolID, qt.TenantID, qt.Model, qt.MigProfile)
		return Quota{}, false, err
	}
	err := q.QueryRow(ctx, `
		INSERT INTO quotas (pool_id, tenant_id, model, gpu_limit, mig_profile) VALUES ($1, $2, $3, $4, $5)
		ON CONFLICT (pool_id, tenant_id, model, mig_profile) DO UPDATE SET gpu_limit = EXCLUDED.gpu_limit, updated_at = now()
		RETURNING updated_at`, qt.PoolID, qt.TenantID, qt.Model, qt.GPULimit, qt.MigProfile).Scan(&qt.UpdatedAt)
	if err != nil {
		return Quota{}, false, fmt.Errorf("set quota: %w", err)
	}
	return qt, true, nil
}

// ListQuotas lists pool's quotas.
func ListQuotas(ctx context.Context, q Querier, pool string) ([]Quota, error) {
	rows, err := q.Query(ctx, `SELECT pool_id, tenant_id, model, mig_profile, gpu_limit, updated_at FROM quotas
		WHERE pool_id = $1 ORDER BY tenant_id, model, mig_profile`, pool)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Quota, error) {
		var v Quota
		return v, r.Scan(&v.PoolID, &v.TenantID, &v.Model, &v.MigProfile, &v.GPULimit, &v.UpdatedAt)
	})
}
