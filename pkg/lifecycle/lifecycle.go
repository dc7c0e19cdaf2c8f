// Package lifecycle is a node's lifecycle as the roles share it: the kinds
// of the jobs other roles enqueue (inventory, health, drain, fleet.drift),
// and the drain and undrain transitions with the events and work each
// implies, run in the caller's transaction. The jobs themselves live in
// services/inventory and services/lifecycle.
package lifecycle

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	capstore "github.com/bettercompute/bettercompute/pkg/capacity"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// The node-sharded jobs' kinds in the work queue; their keys are node ids.
const (
	// KindInventory is the inventory job: it stores a node's reported
	// hardware and runs acceptance.
	KindInventory = "inventory"
	// KindHealth is the health job: it applies a node's health reports.
	KindHealth = "health"
	// KindDrain is the drain job: it moves a draining node to drained and
	// retires it when asked.
	KindDrain = "drain"
)

// KindDrift is the fleet.drift job's kind: pool-sharded, its keys are
// pool ids. It computes the Drifted condition of every node of the pool.
const KindDrift = "fleet.drift"

// DrainRequest is how [StartDrain] drains a node.
type DrainRequest struct {
	// Deadline is when the node's bookings must be gone.
	Deadline time.Time
	// Reason says why, for the events and nodes.get.
	Reason string
	// By is [nodes.DrainByOperator] or [nodes.DrainByRemediation].
	By string
	// Retire ends the drain in retirement.
	Retire bool
}

// StartDrain drains node id in tx ([nodes.StartDrain]: no new bookings from
// now, while desired state and commands keep flowing), writes node.draining
// and one reservation.node_draining per live reservation with an active
// booking on the node, and enqueues the node's drain key through q: the
// job drains it as soon as it holds no active booking, or at the deadline.
// The API's nodes.drain and nodes.retire call it, and so does the
// remediation ladder before a reboot (By [nodes.DrainByRemediation]).
// Errors are [nodes.StartDrain]'s.
func StartDrain(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, id string, r DrainRequest) (nodes.Node, error) {
	n, err := nodes.StartDrain(ctx, tx, id, nodes.Drain{Deadline: r.Deadline, Reason: r.Reason, By: r.By, Retire: r.Retire})
	if err != nil {
		return nodes.Node{}, err
	}
	deadline := ""
	if n.DrainDeadline != nil {
		deadline = n.DrainDeadline.UTC().Format(time.RFC3339Nano)
	}
	es := []outbox.Event{{TenantID: n.TenantID, Type: "node.draining", Resource: n.ID, Payload: map[string]any{
		"nodeId": n.ID, "poolId": n.PoolID, "deadline": deadline, "reason": n.DrainReason, "by": n.DrainBy, "retiring": n.Retiring,
	}}}
	rsvs, err := nodes.LiveReservationsOn(ctx, tx, n.ID)
	if err != nil {
		return nodes.Node{}, err
	}
	for _, rsv := range rsvs {
		es = append(es, outbox.Event{TenantID: rsv.TenantID, Type: "reservation.node_draining", Resource: rsv.ID, Payload: map[string]any{
			"reservationId": rsv.ID, "nodeId": n.ID, "deadline": deadline, "reason": n.DrainReason,
		}})
	}
	if err := outbox.WriteMany(ctx, tx, es); err != nil {
		return nodes.Node{}, err
	}
	if err := q.Enqueue(ctx, KindDrain, n.ID); err != nil {
		return nodes.Node{}, err
	}
	return n, nil
}

// Undrain returns draining or drained node id to service in tx
// ([nodes.Undrain]) and enqueues its pool's placer through q, so pending
// reservations that fit on it are placed now rather than at the next tick.
// It writes no event: the caller says why (the API's node.undrained).
func Undrain(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, id string) (nodes.Node, error) {
	n, err := nodes.Undrain(ctx, tx, id)
	if err != nil {
		return nodes.Node{}, err
	}
	if err := q.Enqueue(ctx, capstore.KindReservations, n.PoolID); err != nil {
		return nodes.Node{}, err
	}
	return n, nil
}
