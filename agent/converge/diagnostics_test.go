package converge_test

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/bettercompute/bettercompute/agent/converge"
	"github.com/bettercompute/bettercompute/agent/internal/fakedcgmi"
	"github.com/bettercompute/bettercompute/agent/inventory"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// diagNode is a converger over the mock DGX H200 whose inventory runs the
// fake dcgmi.
func diagNode(t *testing.T, dcgmi string) (*converge.Converger, *inventory.Collector, []string) {
	t.Helper()
	inv, err := inventory.New(inventory.NewMock(), inventory.Config{Hostname: "test", DCGMI: dcgmi})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = inv.Close() })
	gpus := func(ctx context.Context) ([]string, error) {
		rep, err := inv.Report(ctx, []string{inventory.SectionGPUs})
		var out []string
		for _, g := range rep.GetGpus() {
			out = append(out, g.GetUuid())
		}
		return out, err
	}
	c, err := converge.New(converge.Config{Root: t.TempDir(), NodeID: "node_1", GPUs: gpus})
	if err != nil {
		t.Fatal(err)
	}
	all, err := gpus(t.Context())
	if err != nil || len(all) != 8 {
		t.Fatalf("GPUs %v, %v", all, err)
	}
	return c, inv, all
}

func diagSpec(level string, booked ...string) *agentv1.NodeSpec {
	s := &agentv1.NodeSpec{Health: &agentv1.HealthSettings{DiagnosticsInterval: durationpb.New(time.Millisecond), DiagnosticsLevel: level}}
	if len(booked) > 0 {
		s.Devices = &agentv1.DeviceAssignments{Assignments: []*agentv1.DeviceAssignment{{ReservationId: "rsv_1", GpuUuids: booked}}}
	}
	return s
}

// firstRun runs the background diagnostics until their first run.
func firstRun(t *testing.T, c *converge.Converger, d converge.Diagnoser) *converge.Diagnostics {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	runs := make(chan *converge.Diagnostics)
	var wg sync.WaitGroup
	wg.Go(func() {
		c.RunDiagnostics(ctx, d, func(r *converge.Diagnostics) {
			select {
			case runs <- r:
			case <-ctx.Done():
			}
		})
	})
	defer wg.Wait()
	defer cancel()
	select {
	case r := <-runs:
		return r
	case <-time.After(20 * time.Second):
		t.Fatal("no diagnostics run")
		return nil
	}
}

// The health section's background diagnostics never touch a booked GPU:
// dcgmi runs on the unbooked GPUs' indices only (at the section's level),
// the NVML checks read only them, the result is the health section's
// status reason; with every GPU booked nothing runs at all.
func TestPeriodicDiagnosticsSkipBookedGPUs(t *testing.T) {
	t.Parallel()
	fake := fakedcgmi.New(t, fakedcgmi.Pass, 0)
	c, inv, all := diagNode(t, fake.Path)
	booked := []string{all[0], all[3]}
	ss, _ := c.Converge(t.Context(), &agentv1.DesiredState{Generation: 1, Spec: diagSpec("medium", booked...)})
	if st := states(ss)["devices"].GetState(); st != agentv1.SectionState_SECTION_STATE_CONVERGED {
		t.Fatalf("devices %v", states(ss)["devices"])
	}
	run := firstRun(t, c, inv)
	calls := fake.Calls(t)
	if len(calls) == 0 {
		t.Fatal("dcgmi never ran")
	}
	for _, call := range calls {
		if call != "diag -r 2 -j -i 1,2,4,5,6,7" {
			t.Fatalf("dcgmi ran with %q", call)
		}
	}
	if !slices.Equal(run.Booked, booked) || len(run.GPUs) != 6 || slices.Contains(run.GPUs, all[0]) || slices.Contains(run.GPUs, all[3]) {
		t.Fatalf("diagnosed %v, left out %v", run.GPUs, run.Booked)
	}
	for _, g := range run.Result.GetGpus() {
		if slices.Contains(booked, g.GetUuid()) {
			t.Fatalf("booked GPU %s checked", g.GetUuid())
		}
	}
	for _, tt := range run.Result.GetDcgm().GetTests() {
		if slices.Contains(booked, tt.GetGpuUuid()) {
			t.Fatalf("DCGM test on booked GPU %v", tt)
		}
	}
	if !strings.Contains(run.Summary, "(medium, DCGM level 2) on 6 unbooked GPUs (2 booked left out): passed") {
		t.Fatalf("summary %q", run.Summary)
	}
	// Reported where the health section reports: its status.
	ss, _ = c.Converge(t.Context(), &agentv1.DesiredState{Generation: 1, Spec: diagSpec("medium", booked...)})
	if h := states(ss)["health"]; h.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED || !strings.Contains(h.GetReason(), "on 6 unbooked GPUs (2 booked left out): passed") {
		t.Fatalf("health %v", h)
	}

	// Every GPU booked (quick is DCGM level 1): nothing runs.
	c.Converge(t.Context(), &agentv1.DesiredState{Generation: 2, Spec: diagSpec("quick", all...)})
	before := len(fake.Calls(t))
	run = firstRun(t, c, inv)
	if n := len(fake.Calls(t)); n != before || run.Result != nil || len(run.GPUs) != 0 {
		t.Fatalf("dcgmi ran %d more times, result %v", n-before, run.Result)
	}
	if !strings.Contains(run.Summary, "(quick, DCGM level 1): none run, every GPU (8) is booked") {
		t.Fatalf("summary %q", run.Summary)
	}
}

// blockingDiagnoser stands for a long DCGM run: it says when it started
// and returns only when its context ends.
type blockingDiagnoser struct {
	started chan []string
}

func (b blockingDiagnoser) DiagnoseAt(ctx context.Context, uuids []string, _ int) (*agentv1.DiagNvmlResult, error) {
	b.started <- uuids
	<-ctx.Done()
	return nil, ctx.Err()
}

// A GPU booked while the background diagnostics run on it stops the run.
func TestPeriodicDiagnosticsStopWhenAGPUIsBooked(t *testing.T) {
	t.Parallel()
	c, _, all := diagNode(t, fakedcgmi.New(t, fakedcgmi.Pass, 0).Path)
	c.Converge(t.Context(), &agentv1.DesiredState{Generation: 1, Spec: diagSpec("long", all[0])})
	d := blockingDiagnoser{started: make(chan []string, 1)}
	var wg sync.WaitGroup
	defer wg.Wait() // the Converge below writes under the temp dir
	wg.Go(func() {
		uuids := <-d.started
		if slices.Contains(uuids, all[0]) || !slices.Contains(uuids, all[5]) {
			t.Errorf("diagnosing %v", uuids)
		}
		c.Converge(context.Background(), &agentv1.DesiredState{Generation: 2, Spec: diagSpec("long", all[0], all[5])})
	})
	run := firstRun(t, c, d)
	if !strings.Contains(run.Summary, "stopped, "+all[5]+" was booked during the run") {
		t.Fatalf("summary %q", run.Summary)
	}
}
