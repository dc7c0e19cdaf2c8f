package capacity

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/brakes"
	capstore "github.com/bettercompute/bettercompute/pkg/capacity"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// placer is the pool-lease placer: capacity.reservations runs one pool's
// keys under the scheduler membership's shard lease, so one worker at a time
// places a pool, and every write checks the lease's fence.
type placer struct{ cfg Config }

// intentSQL is the condition on nodes n that makes a node lost by an
// operator's or the control plane's decision (failed, retired, drained):
// acted on at once, unbraked.
const intentSQL = `n.state IN ('failed', 'retired', 'drained')`

// lostSQL is the condition on nodes n that makes a node lost: by intent, or
// unseen — Ready Lost, as the liveness job set it after nodes.lostAfter
// without a heartbeat, in the transaction that also recomputed the
// eviction brakes' breakers, so the placer and the breakers agree on which
// nodes are lost. Acting on an unseen node is braked ([brakes.Allow]).
const lostSQL = `(` + intentSQL + ` OR n.ready = 'Lost')`

// tick enqueues the placer for every pool with due work: pending
// reservations whose start has come, live ones past their end time, and
// (unless the policy is wait) bookings on lost nodes.
func (p *placer) tick(ctx context.Context, rc *reconcile.RunContext, _ string) (reconcile.Result, error) {
	err := rc.InTx(ctx, func(tx pgx.Tx, q *reconcile.Queue) error {
		rows, err := tx.Query(ctx, `
			SELECT pool_id FROM reservations
			 WHERE (state = 'pending' AND (start_time IS NULL OR start_time <= now()))
			    OR (state IN ('pending', 'placed', 'bound') AND end_time <= now())
			UNION
			SELECT b.pool_id FROM bookings b JOIN nodes n ON n.id = b.node_id
			 WHERE b.active AND $1 <> 'wait' AND `+lostSQL,
			p.cfg.LostNode)
		if err != nil {
			return err
		}
		pools, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return err
		}
		for _, pool := range pools {
			if err := q.Enqueue(ctx, capstore.KindReservations, pool); err != nil {
				return err
			}
		}
		return nil
	})
	return reconcile.Done, err
}

// run is one placer pass over pool: expire, handle lost nodes, place due
// pending reservations (oldest first). A reservation that does not fit stays
// pending with the reason, and is tried again on the next tick.
func (p *placer) run(ctx context.Context, rc *reconcile.RunContext, pool string) (reconcile.Result, error) {
	err := rc.InTx(ctx, func(tx pgx.Tx, q *reconcile.Queue) error {
		if err := p.expire(ctx, tx, q, pool); err != nil {
			return err
		}
		if err := p.lost(ctx, tx, q, pool); err != nil {
			return err
		}
		return p.placePending(ctx, tx, q, pool)
	})
	return reconcile.Done, err
}

func invalidate(ctx context.Context, q *reconcile.Queue, nodes []string) error {
	for _, n := range nodes {
		if err := nodespec.Invalidate(ctx, q, n); err != nil {
			return err
		}
	}
	return nil
}

func (p *placer) expire(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, pool string) error {
	rows, err := tx.Query(ctx, `SELECT id, tenant_id FROM reservations
		WHERE pool_id = $1 AND state IN ('pending', 'placed', 'bound') AND end_time <= now() ORDER BY id FOR UPDATE`, pool)
	if err != nil {
		return fmt.Errorf("find expired reservations: %w", err)
	}
	due, err := pgx.CollectRows(rows, pgx.RowToStructByPos[idTenant])
	if err != nil {
		return err
	}
	for _, r := range due {
		nodes, changed, err := capstore.Finish(ctx, tx, r.ID, capstore.StateExpired, "its end time passed")
		if err != nil {
			return err
		}
		if !changed {
			continue
		}
		if err := invalidate(ctx, q, nodes); err != nil {
			return err
		}
		if err := event(ctx, tx, r.Tenant, "reservation.expired", map[string]any{"reservationId": r.ID}); err != nil {
			return err
		}
	}
	return nil
}

type idTenant struct {
	ID     string
	Tenant string
}

