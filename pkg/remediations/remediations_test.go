package remediations_test

import (
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/remediations"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// TestLadderCountsAndPrune: the budget counts a node's gpu.reset steps in
// the window that are not cleared; the pool counts running steps; Prune
// removes finished rows older than its cutoff only.
func TestLadderCountsAndPrune(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := t.Context()
	fixture.Pool(t, db, fixture.PoolOpts{ID: "pool_a"})
	for _, id := range []string{"node_1", "node_2"} {
		fixture.Node(t, db, fixture.NodeOpts{ID: id, Pool: "pool_a"})
	}
	now := time.Now()
	start := func(node, step, state string, at time.Time) remediations.Remediation {
		m, err := remediations.Start(ctx, db, remediations.Remediation{TenantID: "root", NodeID: node, PoolID: "pool_a", Step: step, State: state, Devices: []string{"GPU-0"}}, at)
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	old := start("node_1", remediations.StepGPUReset, remediations.Failed, now.Add(-40*24*time.Hour))
	start("node_1", remediations.StepGPUReset, remediations.Succeeded, now.Add(-2*24*time.Hour))
	run := start("node_1", remediations.StepGPUReset, "", now)
	start("node_1", remediations.StepNodeReboot, remediations.Failed, now)
	if n, err := remediations.LaddersSince(ctx, db, "node_1", now.Add(-7*24*time.Hour)); err != nil || n != 2 {
		t.Fatalf("ladders in 7 days %d %v", n, err)
	}
	if m, ok, err := remediations.RunningOn(ctx, db, "node_1"); err != nil || !ok || m.ID != run.ID {
		t.Fatalf("running %+v %v %v", m, ok, err)
	}
	if n, _ := remediations.RunningInPool(ctx, db, "pool_a", "node_2"); n != 1 {
		t.Fatalf("running in pool %d", n)
	}
	if n, _ := remediations.RunningInPool(ctx, db, "pool_a", "node_1"); n != 0 {
		t.Fatalf("running in pool but node_1 %d", n)
	}
	if ok, err := remediations.Finish(ctx, db, run.ID, remediations.Succeeded, "ok", now); err != nil || !ok {
		t.Fatalf("finish %v %v", ok, err)
	}
	if ok, _ := remediations.Finish(ctx, db, run.ID, remediations.Failed, "again", now); ok {
		t.Fatal("finished twice")
	}
	if n, err := remediations.Clear(ctx, db, "node_1", now); err != nil || n != 4 {
		t.Fatalf("cleared %d %v", n, err)
	}
	if n, _ := remediations.LaddersSince(ctx, db, "node_1", now.Add(-7*24*time.Hour)); n != 0 {
		t.Fatalf("cleared ladders still count: %d", n)
	}
	if n, err := remediations.Prune(ctx, db, now.Add(-remediations.Retention), 100); err != nil || n != 1 {
		t.Fatalf("pruned %d %v", n, err)
	}
	ms, _ := remediations.OfNode(ctx, db, "node_1")
	for _, m := range ms {
		if m.ID == old.ID {
			t.Fatal("the old row was not pruned")
		}
	}
	if len(ms) != 3 {
		t.Fatalf("%d rows left", len(ms))
	}
}
