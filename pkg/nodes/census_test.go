package nodes_test

import (
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/nodes"
)

func TestCountByStateAndCondition(t *testing.T) {
	db := setup(t, "node_1", "node_2", "node_3")
	if _, err := db.Exec(t.Context(), `UPDATE nodes SET state = 'adopted' WHERE id IN ('node_1', 'node_2')`); err != nil {
		t.Fatal(err)
	}
	seenAgo(t, db, "node_2", time.Hour)
	if _, err := nodes.UpdateReadiness(t.Context(), db, nodes.Readiness{NotReadyAfter: time.Minute, LostAfter: 2 * time.Hour}); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(t.Context(), `UPDATE nodes SET conditions = '[{"type":"GPUHealthy","status":false,"reason":"xid 79"},{"type":"Inventoried","status":true}]' WHERE id = 'node_1'`); err != nil {
		t.Fatal(err)
	}
	got, err := nodes.CountByState(t.Context(), db)
	if err != nil {
		t.Fatal(err)
	}
	want := map[nodes.Census]bool{
		{PoolID: "pool_a", State: "adopted", Ready: "True", Nodes: 1}:    true,
		{PoolID: "pool_a", State: "adopted", Ready: "Unknown", Nodes: 1}: true,
		{PoolID: "pool_a", State: "adopting", Ready: "True", Nodes: 1}:   true,
	}
	if len(got) != len(want) {
		t.Fatalf("census %+v, want %v", got, want)
	}
	for _, c := range got {
		if !want[c] {
			t.Errorf("unexpected %+v (want %v)", c, want)
		}
	}
	conds, err := nodes.CountByCondition(t.Context(), db)
	if err != nil {
		t.Fatal(err)
	}
	if len(conds) != 2 || conds[0] != (nodes.ConditionCensus{PoolID: "pool_a", Type: "GPUHealthy", Status: false, Nodes: 1}) ||
		conds[1] != (nodes.ConditionCensus{PoolID: "pool_a", Type: "Inventoried", Status: true, Nodes: 1}) {
		t.Fatalf("conditions %+v", conds)
	}
	// Retired nodes leave the condition counts.
	if _, err := db.Exec(t.Context(), `UPDATE nodes SET state = 'retired' WHERE id = 'node_1'`); err != nil {
		t.Fatal(err)
	}
	if conds, err := nodes.CountByCondition(t.Context(), db); err != nil || len(conds) != 0 {
		t.Fatalf("after retiring: %+v %v", conds, err)
	}
}
