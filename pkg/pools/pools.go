// Package pools stores pools: named sets of capacity in a tenant, each of one
// class (gpu servers, VPS hosts, or a provider's capacity).
package pools

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/proto/commandkinds"
)

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Classes of pool.
const (
	ClassGPU      = "gpu"
	ClassVPSHost  = "vps-host"
	ClassProvider = "provider"
)

// Classes lists every class.
var Classes = []string{ClassGPU, ClassVPSHost, ClassProvider}

// AcceptanceChecks lists the acceptance checks a pool can require: command
// kinds the lifecycle runs on a joining node before adopting it.
var AcceptanceChecks = []string{commandkinds.DiagNVML}

// Sharing: who may book a pool besides its own tenant.
const (
	// SharingNone keeps the pool to its own tenant (the default).
	SharingNone = "none"
	// SharingDescendants lets the tenants below the pool's tenant book it,
	// each child tenant (with its descendants) under its own quota or the
	// pool's default quota.
	SharingDescendants = "descendants"
)

// Sharings lists every sharing setting.
var Sharings = []string{SharingNone, SharingDescendants}

// MaxDefaultQuota bounds a pool's default quota (the bound on a quota).
const MaxDefaultQuota = 1024 * 1024

// ValidClass reports whether c is a class.
func ValidClass(c string) bool { return slices.Contains(Classes, c) }

// Pool is one pool.
type Pool struct {
	ID          string
	TenantID    string
	Name        string
	Class       string
	Description string
	Labels      map[string]string
	Generation  int64
	// Acceptance lists the checks (command kinds) a joining node must pass
	// before adoption.
	Acceptance []string
	// Sharing is SharingNone or SharingDescendants; empty on create means
	// SharingNone.
	Sharing string
	// DefaultQuota is the GPUs a child tenant of a shared pool's tenant
	// books, with its descendants, when no quota of its own covers it.
	DefaultQuota int
	CreatedAt    time.Time
	UpdatedAt    time.Time
}

const cols = `id, tenant_id, name, class, description, labels, generation, acceptance, sharing, default_quota, created_at, updated_at`

func scan(r pgx.Row) (Pool, error) {
	var p Pool
	err := r.Scan(&p.ID, &p.TenantID, &p.Name, &p.Class, &p.Description, &p.Labels, &p.Generation, &p.Acceptance, &p.Sharing, &p.DefaultQuota, &p.CreatedAt, &p.UpdatedAt)
	return p, err
}

// Create inserts p. A name taken in the tenant is CONFLICT on "name".
func Create(ctx context.Context, q Querier, p Pool) (Pool, error) {
	if p.Labels == nil {
		p.Labels = map[string]string{}
	}
	if p.Acceptance == nil {
		p.Acceptance = []string{}
	}
	if p.Sharing == "" {
		p.Sharing = SharingNone
	}
	out, err := scan(q.QueryRow(ctx, `
		INSERT INTO pools (id, tenant_id, name, class, description, labels, acceptance, sharing, default_quota)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING `+cols,
		p.ID, p.TenantID, p.Name, p.Class, p.Description, p.Labels, p.Acceptance, p.Sharing, p.DefaultQuota))
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "23505" {
		return Pool{}, fault.New(fault.Conflict, "name", "a pool named %q already exists in tenant %s", p.Name, p.TenantID)
	}
	if err != nil {
		return Pool{}, fmt.Errorf("insert pool: %w", err)
	}
	return out, nil
}

