package iam

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Tenant is one node of the tenant tree.
type Tenant struct {
	ID        string
	ParentID  string
	Name      string
	Labels    map[string]string
	CreatedAt time.Time
}

// Identity is a user or a service account.
type Identity struct {
	ID        string
	TenantID  string
	Kind      string
	Name      string
	CreatedAt time.Time
	RevokedAt *time.Time
}

// APIKey is a key's metadata; the secret is never kept.
type APIKey struct {
	ID         string
	IdentityID string
	TenantID   string
	Name       string
	CreatedAt  time.Time
	ExpiresAt  *time.Time
	RevokedAt  *time.Time
}

// Identity kinds.
const (
	KindUser    = "user"
	KindService = "service"
)

const uniqueViolation = "23505"

func isUnique(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == uniqueViolation
}

// CreateTenant inserts t. An existing id is CONFLICT on field "id".
func CreateTenant(ctx context.Context, q Querier, t Tenant) (Tenant, error) {
	err := q.QueryRow(ctx, `
		INSERT INTO tenants (id, parent_id, name, labels) VALUES ($1, $2, $3, $4)
		RETURNING created_at`, t.ID, t.ParentID, t.Name, labelsOrEmpty(t.Labels)).Scan(&t.CreatedAt)
	if isUnique(err) {
		return Tenant{}, fault.New(fault.Conflict, "id", "tenant %q already exists", t.ID)
	}
	if err != nil {
		return Tenant{}, fmt.Errorf("insert tenant %s: %w", t.ID, err)
	}
	return t, nil
}

// GetTenant reads one tenant; NOT_FOUND when it does not exist.
func GetTenant(ctx context.Context, q Querier, id string) (Tenant, error) {
	var t Tenant
	var parent *string
	err := q.QueryRow(ctx, `SELECT id, parent_id, name, labels, created_at FROM tenants WHERE id = $1`, id).
		Scan(&t.ID, &parent, &t.Name, &t.Labels, &t.CreatedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return Tenant{}, fault.New(fault.NotFound, "tenantId", "tenant %q not found", id)
	}
	if err != nil {
		return Tenant{}, fmt.Errorf("read tenant %s: %w", id, err)
	}
	if parent != nil {
		t.ParentID = *parent
	}
	return t, nil
}

