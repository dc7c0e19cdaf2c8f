package rollouts_test

import (
	"slices"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/miglayouts"
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
		for id, cs := range l {
			if len(cs) != 1 || !slices.Equal(cs[0].Mask, []string{"health"}) {
				t.Fatalf("layers of %s: %+v", id, cs)
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
	// Within one desired-state computation the answer is read once: a
	// memoized context answers a second call for the same nodes from the
	// first, even after the table changed (a fresh context reads it).
	memo := rollouts.WithLayersMemo(ctx)
	if l, err := rollouts.Layers(memo, pool, all); err != nil || len(l["node_1"]) != 1 {
		t.Fatalf("memoized layers %+v %v", l, err)
	}
	if err := rollouts.SetNodes(ctx, pool, "rol_1", []string{"node_1"}, rollouts.NodeWaiting, ""); err != nil {
		t.Fatal(err)
	}
	if l, err := rollouts.Layers(memo, pool, all); err != nil || len(l["node_1"]) != 1 {
		t.Fatalf("second memoized call %+v %v, want the first answer", l, err)
	}
	if got := layers(); len(got) != 0 {
		t.Fatalf("a fresh context still sees node_1's layer after it went back to waiting: %v", got)
	}
	if err := rollouts.SetNodes(ctx, pool, "rol_1", []string{"node_1"}, rollouts.NodeUpdating, ""); err != nil {
		t.Fatal(err)
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

// TestSelectorLayersStay: a succeeded rollout with a selector stays the
// layer of every node it planned (skipped ones included) and of no other,
// the latest rollout wins per section, a later pool-wide rollout that
// succeeded supersedes the sections it names, and rolling it back (or the
// selector's) takes its layer away.
func TestSelectorLayersStay(t *testing.T) {
	t.Parallel()
	pool, err := db.Open(t.Context(), db.Config{URL: pgtest.NewDB(t), MaxConns: 4})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	ctx := t.Context()
	fixture.Pool(t, pool, fixture.PoolOpts{ID: "pool_s"})
	for _, id := range []string{"node_1", "node_2", "node_3"} {
		labels := map[string]string{}
		if id != "node_3" {
			labels["tier"] = "canary"
		}
		fixture.Node(t, pool, fixture.NodeOpts{ID: id, Pool: "pool_s", State: "adopted", Labels: labels})
	}
	all := []string{"node_1", "node_2", "node_3"}
	// run makes rollout id of change with selector, plans nodes (the
	// first released, the rest skipped) and moves it to state.
	run := func(id string, selector map[string]string, change rollouts.Change, state string) rollouts.Rollout {
		t.Helper()
		r, err := rollouts.Create(ctx, pool, rollouts.Rollout{ID: id, TenantID: fixture.DefaultTenant, PoolID: "pool_s",
			Selector: selector, Change: change, Strategy: rollouts.Strategy{Batches: []rollouts.BatchSize{{Count: 1}}}})
		if err != nil {
			t.Fatal(err)
		}
		cands, err := rollouts.Candidates(ctx, pool, "pool_s", selector)
		if err != nil {
			t.Fatal(err)
		}
		var plan []rollouts.Planned
		for i, c := range cands {
			plan = append(plan, rollouts.Planned{NodeID: c.ID, Batch: i})
		}
		if err := rollouts.Plan(ctx, pool, id, plan); err != nil {
			t.Fatal(err)
		}
		if err := rollouts.SetNodes(ctx, pool, id, []string{cands[0].ID}, rollouts.NodeHealthy, ""); err != nil {
			t.Fatal(err)
		}
		if len(cands) > 1 {
			if err := rollouts.SetNodes(ctx, pool, id, []string{cands[1].ID}, rollouts.NodeSkipped, "Ready is Unknown"); err != nil {
				t.Fatal(err)
			}
		}
		r.State = state
		if err := rollouts.Progress(ctx, pool, r); err != nil {
			t.Fatal(err)
		}
		return r
	}
	// layers is each node's layers as "rollout:section" of their health.
	layers := func() map[string][]string {
		t.Helper()
		l, err := rollouts.Layers(ctx, pool, all)
		if err != nil {
			t.Fatal(err)
		}
		out := map[string][]string{}
		for id, cs := range l {
			for _, c := range cs {
				out[id] = append(out[id], strings.ReplaceAll(string(c.Health)+string(c.Site), " ", ""))
			}
		}
		return out
	}
	canary := map[string]string{"tier": "canary"}
	h90 := rollouts.Change{Mask: []string{"health"}, Health: []byte(`{"maxGpuTemperatureCelsius":90}`)}
	run("rol_a", canary, h90, rollouts.Succeeded)
	got := layers()
	if len(got) != 2 || len(got["node_1"]) != 1 || len(got["node_2"]) != 1 || got["node_3"] != nil {
		t.Fatalf("layers after a selector rollout succeeded: %v", got)
	}
	// A second selector rollout of health and site: both layers, the
	// latest last.
	h85 := rollouts.Change{Mask: []string{"health", "site"}, Health: []byte(`{"maxGpuTemperatureCelsius":85}`), Site: []byte(`{"logLevel":"debug"}`)}
	run("rol_b", canary, h85, rollouts.Succeeded)
	if got := layers(); len(got["node_1"]) != 2 || got["node_1"][1] != string(h85.Health)+string(h85.Site) {
		t.Fatalf("layers after a second selector rollout: %v", got)
	}
	// A pool-wide rollout of health succeeded: the selector rollouts'
	// health sections are superseded; rol_b's site stays.
	run("rol_c", nil, rollouts.Change{Mask: []string{"health"}, Health: []byte(`{}`)}, rollouts.Succeeded)
	got = layers()
	if len(got["node_1"]) != 1 || got["node_1"][0] != string(h85.Site) || got["node_3"] != nil {
		t.Fatalf("layers after a pool-wide rollout: %v", got)
	}
	if _, err := rollouts.Transition(ctx, pool, fixture.DefaultTenant, "rol_c", []string{rollouts.Succeeded}, rollouts.RolledBack, "test"); err != nil {
		t.Fatal(err)
	}
	if got := layers(); len(got["node_1"]) != 2 {
		t.Fatalf("layers after the pool-wide rollout was rolled back: %v", got)
	}
	if _, err := rollouts.Transition(ctx, pool, fixture.DefaultTenant, "rol_b", []string{rollouts.Succeeded}, rollouts.RolledBack, "test"); err != nil {
		t.Fatal(err)
	}
	if got := layers(); len(got["node_1"]) != 1 || got["node_1"][0] != string(h90.Health) {
		t.Fatalf("layers after the second selector rollout was rolled back: %v", got)
	}
	if planned, err := rollouts.PlanOf(ctx, pool, "rol_a"); err != nil || !slices.Equal(planned, []string{"node_1", "node_2"}) {
		t.Fatalf("plan of rol_a: %v %v", planned, err)
	}
}

// TestChangeWithout: the dropped sections leave the mask and the content,
// the others stay whole.
func TestChangeWithout(t *testing.T) {
	c := rollouts.Change{Mask: []string{"health", "mig"}, Health: []byte(`{"maxGpuTemperatureCelsius":90}`),
		Mig: &rollouts.Mig{Layouts: []miglayouts.Layout{{Name: "halves", Profiles: []string{"3g.71gb", "3g.71gb"}}}}}
	got := c.Without([]string{"mig", "site"})
	if !slices.Equal(got.Mask, []string{"health"}) || got.Mig != nil || string(got.Health) != string(c.Health) {
		t.Fatalf("without mig: %+v", got)
	}
	got = c.Without([]string{"health"})
	if !slices.Equal(got.Mask, []string{"mig"}) || got.Health != nil || got.Mig == nil || got.Mig.Layouts[0].Name != "halves" {
		t.Fatalf("without health: %+v", got)
	}
	if got := c.Without(nil); !slices.Equal(got.Mask, c.Mask) || got.Mig != c.Mig {
		t.Fatalf("without nothing: %+v", got)
	}
}
