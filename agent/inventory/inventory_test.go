package inventory_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"

	"github.com/bettercompute/bettercompute/agent/inventory"
)

func TestMock_ReportsEightH200(t *testing.T) {
	t.Parallel()
	c, err := inventory.Open(inventory.Config{Backend: inventory.BackendMock, Hostname: "sim-1"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })

	r, err := c.Report(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(r.GetSections(), ","); got != "gpus,host" {
		t.Errorf("sections %q", got)
	}
	if len(r.GetGpus()) != 8 {
		t.Fatalf("%d GPUs, want 8", len(r.GetGpus()))
	}
	seen := map[string]bool{}
	for i, g := range r.GetGpus() {
		if g.GetIndex() != uint32(i) || !strings.HasPrefix(g.GetUuid(), "GPU-") || !strings.Contains(g.GetModel(), "H200") {
			t.Errorf("gpu %d: %v", i, g)
		}
		if g.GetMemoryBytes() < 140<<30 || g.GetSerial() == "" || !g.GetHealthy() || g.GetMigEnabled() {
			t.Errorf("gpu %d: %v", i, g)
		}
		if want := "0000:0" + string(rune('0'+i)) + ":00.0"; g.GetPciBusId() != want {
			t.Errorf("gpu %d: bus id %q, want %q", i, g.GetPciBusId(), want)
		}
		if seen[g.GetUuid()] {
			t.Errorf("duplicate uuid %s", g.GetUuid())
		}
		seen[g.GetUuid()] = true
	}
	h := r.GetHost()
	if h.GetHostname() != "sim-1" || h.GetDriverVersion() != "550.54.15" || h.GetCudaVersion() != "12.4" {
		t.Errorf("host %v", h)
	}
}

func TestReport_Sections(t *testing.T) {
	t.Parallel()
	c, err := inventory.Open(inventory.Config{Backend: inventory.BackendMock})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	r, err := c.Report(context.Background(), []string{inventory.SectionHost, "bogus"})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.GetGpus()) != 0 || r.GetHost() == nil || len(r.GetSections()) != 1 {
		t.Errorf("report %v", r)
	}
}

