package api_test

import (
	"context"
	"strings"
	"testing"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// TestClearUpgrade: nodes.clearUpgrade queues an agent.upgrade that
// only clears the latch (no manifest), with an audit row under
// compute:nodes:repair and a command.requested event; bad input and
// another tenant's node are refused with their codes and fields.
func TestClearUpgrade(t *testing.T) {
	t.Parallel()
	f := newDrainFixture(t)
	id := f.ids[0]
	for _, tc := range []struct {
		name  string
		ctx   context.Context
		req   *computev1.NodesServiceClearUpgradeRequest
		code  fault.Code
		field string
	}{
		{"without a node", as(f.acmeKey), &computev1.NodesServiceClearUpgradeRequest{TenantId: "acme"}, fault.InvalidInput, "nodeId"},
		{"a long reason", as(f.acmeKey), &computev1.NodesServiceClearUpgradeRequest{TenantId: "acme", NodeId: id, Reason: strings.Repeat("x", 1025)}, fault.InvalidInput, "reason"},
		{"an unknown node", as(f.acmeKey), &computev1.NodesServiceClearUpgradeRequest{TenantId: "acme", NodeId: "node_nope"}, fault.NotFound, "nodeId"},
		{"another tenant's node", as(f.otherKey), &computev1.NodesServiceClearUpgradeRequest{TenantId: "acme", NodeId: id}, fault.AccessDenied, "tenantId"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := f.nodes.ClearUpgrade(tc.ctx, tc.req)
			wantCode(t, err, tc.code, tc.field)
		})
	}
	resp, err := f.nodes.ClearUpgrade(as(f.acmeKey), &computev1.NodesServiceClearUpgradeRequest{TenantId: "acme", NodeId: id, Reason: "fixed build published"})
	if err != nil {
		t.Fatal(err)
	}
	c := resp.GetCommand()
	if c.GetKind() != "agent.upgrade" || c.GetNodeId() != id || c.GetPayload().GetFields()["clearUpgradeFailed"].GetBoolValue() != true {
		t.Fatalf("command %v", c)
	}
	ctx, db := context.Background(), f.h.db
	// (This harness's registry does not sign; the app's signs every
	// destructive kind it admits.)
	var queued, audits, events int
	_ = db.QueryRow(ctx, `SELECT count(*) FROM commands WHERE id = $1 AND kind = 'agent.upgrade' AND node_id = $2`, c.GetId(), id).Scan(&queued)
	_ = db.QueryRow(ctx, `SELECT count(*) FROM audit WHERE action = 'compute:nodes:repair' AND detail->>'reason' = 'fixed build published' AND detail->>'commandId' = $1`, c.GetId()).Scan(&audits)
	_ = db.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE type = 'command.requested' AND resource_id = $1`, c.GetId()).Scan(&events)
	if queued != 1 || audits != 1 || events != 1 {
		t.Fatalf("commands %d, audit rows %d, events %d", queued, audits, events)
	}
}
