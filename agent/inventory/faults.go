package inventory

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"
)

// FaultsFile is the name of a simulated machine's faults file, in its state
// directory: the mock NVML of the daemon running there re-reads it on every
// health check, so another process (bcsim fault, a test) can break and mend
// its GPUs.
const FaultsFile = "nvml-faults.json"

// Fault is what is wrong with one mock GPU. The mock devices read it on
// every query, so the health checks (and Diagnose, and gpu.reset) see it.
// The zero value is a healthy GPU.
type Fault struct {
	// XIDs are critical XID errors the GPU raised: the mock's event set
	// delivers each once while it is injected. XID 79 also takes the GPU
	// off the bus (see FallenOffBus).
	XIDs []uint32 `json:"xids,omitempty"`
	// UncorrectableECC and CorrectableECC are the volatile ECC counts.
	UncorrectableECC uint64 `json:"uncorrectable_ecc,omitempty"`
	CorrectableECC   uint64 `json:"correctable_ecc,omitempty"`
	// RetiredPages is how many pages are retired.
	RetiredPages uint32 `json:"retired_pages,omitempty"`
	// RetirementPending: a page retirement waits for a reset.
	RetirementPending bool `json:"retirement_pending,omitempty"`
	// RowRemapPending and RowRemapFailed are the row remapper's state.
	RowRemapPending bool `json:"row_remap_pending,omitempty"`
	RowRemapFailed  bool `json:"row_remap_failed,omitempty"`
	// ThermalSlowdown: HW thermal slowdown is active.
	ThermalSlowdown bool `json:"thermal_slowdown,omitempty"`
	// TemperatureCelsius, when set, replaces the GPU's temperature.
	TemperatureCelsius uint32 `json:"temperature_celsius,omitempty"`
	// PowerBrake: HW power-brake slowdown is active.
	PowerBrake bool `json:"power_brake,omitempty"`
	// PCIeWidthDegraded: the link trained at x8 of x16.
	PCIeWidthDegraded bool `json:"pcie_width_degraded,omitempty"`
	// PCIeGenDegraded: the link runs at Gen 3 of Gen 5.
	PCIeGenDegraded bool `json:"pcie_gen_degraded,omitempty"`
	// FallenOffBus: every health query answers ERROR_GPU_IS_LOST (the
	// identity the driver cached still reads).
	FallenOffBus bool `json:"fallen_off_bus,omitempty"`
	// ComputePIDs are compute processes running on the GPU (gpu.reset
	// refuses them unless forced).
	ComputePIDs []uint32 `json:"compute_pids,omitempty"`
	// MIGNeedsReset: a MIG mode change stays pending until the GPU is
	// reset (gpu.reset) or the machine reboots, as on a GPU the driver
	// cannot switch live.
	MIGNeedsReset bool `json:"mig_needs_reset,omitempty"`
	// MIGBusy: processes run on the GPU's MIG instances, so destroying
	// one (or changing the mode) answers IN_USE.
	MIGBusy bool `json:"mig_busy,omitempty"`
	// MIGUnsupportedProfiles are MIG profiles ("1g.18gb+me") this GPU's
	// driver does not offer: their profile info answers NOT_SUPPORTED.
	MIGUnsupportedProfiles []string `json:"mig_unsupported_profiles,omitempty"`
}

// lost reports whether the GPU is off the bus.
func (f Fault) lost() bool { return f.FallenOffBus || slices.Contains(f.XIDs, xidFallenOffBus) }

// merge adds x to f: lists are joined (without repeats), counts and flags
// take the larger or the set value.
func (f *Fault) merge(x Fault) {
	for _, v := range x.XIDs {
		if !slices.Contains(f.XIDs, v) {
			f.XIDs = append(f.XIDs, v)
		}
	}
	for _, v := range x.ComputePIDs {
		if !slices.Contains(f.ComputePIDs, v) {
			f.ComputePIDs = append(f.ComputePIDs, v)
		}
	}
	f.UncorrectableECC = max(f.UncorrectableECC, x.UncorrectableECC)
	f.CorrectableECC = max(f.CorrectableECC, x.CorrectableECC)
	f.RetiredPages = max(f.RetiredPages, x.RetiredPages)
	f.TemperatureCelsius = max(f.TemperatureCelsius, x.TemperatureCelsius)
	f.RetirementPending = f.RetirementPending || x.RetirementPending
	f.RowRemapPending = f.RowRemapPending || x.RowRemapPending
	f.RowRemapFailed = f.RowRemapFailed || x.RowRemapFailed
	f.ThermalSlowdown = f.ThermalSlowdown || x.ThermalSlowdown
	f.PowerBrake = f.PowerBrake || x.PowerBrake
	f.PCIeWidthDegraded = f.PCIeWidthDegraded || x.PCIeWidthDegraded
	f.PCIeGenDegraded = f.PCIeGenDegraded || x.PCIeGenDegraded
	f.FallenOffBus = f.FallenOffBus || x.FallenOffBus
	f.MIGNeedsReset = f.MIGNeedsReset || x.MIGNeedsReset
	f.MIGBusy = f.MIGBusy || x.MIGBusy
	for _, v := range x.MIGUnsupportedProfiles {
		if !slices.Contains(f.MIGUnsupportedProfiles, v) {
			f.MIGUnsupportedProfiles = append(f.MIGUnsupportedProfiles, v)
		}
	}
}

