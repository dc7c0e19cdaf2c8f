package command_test

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/agent/command"
	"github.com/bettercompute/bettercompute/agent/internal/fakedcgmi"
	"github.com/bettercompute/bettercompute/agent/inventory"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// diagWith sets up an executor whose inventory (the mock DGX H200) runs
// dcgmi as the binary at dcgmi.
func diagWith(t *testing.T, dcgmi string) *fixture {
	t.Helper()
	inv, err := inventory.New(inventory.NewMock(), inventory.Config{Hostname: "test", DCGMI: dcgmi})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = inv.Close() })
	return setup(t, func(c *command.Config) { c.Inventory = inv })
}

func diagAt(level string, uuids ...string) *agentv1.CommandBody {
	return &agentv1.CommandBody{Kind: &agentv1.CommandBody_DiagNvml{DiagNvml: &agentv1.DiagNvml{Level: level, GpuUuids: uuids}}}
}

// run handles a diag.nvml and returns its final update.
func (f *fixture) run(t *testing.T, body *agentv1.CommandBody) *agentv1.CommandUpdate {
	t.Helper()
	f.e.Handle(cmd(1, command.KindDiagNvml, body))
	expect(t, f.next(t), 1, accepted, noReject)
	return f.next(t)
}

// quick (and no level) reads NVML only: dcgmi never runs.
func TestDiagQuickReadsNVML(t *testing.T) {
	t.Parallel()
	for _, level := range []string{"", "quick"} {
		fake := fakedcgmi.New(t, fakedcgmi.Pass, 0)
		f := diagWith(t, fake.Path)
		u := f.run(t, diagAt(level))
		expect(t, u, 1, succeeded, noReject)
		res := u.GetResult().GetDiagNvml()
		if res.GetLevel() != "quick" || res.GetDcgm() != nil || len(res.GetGpus()) != 8 || res.GetGpus()[0].GetTemperatureCelsius() == 0 {
			t.Fatalf("level %q: result %v", level, res)
		}
		if c := fake.Calls(t); len(c) != 0 {
			t.Fatalf("level %q ran dcgmi: %q", level, c)
		}
	}
}

// medium, long and full run dcgmi diag -r 2, 3 and 3 (JSON, on the GPUs
// asked for, by NVML index), with each test's result per GPU.
func TestDiagLevelRunsDCGMWithThatLevel(t *testing.T) {
	t.Parallel()
	for level, want := range map[string]string{"medium": "diag -r 2 -j -i 0,1", "long": "diag -r 3 -j -i 0,1", "full": "diag -r 3 -j -i 0,1"} {
		t.Run(level, func(t *testing.T) {
			t.Parallel()
			fake := fakedcgmi.New(t, fakedcgmi.Pass, 0)
			f := diagWith(t, fake.Path)
			uuids := gpuUUIDs(t, f, 2)
			u := f.run(t, diagAt(level, uuids...))
			expect(t, u, 1, succeeded, noReject)
			if c := fake.Calls(t); !slices.Equal(c, []string{want}) {
				t.Fatalf("dcgmi ran with %q, want %q", c, want)
			}
			dc := u.GetResult().GetDiagNvml().GetDcgm()
			if dc.GetStatus() != agentv1.DcgmStatus_DCGM_STATUS_PASSED || dc.GetVersion() != "3.3.5" || len(dc.GetTests()) != 7 {
				t.Fatalf("dcgm %v", dc)
			}
			pcie := dc.GetTests()[3]
			if pcie.GetName() != "PCIe" || pcie.GetCategory() != "Integration" || pcie.GetGpuUuid() != uuids[0] || pcie.GetResult() != "pass" {
				t.Fatalf("PCIe on GPU 0: %v", pcie)
			}
			if skip := dc.GetTests()[6]; skip.GetResult() != "skip" || skip.GetGpuUuid() != uuids[1] {
				t.Fatalf("memory on GPU 1: %v", skip)
			}
		})
	}
}

