package api_test

import (
	"slices"
	"testing"
	"time"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/nodes"
)

// TestDriftedInNodesAndCapacity: a node's Drifted condition, as fleet.drift
// stores it, shows in nodes.get with each reason; nodes.list
// condition=Drifted lists exactly the drifted nodes (Drifted=False and
// !Drifted the others); capacity.get counts them per pool.
func TestDriftedInNodesAndCapacity(t *testing.T) {
	t.Parallel()
	f := newDrainFixture(t)
	ctx := as(f.acmeKey)
	since := time.Now().UTC().Truncate(time.Second)
	reasons := []string{"driver version 535.104.05 differs from the pool's baseline 550.54.15",
		"section devices reports drifted: /var/run/cdi/bettercompute.io-gpu.json was edited or removed by hand, restored"}
	if err := nodes.SetDrift(t.Context(), f.h.db, []nodes.DriftUpdate{
		{ID: f.ids[0], Drifted: nodes.Condition{Status: true, Reasons: reasons, Reason: reasons[0] + "; " + reasons[1], Since: since}},
		{ID: f.ids[1], Drifted: nodes.Condition{Since: since}},
	}); err != nil {
		t.Fatal(err)
	}
	got, err := f.nodes.Get(ctx, &computev1.NodesServiceGetRequest{TenantId: "acme", NodeId: f.ids[0]})
	if err != nil {
		t.Fatal(err)
	}
	c := condition(got.GetNode(), "Drifted")
	if c == nil || !c.GetStatus() || c.GetValue() != "True" || !slices.Equal(c.GetReasons(), reasons) ||
		c.GetReason() != reasons[0]+"; "+reasons[1] || !c.GetSince().AsTime().Equal(since) {
		t.Fatalf("Drifted of %s: %v", f.ids[0], c)
	}
	got, err = f.nodes.Get(ctx, &computev1.NodesServiceGetRequest{TenantId: "acme", NodeId: f.ids[1]})
	if err != nil {
		t.Fatal(err)
	}
	if c := condition(got.GetNode(), "Drifted"); c == nil || c.GetStatus() || c.GetValue() != "False" || len(c.GetReasons()) != 0 {
		t.Fatalf("Drifted of %s: %v", f.ids[1], c)
	}
	list := func(cond string) []string {
		t.Helper()
		resp, err := f.nodes.List(ctx, &computev1.NodesServiceListRequest{TenantId: "acme", Condition: cond})
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, n := range resp.GetNodes() {
			out = append(out, n.GetId())
		}
		return out
	}
	if got := list("Drifted"); !slices.Equal(got, f.ids[:1]) {
		t.Fatalf("condition=Drifted: %v, want %v", got, f.ids[:1])
	}
	if got := list("Drifted=False"); !slices.Equal(got, f.ids[1:2]) {
		t.Fatalf("condition=Drifted=False: %v, want %v", got, f.ids[1:2])
	}
	// The adopting node has no Drifted condition: it does not hold it.
	want := slices.Sorted(slices.Values(f.ids[1:]))
	if got := list("!Drifted"); !slices.Equal(got, want) {
		t.Fatalf("condition=!Drifted: %v, want %v", got, want)
	}
	caps, err := computev1.NewCapacityServiceClient(f.h.conn).Get(ctx, &computev1.CapacityServiceGetRequest{TenantId: "acme", PoolId: f.pool})
	if err != nil {
		t.Fatal(err)
	}
	if caps.GetDriftedNodes() != 1 {
		t.Fatalf("capacity.get drifted nodes %d, want 1", caps.GetDriftedNodes())
	}
}
