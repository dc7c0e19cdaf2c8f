package session_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/bettercompute/bettercompute/agent/converge"
	"github.com/bettercompute/bettercompute/agent/session"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// run starts the session client and returns a function that stops it and
// waits for Run to return.
func (f *fixture) run(t *testing.T) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- session.Run(ctx, f.cfg) }()
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		if err := recv(t, done, "Run's return"); err != nil {
			t.Errorf("Run: %v", err)
		}
	}
	t.Cleanup(stop)
	return stop
}

// gpus returns the UUIDs of the node's (mock) GPUs.
func (f *fixture) gpus(t *testing.T) []string {
	t.Helper()
	rep, err := f.cfg.Inventory.Report(context.Background(), []string{"gpus"})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, g := range rep.GetGpus() {
		out = append(out, g.GetUuid())
	}
	return out
}

// observed waits for the Observed report for generation gen, skipping
// reports for earlier ones.
func (f *fixture) observed(t *testing.T, gen int64) *agentv1.Observed {
	t.Helper()
	for {
		o := recv(t, f.cp.Observed, fmt.Sprintf("Observed for generation %d", gen))
		if o.GetGeneration() == gen {
			return o
		}
		if o.GetGeneration() > gen {
			t.Fatalf("Observed for generation %d while waiting for %d", o.GetGeneration(), gen)
		}
	}
}

func (f *fixture) file(t *testing.T, rel string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(f.store.Root(), rel))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func (f *fixture) absent(t *testing.T, rel string) {
	t.Helper()
	if _, err := os.Stat(filepath.Join(f.store.Root(), rel)); !os.IsNotExist(err) {
		t.Errorf("%s: want no file, stat says %v", rel, err)
	}
}

func sectionStates(o *agentv1.Observed) map[string]*agentv1.SectionStatus {
	m := map[string]*agentv1.SectionStatus{}
	for _, s := range o.GetSections() {
		m[s.GetSection()] = s
	}
	return m
}

func ptr[T any](v T) *T { return &v }

// cdiJSON is what cdiDevices says of a spec offering each reservation
// {id, "uuid,uuid"}: its device names, sorted.
func cdiJSON(devs ...[2]string) string {
	var names []string
	for _, d := range devs {
		names = append(names, d[0])
		names = append(names, strings.Split(d[1], ",")...)
	}
	slices.Sort(names)
	return strings.Join(names, " ")
}

// cdiDevices parses a CDI spec with the reference library and returns its
// device names, sorted.
func cdiDevices(t *testing.T, content string) string {
	t.Helper()
	s, err := cdi.ParseSpec([]byte(content))
	if err != nil {
		t.Fatal(err)
	}
	if s.Kind != converge.CDIKind {
		t.Fatalf("kind %q", s.Kind)
	}
	var names []string
	for _, d := range s.Devices {
		names = append(names, d.Name)
	}
	slices.Sort(names)
	return strings.Join(names, " ")
}

