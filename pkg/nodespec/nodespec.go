// Package nodespec is a node's desired state (bettercompute.agent.v1.NodeSpec)
// for the code that shapes it:
//
//   - [Invalidate] enqueues the nodespec controller for a node in the
//     caller's transaction, so the change and the work it implies commit
//     together;
//   - modules contribute their parts with [Registry.Register], and
//     [Registry.Compute] merges them in registration order. Every section
//     but site is replaced whole by a later part that sets it; site is
//     merged field by field, and two modules setting the same site field to
//     different values is a [ConflictError].
//
// The controller that computes and stores every adopted node's spec lives in
// services/nodespec.
package nodespec

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
)

// Kind is the nodespec controller's kind in the work queue; its keys are
// node ids.
const Kind = "nodespec"

// Change is one node's committed generation change, as the nodespec
// controller hands it to the gateways after each commit.
type Change struct {
	NodeID     string
	Generation int64
	// GatewayID is the gateway that held the node's session when its spec
	// was stored ("" when none ever did).
	GatewayID string
}

// Invalidate says node nodeID's desired state may have changed: it enqueues
// (nodespec, nodeID) in q's transaction, poked after commit. Nothing is
// recomputed or pushed yet; the controller recomputes the spec and bumps the
// generation only if it changed, so invalidating too often is harmless.
func Invalidate(ctx context.Context, q *reconcile.Queue, nodeID string) error {
	if err := q.Enqueue(ctx, Kind, nodeID); err != nil {
		return fmt.Errorf("invalidate spec of %s: %w", nodeID, err)
	}
	return nil
}

// InvalidatePool invalidates every node of pool that has desired state (is
// past adopting) in q's transaction, in one statement per thousand nodes,
// poked after commit.
func InvalidatePool(ctx context.Context, tx workqueue.Querier, q *reconcile.Queue, poolID string) error {
	rows, err := tx.Query(ctx, `SELECT id FROM nodes WHERE pool_id = $1 AND state <> 'adopting'`, poolID)
	if err != nil {
		return fmt.Errorf("invalidate pool %s: %w", poolID, err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("invalidate pool %s: %w", poolID, err)
	}
	items := make([]workqueue.Item, len(ids))
	for i, id := range ids {
		items[i] = workqueue.Item{Kind: Kind, Key: id}
	}
	if err := q.EnqueueMany(ctx, items); err != nil {
		return fmt.Errorf("invalidate pool %s: %w", poolID, err)
	}
	return nil
}
