package api_test

import (
	"context"
	"strings"
	"testing"
	"time"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	nodestore "github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/remediations"
)

func TestClearRepairBadInput(t *testing.T) {
	t.Parallel()
	f := newDrainFixture(t)
	id := f.ids[0]
	for _, tc := range []struct {
		name  string
		ctx   context.Context
		req   *computev1.NodesServiceClearRepairRequest
		code  fault.Code
		field string
	}{
		{"without a node", as(f.acmeKey), &computev1.NodesServiceClearRepairRequest{TenantId: "acme"}, fault.InvalidInput, "nodeId"},
		{"a long reason", as(f.acmeKey), &computev1.NodesServiceClearRepairRequest{TenantId: "acme", NodeId: id, Reason: strings.Repeat("x", 1025)}, fault.InvalidInput, "reason"},
		{"an unknown node", as(f.acmeKey), &computev1.NodesServiceClearRepairRequest{TenantId: "acme", NodeId: "node_nope"}, fault.NotFound, "nodeId"},
		{"another tenant's node", as(f.otherKey), &computev1.NodesServiceClearRepairRequest{TenantId: "acme", NodeId: id}, fault.AccessDenied, "tenantId"},
		{"another tenant's node as one's own", as(f.otherKey), &computev1.NodesServiceClearRepairRequest{TenantId: "other", NodeId: id}, fault.NotFound, "nodeId"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := f.nodes.ClearRepair(tc.ctx, tc.req)
			wantCode(t, err, tc.code, tc.field)
		})
	}
}

// TestClearRepair: a failed node with NeedsRepair latched and a spent
// budget → clearRepair clears the latch, marks its remediation rows
// cleared (the budget counts none), sends it back to adopting with the
// inventory controller enqueued, with an audit row and node.repair_cleared.
func TestClearRepair(t *testing.T) {
	t.Parallel()
	f := newDrainFixture(t)
	id := f.ids[0]
	ctx := context.Background()
	db := f.h.db
	for range 2 {
		if _, err := remediations.Start(ctx, db, remediations.Remediation{TenantID: "acme", NodeID: id, PoolID: f.pool, Step: remediations.StepGPUReset, State: remediations.Failed}, time.Now()); err != nil {
			t.Fatal(err)
		}
	}
	if ok, err := nodestore.LatchNeedsRepair(ctx, db, id, "remediation gave up", true, time.Now()); err != nil || !ok {
		t.Fatalf("latch %v %v", ok, err)
	}
	if f.state(t, id) != nodestore.StateFailed {
		t.Fatalf("state %s", f.state(t, id))
	}
	resp, err := f.nodes.ClearRepair(as(f.acmeKey), &computev1.NodesServiceClearRepairRequest{TenantId: "acme", NodeId: id, Reason: "replaced the GPU"})
	if err != nil {
		t.Fatal(err)
	}
	if resp.GetNode().GetState() != nodestore.StateAdopting {
		t.Fatalf("response node %v", resp.GetNode())
	}
	n, err := nodestore.Lookup(ctx, db, id)
	if err != nil || n.NeedsRepair || n.NeedsRepairReason != "" || n.NeedsRepairSince != nil || n.State != nodestore.StateAdopting {
		t.Fatalf("after clearRepair: %+v %v", n, err)
	}
	if left, err := remediations.LaddersSince(ctx, db, id, time.Now().Add(-time.Hour)); err != nil || left != 0 {
		t.Fatalf("ladders still counted: %d %v", left, err)
	}
	var queued, audits, events int
	_ = db.QueryRow(ctx, `SELECT count(*) FROM work_queue WHERE kind = 'inventory' AND key = $1`, id).Scan(&queued)
	_ = db.QueryRow(ctx, `SELECT count(*) FROM audit WHERE action = 'compute:nodes:repair' AND resource LIKE '%'||$1||'%' AND detail->>'reason' = 'replaced the GPU'`, id).Scan(&audits)
	_ = db.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE type = 'node.repair_cleared' AND resource_id = $1`, id).Scan(&events)
	if queued != 1 || audits != 1 || events != 1 {
		t.Fatalf("inventory queued %d, audit rows %d, events %d", queued, audits, events)
	}
}

// TestClearRepairCannotResetBudget: a tenant restarting its nodes'
// remediation ladders with nodes.clearRepair (each ladder takes an
// eviction token) gets health.maxRepairClearsPerNode (3) clears of a node
// in 7 days; the fourth is RATE_LIMITED naming the node, and clearing
// resets the ladders' budget but never its own. Another node still clears.
func TestClearRepairCannotResetBudget(t *testing.T) {
	t.Parallel()
	f := newDrainFixture(t)
	id := f.ids[0]
	ctx := context.Background()
	db := f.h.db
	clearOnce := func(node string) error {
		if _, err := remediations.Start(ctx, db, remediations.Remediation{TenantID: "acme", NodeID: node, PoolID: f.pool, Step: remediations.StepGPUReset, State: remediations.Failed}, time.Now()); err != nil {
			t.Fatal(err)
		}
		if _, err := nodestore.LatchNeedsRepair(ctx, db, node, "remediation gave up", true, time.Now()); err != nil {
			t.Fatal(err)
		}
		_, err := f.nodes.ClearRepair(as(f.acmeKey), &computev1.NodesServiceClearRepairRequest{TenantId: "acme", NodeId: node, Reason: "again"})
		return err
	}
	for i := range 3 {
		if err := clearOnce(id); err != nil {
			t.Fatalf("clear %d: %v", i+1, err)
		}
	}
	err := clearOnce(id)
	wantCode(t, err, fault.RateLimited, "nodeId")
	if !strings.Contains(err.Error(), id) || !strings.Contains(err.Error(), "health.maxRepairClearsPerNode") {
		t.Fatalf("the refusal names neither the node nor the setting: %v", err)
	}
	// The refused clear changed nothing: the node is still latched.
	if n, err := nodestore.Lookup(ctx, db, id); err != nil || !n.NeedsRepair {
		t.Fatalf("after a refused clear: %+v %v", n, err)
	}
	if err := clearOnce(f.ids[1]); err != nil {
		t.Fatalf("another node: %v", err)
	}
}