// Get reads one pool of tenant; NOT_FOUND otherwise.
func Get(ctx context.Context, q Querier, tenant, id string) (Pool, error) {
	p, err := scan(q.QueryRow(ctx, `SELECT `+cols+` FROM pools WHERE tenant_id = $1 AND id = $2`, tenant, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Pool{}, fault.New(fault.NotFound, "id", "pool %q not found in tenant %s", id, tenant)
	}
	if err != nil {
		return Pool{}, fmt.Errorf("read pool %s: %w", id, err)
	}
	return p, nil
}

// List returns up to limit pools of tenant (of one class when class is not
// empty) with ids after after, in id order.
func List(ctx context.Context, q Querier, tenant, class, after string, limit int) ([]Pool, error) {
	rows, err := q.Query(ctx, `SELECT `+cols+` FROM pools
		WHERE tenant_id = $1 AND ($2 = '' OR class = $2) AND id > $3 ORDER BY id LIMIT $4`, tenant, class, after, limit)
	if err != nil {
		return nil, fmt.Errorf("list pools: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Pool, error) { return scan(r) })
}

// Update is a change to a pool; nil fields are kept.
type Update struct {
	Description *string
	Labels      map[string]string
	SetLabels   bool
	// Site, Health and Runtime, when set, replace the pool's NodeSpec site,
	// health and runtime sections (proto3 JSON, validated by the caller).
	Site, Health, Runtime []byte
	// Agent, when set, replaces the pool's NodeSpec agent section (proto3
	// JSON of AgentSettings: its signed release manifest, validated by the
	// caller).
	Agent []byte
	// Acceptance, when not nil, replaces the pool's acceptance checks.
	Acceptance []string
	// Sharing and DefaultQuota, when not nil, replace the pool's.
	Sharing      *string
	DefaultQuota *int
}

func nullJSON(b []byte) *string {
	if b == nil {
		return nil
	}
	s := string(b)
	return &s
}

// Apply changes the pool and bumps its generation.
func Apply(ctx context.Context, q Querier, tenant, id string, u Update) (Pool, error) {
	labels := u.Labels
	if u.SetLabels && labels == nil {
		labels = map[string]string{}
	}
	p, err := scan(q.QueryRow(ctx, `
		UPDATE pools SET
			description = coalesce($3, description),
			labels = CASE WHEN $4 THEN $5::jsonb ELSE labels END,
			site = coalesce($6::jsonb, site), health = coalesce($7::jsonb, health),
			acceptance = coalesce($8::text[], acceptance),
			sharing = coalesce($9, sharing), default_quota = coalesce($10::int, default_quota),
			runtime = coalesce($11::jsonb, runtime), agent = coalesce($12::jsonb, agent),
			generation = generation + 1, updated_at = now()
		WHERE tenant_id = $1 AND id = $2 RETURNING `+cols, tenant, id, u.Description, u.SetLabels, labels, nullJSON(u.Site), nullJSON(u.Health), u.Acceptance,
		u.Sharing, u.DefaultQuota, nullJSON(u.Runtime), nullJSON(u.Agent)))
	if errors.Is(err, pgx.ErrNoRows) {
		return Pool{}, fault.New(fault.NotFound, "id", "pool %q not found in tenant %s", id, tenant)
	}
	if err != nil {
		return Pool{}, fmt.Errorf("update pool %s: %w", id, err)
	}
	return p, nil
}

// IDsOfClass returns the id of every pool of class, of every tenant, in id
// order (the vps role's sweep over hosted pools).
func IDsOfClass(ctx context.Context, q Querier, class string) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT id FROM pools WHERE class = $1 ORDER BY id`, class)
	if err != nil {
		return nil, fmt.Errorf("pools of class %s: %w", class, err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("pools of class %s: %w", class, err)
	}
	return ids, nil
}

// NodeSettings is the settings a pool gives its nodes' desired state: the
// proto3 JSON of its site, health, runtime and agent sections ("{}" when
// unset).
type NodeSettings struct {
	ID                           string
	Site, Health, Runtime, Agent []byte
}

// NodeSettingsOf returns the node settings of each pool of ids that exists,
// in no particular order.
func NodeSettingsOf(ctx context.Context, q Querier, ids []string) ([]NodeSettings, error) {
	rows, err := q.Query(ctx, `SELECT id, site::text, health::text, runtime::text, agent::text FROM pools WHERE id = ANY($1)`, ids)
	if err != nil {
		return nil, fmt.Errorf("read pools: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[NodeSettings])
	if err != nil {
		return nil, fmt.Errorf("read pools: %w", err)
	}
	return out, nil
}

// ClassOf returns the class of pool id, of any tenant.
func ClassOf(ctx context.Context, q Querier, id string) (string, error) {
	var class string
	if err := q.QueryRow(ctx, `SELECT class FROM pools WHERE id = $1`, id).Scan(&class); err != nil {
		return "", fmt.Errorf("read pool %s: %w", id, err)
	}
	return class, nil
}

// Lock locks pool id's row FOR NO KEY UPDATE until q's transaction ends
// (nothing when there is no such pool): a serialization point for writes
// that count over the pool.
func Lock(ctx context.Context, q Querier, id string) error {
	rows, err := q.Query(ctx, `SELECT 1 FROM pools WHERE id = $1 FOR NO KEY UPDATE`, id)
	if err != nil {
		return fmt.Errorf("lock pool %s: %w", id, err)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("lock pool %s: %w", id, err)
	}
	return nil
}
