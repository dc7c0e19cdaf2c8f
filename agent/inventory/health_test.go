package inventory_test

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"

	"github.com/bettercompute/bettercompute/agent/inventory"
)

func mockCollector(t testing.TB, cfg inventory.Config) (*inventory.Collector, *server.Server) {
	t.Helper()
	lib := inventory.NewMock()
	c, err := inventory.New(lib, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c, lib
}

// TestHealth_EachFault: every injectable fault fails its check on that GPU
// alone, with a reason naming the check and the numbers; the report says
// so too; clearing the fault makes the GPU healthy again.
func TestHealth_EachFault(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name   string
		fault  inventory.Fault
		checks []string
		reason string
	}{
		{"xid 48", inventory.Fault{XIDs: []uint32{48}}, []string{"xid"}, "xid: critical XID 48"},
		{"xid 79 falls off the bus", inventory.Fault{XIDs: []uint32{79}}, []string{"xid", "fallen_off_bus"}, "fallen_off_bus: XID 79"},
		{"uncorrectable ecc", inventory.Fault{UncorrectableECC: 3}, []string{"ecc"}, "ecc: 3 volatile uncorrectable ECC errors (max 0)"},
		{"retired pages", inventory.Fault{RetiredPages: 61}, []string{"retired_pages"}, "retired_pages: 61 pages retired (max 60)"},
		{"pending retirement", inventory.Fault{RetirementPending: true}, []string{"retired_pages"}, "page retirement pending"},
		{"row remap pending", inventory.Fault{RowRemapPending: true}, []string{"retired_pages"}, "row remapping pending"},
		{"thermal slowdown", inventory.Fault{ThermalSlowdown: true}, []string{"thermal"}, "thermal: HW thermal slowdown active at 36 °C"},
		{"power brake", inventory.Fault{PowerBrake: true}, []string{"power"}, "power: HW power-brake slowdown active"},
		{"pcie width", inventory.Fault{PCIeWidthDegraded: true}, []string{"pcie_link"}, "pcie_link: link width x8 below x16"},
		{"pcie gen", inventory.Fault{PCIeGenDegraded: true}, []string{"pcie_link"}, "pcie_link: link generation 3 below 5"},
		{"fallen off the bus", inventory.Fault{FallenOffBus: true}, []string{"fallen_off_bus"}, "fallen_off_bus: NVML reports the GPU lost (ERROR_GPU_IS_LOST)"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c, _ := mockCollector(t, inventory.Config{})
			if _, err := c.GPUs(t.Context()); err != nil { // identity read while healthy
				t.Fatal(err)
			}
			if err := c.Faults().Inject(2, tc.fault); err != nil {
				t.Fatal(err)
			}
			hs, err := c.CheckHealth(t.Context(), nil)
			if err != nil {
				t.Fatal(err)
			}
			for i, h := range hs {
				if i == 2 {
					continue
				}
				if !h.Healthy() {
					t.Errorf("gpu %d unhealthy: %s", i, h.Reason)
				}
			}
			h := hs[2]
			if h.Healthy() || !slices.Equal(h.Failed.Names(), tc.checks) || !strings.Contains(h.Reason, tc.reason) {
				t.Fatalf("gpu 2: failed %v reason %q; want %v containing %q", h.Failed.Names(), h.Reason, tc.checks, tc.reason)
			}
			gpus, err := c.GPUs(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if g := gpus[2]; g.GetHealthy() || !slices.Equal(g.GetFailedChecks(), tc.checks) || g.GetHealthReason() != h.Reason || g.GetUuid() == "" {
				t.Fatalf("report: %v", g)
			}
			if err := c.Faults().Clear(2); err != nil {
				t.Fatal(err)
			}
			hs, err = c.CheckHealth(t.Context(), hs)
			if err != nil {
				t.Fatal(err)
			}
			if !hs[2].Healthy() {
				t.Fatalf("still unhealthy after Clear: %s", hs[2].Reason)
			}
		})
	}
}

