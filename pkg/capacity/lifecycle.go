package capacity

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// SetPending records why r stays pending.
func SetPending(ctx context.Context, q Querier, id, reason string) error {
	_, err := q.Exec(ctx, `UPDATE reservations SET reason = $2, updated_at = now()
		WHERE id = $1 AND state = 'pending' AND reason <> $2`, id, reason)
	return err
}

// Finish ends live reservation id in state (released, expired or failed)
// with reason: its bookings are freed. It returns the nodes that held them
// (whose desired state the caller invalidates) and false when the
// reservation was already finished (nothing changed).
func Finish(ctx context.Context, q Querier, id, state, reason string) ([]string, bool, error) {
	var nodes []string
	var changed bool
	err := q.QueryRow(ctx, `
		WITH r AS (
			UPDATE reservations SET state = $2, reason = $3, finished_at = now(), updated_at = now()
			 WHERE id = $1 AND state IN ('pending', 'placed', 'bound') RETURNING id, finished_at),
		b AS (
			UPDATE bookings SET active = false, released_at = r.finished_at FROM r
			 WHERE bookings.reservation_id = r.id AND bookings.active RETURNING bookings.node_id)
		SELECT (SELECT count(*) > 0 FROM r), coalesce((SELECT array_agg(DISTINCT node_id ORDER BY node_id) FROM b), '{}')`,
		id, state, reason).Scan(&changed, &nodes)
	if err != nil {
		return nil, false, fmt.Errorf("finish reservation %s: %w", id, err)
	}
	return nodes, changed, nil
}

// Unbook frees r's active bookings on node (a lost node being replaced) and
// moves r back to placed; the caller books replacements.
func Unbook(ctx context.Context, q Querier, id, node string) (int, error) {
	tag, err := q.Exec(ctx, `UPDATE bookings SET active = false, released_at = now()
		WHERE reservation_id = $1 AND node_id = $2 AND active`, id, node)
	if err != nil {
		return 0, fmt.Errorf("unbook %s on %s: %w", id, node, err)
	}
	return int(tag.RowsAffected()), nil
}

// UnbookDevice frees r's active booking of device on node (a quarantined
// GPU being replaced) and returns how many it freed (0 or 1); the caller
// books a replacement.
func UnbookDevice(ctx context.Context, q Querier, id, node, device string) (int, error) {
	tag, err := q.Exec(ctx, `UPDATE bookings SET active = false, released_at = now()
		WHERE reservation_id = $1 AND node_id = $2 AND device_id = $3 AND active`, id, node, device)
	if err != nil {
		return 0, fmt.Errorf("unbook %s of %s on %s: %w", device, id, node, err)
	}
	return int(tag.RowsAffected()), nil
}

// DeviceBookings lists the live reservations with an active booking of
// device on node, by id.
func DeviceBookings(ctx context.Context, q Querier, node, device string) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT b.reservation_id FROM bookings b JOIN reservations r ON r.id = b.reservation_id
		WHERE b.node_id = $1 AND b.device_id = $2 AND b.active AND r.state IN ('pending', 'placed', 'bound')
		ORDER BY b.reservation_id`, node, device)
	if err != nil {
		return nil, fmt.Errorf("bookings of %s on %s: %w", device, node, err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// Assignments is one node's active bookings by reservation: Order lists the
// reservations sorted, Devices their devices sorted.
type Assignments struct {
	Order   []string
	Devices map[string][]string
}

// NodesAssignments is [NodeAssignments] for many nodes in one statement:
// nodes without bookings are absent from the map.
func NodesAssignments(ctx context.Context, q Querier, nodes []string) (map[string]*Assignments, error) {
	rows, err := q.Query(ctx, `SELECT node_id, reservation_id, device_id FROM bookings WHERE node_id = ANY($1) AND active
		ORDER BY node_id, reservation_id, device_id`, nodes)
	if err != nil {
		return nil, fmt.Errorf("read bookings of %d nodes: %w", len(nodes), err)
	}
	defer rows.Close()
	out := map[string]*Assignments{}
	for rows.Next() {
		var node, rsv, dev string
		if err := rows.Scan(&node, &rsv, &dev); err != nil {
			return nil, err
		}
		a := out[node]
		if a == nil {
			a = &Assignments{Devices: map[string][]string{}}
			out[node] = a
		}
		if _, ok := a.Devices[rsv]; !ok {
			a.Order = append(a.Order, rsv)
		}
		a.Devices[rsv] = append(a.Devices[rsv], dev)
	}
	return out, rows.Err()
}

// AwaitingBind returns which of nodes hold an active booking of a placed
// reservation: the nodes whose convergence may bind one ([Bind]).
func AwaitingBind(ctx context.Context, q Querier, nodes []string) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT DISTINCT b.node_id FROM bookings b JOIN reservations r ON r.id = b.reservation_id
		WHERE b.node_id = ANY($1) AND b.active AND r.state = 'placed'`, nodes)
	if err != nil {
		return nil, fmt.Errorf("nodes awaiting bind: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// Bind moves every placed reservation with bookings on node to bound when
// all of its booked nodes have observed a generation whose spec exposes its
// devices, and returns those bound (id and tenant).
func Bind(ctx context.Context, q Querier, node string) ([][2]string, error) {
	rows, err := q.Query(ctx, `
		UPDATE reservations r SET state = 'bound', bound_at = now(), updated_at = now(), reason = ''
		 WHERE r.state = 'placed'
		   AND r.id IN (SELECT reservation_id FROM bookings WHERE node_id = $1 AND active)
		   AND NOT EXISTS (
		       SELECT 1 FROM bookings b JOIN nodes n ON n.id = b.node_id
		        WHERE b.reservation_id = r.id AND b.active
		          AND NOT (n.generation >= 1 AND n.observed_generation >= n.generation
		                   AND EXISTS (SELECT 1 FROM jsonb_array_elements(coalesce(n.spec->'devices'->'assignments', '[]')) a
		                                WHERE a->>'reservationId' = r.id AND coalesce(a->'gpuUuids', '[]') ? b.device_id)))
		RETURNING r.id, r.tenant_id`, node)
	if err != nil {
		return nil, fmt.Errorf("bind reservations on %s: %w", node, err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) ([2]string, error) {
		var v [2]string
		return v, r.Scan(&v[0], &v[1])
	})
}

// ReservationTenants returns the tenant of each of ids that exists, in one
// statement.
func ReservationTenants(ctx context.Context, q Querier, ids []string) (map[string]string, error) {
	out := map[string]string{}
	if len(ids) == 0 {
		return out, nil
	}
	rows, err := q.Query(ctx, `SELECT id, tenant_id FROM reservations WHERE id = ANY($1)`, ids)
	if err != nil {
		return nil, fmt.Errorf("read reservations' tenants: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var id, tenant string
		if err := rows.Scan(&id, &tenant); err != nil {
			return nil, fmt.Errorf("read reservations' tenants: %w", err)
		}
		out[id] = tenant
	}
	return out, rows.Err()
}
