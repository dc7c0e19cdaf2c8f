// Package sites stores sites, their tokens, their agents and their boot
// lease (tables sites, site_tokens, site_agents; migration 00021).
//
// A site is where machines boot over the network. `bcd site` enrolls with a
// site token ("bcst_<id>.<secret>"; only SHA-256 of the secret is stored, a
// use is spent by one conditional UPDATE, as for join tokens) and becomes a
// site agent. One site agent per site holds the site's boot lease and
// serves PXE; the lease is fenced: every take bumps the site's boot epoch,
// and [CheckFence] refuses a write made under an older one, so an agent
// paused past its lease writes nothing when it resumes.
package sites

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/secret"
)

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Limits on what a site holds.
const (
	// MaxNameLen bounds a site's name.
	MaxNameLen = 63
	// MaxDescriptionLen bounds its description.
	MaxDescriptionLen = 1024
)

// Site is a stored site.
type Site struct {
	ID          string
	TenantID    string
	Name        string
	Description string
	Labels      map[string]string
	Generation  int64
	// BootHolder is the site agent holding the boot lease ("" when none has
	// held it); BootEpoch the lease's fencing token; BootExpiresAt when the
	// holder's lease lapses unless renewed.
	BootHolder    string
	BootEpoch     int64
	BootExpiresAt *time.Time
	CreatedAt     time.Time
	UpdatedAt     time.Time
}

// NewID returns a new site id, "site_…".
func NewID() string { return "site_" + secret.Random(10) }

const siteCols = `id, tenant_id, name, description, labels, generation, coalesce(boot_holder, ''), boot_epoch, boot_expires_at, created_at, updated_at`

func scanSite(r pgx.Row) (Site, error) {
	var s Site
	err := r.Scan(&s.ID, &s.TenantID, &s.Name, &s.Description, &s.Labels, &s.Generation, &s.BootHolder, &s.BootEpoch,
		&s.BootExpiresAt, &s.CreatedAt, &s.UpdatedAt)
	return s, err
}

func notFound(tenant, id string) error {
	return fault.New(fault.NotFound, "siteId", "site %q not found in tenant %s", id, tenant)
}

// Create stores s. A name already used in the tenant is CONFLICT on
// "name".
func Create(ctx context.Context, q Querier, s Site) (Site, error) {
	if s.Labels == nil {
		s.Labels = map[string]string{}
	}
	out, err := scanSite(q.QueryRow(ctx, `
		INSERT INTO sites (id, tenant_id, name, description, labels) VALUES ($1, $2, $3, $4, $5)
		RETURNING `+siteCols, s.ID, s.TenantID, s.Name, s.Description, s.Labels))
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "23505" && pgErr.ConstraintName == "sites_tenant_id_name_key" {
		return Site{}, fault.New(fault.Conflict, "name", "a site named %q already exists in tenant %s", s.Name, s.TenantID)
	}
	if err != nil {
		return Site{}, fmt.Errorf("insert site: %w", err)
	}
	return out, nil
}

// Get reads one site of tenant; NOT_FOUND on "siteId" otherwise.
func Get(ctx context.Context, q Querier, tenant, id string) (Site, error) {
	s, err := scanSite(q.QueryRow(ctx, `SELECT `+siteCols+` FROM sites WHERE tenant_id = $1 AND id = $2`, tenant, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Site{}, notFound(tenant, id)
	}
	if err != nil {
		return Site{}, fmt.Errorf("read site %s: %w", id, err)
	}
	return s, nil
}

// Lock reads one site of tenant FOR UPDATE, in the caller's transaction.
func Lock(ctx context.Context, q Querier, tenant, id string) (Site, error) {
	s, err := scanSite(q.QueryRow(ctx, `SELECT `+siteCols+` FROM sites WHERE tenant_id = $1 AND id = $2 FOR UPDATE`, tenant, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Site{}, notFound(tenant, id)
	}
	if err != nil {
		return Site{}, fmt.Errorf("lock site %s: %w", id, err)
	}
	return s, nil
}

// List returns up to limit sites of tenant with ids after after, in id
// order.
func List(ctx context.Context, q Querier, tenant, after string, limit int) ([]Site, error) {
	rows, err := q.Query(ctx, `SELECT `+siteCols+` FROM sites WHERE tenant_id = $1 AND id > $2 ORDER BY id LIMIT $3`,
		tenant, after, limit)
	if err != nil {
		return nil, fmt.Errorf("list sites: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Site, error) { return scanSite(r) })
}

// Delete removes a site of tenant with its tokens and agents (the agents'
// certificates are revoked by the caller). A site whose boot lease is held
// and not lapsed is CONFLICT on "siteId": stop its agents first,
// or revoke them.
func Delete(ctx context.Context, q Querier, tenant, id string) error {
	var live bool
	err := q.QueryRow(ctx, `SELECT boot_holder IS NOT NULL AND boot_expires_at > now() FROM sites
		WHERE tenant_id = $1 AND id = $2`, tenant, id).Scan(&live)
	if errors.Is(err, pgx.ErrNoRows) {
		return notFound(tenant, id)
	}
	if err != nil {
		return fmt.Errorf("read site %s: %w", id, err)
	}
	if live {
		return fault.New(fault.Conflict, "siteId", "site %s has a site agent holding its boot lease; revoke its agents first", id)
	}
	if _, err := q.Exec(ctx, `DELETE FROM sites WHERE tenant_id = $1 AND id = $2`, tenant, id); err != nil {
		return fmt.Errorf("delete site %s: %w", id, err)
	}
	return nil
}
