package capacity_test

import (
	"testing"

	"github.com/bettercompute/bettercompute/pkg/capacity"
	"github.com/bettercompute/bettercompute/pkg/fault"
)

// TestQuarantinedGPUsAreNotBookable: a quarantined GPU (healthy or not)
// is neither counted free nor booked; lifting the quarantine counts it
// again; UnbookDevice frees exactly one booking.
func TestQuarantinedGPUsAreNotBookable(t *testing.T) {
	t.Parallel()
	pool := setup(t, 1, 2)
	ctx := t.Context()
	mustExec(t, pool, `UPDATE devices SET quarantined_at = now(), quarantine_reason = 'XID 79' WHERE id = 'GPU-node_00-1'`)
	free, err := capacity.FreeCounts(ctx, pool, "pool_p", capacity.Constraints{}, capacity.DefaultLostAfter)
	if err != nil || len(free) != 1 || len(free[0].Free) != 1 {
		t.Fatalf("free %+v %v", free, err)
	}
	if drift := countsDrift(t, pool); len(drift) > 0 {
		t.Fatalf("counts drift: %v", drift)
	}
	if _, err := create(ctx, pool, "rsv_2", "root", 2, capacity.Constraints{}); fault.CodeOf(err) != fault.NoCapacity {
		t.Fatalf("two GPUs with one quarantined: %v", err)
	}
	r, err := create(ctx, pool, "rsv_1", "root", 1, capacity.Constraints{})
	if err != nil {
		t.Fatal(err)
	}
	got, err := capacity.Get(ctx, pool, "root", r.ID)
	if err != nil || len(got.Bookings) != 1 || got.Bookings[0].DeviceID != "GPU-node_00-0" {
		t.Fatalf("booked %+v %v", got.Bookings, err)
	}
	if ids, err := capacity.DeviceBookings(ctx, pool, "node_00", "GPU-node_00-0"); err != nil || len(ids) != 1 || ids[0] != "rsv_1" {
		t.Fatalf("device bookings %v %v", ids, err)
	}
	mustExec(t, pool, `UPDATE devices SET quarantined_at = NULL WHERE id = 'GPU-node_00-1'`)
	if n, err := capacity.UnbookDevice(ctx, pool, "rsv_1", "node_00", "GPU-node_00-0"); err != nil || n != 1 {
		t.Fatalf("unbook %d %v", n, err)
	}
	free, _ = capacity.FreeCounts(ctx, pool, "pool_p", capacity.Constraints{}, capacity.DefaultLostAfter)
	if len(free) != 1 || len(free[0].Free) != 2 {
		t.Fatalf("free after lift and unbook %+v", free)
	}
	if drift := countsDrift(t, pool); len(drift) > 0 {
		t.Fatalf("counts drift: %v", drift)
	}
}
