package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/sim"
)

// runFault is `bcsim fault`: it injects GPU faults into a simulated
// machine's mock NVML (or clears them) by writing the machine's faults
// file, which the running simulator's mock re-reads on its next health
// check:
//
//	bcsim fault --root bcsim-state --machine sim-0003 --gpu 2 --xid 79
//	bcsim fault --root bcsim-state --machine sim-0003 --gpu 2 --clear
//	bcsim fault --root bcsim-state --machine sim-0003 --gpu 0 --mig-needs-reset
func runFault(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("bcsim fault", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		root     = fs.String("root", "bcsim-state", "the simulator's state directory")
		machine  = fs.String("machine", "", "the simulated machine: its host name (sim-0003), directory (node-0003) or number; required")
		gpu      = fs.Int("gpu", -1, "the GPU index (0-7); with --clear and no --gpu, every GPU")
		xids     = fs.String("xid", "", "comma-separated critical XIDs to raise (79: fallen off the bus)")
		ecc      = fs.Uint64("ecc", 0, "volatile uncorrectable ECC errors")
		cecc     = fs.Uint64("correctable-ecc", 0, "volatile correctable ECC errors")
		retired  = fs.Uint("retired-pages", 0, "retired pages")
		pending  = fs.Bool("retirement-pending", false, "a page retirement pending")
		remap    = fs.Bool("row-remap-pending", false, "a row remap pending")
		remapBad = fs.Bool("row-remap-failed", false, "a row remap failed")
		thermal  = fs.Bool("thermal", false, "HW thermal slowdown")
		temp     = fs.Uint("temperature", 0, "the GPU temperature in °C")
		power    = fs.Bool("power-brake", false, "HW power-brake slowdown")
		width    = fs.Bool("pcie-width", false, "PCIe link trained at x8")
		gen      = fs.Bool("pcie-gen", false, "PCIe link at Gen 3")
		lost     = fs.Bool("fallen-off-bus", false, "the GPU fell off the bus (ERROR_GPU_IS_LOST)")
		pids     = fs.String("processes", "", "comma-separated pids of compute processes running on the GPU")
		clearIt  = fs.Bool("clear", false, "clear the GPU's faults (every GPU's without --gpu)")
		migReset = fs.Bool("mig-needs-reset", false, "a MIG mode change waits for a GPU reset (the mig section reports reset-required until gpu.reset)")
		migBusy  = fs.Bool("mig-busy", false, "processes run on the GPU's MIG instances: destroying one answers IN_USE (the mig section reports busy)")
		migNo    = fs.String("mig-unsupported", "", "comma-separated MIG profiles the GPU's driver does not offer (1g.18gb+me): the mig section fails terminally naming them")
	)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *machine == "" || fs.NArg() > 0 {
		return errors.New("fault: --machine is required (and no other arguments)")
	}
	path, err := sim.FaultsPath(*root, *machine)
	if err != nil {
		return err
	}
	faults := inventory.NewFaults(path)
	if err := faults.Err(); err != nil {
		return err
	}
	if *clearIt {
		if *gpu < 0 {
			err = faults.ClearAll()
		} else {
			err = faults.Clear(*gpu)
		}
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "cleared the faults of %s GPU %s (%s)\n", *machine, gpuName(*gpu), path)
		return nil
	}
	if *gpu < 0 || *gpu > 255 {
		return errors.New("fault: --gpu is required (0-7)")
	}
	f := inventory.Fault{
		UncorrectableECC: *ecc, CorrectableECC: *cecc, RetiredPages: uint32(*retired), RetirementPending: *pending,
		RowRemapPending: *remap, RowRemapFailed: *remapBad, ThermalSlowdown: *thermal, TemperatureCelsius: uint32(*temp),
		PowerBrake: *power, PCIeWidthDegraded: *width, PCIeGenDegraded: *gen, FallenOffBus: *lost,
		MIGNeedsReset: *migReset, MIGBusy: *migBusy,
	}
	for p := range strings.SplitSeq(*migNo, ",") {
		if p = strings.TrimSpace(p); p != "" {
			f.MIGUnsupportedProfiles = append(f.MIGUnsupportedProfiles, p)
		}
	}
	if f.XIDs, err = uints(*xids, "xid"); err != nil {
		return err
	}
	if f.ComputePIDs, err = uints(*pids, "processes"); err != nil {
		return err
	}
	if err := faults.Inject(*gpu, f); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "%s GPU %d now: %+v (%s)\n", *machine, *gpu, faults.Get(*gpu), path)
	return nil
}

func gpuName(i int) string {
	if i < 0 {
		return "all"
	}
	return strconv.Itoa(i)
}

func uints(s, flag string) ([]uint32, error) {
	var out []uint32
	for v := range strings.SplitSeq(s, ",") {
		if v = strings.TrimSpace(v); v == "" {
			continue
		}
		n, err := strconv.ParseUint(v, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("fault: --%s %q: %w", flag, v, err)
		}
		out = append(out, uint32(n))
	}
	return out, nil
}
