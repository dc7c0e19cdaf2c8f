package converge_test

import (
	"context"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"tags.cncf.io/container-device-interface/pkg/cdi"
	specs "tags.cncf.io/container-device-interface/specs-go"

	"github.com/bettercompute/bettercompute/agent/converge"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

func readCDI(t *testing.T, root string) *specs.Spec {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, converge.CDISpecFile))
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	s, err := cdi.ParseSpec(b)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestDevices_RestartRepairsDrift: a node restarted after its devices file
// was changed (or removed) while it was down exposes exactly the last
// desired state again, before the control plane sends anything, and the
// section reports what it exposes.
func TestDevices_RestartRepairsDrift(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	c := newConverger(t, root)
	ss, obs := c.Converge(context.Background(), &agentv1.DesiredState{Generation: 3, Spec: fullSpec()})
	if obs != 3 {
		t.Fatalf("observed %d", obs)
	}
	if got := states(ss)["devices"].GetReason(); !strings.HasPrefix(got, "exposes 2 GPUs: rsv_1 (GPU-b,GPU-a)") {
		t.Fatalf("devices reason %q", got)
	}
	want := readCDI(t, root)
	if want == nil || !slices.Equal(deviceNames(want), []string{"GPU-a", "GPU-b", "rsv_1"}) {
		t.Fatalf("cdi %+v", want)
	}

	for _, tamper := range []func() error{
		func() error { // a stale reservation left over
			return os.WriteFile(filepath.Join(root, converge.CDISpecFile), []byte(`{"cdiVersion":"0.6.0","kind":"bettercompute.io/gpu","devices":[{"name":"rsv_old","containerEdits":{"deviceNodes":[{"path":"/dev/nvidia2"}]}}]}`), 0o644)
		},
		func() error { return os.Remove(filepath.Join(root, converge.CDISpecFile)) }, // removed
	} {
		if err := tamper(); err != nil {
			t.Fatal(err)
		}
		restarted := newConverger(t, root)
		if restarted.ObservedGeneration() != 3 {
			t.Fatalf("observed after restart %d", restarted.ObservedGeneration())
		}
		got := readCDI(t, root)
		if got == nil || !reflect.DeepEqual(got, want) {
			t.Fatalf("after restart the node exposes %+v, want %+v", got, want)
		}
	}

	// Releasing everything removes the file, and a restart keeps it removed.
	ss, _ = c.Converge(context.Background(), &agentv1.DesiredState{Generation: 4, Spec: &agentv1.NodeSpec{Identity: &agentv1.NodeIdentity{NodeId: "node_1"}}})
	if got := states(ss)["devices"].GetReason(); got != "exposes no GPUs" {
		t.Fatalf("devices reason %q", got)
	}
	newConverger(t, root)
	if got := readCDI(t, root); got != nil {
		t.Fatalf("a released node exposes %+v after restart", got)
	}
}

func deviceNames(s *specs.Spec) []string {
	var out []string
	for _, d := range s.Devices {
		out = append(out, d.Name)
	}
	return out
}

func booking(gen int64, asg ...*agentv1.DeviceAssignment) *agentv1.DesiredState {
	return &agentv1.DesiredState{Generation: gen, Spec: &agentv1.NodeSpec{
		Identity: &agentv1.NodeIdentity{NodeId: "node_1"},
		Devices:  &agentv1.DeviceAssignments{Assignments: asg},
	}}
}

// resolves loads root's CDI directory with the reference library and
// returns the device nodes name gets, or nil when it does not resolve.
func resolves(t *testing.T, root, name string) []string {
	t.Helper()
	c, err := cdi.NewCache(cdi.WithSpecDirs(filepath.Join(root, "cdi")), cdi.WithAutoRefresh(false))
	if err != nil {
		t.Fatal(err)
	}
	if errs := c.GetErrors(); len(errs) > 0 {
		t.Fatalf("the library rejects the spec: %v", errs)
	}
	d := c.GetDevice(name)
	if d == nil {
		return nil
	}
	var out []string
	for _, n := range d.ContainerEdits.DeviceNodes {
		out = append(out, n.Path)
	}
	return out
}

