package inventory_test

import (
	"testing"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	nodelife "github.com/bettercompute/bettercompute/pkg/lifecycle"
	"github.com/bettercompute/bettercompute/services/inventory"
)

// TestInventoryStoresMigSlices: each GPU's reported MIG slices become
// devices of kind mig (parent GPU, profile, start, memory, compute slices
// from the catalog), replaced on each report; a slice no longer reported
// is marked missing, not deleted, and does not make the node's devices
// missing (only GPUs do).
func TestInventoryStoresMigSlices(t *testing.T) {
	t.Parallel()
	pool, rt := setup(t)

	g0 := gpu(0, true)
	g0.Model, g0.MemoryBytes, g0.MigEnabled = "NVIDIA H200 141GB HBM3e", 144384<<20, true
	g0.MigSlices = []*agentv1.MigSlice{
		{Uuid: "MIG-a", Profile: "3g.71gb", Start: 4, MemoryBytes: 71 << 30, GpuInstanceId: 2},
		{Uuid: "MIG-b", Profile: "1g.18gb", Start: 0, MemoryBytes: 18 << 30, GpuInstanceId: 7},
		{Uuid: "", Profile: "1g.18gb", Start: 1}, // no compute instance yet: not a device
	}
	report(t, pool, g0, gpu(1, true))
	if tr := tick(t, rt, nodelife.KindInventory); tr.Done != 1 {
		t.Fatalf("tick %+v", tr)
	}
	type slice struct {
		ID, Parent, Profile      string
		Start, Compute, Instance int
		Memory                   int64
		Missing                  bool
	}
	read := func() []slice {
		t.Helper()
		rows, err := pool.Query(t.Context(), `SELECT id, parent_id, profile, mig_start, compute_slices, gpu_instance_id, memory_bytes,
			missing_since IS NOT NULL FROM devices WHERE node_id = 'node_1' AND kind = 'mig' ORDER BY id`)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		var out []slice
		for rows.Next() {
			var s slice
			if err := rows.Scan(&s.ID, &s.Parent, &s.Profile, &s.Start, &s.Compute, &s.Instance, &s.Memory, &s.Missing); err != nil {
				t.Fatal(err)
			}
			out = append(out, s)
		}
		return out
	}
	got := read()
	want := []slice{{"MIG-a", "GPU-0", "3g.71gb", 4, 3, 2, 71 << 30, false}, {"MIG-b", "GPU-0", "1g.18gb", 0, 1, 7, 18 << 30, false}}
	if len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("slices %+v, want %+v", got, want)
	}

	// GPU 0 re-laid: MIG-a goes, MIG-c comes.
	g0.MigSlices = []*agentv1.MigSlice{
		{Uuid: "MIG-b", Profile: "1g.18gb", Start: 0, MemoryBytes: 18 << 30, GpuInstanceId: 7},
		{Uuid: "MIG-c", Profile: "2g.35gb", Start: 2, MemoryBytes: 35 << 30, GpuInstanceId: 3},
	}
	report(t, pool, g0, gpu(1, true))
	tick(t, rt, nodelife.KindInventory)
	got = read()
	if len(got) != 3 || !got[0].Missing || got[1].Missing || got[2] != (slice{"MIG-c", "GPU-0", "2g.35gb", 2, 2, 3, 35 << 30, false}) {
		t.Fatalf("after the re-lay: %+v", got)
	}
	if _, conds := node(t, pool); !conds[inventory.DevicesPresent].Status {
		t.Fatalf("a missing slice made the node's devices missing: %+v", conds)
	}
	// Two GPUs and three slices (one missing), none deleted.
	if d := devices(t, pool); len(d) != 5 {
		t.Fatalf("devices %+v", d)
	}

	// MIG off: every slice goes missing.
	g0.MigEnabled, g0.MigSlices = false, nil
	report(t, pool, g0, gpu(1, true))
	tick(t, rt, nodelife.KindInventory)
	for _, s := range read() {
		if !s.Missing {
			t.Fatalf("slice %s still present with MIG off", s.ID)
		}
	}
}
