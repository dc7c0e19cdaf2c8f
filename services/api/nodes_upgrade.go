package api

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// clearUpgradeTTL is how long nodes.clearUpgrade's command may wait for
// the node.
const clearUpgradeTTL = 24 * time.Hour

// ClearUpgrade clears a node's latched UpgradeFailed: it queues a signed
// agent.upgrade command with clear_upgrade_failed and no manifest
// (docs/agent-upgrades.md), in the same transaction as its audit row and
// command.requested event. The node clears the latch when it runs it; the
// agent section tries the next release manifest from its next converge.
func (s *nodes) ClearUpgrade(ctx context.Context, req *computev1.NodesServiceClearUpgradeRequest) (*computev1.NodesServiceClearUpgradeResponse, error) {
	if err := required("nodeId", req.GetNodeId()); err != nil {
		return nil, err
	}
	if len([]rune(req.GetReason())) > maxRepairReason {
		return nil, fault.New(fault.InvalidInput, "reason", "at most %d characters, got %d", maxRepairReason, len([]rune(req.GetReason())))
	}
	res, err := authz.Get(ctx, s.db, req.GetTenantId(), authz.TypeNode, req.GetNodeId(), "nodeId")
	if err != nil {
		return nil, err
	}
	p, _ := iam.PrincipalFrom(ctx)
	out := &computev1.NodesServiceClearUpgradeResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			c, _, err := s.kinds.Enqueue(ctx, tx, commands.Request{
				NodeID: req.GetNodeId(), Kind: commands.KindAgentUpgrade,
				Payload:  map[string]any{"clearUpgradeFailed": true, "reason": req.GetReason()},
				NotAfter: s.now().Add(clearUpgradeTTL), CreatedBy: p.IdentityID,
			})
			if err != nil {
				return admission.Outcome{}, err
			}
			pb, err := commandPB(c)
			if err != nil {
				return admission.Outcome{}, err
			}
			o, err := outcome(&computev1.NodesServiceClearUpgradeResponse{Command: pb}, "command.requested", nil)
			o.Detail = map[string]any{"commandId": c.ID, "kind": c.Kind, "reason": req.GetReason(), "clearUpgradeFailed": true}
			o.Event.Resource = c.ID
			q.WakeCommands(req.GetNodeId())
			return o, err
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}
