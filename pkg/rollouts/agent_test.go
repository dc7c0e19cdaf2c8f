package rollouts_test

import (
	"testing"

	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/pools"
	"github.com/bettercompute/bettercompute/pkg/rollouts"
)

// TestAgentChange: a rollout with mask agent keeps the pool's previous
// agent section and the manifest's version; a released node has the new
// content only once its spec holds the section, its agent section reports
// converged and its Hello reported the version; UpgradeFailed makes it
// unhealthy with the section's reason.
func TestAgentChange(t *testing.T) {
	t.Parallel()
	pool, err := db.Open(t.Context(), db.Config{URL: pgtest.NewDB(t), MaxConns: 4})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	ctx := t.Context()
	fixture.Pool(t, pool, fixture.PoolOpts{ID: "pool_a"})
	fixture.Node(t, pool, fixture.NodeOpts{ID: "node_1", Pool: "pool_a", State: "adopted", Gateway: "gw-1"})
	if _, err := pools.Apply(ctx, pool, fixture.DefaultTenant, "pool_a", pools.Update{Agent: []byte(`{"releaseManifest": "b2xk"}`)}); err != nil {
		t.Fatal(err)
	}
	change := rollouts.Change{Mask: []string{"agent"}, Agent: []byte(`{"releaseManifest":"bmV3"}`), AgentVersion: "v0.2.0"}
	r, err := rollouts.Create(ctx, pool, rollouts.Rollout{ID: "rol_1", TenantID: fixture.DefaultTenant, PoolID: "pool_a", Change: change,
		Strategy: rollouts.Strategy{Batches: []rollouts.BatchSize{{Percent: 100}}}})
	if err != nil {
		t.Fatal(err)
	}
	if string(r.Previous.Agent) != `{"releaseManifest": "b2xk"}` || r.Change.AgentVersion != "v0.2.0" || string(r.Change.Section("agent")) != `{"releaseManifest": "bmV3"}` {
		t.Fatalf("created: previous %s, change %+v", r.Previous.Agent, r.Change)
	}
	if err := rollouts.Plan(ctx, pool, "rol_1", []rollouts.Planned{{NodeID: "node_1", Batch: 0}}); err != nil {
		t.Fatal(err)
	}
	if err := rollouts.SetNodes(ctx, pool, "rol_1", []string{"node_1"}, rollouts.NodeUpdating, ""); err != nil {
		t.Fatal(err)
	}
	status := func() rollouts.NodeStatus {
		t.Helper()
		ns, err := rollouts.Nodes(ctx, pool, r)
		if err != nil || len(ns) != 1 {
			t.Fatalf("nodes %+v %v", ns, err)
		}
		return ns[0]
	}
	// report opens a session of version and reports the agent section.
	report := func(version, state, reason string) {
		t.Helper()
		s, err := nodes.OpenSession(ctx, pool, "node_1", "gw-1", "boot-1", "journal-1", version)
		if err != nil {
			t.Fatal(err)
		}
		st := `[{"section": "agent", "state": "` + state + `", "reason": "` + reason + `", "generation": 1}]`
		if _, err := nodes.RecordObserved(ctx, pool, []nodes.Observation{{NodeID: "node_1", Epoch: s.Epoch, Generation: 1, SectionStatus: []byte(st)}}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := nodes.StoreSpecs(ctx, pool, []nodes.SpecWrite{{ID: "node_1", Spec: []byte(`{"agent": {"releaseManifest": "bmV3"}}`)}}); err != nil {
		t.Fatal(err)
	}
	report("v0.1.0", nodes.SectionConverged, "running bcd v0.1.0")
	if s := status(); s.HasContent {
		t.Fatalf("the old version counts as the new content: %+v", s)
	}
	report("v0.2.0", "SECTION_STATE_FAILED", "staged, handing over")
	if s := status(); s.HasContent {
		t.Fatalf("an agent section not converged counts as the new content: %+v", s)
	}
	report("v0.2.0", nodes.SectionConverged, "running bcd v0.2.0")
	if s := status(); !s.HasContent {
		t.Fatalf("converged on v0.2.0: %+v", s)
	}
	report("v0.1.0", nodes.SectionFailedTerminal, "UpgradeFailed: bcd v0.2.0 did not report")
	if s := status(); s.HasContent || s.Unhealthy != "UpgradeFailed: bcd v0.2.0 did not report" {
		t.Fatalf("UpgradeFailed: %+v", s)
	}
}

// TestNodesSeeSectionStates: a node whose other section is not converged
// has not the new content yet, and one whose section failed is unhealthy,
// naming the section (section_status is an array of proto enum names).
func TestNodesSeeSectionStates(t *testing.T) {
	t.Parallel()
	pool, err := db.Open(t.Context(), db.Config{URL: pgtest.NewDB(t), MaxConns: 4})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	ctx := t.Context()
	fixture.Pool(t, pool, fixture.PoolOpts{ID: "pool_a"})
	fixture.Node(t, pool, fixture.NodeOpts{ID: "node_1", Pool: "pool_a", State: "adopted", Gateway: "gw-1"})
	change := rollouts.Change{Mask: []string{"site"}, Site: []byte(`{"logLevel":"debug"}`)}
	r, err := rollouts.Create(ctx, pool, rollouts.Rollout{ID: "rol_1", TenantID: fixture.DefaultTenant, PoolID: "pool_a", Change: change,
		Strategy: rollouts.Strategy{Batches: []rollouts.BatchSize{{Percent: 100}}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := rollouts.Plan(ctx, pool, "rol_1", []rollouts.Planned{{NodeID: "node_1", Batch: 0}}); err != nil {
		t.Fatal(err)
	}
	if _, err := nodes.StoreSpecs(ctx, pool, []nodes.SpecWrite{{ID: "node_1", Spec: []byte(`{"site": {"logLevel": "debug"}}`)}}); err != nil {
		t.Fatal(err)
	}
	s, err := nodes.OpenSession(ctx, pool, "node_1", "gw-1", "boot-1", "journal-1", "v0.1.0")
	if err != nil {
		t.Fatal(err)
	}
	status := func(sections string) rollouts.NodeStatus {
		t.Helper()
		n, err := nodes.Lookup(ctx, pool, "node_1")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := nodes.RecordObserved(ctx, pool, []nodes.Observation{{NodeID: "node_1", Epoch: s.Epoch, Generation: n.Generation, SectionStatus: []byte(sections)}}); err != nil {
			t.Fatal(err)
		}
		ns, err := rollouts.Nodes(ctx, pool, r)
		if err != nil || len(ns) != 1 {
			t.Fatalf("nodes %+v %v", ns, err)
		}
		return ns[0]
	}
	if st := status(`[{"section": "site", "state": "SECTION_STATE_CONVERGED"}, {"section": "devices", "state": "SECTION_STATE_CONVERGED"}]`); !st.HasContent || st.Unhealthy != "" {
		t.Fatalf("every section converged: %+v", st)
	}
	if st := status(`[{"section": "site", "state": "SECTION_STATE_CONVERGED"}, {"section": "devices", "state": "SECTION_STATE_PROGRESSING"}]`); st.HasContent {
		t.Fatalf("a section still progressing counts as the new content: %+v", st)
	}
	st := status(`[{"section": "site", "state": "SECTION_STATE_CONVERGED"}, {"section": "devices", "state": "SECTION_STATE_FAILED", "reason": "GPUs not in this node's inventory"}]`)
	if st.HasContent || st.Unhealthy != "a section failed: devices GPUs not in this node's inventory" {
		t.Fatalf("a failed section: %+v", st)
	}
}