func TestDesiredState(t *testing.T) {
	t.Parallel()

	t.Run("devices, site and health converge and the generation is observed", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		f.run(t)
		g := f.gpus(t)
		recv(t, f.cp.Hellos, "Hello")
		f.cp.SetDesired(&agentv1.DesiredState{Generation: 1, Spec: &agentv1.NodeSpec{
			Identity: &agentv1.NodeIdentity{NodeId: f.id.NodeID, PoolId: "pool_1"},
			Devices: &agentv1.DeviceAssignments{Assignments: []*agentv1.DeviceAssignment{
				{ReservationId: "rsv_b", GpuUuids: []string{g[3], g[2]}},
				{ReservationId: "rsv_a", GpuUuids: []string{g[0]}},
			}},
			Site: &agentv1.SiteSettings{
				NtpServers: &agentv1.StringList{Values: []string{"ntp1.example", "ntp2.example"}},
				DnsServers: &agentv1.StringList{},
				HttpProxy:  ptr("http://proxy.example:3128"), OtlpEndpoint: ptr("otel.example:4317"), LogLevel: ptr("debug"),
			},
			Health: &agentv1.HealthSettings{CheckInterval: durationpb.New(30 * time.Second), DiagnosticsInterval: durationpb.New(6 * time.Hour), DiagnosticsLevel: "quick", MaxGpuTemperatureCelsius: 85},
		}})
		o := f.observed(t, 1)
		if o.GetObservedGeneration() != 1 {
			t.Errorf("observed_generation %d, want 1", o.GetObservedGeneration())
		}
		if len(o.GetSections()) != 9 {
			t.Errorf("%d sections, want 9 (one per section, tunnels included)", len(o.GetSections()))
		}
		for _, s := range o.GetSections() {
			if s.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED || s.GetGeneration() != 1 {
				t.Errorf("section %v", s)
			}
		}
		if got, want := cdiDevices(t, f.file(t, converge.CDISpecFile)), cdiJSON([2]string{"rsv_a", g[0]}, [2]string{"rsv_b", g[3] + "," + g[2]}); got != want {
			t.Errorf("CDI spec:\n%s\nwant:\n%s", got, want)
		}
		wantSite := `{
  "ntp_servers": [
    "ntp1.example",
    "ntp2.example"
  ],
  "dns_servers": [],
  "http_proxy": "http://proxy.example:3128",
  "otlp_endpoint": "otel.example:4317",
  "log_level": "debug"
}
`
		if got := f.file(t, converge.SiteFile); got != wantSite {
			t.Errorf("site.json:\n%s\nwant:\n%s", got, wantSite)
		}
		wantHealth := `{
  "check_interval": "30s",
  "diagnostics_interval": "6h0m0s",
  "diagnostics_level": "quick",
  "max_gpu_temperature_celsius": 85
}
`
		if got := f.file(t, converge.HealthFile); got != wantHealth {
			t.Errorf("health.json:\n%s\nwant:\n%s", got, wantHealth)
		}
		if got := f.file(t, converge.ObservedGenerationFile); got != "1\n" {
			t.Errorf("observed_generation file %q", got)
		}
	})

	t.Run("an unsupported section fails terminally and the generation is still observed", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		f.run(t)
		recv(t, f.cp.Hellos, "Hello")
		f.cp.SetDesired(&agentv1.DesiredState{Generation: 4, Spec: &agentv1.NodeSpec{Agent: &agentv1.AgentSettings{DesiredVersion: "v0.3.1"}}})
		o := f.observed(t, 4)
		if o.GetObservedGeneration() != 4 {
			t.Errorf("observed_generation %d, want 4", o.GetObservedGeneration())
		}
		a := sectionStates(o)["agent"]
		if a.GetState() != agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL || a.GetReason() != "not built yet: would upgrade bcd to v0.3.1" {
			t.Errorf("agent section %v", a)
		}
		if s := sectionStates(o)["devices"]; s.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED {
			t.Errorf("devices section %v", s)
		}
	})

	t.Run("a GPU not in the inventory fails the devices section and holds the generation back", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		f.run(t)
		g := f.gpus(t)
		recv(t, f.cp.Hellos, "Hello")
		f.cp.SetDesired(&agentv1.DesiredState{Generation: 1, Spec: &agentv1.NodeSpec{Devices: &agentv1.DeviceAssignments{Assignments: []*agentv1.DeviceAssignment{
			{ReservationId: "rsv_a", GpuUuids: []string{g[1], "GPU-not-here"}},
		}}}})
		o := f.observed(t, 1)
		if o.GetObservedGeneration() != 0 {
			t.Errorf("observed_generation %d, want 0", o.GetObservedGeneration())
		}
		d := sectionStates(o)["devices"]
		if d.GetState() != agentv1.SectionState_SECTION_STATE_FAILED || !strings.Contains(d.GetReason(), "GPU-not-here") {
			t.Errorf("devices section %v", d)
		}
		// The GPUs that are there are exposed; the missing one is not.
		if got, want := cdiDevices(t, f.file(t, converge.CDISpecFile)), cdiJSON([2]string{"rsv_a", g[1]}); got != want {
			t.Errorf("CDI spec:\n%s\nwant:\n%s", got, want)
		}
		f.absent(t, converge.ObservedGenerationFile)
	})

	t.Run("three quick desired states end at the last one", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		f.run(t)
		g := f.gpus(t)
		recv(t, f.cp.Hellos, "Hello")
		for gen := int64(1); gen <= 3; gen++ {
			f.cp.SetDesired(&agentv1.DesiredState{Generation: gen, Spec: &agentv1.NodeSpec{
				Devices: &agentv1.DeviceAssignments{Assignments: []*agentv1.DeviceAssignment{{ReservationId: fmt.Sprintf("rsv_%d", gen), GpuUuids: []string{g[gen]}}}},
				Site:    &agentv1.SiteSettings{LogLevel: ptr([]string{"", "debug", "warn", "error"}[gen])},
			}})
		}
		o := f.observed(t, 3)
		if o.GetObservedGeneration() != 3 {
			t.Errorf("observed_generation %d, want 3", o.GetObservedGeneration())
		}
		if got, want := cdiDevices(t, f.file(t, converge.CDISpecFile)), cdiJSON([2]string{"rsv_3", g[3]}); got != want {
			t.Errorf("CDI spec:\n%s\nwant:\n%s", got, want)
		}
		if got, want := f.file(t, converge.SiteFile), "{\n  \"log_level\": \"error\"\n}\n"; got != want {
			t.Errorf("site.json %q, want %q", got, want)
		}
		f.absent(t, converge.HealthFile)
	})

	t.Run("a restarted client says Hello with the persisted generation and catches up in one step", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		stop := f.run(t)
		g := f.gpus(t)
		recv(t, f.cp.Hellos, "Hello")
		f.cp.SetDesired(&agentv1.DesiredState{Generation: 2, Spec: &agentv1.NodeSpec{Site: &agentv1.SiteSettings{LogLevel: ptr("info")}}})
		if o := f.observed(t, 2); o.GetObservedGeneration() != 2 {
			t.Fatalf("observed_generation %d, want 2", o.GetObservedGeneration())
		}
		stop()

		// Offline while the spec changes twice: only the latest is sent.
		f.cp.SetDesired(&agentv1.DesiredState{Generation: 3, Spec: &agentv1.NodeSpec{Site: &agentv1.SiteSettings{LogLevel: ptr("warn")}}})
		f.cp.SetDesired(&agentv1.DesiredState{Generation: 5, Spec: &agentv1.NodeSpec{
			Devices: &agentv1.DeviceAssignments{Assignments: []*agentv1.DeviceAssignment{{ReservationId: "rsv_x", GpuUuids: []string{g[7]}}}},
		}})
		f.run(t)
		h := recv(t, f.cp.Hellos, "Hello after restart")
		if h.GetObservedGeneration() != 2 {
			t.Errorf("Hello.observed_generation %d, want 2", h.GetObservedGeneration())
		}
		o := recv(t, f.cp.Observed, "Observed after restart")
		if o.GetGeneration() != 5 || o.GetObservedGeneration() != 5 {
			t.Errorf("first Observed after restart: generation %d, observed %d; want 5, 5", o.GetGeneration(), o.GetObservedGeneration())
		}
		f.absent(t, converge.SiteFile)
		if got, want := cdiDevices(t, f.file(t, converge.CDISpecFile)), cdiJSON([2]string{"rsv_x", g[7]}); got != want {
			t.Errorf("CDI spec:\n%s\nwant:\n%s", got, want)
		}
	})
}

