package authz

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// PutDraft writes res's projection row as a draft unless a row for it
// exists. Admission calls it in its first transaction.
func PutDraft(ctx context.Context, q Querier, res Resource) error {
	_, err := q.Exec(ctx, `
		INSERT INTO authz_projection (type, id, tenant_id, pool_id, labels, draft)
		VALUES ($1, $2, $3, nullif($4, ''), $5, true)
		ON CONFLICT (type, id) DO NOTHING`, res.Type, res.ID, res.TenantID, res.PoolID, labels(res.Labels))
	if err != nil {
		return fmt.Errorf("project %s: %w", res.UID(), err)
	}
	return nil
}

// Put writes res's projection row, live, replacing what was there.
func Put(ctx context.Context, q Querier, res Resource) error {
	_, err := q.Exec(ctx, `
		INSERT INTO authz_projection (type, id, tenant_id, pool_id, labels, draft)
		VALUES ($1, $2, $3, nullif($4, ''), $5, false)
		ON CONFLICT (type, id) DO UPDATE
		SET tenant_id = excluded.tenant_id, pool_id = excluded.pool_id, labels = excluded.labels,
		    draft = false, updated_at = now()`, res.Type, res.ID, res.TenantID, res.PoolID, labels(res.Labels))
	if err != nil {
		return fmt.Errorf("project %s: %w", res.UID(), err)
	}
	return nil
}

// DeleteDraft removes a draft row left by an admission that did not finish.
// A live row is kept.
func DeleteDraft(ctx context.Context, q Querier, typ, id string) error {
	if _, err := q.Exec(ctx, `DELETE FROM authz_projection WHERE type = $1 AND id = $2 AND draft`, typ, id); err != nil {
		return fmt.Errorf("delete draft %s %s: %w", typ, id, err)
	}
	return nil
}

// Get reads the live projection row of (typ, id) in tenant. A missing row,
// a draft, or one in another tenant is NOT_FOUND on field, so a caller learns
// nothing about other tenants' resources.
func Get(ctx context.Context, q Querier, tenant, typ, id, field string) (Resource, error) {
	res := Resource{Type: typ, ID: id}
	var pool *string
	err := q.QueryRow(ctx, `
		SELECT tenant_id, pool_id, labels FROM authz_projection
		WHERE type = $1 AND id = $2 AND tenant_id = $3 AND NOT draft`, typ, id, tenant).Scan(&res.TenantID, &pool, &res.Labels)
	if errors.Is(err, pgx.ErrNoRows) {
		return Resource{}, fault.New(fault.NotFound, field, "%s %q not found in tenant %s", typ, id, tenant)
	}
	if err != nil {
		return Resource{}, fmt.Errorf("read projection of %s %s: %w", typ, id, err)
	}
	if pool != nil {
		res.PoolID = *pool
	}
	return res, nil
}

func labels(m map[string]string) map[string]string {
	if m == nil {
		return map[string]string{}
	}
	return m
}

// Delete removes the projection row of a deleted resource.
func Delete(ctx context.Context, q Querier, typ, id string) error {
	if _, err := q.Exec(ctx, `DELETE FROM authz_projection WHERE type = $1 AND id = $2`, typ, id); err != nil {
		return fmt.Errorf("delete projection of %s %s: %w", typ, id, err)
	}
	return nil
}
