package main

import (
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/mig"
	"github.com/bettercompute/bettercompute/agent/sim"
	"github.com/bettercompute/bettercompute/proto/migcatalog"
)

// TestFault_ReachesTheSimulatedMachine: `bcsim fault` writes the machine's
// faults file and a running simulated machine's mock NVML (here a
// collector over that file, as agent/sim opens it) sees the fault on its
// next check; --clear mends it.
func TestFault_ReachesTheSimulatedMachine(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	if err := os.MkdirAll(sim.NodeDir(root, 3), 0o755); err != nil {
		t.Fatal(err)
	}
	path, err := sim.FaultsPath(root, "sim-0003")
	if err != nil || path != filepath.Join(root, "node-0003", inventory.FaultsFile) {
		t.Fatalf("path %q %v", path, err)
	}
	inv, err := inventory.Open(inventory.Config{Backend: inventory.BackendMock, Hostname: "sim-0003", FaultsFile: path})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = inv.Close() })
	check := func() []inventory.GPUHealth {
		t.Helper()
		hs, err := inv.CheckHealth(t.Context(), nil)
		if err != nil {
			t.Fatal(err)
		}
		return hs
	}
	if hs := check(); !hs[2].Healthy() {
		t.Fatalf("gpu 2 %v", hs[2])
	}
	bcsim := func(args ...string) error { return runFault(args, io.Discard, io.Discard) }
	if err := bcsim("--root", root, "--machine", "sim-0003", "--gpu", "2", "--xid", "79"); err != nil {
		t.Fatal(err)
	}
	if err := bcsim("--root", root, "--machine", "node-0003", "--gpu", "5", "--ecc", "4", "--processes", "77,78"); err != nil {
		t.Fatal(err)
	}
	hs := check()
	if !hs[2].Failed.Has(inventory.CheckFallenOffBus) || !hs[5].Failed.Has(inventory.CheckECC) || !hs[0].Healthy() {
		t.Fatalf("faults not seen: %v / %v", hs[2], hs[5])
	}
	if pids, _, _ := inv.ComputeProcesses(t.Context(), hs[5].UUID); len(pids) != 2 {
		t.Fatalf("processes %v", pids)
	}
	if err := bcsim("--root", root, "--machine", "3", "--gpu", "2", "--clear"); err != nil {
		t.Fatal(err)
	}
	if hs := check(); !hs[2].Healthy() || hs[5].Healthy() {
		t.Fatalf("after clearing gpu 2: %v / %v", hs[2], hs[5])
	}
	if err := bcsim("--root", root, "--machine", "sim-0003", "--clear"); err != nil {
		t.Fatal(err)
	}
	if hs := check(); !hs[5].Healthy() {
		t.Fatalf("after clearing all: %v", hs[5])
	}
	for _, bad := range [][]string{
		{"--root", root, "--machine", "sim-0009", "--gpu", "1", "--thermal"},
		{"--root", root, "--machine", "sim-0003", "--thermal"},
		{"--root", root, "--machine", "sim-0003", "--gpu", "1", "--xid", "x"},
		{"--root", root, "--gpu", "1"},
	} {
		if err := bcsim(bad...); err == nil {
			t.Errorf("%s: no error", strings.Join(bad, " "))
		}
	}
}

// TestFault_MIG: `bcsim fault` MIG flags reach the simulated machine's
// mock NVML: a mode change waits for a reset, a profile is not offered.
func TestFault_MIG(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	if err := os.MkdirAll(sim.NodeDir(root, 1), 0o755); err != nil {
		t.Fatal(err)
	}
	path, _ := sim.FaultsPath(root, "sim-0001")
	inv, err := inventory.Open(inventory.Config{Backend: inventory.BackendMock, Hostname: "sim-0001", FaultsFile: path})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = inv.Close() })
	gpus, err := inv.GPUs(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	bcsim := func(args ...string) error { return runFault(args, io.Discard, io.Discard) }
	if err := bcsim("--root", root, "--machine", "sim-0001", "--gpu", "1", "--mig-needs-reset"); err != nil {
		t.Fatal(err)
	}
	if err := bcsim("--root", root, "--machine", "sim-0001", "--gpu", "2", "--mig-unsupported", "1g.18gb+me, 7g.141gb"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := inv.ApplyMIG(mig.Want{GPU: gpus[1].GetUuid(), Enabled: true}); mig.KindOf(err) != mig.ResetRequired {
		t.Fatalf("GPU 1: %v, want reset-required", err)
	}
	_, _, err = inv.ApplyMIG(mig.Want{GPU: gpus[2].GetUuid(), Enabled: true, Instances: []migcatalog.Placement{{Profile: "7g.141gb"}}})
	if mig.KindOf(err) != mig.Unsupported || !strings.Contains(err.Error(), "7g.141gb") {
		t.Fatalf("GPU 2: %v, want 7g.141gb unsupported", err)
	}
}
