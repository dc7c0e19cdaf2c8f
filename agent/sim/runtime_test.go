package sim_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/agent/engines"
	"github.com/bettercompute/bettercompute/agent/internal/testcontrol"
	"github.com/bettercompute/bettercompute/agent/sim"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// TestFleet_RuntimeSectionUnderTheNodesRoot: a simulated node converges a
// runtime section with its engines' files and CDI directory under its own
// state directory, no engine installed ("not checked"), and the devices
// section names the reservation's CDI device.
func TestFleet_RuntimeSectionUnderTheNodesRoot(t *testing.T) {
	t.Parallel()
	cp := testcontrol.New(t)
	f, err := sim.Start(context.Background(), sim.Config{
		Gateway: cp.Addr, RootCAs: cp.RootCAs(), Token: cp.Token, JoinserviceKey: cp.PublicKey, JoinserviceKeyID: cp.KeyID,
		Root: t.TempDir(),
	}, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Stop)
	node := f.Nodes()[0]
	var gpu string
	for gpu == "" {
		for _, g := range recv(t, cp.Reports, "inventory report").GetGpus() {
			gpu = g.GetUuid()
			break
		}
	}
	cp.SetDesired(&agentv1.DesiredState{Generation: 1, Spec: &agentv1.NodeSpec{
		Identity: &agentv1.NodeIdentity{NodeId: node},
		Runtime:  &agentv1.RuntimeSettings{Engines: []string{"containerd", "docker"}},
		Devices:  &agentv1.DeviceAssignments{Assignments: []*agentv1.DeviceAssignment{{ReservationId: "rsv_1", GpuUuids: []string{gpu}}}},
	}})
	var o *agentv1.Observed
	for o.GetObservedGeneration() != 1 {
		o = recv(t, cp.Observed, "Observed")
	}
	for _, s := range o.GetSections() {
		if s.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED {
			t.Errorf("%s: %v", s.GetSection(), s)
		}
		switch s.GetSection() {
		case "runtime":
			if !strings.Contains(s.GetReason(), "(not checked: crictl not found)") || !strings.Contains(s.GetReason(), "(not checked: docker not found)") {
				t.Errorf("runtime reason %q", s.GetReason())
			}
		case "devices":
			if !strings.Contains(s.GetReason(), "as bettercompute.io/gpu=rsv_1") {
				t.Errorf("devices reason %q", s.GetReason())
			}
		}
	}
	root := f.Root(0)
	for _, rel := range []string{engines.ContainerdDropIn, engines.DockerConf, "var/run/cdi/bettercompute.io-gpu.json"} {
		if _, err := os.Stat(filepath.Join(root, rel)); err != nil {
			t.Errorf("not under the node's root: %v", err)
		}
	}
}
