package rollouts_test

import (
	"slices"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/pools"
	"github.com/bettercompute/bettercompute/pkg/rollouts"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// TestStore: a rollout keeps the pool's previous sections, one is active
// per pool, transitions check the state, and only released nodes of a
// progressing or paused rollout have a layer.
func TestStore(t *testing.T) {
	t.Parallel()
	pool, err := db.Open(t.Context(), db.Config{URL: pgtest.NewDB(t), MaxConns: 4})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	ctx := t.Context()
	fixture.Pool(t, pool, fixture.PoolOpts{ID: "pool_a"})
	for _, id := range []string{"node_1", "node_2", "node_3"} {
		fixture.Node(t, pool, fixture.NodeOpts{ID: id, Pool: "pool_a", State: "adopted", Labels: map[string]string{"rack": "r-" + id}})
	}
	if _, err := pools.Apply(ctx, pool, fixture.DefaultTenant, "pool_a", pools.Update{Health: []byte(`{"maxGpuTemperatureCelsius": 80}`)}); err != nil {
		t.Fatal(err)
	}
	change := rollouts.Change{Mask: []string{"health"}, Health: []byte(`{"maxGpuTemperatureCelsius":90}`)}
	r, err := rollouts.Create(ctx, pool, rollouts.Rollout{ID: "rol_1", TenantID: fixture.DefaultTenant, PoolID: "pool_a", Change: change,
		Strategy: rollouts.Strategy{Batches: []rollouts.BatchSize{{Percent: 50}}, BakeMs: 1000}})
	if err != nil {
		t.Fatal(err)
	}
	if r.State != rollouts.Pending || r.Failure != (rollouts.Threshold{Count: 1}) || string(r.Previous.Health) != `{"maxGpuTemperatureCelsius": 80}` || r.Previous.Site != nil {
		t.Fatalf("created %+v (previous health %s)", r, r.Previous.Health)
	}
	_, err = rollouts.Create(ctx, pool, rollouts.Rollout{ID: "rol_2", TenantID: fixture.DefaultTenant, PoolID: "pool_a", Change: change})
	if fault.CodeOf(err) != fault.Conflict {
		t.Fatalf("second active rollout: %v", err)
	}
	if _, err := rollouts.Transition(ctx, pool, fixture.DefaultTenant, "rol_1", []string{rollouts.Paused}, rollouts.Progressing, ""); fault.CodeOf(err) != fault.Conflict {
		t.Fatalf("resume of a pending rollout: %v", err)
	}
	cands, err := rollouts.Candidates(ctx, pool, "pool_a", nil)
	if err != nil || len(cands) != 3 || cands[0].Rack != "r-node_1" {
		t.Fatalf("candidates %+v %v", cands, err)
	}
	if err := rollouts.Plan(ctx, pool, "rol_1", []rollouts.Planned{{NodeID: "node_1", Batch: 0}, {NodeID: "node_2", Batch: 1}, {NodeID: "node_3", Batch: 1}}); err != nil {
		t.Fatal(err)
	}
	if err := rollouts.SetNodes(ctx, pool, "rol_1", []string{"node_1"}, rollouts.NodeUpdating, ""); err != nil {
		t.Fatal(err)
	}
	all := []string{"node_1", "node_2", "node_3"}
	layers := func() []string {
		l, err := rollouts.Layers(ctx, pool, all)
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for id, c := range l {
			if !slices.Equal(c.Mask, []string{"health"}) {
				t.Fatalf("layer of %s: %+v", id, c)
			}
			ids = append(ids, id)
		}
		slices.Sort(ids)
		return ids
	}
	if got := layers(); len(got) != 0 {
		t.Fatalf("layers of a pending rollout: %v", got)
	}
	r.State = rollouts.Progressing
	if err := rollouts.Progress(ctx, pool, r); err != nil {
		t.Fatal(err)
	}
	if got := layers(); !slices.Equal(got, []string{"node_1"}) {
		t.Fatalf("layers while progressing: %v", got)
	}
	m, ok, err := rollouts.MembershipOf(ctx, pool, "node_2")
	if err != nil || !ok || m.Batch != 1 || m.Released || m.RolloutID != "rol_1" {
		t.Fatalf("membership of node_2: %+v %v %v", m, ok, err)
	}
	nodes, err := rollouts.Nodes(ctx, pool, r)
	if err != nil || len(nodes) != 3 || nodes[0].NodeID != "node_1" || nodes[0].State != rollouts.NodeUpdating || nodes[0].HasContent {
		t.Fatalf("nodes %+v %v", nodes, err)
	}
	if _, err := rollouts.Transition(ctx, pool, fixture.DefaultTenant, "rol_1", rollouts.Active, rollouts.Cancelled, "test"); err != nil {
		t.Fatal(err)
	}
	if got := layers(); len(got) != 0 {
		t.Fatalf("layers of a cancelled rollout: %v", got)
	}
	if touched, err := rollouts.Touched(ctx, pool, "rol_1"); err != nil || !slices.Equal(touched, []string{"node_1"}) {
		t.Fatalf("touched %v %v", touched, err)
	}
	if _, ok, err := rollouts.MembershipOf(ctx, pool, "node_2"); ok || err != nil {
		t.Fatalf("membership after cancel: %v %v", ok, err)
	}
}