// Without DCGM a level that needs it fails with NOT_INSTALLED: never a
// silent pass.
func TestDiagWithoutDCGMSaysNotInstalled(t *testing.T) {
	t.Parallel()
	f := diagWith(t, filepath.Join(t.TempDir(), "no", "dcgmi"))
	u := f.run(t, diagAt("medium"))
	expect(t, u, 1, failed, noReject)
	res := u.GetResult().GetDiagNvml()
	if res.GetDcgm().GetStatus() != agentv1.DcgmStatus_DCGM_STATUS_NOT_INSTALLED || len(res.GetGpus()) != 8 {
		t.Fatalf("result %v", res)
	}
	if !strings.Contains(u.GetReason(), "DCGM not installed") {
		t.Fatalf("reason %q", u.GetReason())
	}
	// dcgmi that prints nothing readable is an error, not a pass.
	f = diagWith(t, fakedcgmi.New(t, "Error: unable to establish a connection to the specified host: localhost", 0).Path)
	u = f.run(t, diagAt("long"))
	expect(t, u, 1, failed, noReject)
	if dc := u.GetResult().GetDiagNvml().GetDcgm(); dc.GetStatus() != agentv1.DcgmStatus_DCGM_STATUS_ERROR || !strings.Contains(dc.GetReason(), "unable to establish") {
		t.Fatalf("dcgm %v", dc)
	}
	// Nor is a non-zero exit that no failed test explains.
	f = diagWith(t, fakedcgmi.New(t, fakedcgmi.Pass, 226).Path)
	u = f.run(t, diagAt("long"))
	expect(t, u, 1, failed, noReject)
	if dc := u.GetResult().GetDiagNvml().GetDcgm(); dc.GetStatus() != agentv1.DcgmStatus_DCGM_STATUS_ERROR || !strings.Contains(dc.GetReason(), "exited 226") {
		t.Fatalf("dcgm %v", dc)
	}
}

// A DCGM test that failed on one GPU fails the command naming the test and
// the GPU, which is unhealthy in the result; the others stay healthy.
func TestDiagFailedTestReported(t *testing.T) {
	t.Parallel()
	fake := fakedcgmi.New(t, fakedcgmi.FailPCIe, 226)
	f := diagWith(t, fake.Path)
	uuids := gpuUUIDs(t, f, 2)
	u := f.run(t, diagAt("medium", uuids...))
	expect(t, u, 1, failed, noReject)
	res := u.GetResult().GetDiagNvml()
	dc := res.GetDcgm()
	if dc.GetStatus() != agentv1.DcgmStatus_DCGM_STATUS_FAILED || !strings.Contains(dc.GetReason(), "PCIe on "+uuids[1]) || !strings.Contains(dc.GetReason(), "replay count 250") {
		t.Fatalf("dcgm %v", dc)
	}
	if g := res.GetGpus(); len(g) != 2 || !g[0].GetHealthy() || g[1].GetHealthy() || g[1].GetReason() != "DCGM PCIe failed" {
		t.Fatalf("gpus %v", g)
	}
	if !strings.Contains(u.GetReason(), "DCGM PCIe failed") || !strings.Contains(u.GetReason(), uuids[1]) {
		t.Fatalf("reason %q", u.GetReason())
	}
}

// The daemon refuses a level it does not know, whatever let it through.
func TestDiagUnknownLevelRefusedByDaemon(t *testing.T) {
	t.Parallel()
	fake := fakedcgmi.New(t, fakedcgmi.Pass, 0)
	f := diagWith(t, fake.Path)
	u := f.run(t, diagAt("3"))
	expect(t, u, 1, failed, noReject)
	if !strings.Contains(u.GetReason(), `unknown diag level "3"`) || len(fake.Calls(t)) != 0 {
		t.Fatalf("reason %q, calls %q", u.GetReason(), fake.Calls(t))
	}
}

// gpuUUIDs are the UUIDs of the mock's first n GPUs (by a quick diag).
func gpuUUIDs(t *testing.T, f *fixture, n int) []string {
	t.Helper()
	f.e.Handle(cmd(9, command.KindDiagNvml, diagAt("quick")))
	expect(t, f.next(t), 9, accepted, noReject)
	u := f.next(t)
	var out []string
	for _, g := range u.GetResult().GetDiagNvml().GetGpus()[:n] {
		out = append(out, g.GetUuid())
	}
	return out
}
