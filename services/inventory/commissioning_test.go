package inventory_test

import (
	"testing"

	nodelife "github.com/bettercompute/bettercompute/pkg/lifecycle"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/services/inventory"
)

// TestCommissioningNodeIsNeverAdopted: a node joined by its ramdisk (bcd
// ramdisk, state commissioning) keeps its state however many reports it
// sends, in a pool with acceptance checks too (none is queued for it); its
// inventory is still stored.
func TestCommissioningNodeIsNeverAdopted(t *testing.T) {
	t.Parallel()
	pool, rt := setup(t)
	if _, err := pool.Exec(t.Context(), `UPDATE pools SET acceptance = '{diag.nvml}' WHERE id = 'pool_a'`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(t.Context(), `UPDATE nodes SET state = $1 WHERE id = 'node_1'`, nodes.StateCommissioning); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		report(t, pool, gpu(0, true), gpu(1, true))
		if tr := tick(t, rt, nodelife.KindInventory); tr.Done != 1 {
			t.Fatalf("tick %+v", tr)
		}
		if state, conds := node(t, pool); state != nodes.StateCommissioning || !conds[inventory.InventoryReported].Status {
			t.Fatalf("state %s conditions %+v", state, conds)
		}
	}
	if d := devices(t, pool); len(d) != 2 {
		t.Fatalf("devices %+v", d)
	}
	var cmds int
	var gen int64
	if err := pool.QueryRow(t.Context(), `SELECT (SELECT count(*) FROM commands WHERE node_id = 'node_1'), generation FROM nodes WHERE id = 'node_1'`).Scan(&cmds, &gen); err != nil {
		t.Fatal(err)
	}
	if cmds != 0 || gen != 0 {
		t.Fatalf("%d acceptance commands queued, generation %d: the node was treated as adopting", cmds, gen)
	}
}
