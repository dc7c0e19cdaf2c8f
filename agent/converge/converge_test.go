package converge_test

import (
	"context"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/bettercompute/bettercompute/agent/converge"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

func newConverger(t *testing.T, root string) *converge.Converger {
	t.Helper()
	c, err := converge.New(converge.Config{Root: root, NodeID: "node_1", GPUs: func(context.Context) ([]string, error) {
		return []string{"GPU-a", "GPU-b", "GPU-c"}, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func ptr[T any](v T) *T { return &v }

func states(ss []*agentv1.SectionStatus) map[string]*agentv1.SectionStatus {
	m := map[string]*agentv1.SectionStatus{}
	for _, s := range ss {
		m[s.GetSection()] = s
	}
	return m
}

func fullSpec() *agentv1.NodeSpec {
	return &agentv1.NodeSpec{
		Identity: &agentv1.NodeIdentity{NodeId: "node_1"},
		Devices:  &agentv1.DeviceAssignments{Assignments: []*agentv1.DeviceAssignment{{ReservationId: "rsv_1", GpuUuids: []string{"GPU-b", "GPU-a"}}}},
		Site:     &agentv1.SiteSettings{NtpServers: &agentv1.StringList{Values: []string{"ntp.example"}}, LogLevel: ptr("info")},
		Health:   &agentv1.HealthSettings{CheckInterval: durationpb.New(15 * time.Second), DiagnosticsInterval: durationpb.New(time.Hour), DiagnosticsLevel: "medium"},
	}
}

func TestConverge_IdempotentAndEmptySectionsRemoveFiles(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	c := newConverger(t, root)
	ctx := context.Background()
	ds := &agentv1.DesiredState{Generation: 1, Spec: fullSpec()}
	ss, obs := c.Converge(ctx, ds)
	if obs != 1 {
		t.Fatalf("observed %d, want 1: %v", obs, ss)
	}
	if h := c.Health(); h.CheckInterval != 15*time.Second || h.DiagnosticsInterval != time.Hour || h.DiagnosticsLevel != "medium" {
		t.Errorf("health %+v", h)
	}
	files := []string{converge.CDISpecFile, converge.SiteFile, converge.HealthFile}
	mtimes := map[string]time.Time{}
	for _, f := range files {
		st, err := os.Stat(filepath.Join(root, f))
		if err != nil {
			t.Fatal(err)
		}
		mtimes[f] = st.ModTime()
	}

	// Planning again finds nothing to do, and converging again writes nothing.
	cur := converge.Current{Root: root, NodeID: "node_1", GPUs: map[string]bool{"GPU-a": true, "GPU-b": true, "GPU-c": true}}
	for _, h := range c.Handlers() {
		p, err := h.Plan(cur, ds.GetSpec())
		if err != nil || len(p.Actions) > 0 || p.Failure != "" || p.Terminal != "" {
			t.Errorf("%s: second plan %+v, %v", h.Section(), p, err)
		}
	}
	if _, obs := c.Converge(ctx, &agentv1.DesiredState{Generation: 2, Spec: fullSpec()}); obs != 2 {
		t.Errorf("observed %d, want 2", obs)
	}
	for _, f := range files {
		st, err := os.Stat(filepath.Join(root, f))
		if err != nil {
			t.Fatal(err)
		}
		if !st.ModTime().Equal(mtimes[f]) {
			t.Errorf("%s rewritten", f)
		}
	}

	// An empty spec removes every file and resets the health settings.
	if _, obs := c.Converge(ctx, &agentv1.DesiredState{Generation: 3}); obs != 3 {
		t.Errorf("observed %d, want 3", obs)
	}
	for _, f := range files {
		if _, err := os.Stat(filepath.Join(root, f)); !os.IsNotExist(err) {
			t.Errorf("%s still there: %v", f, err)
		}
	}
	if h := c.Health(); !reflect.DeepEqual(h, converge.Health{}) {
		t.Errorf("health %+v after an empty section", h)
	}
}

func TestConverge_PersistsAndNeverLowersTheObservedGeneration(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	c := newConverger(t, root)
	ctx := context.Background()
	if _, obs := c.Converge(ctx, &agentv1.DesiredState{Generation: 7, Spec: fullSpec()}); obs != 7 {
		t.Fatalf("observed %d", obs)
	}
	if _, obs := c.Converge(ctx, &agentv1.DesiredState{Generation: 5, Spec: fullSpec()}); obs != 7 {
		t.Errorf("observed %d after an older generation, want 7", obs)
	}
	// A failing generation keeps the last one.
	bad := fullSpec()
	bad.Devices.Assignments[0].GpuUuids = []string{"GPU-gone"}
	ss, obs := c.Converge(ctx, &agentv1.DesiredState{Generation: 8, Spec: bad})
	if obs != 7 {
		t.Errorf("observed %d, want 7", obs)
	}
	if d := states(ss)["devices"]; d.GetState() != agentv1.SectionState_SECTION_STATE_FAILED || d.GetGeneration() != 8 {
		t.Errorf("devices %v", d)
	}
	// A new Converger on the same root (a restart) starts from 7, with the
	// health settings on disk.
	c2 := newConverger(t, root)
	if got := c2.ObservedGeneration(); got != 7 {
		t.Errorf("after restart: observed %d, want 7", got)
	}
	if c2.Health().CheckInterval != 15*time.Second {
		t.Errorf("after restart: health %+v", c2.Health())
	}
}

func TestConverge_TerminalFailures(t *testing.T) {
	t.Parallel()
	c := newConverger(t, t.TempDir())
	spec := &agentv1.NodeSpec{
		Identity:  &agentv1.NodeIdentity{NodeId: "node_other"},
		Site:      &agentv1.SiteSettings{LogLevel: ptr("loud")},
		Runtime:   &agentv1.RuntimeSettings{Engines: []string{"containerd", "lxc"}},
		Mig:       &agentv1.MigLayout{Gpus: []*agentv1.GpuMigLayout{{GpuUuid: "GPU-a", MigEnabled: true, Profiles: []string{"1g.18gb", "1g.18gb"}}}},
		Instances: &agentv1.Instances{Instances: []*agentv1.Instance{{Id: "inst_1", Image: "ubuntu", Vcpus: 4, State: "running"}}},
		Health:    &agentv1.HealthSettings{DiagnosticsLevel: "extreme"},
		Agent:     &agentv1.AgentSettings{Channel: "beta"},
		Devices:   &agentv1.DeviceAssignments{Assignments: []*agentv1.DeviceAssignment{{ReservationId: "rsv_1", GpuUuids: []string{"GPU-a"}}, {ReservationId: "rsv_2", GpuUuids: []string{"GPU-a"}}}},
		Tunnels:   &agentv1.TunnelSettings{Allow: []*agentv1.TunnelRule{{Host: "localhost"}}},
	}
	ss, obs := c.Converge(context.Background(), &agentv1.DesiredState{Generation: 1, Spec: spec})
	if obs != 1 {
		t.Errorf("observed %d, want 1 (every section failed terminally)", obs)
	}
	want := map[string]string{
		"identity":  `this node is "node_1"`,
		"site":      `invalid site section: log_level: "loud"`,
		"runtime":   `invalid runtime section: engines: "lxc": want containerd, cri-o, docker or podman`,
		"mig":       "no NVML to apply MIG layouts with: would enable MIG on GPU-a with instances [1g.18gb, 1g.18gb]",
		"instances": "not built yet: would run inst_1",
		"health":    `diagnostics level "extreme"`,
		"agent":     "not built yet: would follow release channel beta",
		"devices":   "GPU GPU-a is assigned to both rsv_1 and rsv_2",
		"tunnels":   "invalid tunnels section (nothing is allowed): allow[0]: ports 0-0",
	}
	for _, s := range ss {
		if s.GetState() != agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL || !strings.Contains(s.GetReason(), want[s.GetSection()]) {
			t.Errorf("%s: %v, want terminal with %q", s.GetSection(), s, want[s.GetSection()])
		}
	}
}