// lost applies the lost-node policy to the pool's bookings on lost nodes.
// Bookings on a node failed, retired or drained are acted on at once (an
// operator's or the control plane's decision, not an inference). A node
// that is merely unseen (Ready Lost) is first put to the eviction brakes,
// once per node per pass, in the acting transaction: while its pool's or
// its gateway's breaker is open it is skipped; when the fleet-wide rate has
// no token left, no more unseen node is acted on this pass (the next tick
// goes on).
func (p *placer) lost(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, pool string) error {
	if p.cfg.LostNode == capstore.LostNodeWait {
		return nil
	}
	rows, err := tx.Query(ctx, `SELECT DISTINCT b.reservation_id, b.node_id, n.pool_id, n.gateway_id, `+intentSQL+`
		  FROM bookings b JOIN nodes n ON n.id = b.node_id
		 WHERE b.pool_id = $1 AND b.active AND `+lostSQL+` ORDER BY 5 DESC, 2, 1`, pool)
	if err != nil {
		return fmt.Errorf("find bookings on lost nodes: %w", err)
	}
	type lostBooking struct {
		Rsv, Node, Pool, Gateway string
		Intent                   bool
	}
	lost, err := pgx.CollectRows(rows, pgx.RowToStructByPos[lostBooking])
	if err != nil {
		return err
	}
	act := map[string]bool{} // unseen node → whether the brakes let it be acted on
	rateSpent := false
	for _, l := range lost {
		ok, decided := act[l.Node]
		if !l.Intent && ((decided && !ok) || (!decided && rateSpent)) {
			continue
		}
		r, err := capstore.Lock(ctx, tx, l.Rsv)
		if err != nil {
			return err
		}
		if !capstore.Live(r.State) {
			continue
		}
		if !l.Intent && !decided {
			// Asked only for a live reservation's booking, so no token is
			// spent on a node with nothing to do.
			d, err := brakes.Allow(ctx, tx, p.cfg.Brakes, brakes.Subject{NodeID: l.Node, PoolID: l.Pool, GatewayID: l.Gateway}, p.cfg.Now())
			if err != nil {
				return err
			}
			act[l.Node] = d.Allowed
			rateSpent = !d.Allowed && !d.Paused
			if !d.Allowed {
				continue
			}
		}
		if p.cfg.LostNode == capstore.LostNodeReplace {
			n, err := capstore.Unbook(ctx, tx, r.ID, l.Node)
			if err != nil {
				return err
			}
			if err := nodespec.Invalidate(ctx, q, l.Node); err != nil {
				return err
			}
			nodes, err := capstore.Place(ctx, tx, &r, capstore.PlaceOptions{LostAfter: p.cfg.LostAfter, Count: n, Exclude: []string{l.Node}})
			if err == nil {
				if err := invalidate(ctx, q, nodes); err != nil {
					return err
				}
				if err := event(ctx, tx, r.TenantID, "reservation.replaced", map[string]any{"reservationId": r.ID, "lostNodeId": l.Node}); err != nil {
					return err
				}
				continue
			}
			if !capstore.Refused(err) {
				return err
			}
			reason := fmt.Sprintf("node %s was lost and its %d GPUs could not be re-placed: %s", l.Node, n, fault.MessageOf(err))
			if err := p.fail(ctx, tx, q, r, reason); err != nil {
				return err
			}
			continue
		}
		if err := p.fail(ctx, tx, q, r, fmt.Sprintf("node %s was lost (capacity.lostNode is fail)", l.Node)); err != nil {
			return err
		}
	}
	return nil
}

func (p *placer) fail(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, r capstore.Reservation, reason string) error {
	nodes, changed, err := capstore.Finish(ctx, tx, r.ID, capstore.StateFailed, reason)
	if err != nil || !changed {
		return err
	}
	if err := invalidate(ctx, q, nodes); err != nil {
		return err
	}
	return event(ctx, tx, r.TenantID, "reservation.failed", map[string]any{"reservationId": r.ID, "reason": reason})
}

// placePending places the pool's due pending reservations, oldest first.
func (p *placer) placePending(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, pool string) error {
	rows, err := tx.Query(ctx, `SELECT id FROM reservations
		WHERE pool_id = $1 AND state = 'pending' AND (start_time IS NULL OR start_time <= now())
		ORDER BY created_at, id`, pool)
	if err != nil {
		return fmt.Errorf("find pending reservations: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err
	}
	for _, id := range ids {
		r, err := capstore.Lock(ctx, tx, id)
		if err != nil {
			return err
		}
		if r.State != capstore.StatePending {
			continue
		}
		nodes, err := capstore.Place(ctx, tx, &r, capstore.PlaceOptions{LostAfter: p.cfg.LostAfter})
		if capstore.Refused(err) {
			if err := capstore.SetPending(ctx, tx, r.ID, "not placed yet: "+fault.MessageOf(err)); err != nil {
				return err
			}
			continue
		}
		if err != nil {
			return err
		}
		if err := invalidate(ctx, q, nodes); err != nil {
			return err
		}
		if err := event(ctx, tx, r.TenantID, "reservation.placed", map[string]any{"reservationId": r.ID}); err != nil {
			return err
		}
	}
	return nil
}
