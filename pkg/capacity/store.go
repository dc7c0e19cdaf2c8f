package capacity

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// DefaultLostAfter is how long a node may go unseen before placement stops
// booking it and the placer treats its bookings as lost.
const DefaultLostAfter = 2 * time.Minute

// Insert writes a new reservation r (state pending, no bookings).
func Insert(ctx context.Context, q Querier, r Reservation) error {
	labels := r.Constraints.NodeLabels
	if labels == nil {
		labels = map[string]string{}
	}
	_, err := q.Exec(ctx, `
		INSERT INTO reservations (id, tenant_id, pool_id, gpu_count, model, min_memory_bytes, same_node, node_labels,
			state, reason, start_time, end_time, mig_profile)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'pending', $9, $10, $11, $12)`,
		r.ID, r.TenantID, r.PoolID, r.GPUCount, r.Constraints.Model, r.Constraints.MinMemoryBytes, r.Constraints.SameNode,
		labels, r.Reason, r.StartTime, r.EndTime, r.MigProfile)
	if err != nil {
		return fmt.Errorf("insert reservation: %w", err)
	}
	return nil
}

const rsvCols = `id, tenant_id, pool_id, gpu_count, model, min_memory_bytes, same_node, node_labels, state, reason,
	start_time, end_time, created_at, updated_at, bound_at, finished_at, gpu_hours, mig_profile`

func scanRsv(row pgx.Row) (Reservation, error) {
	var r Reservation
	err := row.Scan(&r.ID, &r.TenantID, &r.PoolID, &r.GPUCount, &r.Constraints.Model, &r.Constraints.MinMemoryBytes,
		&r.Constraints.SameNode, &r.Constraints.NodeLabels, &r.State, &r.Reason, &r.StartTime, &r.EndTime,
		&r.CreatedAt, &r.UpdatedAt, &r.BoundAt, &r.FinishedAt, &r.GPUHours, &r.MigProfile)
	return r, err
}

// Get reads reservation id of tenant with its bookings (the active ones, or
// for a finished reservation the ones it held). A missing one is NOT_FOUND
// on field "id".
func Get(ctx context.Context, q Querier, tenant, id string) (Reservation, error) {
	return get(ctx, q, `SELECT `+rsvCols+` FROM reservations WHERE id = $1 AND tenant_id = $2`, id, tenant)
}

// Lock reads reservation id FOR UPDATE, whatever its tenant.
func Lock(ctx context.Context, q Querier, id string) (Reservation, error) {
	return get(ctx, q, `SELECT `+rsvCols+` FROM reservations WHERE id = $1 FOR UPDATE`, id)
}

func get(ctx context.Context, q Querier, sql string, args ...any) (Reservation, error) {
	r, err := scanRsv(q.QueryRow(ctx, sql, args...))
	if errors.Is(err, pgx.ErrNoRows) {
		return Reservation{}, fault.New(fault.NotFound, "id", "no reservation %q", args[0])
	}
	if err != nil {
		return Reservation{}, fmt.Errorf("read reservation: %w", err)
	}
	if err := loadBookings(ctx, q, []*Reservation{&r}); err != nil {
		return Reservation{}, err
	}
	return r, nil
}

func loadBookings(ctx context.Context, q Querier, rs []*Reservation) error {
	if len(rs) == 0 {
		return nil
	}
	ids := make([]string, len(rs))
	byID := map[string]*Reservation{}
	for i, r := range rs {
		ids[i] = r.ID
		byID[r.ID] = r
	}
	// A live reservation shows its active bookings; a finished one the
	// bookings it held last.
	rows, err := q.Query(ctx, `
		SELECT b.reservation_id, b.node_id, b.device_id, b.model, b.mig_profile,
		       CASE WHEN b.mig_profile <> '' THEN coalesce((SELECT d.parent_id FROM devices d WHERE d.node_id = b.node_id AND d.id = b.device_id), '') ELSE '' END
		  FROM bookings b JOIN reservations r ON r.id = b.reservation_id
		WHERE b.reservation_id = ANY($1) AND (b.active OR (r.state NOT IN ('pending', 'placed', 'bound') AND b.released_at = r.finished_at))
		ORDER BY b.reservation_id, b.node_id, b.device_id`, ids)
	if err != nil {
		return fmt.Errorf("read bookings: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var id string
		var b Booking
		if err := rows.Scan(&id, &b.NodeID, &b.DeviceID, &b.Model, &b.MigProfile, &b.ParentID); err != nil {
			return err
		}
		byID[id].Bookings = append(byID[id].Bookings, b)
	}
	return rows.Err()
}

// ListFilter narrows [List].
type ListFilter struct {
	TenantID, PoolID, State string
	// After is the id of the last reservation of the previous page.
	After string
	Limit int
}

// List pages through a tenant's reservations, newest first.
func List(ctx context.Context, q Querier, f ListFilter) ([]Reservation, error) {
	rows, err := q.Query(ctx, `SELECT `+rsvCols+` FROM reservations
		WHERE tenant_id = $1 AND ($2 = '' OR pool_id = $2) AND ($3 = '' OR state = $3)
		  AND ($4 = '' OR (created_at, id) < (SELECT created_at, id FROM reservations WHERE id = $4))
		ORDER BY created_at DESC, id DESC LIMIT $5`, f.TenantID, f.PoolID, f.State, f.After, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("list reservations: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Reservation, error) { return scanRsv(r) })
	if err != nil {
		return nil, fmt.Errorf("list reservations: %w", err)
	}
	ptrs := make([]*Reservation, len(out))
	for i := range out {
		ptrs[i] = &out[i]
	}
	return out, loadBookings(ctx, q, ptrs)
}

// Why explains in a sentence why a pending reservation is not placed yet.
func Why(r Reservation, now time.Time) string {
	if r.StartTime != nil && r.StartTime.After(now) {
		return "starts at " + r.StartTime.UTC().Format(time.RFC3339) + "; the placer places it then"
	}
	return strings.TrimSpace(r.Reason)
}