// TenantExists reports whether tenant id exists.
func TenantExists(ctx context.Context, q Querier, id string) (bool, error) {
	var exists bool
	if err := q.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM tenants WHERE id = $1)`, id).Scan(&exists); err != nil {
		return false, fmt.Errorf("read tenant %s: %w", id, err)
	}
	return exists, nil
}

// ListTenants returns up to limit children of parent with ids after after,
// in id order.
func ListTenants(ctx context.Context, q Querier, parent, after string, limit int) ([]Tenant, error) {
	rows, err := q.Query(ctx, `
		SELECT id, parent_id, name, labels, created_at FROM tenants
		WHERE parent_id = $1 AND id > $2 ORDER BY id LIMIT $3`, parent, after, limit)
	if err != nil {
		return nil, fmt.Errorf("list tenants: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Tenant, error) {
		var t Tenant
		err := r.Scan(&t.ID, &t.ParentID, &t.Name, &t.Labels, &t.CreatedAt)
		return t, err
	})
}

// CreateIdentity inserts i. A name taken in the tenant is CONFLICT on "name".
func CreateIdentity(ctx context.Context, q Querier, i Identity) (Identity, error) {
	err := q.QueryRow(ctx, `
		INSERT INTO identities (id, tenant_id, kind, name) VALUES ($1, $2, $3, $4)
		RETURNING created_at`, i.ID, i.TenantID, i.Kind, i.Name).Scan(&i.CreatedAt)
	if isUnique(err) {
		return Identity{}, fault.New(fault.Conflict, "name", "an identity named %q already exists in tenant %s", i.Name, i.TenantID)
	}
	if err != nil {
		return Identity{}, fmt.Errorf("insert identity: %w", err)
	}
	return i, nil
}

const identityCols = `id, tenant_id, kind, name, created_at, revoked_at`

func scanIdentity(r pgx.Row) (Identity, error) {
	var i Identity
	err := r.Scan(&i.ID, &i.TenantID, &i.Kind, &i.Name, &i.CreatedAt, &i.RevokedAt)
	return i, err
}

// GetIdentity reads one identity of tenant; NOT_FOUND otherwise.
func GetIdentity(ctx context.Context, q Querier, tenant, id string) (Identity, error) {
	i, err := scanIdentity(q.QueryRow(ctx, `SELECT `+identityCols+` FROM identities WHERE tenant_id = $1 AND id = $2`, tenant, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Identity{}, fault.New(fault.NotFound, "identityId", "identity %q not found in tenant %s", id, tenant)
	}
	if err != nil {
		return Identity{}, fmt.Errorf("read identity %s: %w", id, err)
	}
	return i, nil
}

// IdentityByID reads one identity of any tenant; NOT_FOUND otherwise.
func IdentityByID(ctx context.Context, q Querier, id string) (Identity, error) {
	i, err := scanIdentity(q.QueryRow(ctx, `SELECT `+identityCols+` FROM identities WHERE id = $1`, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Identity{}, fault.New(fault.NotFound, "identityId", "identity %q not found", id)
	}
	if err != nil {
		return Identity{}, fmt.Errorf("read identity %s: %w", id, err)
	}
	return i, nil
}

// ListIdentities returns up to limit identities of tenant with ids after
// after, in id order.
func ListIdentities(ctx context.Context, q Querier, tenant, after string, limit int) ([]Identity, error) {
	rows, err := q.Query(ctx, `SELECT `+identityCols+` FROM identities
		WHERE tenant_id = $1 AND id > $2 ORDER BY id LIMIT $3`, tenant, after, limit)
	if err != nil {
		return nil, fmt.Errorf("list identities: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Identity, error) { return scanIdentity(r) })
}

// RevokeIdentity marks an identity revoked (its keys stop authenticating
// within the cache bound). Revoking twice keeps the first time.
func RevokeIdentity(ctx context.Context, q Querier, tenant, id string) (Identity, error) {
	i, err := scanIdentity(q.QueryRow(ctx, `
		UPDATE identities SET revoked_at = coalesce(revoked_at, now())
		WHERE tenant_id = $1 AND id = $2 RETURNING `+identityCols, tenant, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Identity{}, fault.New(fault.NotFound, "id", "identity %q not found in tenant %s", id, tenant)
	}
	if err != nil {
		return Identity{}, fmt.Errorf("revoke identity %s: %w", id, err)
	}
	return i, nil
}

// CreateKey stores k's metadata and the hash of its secret. The identity
// must be in k.TenantID and not revoked.
func CreateKey(ctx context.Context, q Querier, k APIKey, hash []byte) (APIKey, error) {
	err := q.QueryRow(ctx, `
		INSERT INTO api_keys (id, identity_id, tenant_id, name, secret_hash, expires_at)
		SELECT $1, i.id, i.tenant_id, $4, $5, $6 FROM identities i
		WHERE i.id = $2 AND i.tenant_id = $3 AND i.revoked_at IS NULL
		RETURNING created_at`, k.ID, k.IdentityID, k.TenantID, k.Name, hash, k.ExpiresAt).Scan(&k.CreatedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return APIKey{}, fault.New(fault.NotFound, "identityId", "identity %q not found (or revoked) in tenant %s", k.IdentityID, k.TenantID)
	}
	if err != nil {
		return APIKey{}, fmt.Errorf("insert api key: %w", err)
	}
	return k, nil
}

const keyCols = `id, identity_id, tenant_id, name, created_at, expires_at, revoked_at`

func scanKey(r pgx.Row) (APIKey, error) {
	var k APIKey
	err := r.Scan(&k.ID, &k.IdentityID, &k.TenantID, &k.Name, &k.CreatedAt, &k.ExpiresAt, &k.RevokedAt)
	return k, err
}

// GetKey reads one key of tenant (its metadata, never its hash); NOT_FOUND
// on "id" otherwise.
func GetKey(ctx context.Context, q Querier, tenant, id string) (APIKey, error) {
	k, err := scanKey(q.QueryRow(ctx, `SELECT `+keyCols+` FROM api_keys WHERE tenant_id = $1 AND id = $2`, tenant, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return APIKey{}, fault.New(fault.NotFound, "id", "API key %q not found in tenant %s", id, tenant)
	}
	if err != nil {
		return APIKey{}, fmt.Errorf("read api key %s: %w", id, err)
	}
	return k, nil
}

// ListKeys returns up to limit keys of tenant (of one identity when identity
// is not empty) with ids after after, in id order.
func ListKeys(ctx context.Context, q Querier, tenant, identity, after string, limit int) ([]APIKey, error) {
	rows, err := q.Query(ctx, `SELECT `+keyCols+` FROM api_keys
		WHERE tenant_id = $1 AND ($2 = '' OR identity_id = $2) AND id > $3 ORDER BY id LIMIT $4`,
		tenant, identity, after, limit)
	if err != nil {
		return nil, fmt.Errorf("list api keys: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (APIKey, error) { return scanKey(r) })
}

// RevokeKey marks a key revoked; it stops authenticating within the cache
// bound. Revoking twice keeps the first time.
func RevokeKey(ctx context.Context, q Querier, tenant, id string) (APIKey, error) {
	k, err := scanKey(q.QueryRow(ctx, `
		UPDATE api_keys SET revoked_at = coalesce(revoked_at, now())
		WHERE tenant_id = $1 AND id = $2 RETURNING `+keyCols, tenant, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return APIKey{}, fault.New(fault.NotFound, "id", "API key %q not found in tenant %s", id, tenant)
	}
	if err != nil {
		return APIKey{}, fmt.Errorf("revoke api key %s: %w", id, err)
	}
	return k, nil
}

func labelsOrEmpty(m map[string]string) map[string]string {
	if m == nil {
		return map[string]string{}
	}
	return m
}
