package capacity

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// The placer's statements: what capacity.bind, capacity.tick and the
// pool-lease placer (capacity.reservations) read to find their work.

// intentSQL is the condition on nodes n that makes a node lost by an
// operator's or the control plane's decision (failed, retired, drained):
// acted on at once, unbraked.
const intentSQL = `n.state IN ('failed', 'retired', 'drained')`

// lostSQL is the condition on nodes n that makes a node lost: by intent, or
// unseen — Ready Lost, as the liveness job set it after nodes.lostAfter
// without a heartbeat, in the transaction that also recomputed the
// eviction brakes' breakers, so the placer and the breakers agree on which
// nodes are lost. Acting on an unseen node is braked (pkg/brakes.Allow).
const lostSQL = `(` + intentSQL + ` OR n.ready = 'Lost')`

// NodesAwaitingBindInShards returns the nodes of shards with an active
// booking of a placed reservation: capacity.bind's resync keys.
func NodesAwaitingBindInShards(ctx context.Context, q Querier, shards []int) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT DISTINCT b.node_id FROM bookings b
		JOIN reservations r ON r.id = b.reservation_id JOIN nodes n ON n.id = b.node_id
		WHERE b.active AND r.state = 'placed' AND n.shard = ANY($1)`, shards)
	if err != nil {
		return nil, fmt.Errorf("nodes awaiting bind: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// PoolsWithLiveReservations returns every pool with a live reservation.
func PoolsWithLiveReservations(ctx context.Context, q Querier) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT DISTINCT pool_id FROM reservations WHERE state IN ('pending', 'placed', 'bound')`)
	if err != nil {
		return nil, fmt.Errorf("pools with live reservations: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// PoolsWithDueWork returns the pools with due placer work: pending
// reservations whose start has come, live ones past their end time, and
// (unless lostNode is [LostNodeWait]) active bookings on lost nodes or of
// devices a waiting MIG layout change removes ([BookingsDrainedByMIG]).
func PoolsWithDueWork(ctx context.Context, q Querier, lostNode string) ([]string, error) {
	rows, err := q.Query(ctx, `
		SELECT pool_id FROM reservations
		 WHERE (state = 'pending' AND (start_time IS NULL OR start_time <= now()))
		    OR (state IN ('pending', 'placed', 'bound') AND end_time <= now())
		UNION
		SELECT b.pool_id FROM bookings b JOIN nodes n ON n.id = b.node_id
		 WHERE b.active AND $1 <> 'wait' AND `+lostSQL+`
		UNION
		SELECT b.pool_id FROM mig_layouts_draining w JOIN bookings b ON b.node_id = w.node_id AND b.device_id = ANY(w.devices)
		 WHERE b.active AND $1 <> 'wait'`,
		lostNode)
	if err != nil {
		return nil, fmt.Errorf("pools with due placer work: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// Owned is a reservation's id and tenant.
type Owned struct {
	ID, TenantID string
}

// LockExpired returns pool's live reservations past their end time, locked
// (FOR UPDATE) in id order until q's transaction ends.
func LockExpired(ctx context.Context, q Querier, pool string) ([]Owned, error) {
	rows, err := q.Query(ctx, `SELECT id, tenant_id FROM reservations
		WHERE pool_id = $1 AND state IN ('pending', 'placed', 'bound') AND end_time <= now() ORDER BY id FOR UPDATE`, pool)
	if err != nil {
		return nil, fmt.Errorf("find expired reservations: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[Owned])
}

// LostBooking is an active booking of pool on a lost node.
type LostBooking struct {
	ReservationID, NodeID, PoolID, GatewayID string
	// Intent is whether the node is lost by decision (failed, retired,
	// drained) rather than unseen.
	Intent bool
}

// BookingsOnLostNodes returns pool's active bookings on lost nodes, one per
// reservation and node: those lost by intent first, then by node and
// reservation.
func BookingsOnLostNodes(ctx context.Context, q Querier, pool string) ([]LostBooking, error) {
	rows, err := q.Query(ctx, `SELECT DISTINCT b.reservation_id, b.node_id, n.pool_id, n.gateway_id, `+intentSQL+`
		  FROM bookings b JOIN nodes n ON n.id = b.node_id
		 WHERE b.pool_id = $1 AND b.active AND `+lostSQL+` ORDER BY 5 DESC, 2, 1`, pool)
	if err != nil {
		return nil, fmt.Errorf("find bookings on lost nodes: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[LostBooking])
}

// MIGDrain is an active booking of a device (a whole GPU, or a MIG slice)
// that a GPU's waiting MIG layout change removes (mig_layouts_draining).
type MIGDrain struct {
	ReservationID, NodeID, GPU, DeviceID string
}

// BookingsDrainedByMIG returns pool's active bookings of devices that
// waiting MIG layout changes remove, by node, GPU, device and reservation.
func BookingsDrainedByMIG(ctx context.Context, q Querier, pool string) ([]MIGDrain, error) {
	rows, err := q.Query(ctx, `SELECT b.reservation_id, b.node_id, w.gpu_uuid, b.device_id
		  FROM mig_layouts_draining w JOIN bookings b ON b.node_id = w.node_id AND b.device_id = ANY(w.devices)
		 WHERE b.pool_id = $1 AND b.active ORDER BY 2, 3, 4, 1`, pool)
	if err != nil {
		return nil, fmt.Errorf("find bookings a MIG layout change drains: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[MIGDrain])
}

// DuePending returns pool's pending reservations whose start has come,
// oldest first.
func DuePending(ctx context.Context, q Querier, pool string) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT id FROM reservations
		WHERE pool_id = $1 AND state = 'pending' AND (start_time IS NULL OR start_time <= now())
		ORDER BY created_at, id`, pool)
	if err != nil {
		return nil, fmt.Errorf("find pending reservations: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}