// TestHealth_Thresholds: the section's thresholds and disabled checks are
// respected; fallen_off_bus cannot be disabled.
func TestHealth_Thresholds(t *testing.T) {
	t.Parallel()
	c, lib := mockCollector(t, inventory.Config{})
	f := c.Faults()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(f.Inject(0, inventory.Fault{UncorrectableECC: 2, CorrectableECC: 50}))
	must(f.Inject(1, inventory.Fault{RetiredPages: 10}))
	must(f.Inject(2, inventory.Fault{TemperatureCelsius: 85}))
	must(f.Inject(3, inventory.Fault{XIDs: []uint32{13}})) // not critical by default
	must(f.Inject(4, inventory.Fault{PowerBrake: true, FallenOffBus: false}))
	must(f.Inject(5, inventory.Fault{FallenOffBus: true}))
	lib.Devices[6].(*server.Device).GetCurrPcieLinkWidthFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED }
	must(f.Inject(6, inventory.Fault{PCIeWidthDegraded: true})) // unsupported query: skipped

	failed := func() [][]string {
		t.Helper()
		hs, err := c.CheckHealth(t.Context(), nil)
		if err != nil {
			t.Fatal(err)
		}
		out := make([][]string, len(hs))
		for i, h := range hs {
			out[i] = h.Failed.Names()
		}
		return out
	}
	got := failed()
	want := [][]string{{"ecc"}, nil, nil, nil, {"power"}, {"fallen_off_bus"}, nil, nil}
	if !slices.EqualFunc(got, want, slices.Equal) {
		t.Fatalf("defaults: %v, want %v", got, want)
	}

	c.SetHealthConfig(inventory.HealthConfig{
		MaxUncorrectableECCErrors: 2, MaxCorrectableECCErrors: 40, MaxRetiredPages: 5,
		MaxGPUTemperatureCelsius: 80, CriticalXIDs: []uint32{13},
		DisabledChecks: []string{"power", "fallen_off_bus"},
	})
	got = failed()
	want = [][]string{{"ecc"}, {"retired_pages"}, {"thermal"}, {"xid"}, nil, {"fallen_off_bus"}, nil, nil}
	if !slices.EqualFunc(got, want, slices.Equal) {
		t.Fatalf("thresholds: %v, want %v", got, want)
	}
	hs, _ := c.CheckHealth(t.Context(), nil)
	if r := hs[0].Reason; r != "ecc: 50 volatile correctable ECC errors (max 40)" {
		t.Errorf("gpu 0 reason %q", r)
	}
	if r := hs[2].Reason; r != "thermal: temperature 85 °C above 80 °C" {
		t.Errorf("gpu 2 reason %q", r)
	}

	c.SetHealthConfig(inventory.HealthConfig{DisabledChecks: []string{"ecc", "xid", "thermal", "retired_pages", "power", "pcie_link"}})
	got = failed()
	want = [][]string{nil, nil, nil, nil, nil, {"fallen_off_bus"}, nil, nil}
	if !slices.EqualFunc(got, want, slices.Equal) {
		t.Fatalf("all disabled: %v, want %v", got, want)
	}
}

// TestHealth_XIDLatchesUntilReset: a critical XID keeps the GPU unhealthy
// after the event was read, until ResetGPU (the event set delivers it
// once, as NVML does).
func TestHealth_XIDLatchesUntilReset(t *testing.T) {
	t.Parallel()
	c, _ := mockCollector(t, inventory.Config{})
	if err := c.Faults().Inject(1, inventory.Fault{XIDs: []uint32{48}}); err != nil {
		t.Fatal(err)
	}
	var hs []inventory.GPUHealth
	for range 3 {
		var err error
		if hs, err = c.CheckHealth(t.Context(), hs); err != nil {
			t.Fatal(err)
		}
		if !hs[1].Failed.Has("xid") {
			t.Fatalf("xid not latched: %v", hs[1])
		}
	}
	if !c.ResetGPU(hs[1].UUID) || c.ResetGPU("GPU-nope") {
		t.Fatal("ResetGPU")
	}
	// The fault is still injected, but its event was read once (as NVML
	// delivers it): after the reset the GPU is healthy.
	hs, _ = c.CheckHealth(t.Context(), hs)
	if !hs[1].Healthy() {
		t.Fatalf("after reset: %s", hs[1].Reason)
	}
}

