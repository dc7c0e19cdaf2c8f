package api

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/lifecycle"
	nodestore "github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/remediations"
)

// maxRepairReason bounds nodes.clearRepair's reason.
const maxRepairReason = 1024

// DefaultMaxRepairClearsPerNode is health.maxRepairClearsPerNode's default:
// how many times nodes.clearRepair may clear one node in
// repairClearWindow.
const DefaultMaxRepairClearsPerNode = 3

// repairClearWindow is the clears' budget's window, the remediation
// budget's (7 days).
const repairClearWindow = 7 * 24 * time.Hour

// ClearRepair clears a node's latched NeedsRepair condition and resets its
// remediation budget, in the same transaction as its audit row and
// node.repair_cleared event. The budget is reset by marking the node's
// remediation rows cleared (remediations.cleared_at): they stay for the
// record until pruned, but the health job's per-node budget no longer
// counts them. A failed node goes back to adopting, and the inventory
// controller is enqueued for it so that its acceptance checks run again;
// the health job is enqueued too, so GPUs still quarantined start a fresh
// ladder.
//
// The clears have their own budget, which a clear never resets: at most
// health.maxRepairClearsPerNode clears of one node in 7 days (a row in
// repair_clears each); past it RATE_LIMITED names the node. Each clear
// restarts a ladder, each ladder takes an eviction token of the tenant, so
// without it a tenant could keep restarting ladders for ever.
func (s *nodes) ClearRepair(ctx context.Context, req *computev1.NodesServiceClearRepairRequest) (*computev1.NodesServiceClearRepairResponse, error) {
	if err := required("nodeId", req.GetNodeId()); err != nil {
		return nil, err
	}
	if len(req.GetReason()) > maxRepairReason {
		return nil, fault.New(fault.InvalidInput, "reason", "at most %d characters, got %d", maxRepairReason, len(req.GetReason()))
	}
	res, err := authz.Get(ctx, s.db, req.GetTenantId(), authz.TypeNode, req.GetNodeId(), "nodeId")
	if err != nil {
		return nil, err
	}
	out := &computev1.NodesServiceClearRepairResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			now := s.now()
			// The node's row is locked first (ClearRepair updates it), so
			// concurrent clears of one node count one after the other.
			c, err := nodestore.ClearRepair(ctx, tx, req.GetTenantId(), req.GetNodeId())
			if err != nil {
				return admission.Outcome{}, err
			}
			clears, err := remediations.ClearsSince(ctx, tx, req.GetNodeId(), now.Add(-repairClearWindow))
			if err != nil {
				return admission.Outcome{}, err
			}
			if clears >= s.maxRepairClears {
				return admission.Outcome{}, fault.New(fault.RateLimited, "nodeId",
					"node %s was cleared %d times in the last %s (health.maxRepairClearsPerNode is %d); it needs a repair, not another clear",
					req.GetNodeId(), clears, repairClearWindow, s.maxRepairClears)
			}
			if err := remediations.RecordClear(ctx, tx, req.GetTenantId(), req.GetNodeId(), now); err != nil {
				return admission.Outcome{}, err
			}
			cleared, err := remediations.Clear(ctx, tx, req.GetNodeId(), now)
			if err != nil {
				return admission.Outcome{}, err
			}
			if c.Readopt {
				if err := q.Enqueue(ctx, lifecycle.KindInventory, req.GetNodeId()); err != nil {
					return admission.Outcome{}, err
				}
			}
			if err := q.Enqueue(ctx, lifecycle.KindHealth, req.GetNodeId()); err != nil {
				return admission.Outcome{}, err
			}
			n, err := nodestore.Get(ctx, tx, req.GetTenantId(), req.GetNodeId())
			if err != nil {
				return admission.Outcome{}, err
			}
			o, err := outcome(&computev1.NodesServiceClearRepairResponse{Node: nodePB(n)}, "node.repair_cleared", nil)
			o.Detail = map[string]any{
				"reason": req.GetReason(), "wasLatched": c.WasLatched, "needsRepairReason": c.Reason,
				"readopted": c.Readopt, "clearedRemediations": cleared,
			}
			return o, err
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}
