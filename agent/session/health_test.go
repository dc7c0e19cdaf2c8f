package session_test

import (
	"slices"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/agent/inventory"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// TestHealthLoop_ReportsOnlyOnChange: the health loop sends an
// InventoryReport of the GPUs when a GPU's health changes — a fault
// injected, then cleared — and none on the passes in between.
func TestHealthLoop_ReportsOnlyOnChange(t *testing.T) {
	t.Parallel()
	f := setup(t, nil)
	passes := make(chan bool, 1000)
	f.cfg.HealthCheckInterval = 5 * time.Millisecond
	f.cfg.OnHealthCheck = func(reported bool) {
		select {
		case passes <- reported:
		default: // never block the loop; the reports themselves are checked
		}
	}
	inv := f.cfg.Inventory.(*inventory.Collector)
	f.start(t)
	recv(t, f.cp.Hellos, "Hello")
	if rep := recv(t, f.cp.Reports, "inventory report"); len(rep.GetGpus()) != 8 {
		t.Fatalf("first report %v", rep)
	}
	// settle waits for n passes that reported nothing and asserts that no
	// report came meanwhile.
	settle := func(n int) {
		t.Helper()
		for quiet := 0; quiet < n; {
			if !recv(t, passes, "health pass") {
				quiet++
			}
		}
		select {
		case rep := <-f.cp.Reports:
			t.Fatalf("report without a change: %v", rep)
		default:
		}
	}
	drain := func() {
		for len(passes) > 0 {
			<-passes
		}
	}
	settle(5)

	if err := inv.Faults().Inject(6, inventory.Fault{XIDs: []uint32{79}}); err != nil {
		t.Fatal(err)
	}
	rep := recv(t, f.cp.Reports, "report of the fault")
	g := rep.GetGpus()[6]
	if len(rep.GetGpus()) != 8 || g.GetHealthy() || !slices.Equal(g.GetFailedChecks(), []string{"xid", "fallen_off_bus"}) || g.GetHealthReason() == "" {
		t.Fatalf("gpu 6 %v", g)
	}
	if !slices.Equal(rep.GetSections(), []string{inventory.SectionGPUs}) {
		t.Errorf("sections %v", rep.GetSections())
	}
	drain()
	settle(5)

	if err := inv.Faults().Clear(6); err != nil {
		t.Fatal(err)
	}
	rep = recv(t, f.cp.Reports, "report of the recovery")
	if g := rep.GetGpus()[6]; !g.GetHealthy() || len(g.GetFailedChecks()) != 0 {
		t.Fatalf("gpu 6 after clear %v", g)
	}
	drain()
	settle(5)
}

// TestHealthLoop_FollowsTheSection: the section's thresholds apply to the
// checks the loop runs (a disabled check does not report).
func TestHealthLoop_FollowsTheSection(t *testing.T) {
	t.Parallel()
	f := setup(t, nil)
	passes := make(chan bool, 1000)
	f.cfg.HealthCheckInterval = 5 * time.Millisecond
	f.cfg.OnHealthCheck = func(reported bool) {
		select {
		case passes <- reported:
		default: // never block the loop; the reports themselves are checked
		}
	}
	inv := f.cfg.Inventory.(*inventory.Collector)
	f.cp.SetDesired(&agentv1.DesiredState{Generation: 1, Spec: &agentv1.NodeSpec{
		Health: &agentv1.HealthSettings{DisabledChecks: []string{"power"}},
	}})
	f.start(t)
	recv(t, f.cp.Hellos, "Hello")
	recv(t, f.cp.Reports, "inventory report")
	if o := recv(t, f.cp.Observed, "observed"); o.GetObservedGeneration() != 1 {
		t.Fatalf("observed %v", o)
	}
	for inv.HealthConfig().DisabledChecks == nil {
		recv(t, passes, "health pass")
	}
	if err := inv.Faults().Inject(1, inventory.Fault{PowerBrake: true}); err != nil {
		t.Fatal(err)
	}
	for quiet := 0; quiet < 5; {
		if recv(t, passes, "health pass") {
			t.Fatal("reported a disabled check")
		}
		quiet++
	}
	if err := inv.Faults().Inject(1, inventory.Fault{ThermalSlowdown: true}); err != nil {
		t.Fatal(err)
	}
	rep := recv(t, f.cp.Reports, "report of the thermal fault")
	if g := rep.GetGpus()[1]; !slices.Equal(g.GetFailedChecks(), []string{"thermal"}) {
		t.Fatalf("gpu 1 %v", g)
	}
}
