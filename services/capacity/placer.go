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

// tick enqueues the placer for every pool with due work: pending
// reservations whose start has come, live ones past their end time, and
// (unless the policy is wait) bookings on lost nodes.
func (p *placer) tick(ctx context.Context, rc *reconcile.RunContext, _ string) (reconcile.Result, error) {
	err := rc.InTx(ctx, func(tx pgx.Tx, q *reconcile.Queue) error {
		pools, err := capstore.PoolsWithDueWork(ctx, tx, p.cfg.LostNode)
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
		if err := p.migDrains(ctx, tx, q, pool); err != nil {
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
	due, err := capstore.LockExpired(ctx, tx, pool)
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
		if err := event(ctx, tx, r.TenantID, "reservation.expired", map[string]any{"reservationId": r.ID}); err != nil {
			return err
		}
	}
	return nil
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
	lost, err := capstore.BookingsOnLostNodes(ctx, tx, pool)
	if err != nil {
		return err
	}
	act := map[string]bool{} // unseen node → whether the brakes let it be acted on
	rateSpent := false
	for _, l := range lost {
		ok, decided := act[l.NodeID]
		if !l.Intent && ((decided && !ok) || (!decided && rateSpent)) {
			continue
		}
		r, err := capstore.Lock(ctx, tx, l.ReservationID)
		if err != nil {
			return err
		}
		if !capstore.Live(r.State) {
			continue
		}
		if !l.Intent && !decided {
			// Asked only for a live reservation's booking, so no token is
			// spent on a node with nothing to do.
			d, err := brakes.Allow(ctx, tx, p.cfg.Brakes, brakes.Subject{NodeID: l.NodeID, PoolID: l.PoolID, GatewayID: l.GatewayID}, p.cfg.Now())
			if err != nil {
				return err
			}
			act[l.NodeID] = d.Allowed
			rateSpent = !d.Allowed && !d.Paused
			if !d.Allowed {
				continue
			}
		}
		if p.cfg.LostNode == capstore.LostNodeReplace {
			n, err := capstore.Unbook(ctx, tx, r.ID, l.NodeID)
			if err != nil {
				return err
			}
			if err := nodespec.Invalidate(ctx, q, l.NodeID); err != nil {
				return err
			}
			nodes, err := capstore.Place(ctx, tx, &r, capstore.PlaceOptions{LostAfter: p.cfg.LostAfter, Count: n, Exclude: []string{l.NodeID}})
			if err == nil {
				if err := invalidate(ctx, q, nodes); err != nil {
					return err
				}
				if err := event(ctx, tx, r.TenantID, "reservation.replaced", map[string]any{"reservationId": r.ID, "lostNodeId": l.NodeID}); err != nil {
					return err
				}
				continue
			}
			if !capstore.Refused(err) {
				return err
			}
			reason := fmt.Sprintf("node %s was lost and its %d GPUs could not be re-placed: %s", l.NodeID, n, fault.MessageOf(err))
			if err := p.fail(ctx, tx, q, r, reason); err != nil {
				return err
			}
			continue
		}
		if err := p.fail(ctx, tx, q, r, fmt.Sprintf("node %s was lost (capacity.lostNode is fail)", l.NodeID)); err != nil {
			return err
		}
	}
	return nil
}

// migDrains applies the lost-node policy to the pool's bookings of
// devices that a waiting MIG layout change removes (capacity.mig marks the
// GPU draining with them): replace books the same count of the same
// profile (a slice) or a whole GPU elsewhere in the pool, never on a GPU
// whose change waits (a draining GPU is not bookable), and fails the
// reservation when none is free; fail ends the reservation. Either way
// the GPU's node is recomputed, and with the booking gone its change
// applies; no other GPU of the node is touched. wait keeps the booking
// (the change waits for it to end). An operator's change, so unbraked.
func (p *placer) migDrains(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, pool string) error {
	if p.cfg.LostNode == capstore.LostNodeWait {
		return nil
	}
	drains, err := capstore.BookingsDrainedByMIG(ctx, tx, pool)
	if err != nil {
		return err
	}
	for _, d := range drains {
		r, err := capstore.Lock(ctx, tx, d.ReservationID)
		if err != nil {
			return err
		}
		if !capstore.Live(r.State) {
			continue
		}
		payload := map[string]any{"reservationId": r.ID, "nodeId": d.NodeID, "gpuUuid": d.GPU, "deviceId": d.DeviceID}
		why := fmt.Sprintf("a MIG layout change of GPU %s on node %s removes %s", d.GPU, d.NodeID, d.DeviceID)
		if p.cfg.LostNode == capstore.LostNodeReplace {
			n, err := capstore.UnbookDevice(ctx, tx, r.ID, d.NodeID, d.DeviceID)
			if err != nil {
				return err
			}
			if n == 0 {
				continue
			}
			if err := nodespec.Invalidate(ctx, q, d.NodeID); err != nil {
				return err
			}
			nodes, err := capstore.Place(ctx, tx, &r, capstore.PlaceOptions{LostAfter: p.cfg.LostAfter, Count: n})
			if err == nil {
				if err := invalidate(ctx, q, nodes); err != nil {
					return err
				}
				payload["action"], payload["reason"] = "replaced", why+" (capacity.lostNode is replace)"
				if err := event(ctx, tx, r.TenantID, "reservation.device_drained", payload); err != nil {
					return err
				}
				continue
			}
			if !capstore.Refused(err) {
				return err
			}
			reason := why + " and it could not be re-placed: " + fault.MessageOf(err)
			payload["action"], payload["reason"] = "failed", reason
			if err := event(ctx, tx, r.TenantID, "reservation.device_drained", payload); err != nil {
				return err
			}
			if err := p.fail(ctx, tx, q, r, reason); err != nil {
				return err
			}
			continue
		}
		reason := why + " (capacity.lostNode is fail)"
		payload["action"], payload["reason"] = "failed", reason
		if err := event(ctx, tx, r.TenantID, "reservation.device_drained", payload); err != nil {
			return err
		}
		if err := p.fail(ctx, tx, q, r, reason); err != nil {
			return err
		}
		if err := nodespec.Invalidate(ctx, q, d.NodeID); err != nil {
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
	ids, err := capstore.DuePending(ctx, tx, pool)
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