// TestCDISpecRemovedByHandRestoredWithinTheDriftCheck: with the periodic
// re-converge an hour away, a CDI spec removed by hand is restored by the
// drift check, and the node reports the devices section drifted, then
// converged.
func TestCDISpecRemovedByHandRestoredWithinTheDriftCheck(t *testing.T) {
	t.Parallel()
	f := setup(t, nil)
	f.cfg.ReconvergeInterval = time.Hour
	f.cfg.DriftCheckInterval = 20 * time.Millisecond
	f.run(t)
	g := f.gpus(t)
	recv(t, f.cp.Hellos, "Hello")
	f.cp.SetDesired(&agentv1.DesiredState{Generation: 1, Spec: &agentv1.NodeSpec{
		Identity: &agentv1.NodeIdentity{NodeId: f.id.NodeID, PoolId: "pool_1"},
		Devices:  &agentv1.DeviceAssignments{Assignments: []*agentv1.DeviceAssignment{{ReservationId: "rsv_a", GpuUuids: []string{g[1]}}}},
	}})
	f.observed(t, 1)
	want := f.file(t, converge.CDISpecFile)
	if err := os.Remove(filepath.Join(f.store.Root(), converge.CDISpecFile)); err != nil {
		t.Fatal(err)
	}
	// Reports for generation 1 sent before the removal may still be queued;
	// the drift check's report says drifted (recv bounds the wait).
	for !strings.HasPrefix(sectionStates(f.observed(t, 1))["devices"].GetReason(), "drifted: ") {
	}
	if got := f.file(t, converge.CDISpecFile); got != want {
		t.Fatalf("restored spec\n%s\nwant\n%s", got, want)
	}
}
