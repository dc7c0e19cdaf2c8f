package lifecycle_test

import (
	"fmt"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/rollouts"
	"github.com/bettercompute/bettercompute/services/lifecycle"
)

// TestPlanBatchesSpreadsFailureDomains: every batch takes its nodes from as
// many failure domains (gateway, rack, zone) as it can, the sizes are the
// strategy's (percent rounded up, the rest in a final batch), and every
// node is planned once.
func TestPlanBatchesSpreadsFailureDomains(t *testing.T) {
	var cands []rollouts.Candidate
	// 3 gateways × 2 racks, 4 nodes each: 24 nodes in 6 domains.
	for g := range 3 {
		for r := range 2 {
			for i := range 4 {
				cands = append(cands, rollouts.Candidate{ID: fmt.Sprintf("n-g%d-r%d-%d", g, r, i), Gateway: fmt.Sprintf("gw%d", g), Rack: fmt.Sprintf("r%d", r)})
			}
		}
	}
	plan := lifecycle.PlanBatches(cands, []rollouts.BatchSize{{Count: 1}, {Percent: 25}, {Percent: 25}})
	sizes := map[int]int{}
	domains := map[int]map[string]bool{}
	seen := map[string]bool{}
	byID := map[string]rollouts.Candidate{}
	for _, c := range cands {
		byID[c.ID] = c
	}
	for _, p := range plan {
		if seen[p.NodeID] {
			t.Fatalf("%s planned twice", p.NodeID)
		}
		seen[p.NodeID] = true
		sizes[p.Batch]++
		if domains[p.Batch] == nil {
			domains[p.Batch] = map[string]bool{}
		}
		c := byID[p.NodeID]
		domains[p.Batch][c.Gateway+"/"+c.Rack] = true
	}
	if len(seen) != len(cands) {
		t.Fatalf("planned %d of %d nodes", len(seen), len(cands))
	}
	// 1, then 25 % of 24 = 6, 6, and the remaining 11 in a final batch.
	if want := map[int]int{0: 1, 1: 6, 2: 6, 3: 11}; fmt.Sprint(sizes) != fmt.Sprint(want) {
		t.Fatalf("batch sizes %v, want %v", sizes, want)
	}
	for b, n := range sizes {
		if want := min(n, 6); len(domains[b]) != want {
			t.Errorf("batch %d of %d nodes spans %d failure domains, want %d", b, n, len(domains[b]), want)
		}
	}
	// A zone label spreads too: two zones, the first batch of two takes one of each.
	z := []rollouts.Candidate{{ID: "a1", Zone: "a"}, {ID: "a2", Zone: "a"}, {ID: "b1", Zone: "b"}, {ID: "b2", Zone: "b"}}
	p := lifecycle.PlanBatches(z, []rollouts.BatchSize{{Count: 2}})
	if p[0].Batch != 0 || p[1].Batch != 0 || p[0].NodeID[0] == p[1].NodeID[0] {
		t.Fatalf("zones not spread: %+v", p)
	}
}