// TestFaults_FileAcrossProcesses: faults written to a machine's faults file
// by one process (the bcsim code path: NewFaults(path).Inject) are seen by
// another's mock on its next check, and cleared the same way.
func TestFaults_FileAcrossProcesses(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), inventory.FaultsFile)
	c, _ := mockCollector(t, inventory.Config{FaultsFile: path})
	hs, err := c.CheckHealth(t.Context(), nil)
	if err != nil || !hs[3].Healthy() {
		t.Fatalf("%v %v", hs, err)
	}
	other := inventory.NewFaults(path) // "bcsim fault"
	if err := other.Inject(3, inventory.Fault{XIDs: []uint32{79}}); err != nil {
		t.Fatal(err)
	}
	hs, _ = c.CheckHealth(t.Context(), hs)
	if !hs[3].Failed.Has("fallen_off_bus") || !hs[3].Failed.Has("xid") {
		t.Fatalf("fault from the file not seen: %v", hs[3])
	}
	if err := inventory.NewFaults(path).Clear(3); err != nil {
		t.Fatal(err)
	}
	hs, _ = c.CheckHealth(t.Context(), hs)
	if !hs[3].Healthy() {
		t.Fatalf("cleared in the file, still %v", hs[3])
	}
	// And the mock's own Clear (a gpu.reset) rewrites the file.
	if err := other.Inject(4, inventory.Fault{PowerBrake: true}); err != nil {
		t.Fatal(err)
	}
	if hs, _ = c.CheckHealth(t.Context(), hs); hs[4].Healthy() {
		t.Fatal("power brake not seen")
	}
	if err := c.Faults().Clear(4); err != nil {
		t.Fatal(err)
	}
	if f := inventory.NewFaults(path).Get(4); f.PowerBrake {
		t.Fatal("the file still holds the cleared fault")
	}
}

// TestDiagnose_UsesTheChecks: diag.nvml sees the same faults.
func TestDiagnose_UsesTheChecks(t *testing.T) {
	t.Parallel()
	c, _ := mockCollector(t, inventory.Config{})
	if err := c.Faults().Inject(7, inventory.Fault{PCIeWidthDegraded: true}); err != nil {
		t.Fatal(err)
	}
	res, err := c.Diagnose(t.Context(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if g := res.GetGpus()[7]; g.GetHealthy() || !strings.HasPrefix(g.GetReason(), "pcie_link:") {
		t.Fatalf("gpu 7 %v", g)
	}
}

// BenchmarkCheckHealth is one pass of every check over the mock's eight
// GPUs (healthy), reusing the result slice.
func BenchmarkCheckHealth(b *testing.B) {
	c, _ := mockCollector(b, inventory.Config{})
	hs, err := c.CheckHealth(b.Context(), nil)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if hs, err = c.CheckHealth(b.Context(), hs); err != nil || len(hs) != 8 {
			b.Fatal(err)
		}
	}
}

// TestReal_HealthChecks runs the checks on the machine's own GPUs when it
// has a driver (skipped elsewhere): a pass must work on real NVML, with
// unsupported queries skipped rather than failing GPUs, and agree with the
// report.
func TestReal_HealthChecks(t *testing.T) {
	t.Parallel()
	c, err := inventory.Open(inventory.Config{Backend: inventory.BackendReal})
	if err != nil {
		t.Skipf("no NVML here: %v", err)
	}
	t.Cleanup(func() { _ = c.Close() })
	hs, err := c.CheckHealth(t.Context(), nil)
	if err != nil {
		t.Fatal(err)
	}
	gpus, err := c.GPUs(t.Context())
	if err != nil || len(gpus) != len(hs) {
		t.Fatalf("%d GPUs (%v), %d checked", len(gpus), err, len(hs))
	}
	for i, h := range hs {
		t.Logf("gpu %d %s: healthy=%v %s (%d °C)", i, h.UUID, h.Healthy(), h.Reason, h.TemperatureCelsius)
		if strings.Contains(h.Reason, "query failed") {
			t.Errorf("gpu %d: a query failed instead of being skipped: %s", i, h.Reason)
		}
		if gpus[i].GetUuid() != h.UUID {
			t.Errorf("gpu %d: uuid %s vs %s", i, gpus[i].GetUuid(), h.UUID)
		}
	}
}
