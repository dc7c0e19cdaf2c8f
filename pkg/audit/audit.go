// Package audit writes and reads the append-only audit log: one row per
// mutation the API admits or denies, saying who did what to which resource,
// with what outcome, under which request id.
//
// A row for an allowed mutation is written in the mutation's own
// transaction, so the log never shows a change that did not commit nor misses
// one that did.
package audit

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Outcomes of a decision.
const (
	Allow = "allow"
	Deny  = "deny"
)

// Record is one audit row.
type Record struct {
	// ID orders records; it is assigned on write.
	ID int64
	// At is when the row was written (database time).
	At time.Time
	// TenantID is the tenant of the resource acted on.
	TenantID string
	// Actor is the identity that acted (idn_…), or a tool such as
	// "bootstrap".
	Actor string
	// ActorTenantID is the actor's own tenant.
	ActorTenantID string
	// Action is the catalog action, e.g. compute:pools:create.
	Action string
	// Resource is the Cedar UID of the resource, e.g. Pool::"pool_x".
	Resource string
	// Decision is [Allow] or [Deny].
	Decision string
	// RequestID correlates the row with logs and traces.
	RequestID string
	// Method is the full gRPC method name.
	Method string
	// Detail is free-form context (the changed fields, a reason).
	Detail map[string]any
}

// Write appends r.
func Write(ctx context.Context, q Querier, r Record) error {
	if r.Decision == "" {
		r.Decision = Allow
	}
	if r.Detail == nil {
		r.Detail = map[string]any{}
	}
	_, err := q.Exec(ctx, `
		INSERT INTO audit (tenant_id, actor, actor_tenant_id, action, resource, decision, request_id, method, detail)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)`,
		r.TenantID, r.Actor, r.ActorTenantID, r.Action, r.Resource, r.Decision, r.RequestID, r.Method, r.Detail)
	if err != nil {
		return fmt.Errorf("write audit row: %w", err)
	}
	return nil
}

// Filter selects audit rows of one tenant. Empty fields match everything.
type Filter struct {
	TenantID string
	Actor    string
	Action   string
	Resource string
	Decision string
	// Since and Until bound At (Since inclusive, Until exclusive); zero
	// values do not bound.
	Since, Until time.Time
	// BeforeID pages: only rows with a smaller id; 0 starts at the newest.
	BeforeID int64
	// Limit caps the rows returned.
	Limit int
}

// List returns the rows f selects, newest first.
func List(ctx context.Context, q Querier, f Filter) ([]Record, error) {
	var since, until *time.Time
	if !f.Since.IsZero() {
		since = &f.Since
	}
	if !f.Until.IsZero() {
		until = &f.Until
	}
	rows, err := q.Query(ctx, `
		SELECT id, at, tenant_id, actor, actor_tenant_id, action, resource, decision, request_id, method, detail
		FROM audit
		WHERE tenant_id = $1
		  AND ($2 = '' OR actor = $2) AND ($3 = '' OR action = $3)
		  AND ($4 = '' OR resource = $4) AND ($5 = '' OR decision = $5)
		  AND ($6::timestamptz IS NULL OR at >= $6) AND ($7::timestamptz IS NULL OR at < $7)
		  AND ($8 = 0 OR id < $8)
		ORDER BY id DESC LIMIT $9`,
		f.TenantID, f.Actor, f.Action, f.Resource, f.Decision, since, until, f.BeforeID, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("list audit: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Record, error) {
		var x Record
		err := r.Scan(&x.ID, &x.At, &x.TenantID, &x.Actor, &x.ActorTenantID, &x.Action, &x.Resource, &x.Decision, &x.RequestID, &x.Method, &x.Detail)
		return x, err
	})
}
