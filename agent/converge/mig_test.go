package converge_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	cdispec "tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/bettercompute/bettercompute/agent/cdi"
	"github.com/bettercompute/bettercompute/agent/converge"
	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/mig"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/migcatalog"
)

// countingMIG counts the GPUs a converge applies a layout to.
type countingMIG struct {
	*inventory.Collector
	applied atomic.Int64
}

func (c *countingMIG) ApplyMIG(w mig.Want) (mig.Layout, []string, error) {
	c.applied.Add(1)
	return c.Collector.ApplyMIG(w)
}

// migNode is a node on the mock DGX H200 (eight GPUs) with the real
// converge code.
type migNode struct {
	inv  *inventory.Collector
	mig  *countingMIG
	root string
	gpus []string
}

func newMigNode(t testing.TB) *migNode {
	t.Helper()
	inv, err := inventory.New(inventory.NewMock(), inventory.Config{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = inv.Close() })
	rep, err := inv.GPUs(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	n := &migNode{inv: inv, mig: &countingMIG{Collector: inv}, root: t.TempDir()}
	for _, g := range rep {
		n.gpus = append(n.gpus, g.GetUuid())
	}
	return n
}

func (n *migNode) converger(t testing.TB) *converge.Converger {
	t.Helper()
	c, err := converge.New(converge.Config{Root: n.root, NodeID: "node_1", MIG: n.mig,
		GPUs: func(context.Context) ([]string, error) { return n.gpus, nil }})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// layout is a GPU's entry as the control plane places it.
func layout(t testing.TB, uuid string, profiles ...string) *agentv1.GpuMigLayout {
	t.Helper()
	if len(profiles) == 0 {
		return &agentv1.GpuMigLayout{GpuUuid: uuid}
	}
	m, _ := migcatalog.ByName("H200 141GB")
	pl, err := m.Place(profiles, nil)
	if err != nil {
		t.Fatal(err)
	}
	g := &agentv1.GpuMigLayout{GpuUuid: uuid, MigEnabled: true, Profiles: profiles}
	for _, p := range pl {
		g.Instances = append(g.Instances, &agentv1.MigInstance{Profile: p.Profile, Start: uint32(p.Start)})
	}
	return g
}

func migSpec(gpus ...*agentv1.GpuMigLayout) *agentv1.DesiredState {
	return &agentv1.DesiredState{Spec: &agentv1.NodeSpec{Identity: &agentv1.NodeIdentity{NodeId: "node_1"}, Mig: &agentv1.MigLayout{Gpus: gpus}}}
}

func (n *migNode) converge(t testing.TB, c *converge.Converger, gen int64, ds *agentv1.DesiredState) *agentv1.SectionStatus {
	t.Helper()
	ds.Generation = gen
	ss, _ := c.Converge(context.Background(), ds)
	return states(ss)["mig"]
}

// read is every GPU's layout.
func (n *migNode) read(t testing.TB) []mig.Layout {
	t.Helper()
	out := make([]mig.Layout, len(n.gpus))
	for i, u := range n.gpus {
		l, err := n.inv.MIGLayout(u)
		if err != nil {
			t.Fatal(err)
		}
		out[i] = l
	}
	return out
}

var (
	seven = []string{"1g.18gb", "1g.18gb", "1g.18gb", "1g.18gb", "1g.18gb", "1g.18gb", "1g.18gb"}
	mixed = []string{"3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb"}
)

func profilesOf(l mig.Layout) []string {
	var out []string
	for _, in := range l.Instances {
		out = append(out, in.Profile)
	}
	sort.Strings(out)
	return out
}

func sortedCopy(s []string) []string { s = slices.Clone(s); sort.Strings(s); return s }

// TestMig_LayoutAppliedIdempotent: the section's layouts are applied
// through NVML (MIG on, instances at their placements, a MIG device each),
// the reason names every slice's MIG UUID, and a second pass applies
// nothing and keeps every instance.
func TestMig_LayoutAppliedIdempotent(t *testing.T) {
	t.Parallel()
	n := newMigNode(t)
	c := n.converger(t)
	ds := migSpec(layout(t, n.gpus[0], seven...), layout(t, n.gpus[1], mixed...))
	st := n.converge(t, c, 1, ds)
	if st.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED {
		t.Fatalf("mig %v", st)
	}
	got := n.read(t)
	for i, want := range [][]string{seven, mixed} {
		l := got[i]
		if !l.Enabled || !slices.Equal(profilesOf(l), sortedCopy(want)) {
			t.Fatalf("GPU %d has %v, want %v", i, l, want)
		}
		for _, in := range l.Instances {
			if !strings.HasPrefix(in.UUID, "MIG-") || !strings.Contains(st.GetReason(), in.UUID) {
				t.Fatalf("GPU %d slice %+v: UUID not in the reason %q", i, in, st.GetReason())
			}
		}
	}
	// The placements are the section's, exactly.
	for i, g := range ds.GetSpec().GetMig().GetGpus() {
		var want []migcatalog.Placement
		for _, in := range g.GetInstances() {
			want = append(want, migcatalog.Placement{Profile: in.GetProfile(), Start: int(in.GetStart())})
		}
		sort.Slice(want, func(a, b int) bool { return want[a].Start < want[b].Start })
		if !slices.Equal(got[i].Placements(), want) {
			t.Fatalf("GPU %d placements %v, want %v", i, got[i].Placements(), want)
		}
	}
	for i := 2; i < 8; i++ {
		if got[i].Enabled || len(got[i].Instances) > 0 {
			t.Fatalf("GPU %d not in the section was touched: %v", i, got[i])
		}
	}
	applied := n.mig.applied.Load()
	if applied != 2 {
		t.Fatalf("applied %d GPUs, want 2", applied)
	}
	st2 := n.converge(t, c, 2, ds)
	if st2.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED || st2.GetReason() != st.GetReason() {
		t.Fatalf("second pass %v, first %v", st2, st)
	}
	if n.mig.applied.Load() != applied {
		t.Fatalf("second pass applied %d GPUs", n.mig.applied.Load()-applied)
	}
	if again := n.read(t); !slices.EqualFunc(again, got, sameLayout) {
		t.Fatalf("second pass changed instances: %v, was %v", again, got)
	}
}

func sameLayout(a, b mig.Layout) bool {
	return a.GPU == b.GPU && a.Enabled == b.Enabled && slices.Equal(a.Instances, b.Instances)
}

// TestMig_ChangeOnOneGPULeavesTheOthers: re-laying GPU 0 destroys and
// creates instances on GPU 0 only: GPUs 1–7 keep their GPU instance ids,
// compute instances and MIG UUIDs; GPU 0's instances the new layout keeps
// at their placement keep theirs too.
func TestMig_ChangeOnOneGPULeavesTheOthers(t *testing.T) {
	t.Parallel()
	n := newMigNode(t)
	c := n.converger(t)
	var all []*agentv1.GpuMigLayout
	for _, u := range n.gpus {
		all = append(all, layout(t, u, seven...))
	}
	if st := n.converge(t, c, 1, migSpec(all...)); st.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED {
		t.Fatalf("mig %v", st)
	}
	before := n.read(t)
	applied := n.mig.applied.Load()

	// The control plane keeps GPU 0's 1g.18gb at 0 and 1 (migcatalog.Place
	// with the current instances kept).
	m, _ := migcatalog.ByName("H200 141GB")
	pl, err := m.Place(mixed, before[0].Placements())
	if err != nil {
		t.Fatal(err)
	}
	g0 := &agentv1.GpuMigLayout{GpuUuid: n.gpus[0], MigEnabled: true, Profiles: mixed}
	for _, p := range pl {
		g0.Instances = append(g0.Instances, &agentv1.MigInstance{Profile: p.Profile, Start: uint32(p.Start)})
	}
	all[0] = g0
	if st := n.converge(t, c, 2, migSpec(all...)); st.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED {
		t.Fatalf("mig %v", st)
	}
	if got := n.mig.applied.Load() - applied; got != 1 {
		t.Fatalf("applied %d GPUs, want 1", got)
	}
	after := n.read(t)
	for i := 1; i < 8; i++ {
		if !sameLayout(after[i], before[i]) {
			t.Fatalf("GPU %d changed: %v, was %v", i, after[i], before[i])
		}
	}
	if !slices.Equal(profilesOf(after[0]), sortedCopy(mixed)) {
		t.Fatalf("GPU 0 has %v", after[0])
	}
	kept := 0
	for _, in := range after[0].Instances {
		for _, was := range before[0].Instances {
			if in == was {
				kept++
			}
		}
	}
	if kept != 2 {
		t.Fatalf("GPU 0 kept %d instances as they were, want the two 1g.18gb the layout keeps: %v, was %v", kept, after[0], before[0])
	}
}

// TestMig_OtherGPUsNeverTouched: a GPU the section does not name keeps
// whatever layout it has.
func TestMig_OtherGPUsNeverTouched(t *testing.T) {
	t.Parallel()
	n := newMigNode(t)
	m, _ := migcatalog.ByName("H200 141GB")
	pl, _ := m.Place([]string{"4g.71gb"}, nil)
	if _, _, err := n.inv.ApplyMIG(mig.Want{GPU: n.gpus[7], Enabled: true, Instances: pl}); err != nil {
		t.Fatal(err)
	}
	before := n.read(t)[7]
	c := n.converger(t)
	if st := n.converge(t, c, 1, migSpec(layout(t, n.gpus[0], mixed...), layout(t, n.gpus[1]))); st.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED {
		t.Fatalf("mig %v", st)
	}
	if after := n.read(t)[7]; !sameLayout(after, before) {
		t.Fatalf("GPU 7 changed: %v, was %v", after, before)
	}
}

// TestMig_ResetRequired: a GPU that needs a reset to enter MIG mode
// reports reset-required (FAILED_TERMINAL: the node cannot progress by
// itself, so the generation counts as observed and the control plane's
// gpu.reset, which presupposes it, can run) with nothing else changed;
// after the reset the next pass lays it out.
func TestMig_ResetRequired(t *testing.T) {
	t.Parallel()
	n := newMigNode(t)
	if err := n.inv.Faults().Inject(2, inventory.Fault{MIGNeedsReset: true}); err != nil {
		t.Fatal(err)
	}
	c := n.converger(t)
	ds := migSpec(layout(t, n.gpus[1], seven...), layout(t, n.gpus[2], mixed...))
	st := n.converge(t, c, 1, ds)
	if st.GetState() != agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL || !strings.Contains(st.GetReason(), n.gpus[2]+": reset-required: MIG mode on is pending") {
		t.Fatalf("mig %v", st)
	}
	if c.ObservedGeneration() != 1 {
		t.Fatalf("observed %d, want 1 (a reset-required GPU does not hold it back)", c.ObservedGeneration())
	}
	got := n.read(t)
	if got[2].Enabled || !got[2].Pending || len(got[2].Instances) > 0 {
		t.Fatalf("GPU 2 %+v, want MIG pending on", got[2])
	}
	if !got[1].Enabled || len(got[1].Instances) != 7 {
		t.Fatalf("GPU 1 %v: the other GPU was not laid out", got[1])
	}
	// Retrying without a reset does not help.
	if st := n.converge(t, c, 1, ds); !strings.Contains(st.GetReason(), "reset-required") {
		t.Fatalf("mig %v", st)
	}
	if err := n.inv.Reset(context.Background(), n.gpus[2]); err != nil {
		t.Fatal(err)
	}
	if st := n.converge(t, c, 1, ds); st.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED {
		t.Fatalf("after the reset: mig %v", st)
	}
	if c.ObservedGeneration() != 1 {
		t.Fatalf("observed %d", c.ObservedGeneration())
	}
}

// TestMig_BusyRetried: instances in use are not destroyed: the section is
// FAILED (retried) saying busy, and converges once they are free.
func TestMig_BusyRetried(t *testing.T) {
	t.Parallel()
	n := newMigNode(t)
	c := n.converger(t)
	if st := n.converge(t, c, 1, migSpec(layout(t, n.gpus[0], seven...))); st.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED {
		t.Fatalf("mig %v", st)
	}
	if err := n.inv.Faults().Inject(0, inventory.Fault{MIGBusy: true}); err != nil {
		t.Fatal(err)
	}
	ds := migSpec(layout(t, n.gpus[0], "7g.141gb"))
	st := n.converge(t, c, 2, ds)
	if st.GetState() != agentv1.SectionState_SECTION_STATE_FAILED || !strings.Contains(st.GetReason(), n.gpus[0]+": busy: ") {
		t.Fatalf("mig %v", st)
	}
	if err := n.inv.Faults().Clear(0); err != nil {
		t.Fatal(err)
	}
	if st := n.converge(t, c, 2, ds); st.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED || !strings.Contains(st.GetReason(), "7g.141gb@0 MIG-") {
		t.Fatalf("mig %v", st)
	}
}

// TestMig_UnsupportedProfileTerminal: a profile the driver does not offer
// fails the section terminally naming the profile; the other GPUs are
// laid out.
func TestMig_UnsupportedProfileTerminal(t *testing.T) {
	t.Parallel()
	n := newMigNode(t)
	if err := n.inv.Faults().Inject(3, inventory.Fault{MIGUnsupportedProfiles: []string{"1g.18gb+me"}}); err != nil {
		t.Fatal(err)
	}
	c := n.converger(t)
	st := n.converge(t, c, 1, migSpec(layout(t, n.gpus[3], "1g.18gb+me", "3g.71gb"), layout(t, n.gpus[4], "1g.18gb+me", "3g.71gb")))
	if st.GetState() != agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL ||
		!strings.Contains(st.GetReason(), n.gpus[3]+": profile-unsupported: profile 1g.18gb+me: ") {
		t.Fatalf("mig %v", st)
	}
	if c.ObservedGeneration() != 1 {
		t.Fatalf("observed %d: a terminal failure is observed", c.ObservedGeneration())
	}
	if l := n.read(t)[4]; len(l.Instances) != 2 {
		t.Fatalf("GPU 4 %v", l)
	}
}

// TestMig_RebootReappliesBeforeConverging: a node whose instances were
// lost in a reboot re-creates them when its daemon starts (the persisted
// desired state), before the control plane sends anything; and a pass
// never reports the section converged without them.
func TestMig_RebootReappliesBeforeConverging(t *testing.T) {
	t.Parallel()
	n := newMigNode(t)
	c := n.converger(t)
	ds := migSpec(layout(t, n.gpus[0], mixed...), layout(t, n.gpus[5], seven...))
	if st := n.converge(t, c, 1, ds); st.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED {
		t.Fatalf("mig %v", st)
	}
	n.inv.SimulateReboot()
	if l := n.read(t)[0]; !l.Enabled || len(l.Instances) > 0 {
		t.Fatalf("after the reboot GPU 0 has %v, want MIG on and no instances", l)
	}
	// The daemon starts again: it re-applies before any spec arrives.
	n.converger(t)
	got := n.read(t)
	if len(got[0].Instances) != 4 || len(got[5].Instances) != 7 {
		t.Fatalf("after the restart: GPU 0 %v, GPU 5 %v", got[0], got[5])
	}
	// A reboot under a running converger: the next pass re-creates them
	// and only then reports converged.
	n.inv.SimulateReboot()
	st := n.converge(t, c, 1, ds)
	if st.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED {
		t.Fatalf("mig %v", st)
	}
	for _, l := range n.read(t) {
		for _, in := range l.Instances {
			if !strings.Contains(st.GetReason(), in.UUID) {
				t.Fatalf("reason %q lacks %s", st.GetReason(), in.UUID)
			}
		}
	}
	if got := n.read(t); len(got[0].Instances) != 4 || len(got[5].Instances) != 7 {
		t.Fatalf("after the pass: GPU 0 %v, GPU 5 %v", got[0], got[5])
	}
}

// TestMig_Disable: a GPU whose entry turns MIG off loses its instances and
// leaves MIG mode.
func TestMig_Disable(t *testing.T) {
	t.Parallel()
	n := newMigNode(t)
	c := n.converger(t)
	if st := n.converge(t, c, 1, migSpec(layout(t, n.gpus[0], seven...))); st.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED {
		t.Fatalf("mig %v", st)
	}
	st := n.converge(t, c, 2, migSpec(layout(t, n.gpus[0])))
	if st.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED || st.GetReason() != n.gpus[0]+": MIG disabled" {
		t.Fatalf("mig %v", st)
	}
	if l := n.read(t)[0]; l.Enabled || len(l.Instances) > 0 {
		t.Fatalf("GPU 0 %v", l)
	}
}

// TestMig_BadSectionNamesTheField: a malformed section fails terminally
// naming the field and changes nothing; a layout that does not fit the
// GPU's model fails that GPU naming the instance, and changes nothing on
// it.
func TestMig_BadSectionNamesTheField(t *testing.T) {
	t.Parallel()
	n := newMigNode(t)
	c := n.converger(t)
	good := layout(t, n.gpus[0], seven...)
	for _, tc := range []struct {
		name string
		gpus []*agentv1.GpuMigLayout
		want string
	}{
		{"empty uuid", []*agentv1.GpuMigLayout{good, {MigEnabled: true}}, "mig.gpus[1].gpu_uuid: empty"},
		{"twice", []*agentv1.GpuMigLayout{good, layout(t, n.gpus[0])}, "mig.gpus[1].gpu_uuid: " + n.gpus[0] + " is also mig.gpus[0]"},
		{"profiles without placements", []*agentv1.GpuMigLayout{good, {GpuUuid: n.gpus[1], MigEnabled: true, Profiles: []string{"1g.18gb"}}}, "mig.gpus[1].instances: 0 placements for 1 profiles"},
		{"mismatch", []*agentv1.GpuMigLayout{good, {GpuUuid: n.gpus[1], MigEnabled: true, Profiles: []string{"1g.18gb"},
			Instances: []*agentv1.MigInstance{{Profile: "2g.35gb"}}}}, `mig.gpus[1].instances[0].profile: "2g.35gb", profiles[0] is "1g.18gb"`},
		{"start", []*agentv1.GpuMigLayout{good, {GpuUuid: n.gpus[1], MigEnabled: true, Profiles: []string{"1g.18gb"},
			Instances: []*agentv1.MigInstance{{Profile: "1g.18gb", Start: 9}}}}, "mig.gpus[1].instances[0].start: 9"},
		{"disabled with instances", []*agentv1.GpuMigLayout{good, {GpuUuid: n.gpus[1], Profiles: []string{"1g.18gb"}}}, "mig.gpus[1].instances: set while mig_enabled is false"},
	} {
		st := n.converge(t, c, 1, migSpec(tc.gpus...))
		if st.GetState() != agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL || !strings.Contains(st.GetReason(), "invalid mig section: "+tc.want) {
			t.Errorf("%s: mig %v, want %q", tc.name, st, tc.want)
		}
	}
	if n.mig.applied.Load() != 0 {
		t.Fatalf("a bad section applied %d GPUs", n.mig.applied.Load())
	}
	// Well formed, but 3g.71gb does not start at 2 on an H200, and two
	// instances overlap.
	bad := &agentv1.GpuMigLayout{GpuUuid: n.gpus[1], MigEnabled: true, Profiles: []string{"3g.71gb"},
		Instances: []*agentv1.MigInstance{{Profile: "3g.71gb", Start: 2}}}
	overlap := &agentv1.GpuMigLayout{GpuUuid: n.gpus[2], MigEnabled: true, Profiles: []string{"2g.35gb", "1g.18gb"},
		Instances: []*agentv1.MigInstance{{Profile: "2g.35gb", Start: 0}, {Profile: "1g.18gb", Start: 1}}}
	st := n.converge(t, c, 2, migSpec(good, bad, overlap))
	for _, want := range []string{
		n.gpus[1] + ": invalid-layout: instances[0].start: 2 is not a start of 3g.71gb on H200 141GB (0, 4)",
		n.gpus[2] + ": invalid-layout: instances[1].start: 1g.18gb at 1 overlaps instances[0] (memory slice 1)",
	} {
		if st.GetState() != agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL || !strings.Contains(st.GetReason(), want) {
			t.Fatalf("mig %v, want %q", st, want)
		}
	}
	got := n.read(t)
	if len(got[0].Instances) != 7 || got[1].Enabled || got[2].Enabled {
		t.Fatalf("GPU 0 %v, GPU 1 %v, GPU 2 %v", got[0], got[1], got[2])
	}
}

// TestMig_GPUNotHereRetried: a GPU the inventory lacks fails the section
// (retried); the others are laid out.
func TestMig_GPUNotHereRetried(t *testing.T) {
	t.Parallel()
	n := newMigNode(t)
	c := n.converger(t)
	st := n.converge(t, c, 1, migSpec(layout(t, "GPU-gone", seven...), layout(t, n.gpus[0], mixed...)))
	if st.GetState() != agentv1.SectionState_SECTION_STATE_FAILED || !strings.Contains(st.GetReason(), "GPU-gone: not in this node's inventory") {
		t.Fatalf("mig %v", st)
	}
	if l := n.read(t)[0]; len(l.Instances) != 4 {
		t.Fatalf("GPU 0 %v", l)
	}
}

// BenchmarkMigLayoutChangeOneGPU: on an 8-GPU node (mock) with every GPU
// laid out, the time from a spec that re-lays GPU 0 (seven 1g.18gb ↔
// 3g.71gb+2g.35gb+2×1g.18gb) to the section converged, p50 and p99.
//
// The whole pass includes writing the observed generation and desired
// state (fsynced); mig-p50/p99 are the mig section's own plan and apply.
func BenchmarkMigLayoutChangeOneGPU(b *testing.B) {
	n := newMigNode(b)
	var section time.Duration
	c, err := converge.New(converge.Config{Root: n.root, NodeID: "node_1", MIG: n.mig,
		GPUs: func(context.Context) ([]string, error) { return n.gpus, nil },
		OnSection: func(s, _ string, d time.Duration) {
			if s == "mig" {
				section = d
			}
		}})
	if err != nil {
		b.Fatal(err)
	}
	var all []*agentv1.GpuMigLayout
	for _, u := range n.gpus {
		all = append(all, layout(b, u, seven...))
	}
	specs := [2]*agentv1.DesiredState{migSpec(all...), nil}
	alt := slices.Clone(all)
	alt[0] = layout(b, n.gpus[0], mixed...)
	specs[1] = migSpec(alt...)
	if st := n.converge(b, c, 1, specs[0]); st.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED {
		b.Fatalf("mig %v", st)
	}
	var lat, mig []time.Duration
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		start := time.Now()
		st := n.converge(b, c, int64(i+2), specs[(i+1)%2])
		lat = append(lat, time.Since(start))
		mig = append(mig, section)
		if st.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED {
			b.Fatalf("mig %v", st)
		}
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
	slices.Sort(mig)
	b.ReportMetric(float64(mig[len(mig)/2].Microseconds()), "mig-p50-µs")
	b.ReportMetric(float64(mig[len(mig)*99/100].Microseconds()), "mig-p99-µs")
}

// TestMig_BookedSliceInTheCDISpec: a booking naming a MIG slice the same
// spec's mig section makes resolves, in the same pass, to exactly that
// slice: its parent's /dev/nvidiaN and its two capability nodes; the
// GPU's other slices and the GPU itself are offered to nobody.
func TestMig_BookedSliceInTheCDISpec(t *testing.T) {
	t.Parallel()
	n := newMigNode(t)
	dir := t.TempDir()
	dev, driver := filepath.Join(dir, "dev-root"), filepath.Join(dir, "driver-root")
	// Created in start order: 2g.35gb@0 is GPU instance 0, 1g.18gb@2 1,
	// 1g.18gb@3 2, 3g.71gb@4 3; one compute instance (0) each. GPU 0's
	// minor is 0.
	minors := "config 1\nmonitor 2\n"
	for gi := range 4 {
		minors += fmt.Sprintf("gpu0/gi%d/access %d\ngpu0/gi%d/ci0/access %d\n", gi, 10+2*gi, gi, 11+2*gi)
	}
	if err := os.MkdirAll(filepath.Join(driver, filepath.Dir(cdi.MigMinorsFile)), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(driver, cdi.MigMinorsFile), []byte(minors), 0o644); err != nil {
		t.Fatal(err)
	}
	w, err := cdi.New(cdi.Config{Dir: filepath.Join(dir, "cdi"), DevRoot: dev, DriverRoot: driver})
	if err != nil {
		t.Fatal(err)
	}
	c, err := converge.New(converge.Config{Root: n.root, NodeID: "node_1", MIG: n.mig, CDI: w, MIGDevices: n.inv.MIGDevices,
		GPUs:   func(context.Context) ([]string, error) { return n.gpus, nil },
		Minors: n.inv.Minors})
	if err != nil {
		t.Fatal(err)
	}
	slice := inventory.MockMigUUID(n.gpus[0], 3, 0) // the 3g.71gb
	ds := migSpec(layout(t, n.gpus[0], mixed...))
	ds.Spec.Devices = &agentv1.DeviceAssignments{Assignments: []*agentv1.DeviceAssignment{{ReservationId: "rsv_1", GpuUuids: []string{slice}}}}
	ds.Generation = 1
	ss, _ := c.Converge(context.Background(), ds)
	if st := states(ss); st["mig"].GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED ||
		st["devices"].GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED || !strings.Contains(st["devices"].GetReason(), "rsv_1 ("+slice+")") {
		t.Fatalf("mig %v, devices %v", st["mig"], st["devices"])
	}
	if l := n.read(t)[0]; l.Instances[len(l.Instances)-1].UUID != slice {
		t.Fatalf("GPU 0 %v: the 3g.71gb is not %s", l, slice)
	}
	spec, err := cdispec.ReadSpec(w.Path(), 0)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string][]string{}
	for _, d := range spec.Devices {
		for _, dn := range d.ContainerEdits.DeviceNodes {
			got[d.Name] = append(got[d.Name], dn.Path)
		}
	}
	want := []string{"/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap16", "/dev/nvidia-caps/nvidia-cap17"}
	if len(got) != 2 || !slices.Equal(got[slice], want) || !slices.Equal(got["rsv_1"], want) {
		t.Fatalf("CDI devices %v, want %s and rsv_1 with %v", got, slice, want)
	}
}