func TestClaims_UseOverrides(t *testing.T) {
	t.Parallel()
	c, err := inventory.Open(inventory.Config{Backend: inventory.BackendMock, Hostname: "h", MachineID: "m", SystemSerial: "s"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	cl, err := c.Claims(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if cl.GetHostname() != "h" || cl.GetMachineId() != "m" || cl.GetSystemSerial() != "s" || len(cl.GetGpus()) != 8 {
		t.Errorf("claims %v", cl)
	}
}

func TestGPU_UnhealthyWhenRowRemappingFailed(t *testing.T) {
	t.Parallel()
	lib := inventory.NewMock()
	d := lib.Devices[3].(*server.Device)
	d.GetRemappedRowsFunc = func() (int, int, bool, bool, nvml.Return) { return 0, 1, false, true, nvml.SUCCESS }
	d.GetRetiredPagesPendingStatusFunc = func() (nvml.EnableState, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED }
	c, err := inventory.New(lib, inventory.Config{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	gpus, err := c.GPUs(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for i, g := range gpus {
		if want := i != 3; g.GetHealthy() != want {
			t.Errorf("gpu %d healthy=%v, want %v (%s)", i, g.GetHealthy(), want, g.GetHealthReason())
		}
	}
	if r := gpus[3].GetHealthReason(); r != "retired_pages: row remapping failed" {
		t.Errorf("reason %q", r)
	}
	if fc := gpus[3].GetFailedChecks(); !slices.Equal(fc, []string{"retired_pages"}) {
		t.Errorf("failed checks %q", fc)
	}
}

func TestGPU_IdentityFailureFails(t *testing.T) {
	t.Parallel()
	lib := inventory.NewMock()
	lib.Devices[0].(*server.Device).GetUUIDFunc = func() (string, nvml.Return) { return "", nvml.ERROR_GPU_IS_LOST }
	c, err := inventory.New(lib, inventory.Config{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	if _, err := c.GPUs(context.Background()); err == nil || !strings.Contains(err.Error(), "gpu 0: uuid") {
		t.Errorf("err %v", err)
	}
}

// TestReal_WithoutDriver runs on machines without libnvidia-ml.so (CI, dev
// boxes): selecting the real backend must fail clearly, not panic.
func TestReal_WithoutDriver(t *testing.T) {
	t.Parallel()
	c, err := inventory.Open(inventory.Config{Backend: inventory.BackendReal})
	if err == nil {
		_ = c.Close()
		t.Skip("NVML is available on this machine")
	}
	if !errors.Is(err, inventory.ErrNVMLUnavailable) || !strings.Contains(err.Error(), "NVML not available") {
		t.Errorf("err %v, want ErrNVMLUnavailable", err)
	}
}

func TestOpen_UnknownBackend(t *testing.T) {
	t.Parallel()
	if _, err := inventory.Open(inventory.Config{Backend: "fake"}); err == nil {
		t.Error("no error for an unknown backend")
	}
}

func TestClose_Twice(t *testing.T) {
	t.Parallel()
	c, err := inventory.Open(inventory.Config{Backend: inventory.BackendMock})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.GPUs(context.Background()); err == nil {
		t.Error("GPUs after Close succeeded")
	}
}

// TestMock_GPUsFollowTheMachine: a simulated machine keeps its GPUs across
// restarts (same machine id → same UUIDs and serials); different machines,
// or machines with nothing to seed from, get different ones.
func TestMock_GPUsFollowTheMachine(t *testing.T) {
	uuids := func(cfg inventory.Config) []string {
		t.Helper()
		cfg.Backend = inventory.BackendMock
		c, err := inventory.Open(cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = c.Close() }()
		gpus, err := c.GPUs(t.Context())
		if err != nil || len(gpus) != 8 {
			t.Fatalf("gpus %v %v", gpus, err)
		}
		var out []string
		for _, g := range gpus {
			if !strings.HasPrefix(g.GetUuid(), "GPU-") || len(g.GetUuid()) != len("GPU-")+36 {
				t.Fatalf("not a GPU UUID: %q", g.GetUuid())
			}
			out = append(out, g.GetUuid()+"/"+g.GetSerial())
		}
		return out
	}
	first := uuids(inventory.Config{Hostname: "sim-1", MachineID: "m-1"})
	if again := uuids(inventory.Config{Hostname: "sim-1", MachineID: "m-1"}); !slices.Equal(first, again) {
		t.Fatalf("a restarted machine changed GPUs:\n%v\n%v", first, again)
	}
	if other := uuids(inventory.Config{Hostname: "sim-2", MachineID: "m-2"}); slices.ContainsFunc(other, func(u string) bool { return slices.Contains(first, u) }) {
		t.Fatalf("two machines share a GPU: %v %v", first, other)
	}
	if slices.Equal(uuids(inventory.Config{}), uuids(inventory.Config{})) {
		t.Fatal("unseeded mocks made the same GPUs")
	}
	if len(slices.Compact(slices.Sorted(slices.Values(first)))) != 8 {
		t.Fatalf("a machine's GPUs repeat: %v", first)
	}
}

// TestMinors_ByUUID: every GPU's minor number (its /dev/nvidia<minor>, for
// the CDI spec) by UUID; the mock's are 0 to 7.
func TestMinors_ByUUID(t *testing.T) {
	t.Parallel()
	c, err := inventory.Open(inventory.Config{Backend: inventory.BackendMock})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close() }()
	gpus, err := c.GPUs(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	m, err := c.Minors(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(m) != len(gpus) {
		t.Fatalf("minors %v for %d GPUs", m, len(gpus))
	}
	for _, g := range gpus {
		if got, ok := m[g.GetUuid()]; !ok || got != int(g.GetIndex()) {
			t.Fatalf("GPU %s (index %d): minor %d %v", g.GetUuid(), g.GetIndex(), got, ok)
		}
	}
}

// BenchmarkMetrics8GPUs is one telemetry collection's NVML side on the
// mock's eight GPUs (steady state: the buffer is reused).
func BenchmarkMetrics8GPUs(b *testing.B) {
	c, err := inventory.New(inventory.NewMock(), inventory.Config{})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = c.Close() }()
	var buf []inventory.GPUMetrics
	for b.Loop() {
		if buf, err = c.Metrics(b.Context(), buf); err != nil || len(buf) != 8 {
			b.Fatal(len(buf), err)
		}
	}
}

// TestMetricsReadings: every reading of a healthy mock GPU is there, an
// injected fault shows in it (temperature, ECC, XID count), and a GPU that
// fell off the bus reports no readings rather than zeros.
func TestMetricsReadings(t *testing.T) {
	c, err := inventory.New(inventory.NewMock(), inventory.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close() }()
	all := inventory.MetricUtilization | inventory.MetricMemory | inventory.MetricTemperature | inventory.MetricPower |
		inventory.MetricClocks | inventory.MetricThrottle | inventory.MetricECC | inventory.MetricPCIeReplays
	if err := c.Faults().Inject(1, inventory.Fault{TemperatureCelsius: 88, UncorrectableECC: 3, XIDs: []uint32{48}, ThermalSlowdown: true}); err != nil {
		t.Fatal(err)
	}
	if err := c.Faults().Inject(2, inventory.Fault{FallenOffBus: true}); err != nil {
		t.Fatal(err)
	}
	ms, err := c.Metrics(t.Context(), nil)
	if err != nil || len(ms) != 8 {
		t.Fatalf("%d GPUs, %v", len(ms), err)
	}
	for _, m := range ms {
		switch m.Index {
		case 1:
			if m.Has != all || m.TemperatureCelsius != 88 || m.ECCUncorrected != 3 || m.XIDEvents != 1 || m.ThrottleReasons&nvml.ClocksThrottleReasonHwThermalSlowdown == 0 {
				t.Errorf("faulty GPU: %+v", m)
			}
		case 2:
			if m.Has&(inventory.MetricTemperature|inventory.MetricUtilization|inventory.MetricECC|inventory.MetricClocks|inventory.MetricPower) != 0 {
				t.Errorf("a GPU off the bus reports readings: %+v", m)
			}
		default:
			if m.Has != all || m.UUID == "" || m.MemoryTotalBytes == 0 || m.PowerWatts <= 0 || m.SMClockMHz == 0 || m.XIDEvents != 0 {
				t.Errorf("healthy GPU %d: %+v", m.Index, m)
			}
		}
	}
}