// zero reports whether f injects nothing.
func (f *Fault) zero() bool {
	return len(f.XIDs) == 0 && len(f.ComputePIDs) == 0 && f.UncorrectableECC == 0 && f.CorrectableECC == 0 &&
		f.RetiredPages == 0 && f.TemperatureCelsius == 0 && !f.RetirementPending && !f.RowRemapPending &&
		!f.RowRemapFailed && !f.ThermalSlowdown && !f.PowerBrake && !f.PCIeWidthDegraded && !f.PCIeGenDegraded && !f.FallenOffBus &&
		!f.MIGNeedsReset && !f.MIGBusy && len(f.MIGUnsupportedProfiles) == 0
}

// faultsFileContent is the faults file: faults by GPU index.
type faultsFileContent struct {
	GPUs map[int]Fault `json:"gpus"`
}

// Faults are the injected faults of one mock machine, by GPU index. With a
// file (NewFaults(path)) they live in it: Refresh re-reads it when it
// changed, Inject and Clear rewrite it, so several processes share them.
// Its methods are safe for concurrent use.
type Faults struct {
	path string

	mu    sync.Mutex
	gpus  map[int]Fault
	size  int64
	mtime time.Time
	err   error // the last read's error, logged once by the owner
}

// NewFaults returns a machine's faults, kept in path when it is not empty
// (read now; a missing file is no faults).
func NewFaults(path string) *Faults {
	f := &Faults{path: path, gpus: map[int]Fault{}}
	f.Refresh()
	return f
}

// Path is the faults file; empty when the faults live in memory only.
func (f *Faults) Path() string { return f.path }

// Refresh re-reads the file when its size or modification time changed
// since the last read or write. A file that does not parse leaves the
// faults as they were (Err says why).
func (f *Faults) Refresh() {
	if f == nil || f.path == "" {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	st, err := os.Stat(f.path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		if f.size != 0 || !f.mtime.IsZero() {
			f.gpus, f.size, f.mtime = map[int]Fault{}, 0, time.Time{}
		}
		return
	case err != nil:
		f.err = err
		return
	case st.Size() == f.size && st.ModTime().Equal(f.mtime):
		return
	}
	gpus, err := readFaults(f.path)
	if err != nil {
		f.err = err
		return
	}
	f.gpus, f.size, f.mtime, f.err = gpus, st.Size(), st.ModTime(), nil
}

// Err is the error of the last file read, nil when it parsed.
func (f *Faults) Err() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.err
}

// Get returns GPU index's faults (the zero Fault when healthy). The slices
// are shared: do not change them.
func (f *Faults) Get(index int) Fault {
	if f == nil {
		return Fault{}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.gpus[index]
}

// All returns a copy of every GPU's faults.
func (f *Faults) All() map[int]Fault {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make(map[int]Fault, len(f.gpus))
	for i, x := range f.gpus {
		out[i] = x
	}
	return out
}

// Inject adds x to GPU index's faults (see Fault.merge: flags are set,
// counts raised, XIDs and processes added) and rewrites the file.
func (f *Faults) Inject(index int, x Fault) error {
	if index < 0 {
		return fmt.Errorf("inventory: fault on GPU %d", index)
	}
	return f.update(func(gpus map[int]Fault) {
		cur := gpus[index]
		cur.XIDs, cur.ComputePIDs = slices.Clone(cur.XIDs), slices.Clone(cur.ComputePIDs)
		cur.MIGUnsupportedProfiles = slices.Clone(cur.MIGUnsupportedProfiles)
		cur.merge(x)
		gpus[index] = cur
	})
}

// Clear removes GPU index's faults (a reset GPU is healthy again).
func (f *Faults) Clear(index int) error {
	return f.update(func(gpus map[int]Fault) { delete(gpus, index) })
}

// ClearAll removes every GPU's faults.
func (f *Faults) ClearAll() error {
	return f.update(func(gpus map[int]Fault) { clear(gpus) })
}

// update re-reads the file, applies fn to a copy of the faults, writes the
// file back and keeps the result.
func (f *Faults) update(fn func(map[int]Fault)) error {
	f.Refresh()
	f.mu.Lock()
	defer f.mu.Unlock()
	next := make(map[int]Fault, len(f.gpus)+1)
	for i, x := range f.gpus {
		next[i] = x
	}
	fn(next)
	for i, x := range next {
		if x.zero() {
			delete(next, i)
		}
	}
	if f.path != "" {
		if err := writeFaults(f.path, next); err != nil {
			return err
		}
		if st, err := os.Stat(f.path); err == nil {
			f.size, f.mtime = st.Size(), st.ModTime()
		}
	}
	f.gpus = next
	return nil
}

// maxFaultsFile bounds the faults file a mock reads.
const maxFaultsFile = 1 << 20

func readFaults(path string) (map[int]Fault, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	if len(b) > maxFaultsFile {
		return nil, fmt.Errorf("inventory: %s: %d bytes, at most %d", path, len(b), maxFaultsFile)
	}
	var c faultsFileContent
	if err := json.Unmarshal(b, &c); err != nil {
		return nil, fmt.Errorf("inventory: %s: %w", path, err)
	}
	if c.GPUs == nil {
		c.GPUs = map[int]Fault{}
	}
	return c.GPUs, nil
}

// writeFaults replaces path atomically (temporary file, rename).
func writeFaults(path string, gpus map[int]Fault) error {
	b, err := json.MarshalIndent(faultsFileContent{GPUs: gpus}, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".nvml-faults-*")
	if err != nil {
		return err
	}
	defer func() { _ = os.Remove(tmp.Name()) }()
	if _, err := tmp.Write(append(b, '\n')); err != nil {
		_ = tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}
