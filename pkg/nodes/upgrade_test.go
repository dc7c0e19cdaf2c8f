package nodes_test

import (
	"testing"

	"github.com/bettercompute/bettercompute/pkg/nodes"
)

// TestUpgradeFailedFollowsTheAgentSection: a report whose agent section is
// FAILED_TERMINAL "UpgradeFailed: …" sets the node's UpgradeFailed
// condition (once: NewUpgradeFailed, and its since stays), nodes.list
// condition=UpgradeFailed finds it, another terminal reason or another
// section does not set it, and the first report without it clears it.
// OpenSession records the Hello's version.
func TestUpgradeFailedFollowsTheAgentSection(t *testing.T) {
	t.Parallel()
	db := setup(t, "node_a", "node_b")
	ctx := t.Context()
	if n := lookup(t, db, "node_a"); n.AgentVersion != "v0.1.0" || n.UpgradeFailed != "" || n.UpgradeFailedSince != nil {
		t.Fatalf("after the session: %+v", n)
	}
	report := func(id, status string) nodes.Observed {
		t.Helper()
		n := lookup(t, db, id)
		out, err := nodes.RecordObserved(ctx, db, []nodes.Observation{{NodeID: id, Epoch: n.SessionEpoch, SectionStatus: []byte(status)}})
		if err != nil || !out[0].Stored {
			t.Fatalf("report %+v %v", out, err)
		}
		return out[0]
	}
	listed := func(cond string) []string {
		t.Helper()
		ns, err := nodes.List(ctx, db, nodes.Filter{TenantID: "acme", Condition: cond}, "", 10)
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, n := range ns {
			ids = append(ids, n.ID)
		}
		return ids
	}
	const failed = `[{"section": "site", "state": "SECTION_STATE_CONVERGED"},
		{"section": "agent", "state": "SECTION_STATE_FAILED_TERMINAL", "reason": "UpgradeFailed: bcd v0.2.0 (counter 2): the new build exited"}]`
	o := report("node_a", failed)
	if o.UpgradeFailed != "UpgradeFailed: bcd v0.2.0 (counter 2): the new build exited" || !o.NewUpgradeFailed {
		t.Fatalf("first failed report: %+v", o)
	}
	since := lookup(t, db, "node_a").UpgradeFailedSince
	if since == nil {
		t.Fatal("no since")
	}
	if o := report("node_a", failed); o.UpgradeFailed == "" || o.NewUpgradeFailed {
		t.Fatalf("second failed report: %+v", o)
	}
	if n := lookup(t, db, "node_a"); n.UpgradeFailedSince == nil || !n.UpgradeFailedSince.Equal(*since) {
		t.Fatalf("since moved: %v, was %v", n.UpgradeFailedSince, since)
	}
	// Not an upgrade failure: another terminal reason, or another section.
	report("node_b", `[{"section": "agent", "state": "SECTION_STATE_FAILED_TERMINAL", "reason": "upgrade to bcd v0.2.0 (counter 1) refused: expired"},
		{"section": "site", "state": "SECTION_STATE_FAILED_TERMINAL", "reason": "UpgradeFailed: not the agent"}]`)
	if got := listed("UpgradeFailed"); len(got) != 1 || got[0] != "node_a" {
		t.Fatalf("condition=UpgradeFailed: %v", got)
	}
	if got := listed("!UpgradeFailed"); len(got) != 1 || got[0] != "node_b" {
		t.Fatalf("condition=!UpgradeFailed: %v", got)
	}
	// The latch cleared (nodes.clearUpgrade), the section converges.
	if o := report("node_a", `[{"section": "agent", "state": "SECTION_STATE_CONVERGED", "reason": "running bcd v0.1.0"}]`); o.UpgradeFailed != "" || o.NewUpgradeFailed {
		t.Fatalf("report without it: %+v", o)
	}
	if n := lookup(t, db, "node_a"); n.UpgradeFailed != "" || n.UpgradeFailedSince != nil {
		t.Fatalf("after the clear: %+v", n)
	}
	if got := listed("UpgradeFailed=True"); len(got) != 0 {
		t.Fatalf("condition=UpgradeFailed after the clear: %v", got)
	}
}
