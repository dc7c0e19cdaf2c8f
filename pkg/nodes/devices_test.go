package nodes_test

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/nodes"
)

// TestQuarantineAndLift: unhealthy and missing GPUs are quarantined once,
// with their reason; a healthy one again is lifted unless kept (a running
// remediation step is for it) or not among only.
func TestQuarantineAndLift(t *testing.T) {
	t.Parallel()
	db := setup(t, "node_q")
	_, err := db.Exec(t.Context(), `INSERT INTO devices (node_id, id, kind, index, model, healthy, health_reason, missing_since) VALUES
		('node_q', 'GPU-0', 'gpu', 0, 'H200', true, '', NULL),
		('node_q', 'GPU-1', 'gpu', 1, 'H200', false, 'XID 79', NULL),
		('node_q', 'GPU-2', 'gpu', 2, 'H200', true, '', now()),
		('node_q', 'GPU-3', 'gpu', 3, 'H200', false, '', NULL)`)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	qs, err := nodes.Quarantine(t.Context(), db, "node_q", now)
	if err != nil || len(qs) != 3 {
		t.Fatalf("quarantined %+v %v", qs, err)
	}
	if qs[0].DeviceID != "GPU-1" || qs[0].Reason != "unhealthy: XID 79" || qs[1].DeviceID != "GPU-2" || !qs[1].Missing ||
		!strings.HasPrefix(qs[1].Reason, "missing") || qs[2].Reason != "unhealthy" {
		t.Fatalf("quarantined %+v", qs)
	}
	if again, err := nodes.Quarantine(t.Context(), db, "node_q", now); err != nil || len(again) != 0 {
		t.Fatalf("quarantined twice: %+v %v", again, err)
	}
	// All heal.
	if _, err := db.Exec(t.Context(), `UPDATE devices SET healthy = true, missing_since = NULL`); err != nil {
		t.Fatal(err)
	}
	lifted, err := nodes.LiftQuarantine(t.Context(), db, "node_q", []string{"GPU-1"}, nil)
	if err != nil || !slices.Equal(lifted, []string{"GPU-2", "GPU-3"}) {
		t.Fatalf("lifted %v %v", lifted, err)
	}
	if lifted, err := nodes.LiftQuarantine(t.Context(), db, "node_q", nil, []string{"GPU-0"}); err != nil || len(lifted) != 0 {
		t.Fatalf("lifted outside only: %v %v", lifted, err)
	}
	n, err := nodes.Get(t.Context(), db, "acme", "node_q")
	if err != nil {
		t.Fatal(err)
	}
	if n.Devices[1].QuarantinedAt == nil || n.Devices[2].QuarantinedAt != nil {
		t.Fatalf("devices %+v", n.Devices)
	}
}

// TestNeedsRepairLatchAndClear: the latch is set once (optionally failing
// the node) and ClearRepair clears it, sending a failed node back to
// adopting; another tenant's node is NOT_FOUND.
func TestNeedsRepairLatchAndClear(t *testing.T) {
	t.Parallel()
	db := setup(t, "node_r", "node_s")
	now := time.Now()
	if ok, err := nodes.LatchNeedsRepair(t.Context(), db, "node_r", "gave up", true, now); err != nil || !ok {
		t.Fatalf("latch %v %v", ok, err)
	}
	if ok, err := nodes.LatchNeedsRepair(t.Context(), db, "node_r", "again", true, now); err != nil || ok {
		t.Fatalf("latched twice: %v %v", ok, err)
	}
	if n := lookup(t, db, "node_r"); !n.NeedsRepair || n.NeedsRepairReason != "gave up" || n.State != nodes.StateFailed || n.NeedsRepairSince == nil {
		t.Fatalf("latched node %+v", n)
	}
	if ok, err := nodes.LatchNeedsRepair(t.Context(), db, "node_s", "budget", false, now); err != nil || !ok {
		t.Fatal(err)
	}
	if n := lookup(t, db, "node_s"); !n.NeedsRepair || n.State != nodes.StateAdopting {
		t.Fatalf("latch without fail changed the state: %+v", n)
	}
	c, err := nodes.ClearRepair(t.Context(), db, "acme", "node_r")
	if err != nil || !c.WasLatched || !c.Readopt || c.Reason != "gave up" {
		t.Fatalf("clear %+v %v", c, err)
	}
	if n := lookup(t, db, "node_r"); n.NeedsRepair || n.State != nodes.StateAdopting {
		t.Fatalf("cleared node %+v", n)
	}
	if _, err := nodes.ClearRepair(t.Context(), db, "other", "node_s"); fault.CodeOf(err) != fault.NotFound {
		t.Fatalf("another tenant's node: %v", err)
	}
}
