package sim_test

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/agent/internal/testcontrol"
	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/mig"
	"github.com/bettercompute/bettercompute/agent/sim"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// migConverged waits for an Observed report of gen whose mig section
// converged, and returns that section.
func migConverged(t *testing.T, cp *testcontrol.Server, gen int64) *agentv1.SectionStatus {
	t.Helper()
	for {
		o := recv(t, cp.Observed, "Observed")
		if o.GetGeneration() != gen {
			continue
		}
		for _, s := range o.GetSections() {
			if s.GetSection() == "mig" && s.GetState() == agentv1.SectionState_SECTION_STATE_CONVERGED {
				return s
			}
		}
	}
}

// TestFleet_MigLayoutAcrossRestartAndReboot: a simulated node lays its
// GPU out as the mig section says; a daemon restart keeps the very
// instances (same ids and MIG UUIDs) and a mode change still waiting for a
// reset; a reboot applies that mode, loses the instances, and the node lays
// them out again before its session opens and reports the section
// converged.
func TestFleet_MigLayoutAcrossRestartAndReboot(t *testing.T) {
	t.Parallel()
	cp := testcontrol.New(t)
	up := make(chan bool, 16)
	f, err := sim.Start(context.Background(), sim.Config{
		Gateway: cp.Addr, RootCAs: cp.RootCAs(), Token: cp.Token, JoinserviceKey: cp.PublicKey, JoinserviceKeyID: cp.KeyID,
		Root: t.TempDir(), OnSession: func(u bool) {
			if u {
				up <- u
			}
		},
	}, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Stop)
	var gpus []string
	for len(gpus) < 2 {
		gpus = nil
		for _, g := range recv(t, cp.Reports, "inventory report").GetGpus() {
			gpus = append(gpus, g.GetUuid())
		}
	}
	gpu := gpus[0]
	spec := &agentv1.NodeSpec{
		Identity: &agentv1.NodeIdentity{NodeId: f.Nodes()[0]},
		Mig: &agentv1.MigLayout{Gpus: []*agentv1.GpuMigLayout{{GpuUuid: gpu, MigEnabled: true,
			Profiles:  []string{"3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb"},
			Instances: []*agentv1.MigInstance{{Profile: "3g.71gb", Start: 4}, {Profile: "2g.35gb", Start: 0}, {Profile: "1g.18gb", Start: 2}, {Profile: "1g.18gb", Start: 3}}}}},
	}
	cp.SetDesired(&agentv1.DesiredState{Generation: 1, Spec: spec})
	st := migConverged(t, cp, 1)
	readGPU := func(u string) mig.Layout {
		t.Helper()
		l, err := f.Inventory(0).MIGLayout(u)
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	read := func() mig.Layout { t.Helper(); return readGPU(gpu) }
	before := read()
	// GPU 1 (not in the section) waits for a reset to enter MIG mode.
	if err := f.Faults(0).Inject(1, inventory.Fault{MIGNeedsReset: true}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := f.Inventory(0).ApplyMIG(mig.Want{GPU: gpus[1], Enabled: true}); mig.KindOf(err) != mig.ResetRequired {
		t.Fatalf("GPU 1: %v", err)
	}
	if len(before.Instances) != 4 || !strings.Contains(st.GetReason(), before.Instances[0].UUID) {
		t.Fatalf("layout %v, reason %q", before, st.GetReason())
	}

	// The daemon starts its session after it re-applied the last desired
	// state it observed.
	drain(up)
	f.Restart(0, false) // the daemon alone
	recv(t, up, "session")
	if after := read(); !slices.Equal(after.Instances, before.Instances) {
		t.Fatalf("after a daemon restart %v, was %v", after, before)
	}
	if l := readGPU(gpus[1]); l.Enabled || !l.Pending {
		t.Fatalf("after a daemon restart GPU 1 %+v: a restart is no reset", l)
	}

	drain(up)
	f.Restart(0, true) // a reboot: the instances are gone until re-applied
	recv(t, up, "session")
	after := read()
	if !after.Enabled || len(after.Instances) != 4 {
		t.Fatalf("after a reboot, before the control plane spoke: %v", after)
	}
	if l := readGPU(gpus[1]); !l.Enabled {
		t.Fatalf("after a reboot GPU 1 %+v: its pending MIG mode did not apply", l)
	}
	cp.SetDesired(&agentv1.DesiredState{Generation: 2, Spec: spec})
	st = migConverged(t, cp, 2)
	if !after.Enabled || len(after.Instances) != 4 || !strings.Contains(st.GetReason(), after.Instances[0].UUID) {
		t.Fatalf("after a reboot %v, reason %q", after, st.GetReason())
	}
}

func drain[T any](ch chan T) {
	for {
		select {
		case <-ch:
		default:
			return
		}
	}
}