// TestBookingChangeRegeneratesSpec: a new booking replaces the spec in the
// same converge: the released reservation and GPU no longer resolve, the
// new ones resolve to exactly their GPUs' nodes (minor = position in the
// test inventory: GPU-a 0, GPU-b 1, GPU-c 2); releasing all removes it.
func TestBookingChangeRegeneratesSpec(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	c := newConverger(t, root)
	ctx := context.Background()
	c.Converge(ctx, booking(1, &agentv1.DeviceAssignment{ReservationId: "rsv_1", GpuUuids: []string{"GPU-a"}}))
	if got := resolves(t, root, "bettercompute.io/gpu=rsv_1"); !slices.Equal(got, []string{"/dev/nvidia0"}) {
		t.Fatalf("rsv_1 resolves to %v", got)
	}
	ss, obs := c.Converge(ctx, booking(2, &agentv1.DeviceAssignment{ReservationId: "rsv_2", GpuUuids: []string{"GPU-c", "GPU-b"}}))
	st := states(ss)["devices"]
	if obs != 2 || st.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED || !strings.HasPrefix(st.GetReason(), "exposes 2 GPUs: rsv_2 (GPU-c,GPU-b)") {
		t.Fatalf("observed %d, devices %v", obs, st)
	}
	for _, gone := range []string{"rsv_1", "GPU-a"} {
		if got := resolves(t, root, "bettercompute.io/gpu="+gone); got != nil {
			t.Fatalf("released %s still resolves to %v", gone, got)
		}
	}
	if got := resolves(t, root, "bettercompute.io/gpu=rsv_2"); !slices.Equal(got, []string{"/dev/nvidia2", "/dev/nvidia1"}) {
		t.Fatalf("rsv_2 resolves to %v", got)
	}
	if got := resolves(t, root, "bettercompute.io/gpu=GPU-b"); !slices.Equal(got, []string{"/dev/nvidia1"}) {
		t.Fatalf("GPU-b resolves to %v", got)
	}
	c.Converge(ctx, booking(3))
	if got := readCDI(t, root); got != nil {
		t.Fatalf("nothing booked, yet the spec is %+v", got)
	}
}

// TestCDISpecRestoredAfterHandEdit: a spec edited or removed by hand is
// found by the next converge pass (the session's periodic one runs the same
// desired state again), restored, and the section says it drifted; the pass
// after reports plain convergence.
func TestCDISpecRestoredAfterHandEdit(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	c := newConverger(t, root)
	ctx := context.Background()
	ds := booking(1, &agentv1.DeviceAssignment{ReservationId: "rsv_1", GpuUuids: []string{"GPU-a"}})
	c.Converge(ctx, ds)
	want := readCDI(t, root)
	path := filepath.Join(root, converge.CDISpecFile)
	if c.DevicesDrifted() {
		t.Fatal("drifted right after writing")
	}
	for name, tamper := range map[string]func() error{
		"edited": func() error { // someone offers an unbooked GPU
			return os.WriteFile(path, []byte(`{"cdiVersion":"0.6.0","kind":"bettercompute.io/gpu","devices":[{"name":"rsv_1","containerEdits":{"deviceNodes":[{"path":"/dev/nvidia0"},{"path":"/dev/nvidia2"}]}}]}`), 0o644)
		},
		"removed": func() error { return os.Remove(path) },
	} {
		if err := tamper(); err != nil {
			t.Fatal(err)
		}
		if !c.DevicesDrifted() {
			t.Fatalf("%s: DevicesDrifted says no", name)
		}
		st := states(must(c.Converge(ctx, ds)))["devices"]
		if c.DevicesDrifted() {
			t.Fatalf("%s: still drifted after the repair", name)
		}
		if st.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED || !strings.HasPrefix(st.GetReason(), "drifted: "+path+" was edited or removed by hand, restored; exposes 1 GPUs: rsv_1 (GPU-a)") {
			t.Fatalf("%s: devices %v", name, st)
		}
		if got := readCDI(t, root); !reflect.DeepEqual(got, want) {
			t.Fatalf("%s: spec %+v, want %+v", name, got, want)
		}
		st = states(must(c.Converge(ctx, ds)))["devices"]
		if !strings.HasPrefix(st.GetReason(), "exposes 1 GPUs: rsv_1 (GPU-a)") {
			t.Fatalf("%s: the pass after the repair says %q", name, st.GetReason())
		}
	}
}

func must(ss []*agentv1.SectionStatus, _ int64) []*agentv1.SectionStatus { return ss }

// TestDevices_BadNameLeavesTheOthers: a reservation id CDI does not take as
// a device name fails the section terminally, and the other reservation is
// still offered.
func TestDevices_BadNameLeavesTheOthers(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	c := newConverger(t, root)
	ss, _ := c.Converge(context.Background(), booking(1,
		&agentv1.DeviceAssignment{ReservationId: "rsv/../x", GpuUuids: []string{"GPU-a"}},
		&agentv1.DeviceAssignment{ReservationId: "rsv_2", GpuUuids: []string{"GPU-b"}}))
	st := states(ss)["devices"]
	if st.GetState() != agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL || !strings.Contains(st.GetReason(), `reservation "rsv/../x" is not a CDI device name`) {
		t.Fatalf("devices %v", st)
	}
	if got := resolves(t, root, "bettercompute.io/gpu=rsv_2"); !slices.Equal(got, []string{"/dev/nvidia1"}) {
		t.Fatalf("rsv_2 resolves to %v", got)
	}
}
