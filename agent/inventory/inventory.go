// Package inventory reports a node's hardware: its GPUs through NVML
// (github.com/NVIDIA/go-nvml), the driver and CUDA versions, and host facts
// (hostname, kernel, machine id, system serial).
//
// The NVML backend is chosen by configuration: BackendReal loads
// libnvidia-ml.so, BackendMock is go-nvml's simulated DGX H200 (eight H200
// GPUs, fresh UUIDs per Collector) for tests and simulated fleets.
//
// Every GPU report carries the GPU's health from the checks in health.go
// (XID, ECC, retired pages and row remapping, thermal and power slowdown,
// PCIe link, fallen off the bus), with the NodeSpec health section's
// thresholds (SetHealthConfig). The mock can be broken per GPU (faults.go):
// in process through Collector.Faults, across processes through a faults
// file the mock re-reads on every check.
package inventory

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"

	"github.com/bettercompute/bettercompute/agent/mig"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// Backends selectable in Config.Backend.
const (
	// BackendReal is the NVIDIA driver's libnvidia-ml.so.
	BackendReal = "real"
	// BackendMock is go-nvml's mock DGX H200: eight H200 GPUs.
	BackendMock = "mock"
)

// Sections a report can cover (InventoryRequest.sections).
const (
	// SectionGPUs is the GPU list.
	SectionGPUs = "gpus"
	// SectionHost is the host facts, driver and CUDA versions.
	SectionHost = "host"
)

// ErrNVMLUnavailable is returned by Open when the real backend is selected
// and the NVML library cannot be loaded or initialised (no driver, no GPU).
var ErrNVMLUnavailable = errors.New("NVML not available")

// Config selects the backend and overrides host facts. The zero value is the
// real NVML library and the machine's own host facts.
type Config struct {
	// Backend is BackendReal (the default when empty) or BackendMock.
	Backend string
	// Hostname overrides os.Hostname (simulated nodes set their own).
	Hostname string
	// MachineID overrides /etc/machine-id.
	MachineID string
	// SystemSerial overrides /sys/class/dmi/id/product_serial.
	SystemSerial string
	// FaultsFile, for the mock backend, is the JSON file of injected
	// faults (see [Faults]) the mock re-reads on every check: a simulated
	// machine's <state dir>/nvml-faults.json. Empty keeps the faults in
	// memory ([Collector.Faults]).
	FaultsFile string
	// Logger hears about checks the hardware cannot run; nil is silent.
	Logger *slog.Logger
	// CPUCount, MemoryBytes and DiskBytes override the host's size in the
	// host section (what a vps-host's capacity starts from). Unset, the
	// mock backend reports a DGX H200's (MockCPUCount, MockMemoryBytes,
	// MockDiskBytes) and the real one the machine's: its logical CPUs,
	// /proc/meminfo's MemTotal and the size of the file system holding
	// DiskPath.
	CPUCount    uint32
	MemoryBytes uint64
	DiskBytes   uint64
	// DiskPath is where the VPS instances' disks live (the state
	// directory); empty means "/".
	DiskPath string
	// DCGMI is the dcgmi binary DiagnoseAt runs for DCGM's diagnostics (a
	// name is looked up on PATH); empty means DefaultDCGMI.
	DCGMI string
}

// A DGX H200's size, as the mock backend reports it: 2 × 56-core Xeon
// Platinum 8480C with SMT, 2 TiB of memory, 8 × 3.84 TB of NVMe.
const (
	MockCPUCount    = 224
	MockMemoryBytes = 2 << 40
	MockDiskBytes   = 8 * 3_840_000_000_000
)

// Collector reads inventory from one NVML backend and runs the GPU health
// checks. Its methods are safe for concurrent use; Close releases the
// backend.
type Collector struct {
	cfg   Config
	mu    sync.Mutex // serialises NVML calls and Close
	lib   nvml.Interface
	open  bool
	rules atomic.Pointer[rules]
	// faults are the mock's injected faults; nil for real NVML.
	faults *Faults

	// Health check state, read on the first pass after Open or Rescan;
	// guarded by mu.
	devs         []*devState
	events       nvml.EventSet
	eventsFailed bool
	eventReasons bool
	// carried are latched XIDs by UUID across a Rescan.
	carried map[string][]uint32
}

// Open initialises the backend cfg selects. For BackendReal without a usable
// libnvidia-ml.so it returns an error wrapping ErrNVMLUnavailable.
func Open(cfg Config) (*Collector, error) {
	switch cfg.Backend {
	case "", BackendReal:
		return New(nvml.New(), cfg)
	case BackendMock:
		// The simulated machine's GPUs follow its machine id (or host
		// name) when one is configured, so they survive a restart.
		return New(NewMockSeeded(firstNonEmpty(cfg.MachineID, cfg.Hostname)), cfg)
	default:
		return nil, fmt.Errorf("inventory: unknown NVML backend %q (want %q or %q)", cfg.Backend, BackendReal, BackendMock)
	}
}

// New initialises lib, any NVML implementation, and returns a Collector over
// it. cfg.Backend is ignored. A go-nvml mock server (NewMock) gets fault
// injection: its devices read [Collector.Faults] (kept in cfg.FaultsFile
// when set) on every query.
func New(lib nvml.Interface, cfg Config) (c *Collector, err error) {
	defer func() {
		// go-nvml panics on some symbol lookups when the library is
		// half-loaded; turn that into the same clear error.
		if r := recover(); r != nil {
			c, err = nil, fmt.Errorf("%w: %v", ErrNVMLUnavailable, r)
		}
	}()
	var faults *Faults
	if s, ok := lib.(*server.Server); ok {
		faults = NewFaults(cfg.FaultsFile)
		lib = newMockLib(s, faults)
	}
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("%w: init: %s (is the NVIDIA driver installed? libnvidia-ml.so must be loadable)", ErrNVMLUnavailable, nvml.ErrorString(ret))
	}
	return &Collector{cfg: cfg, lib: lib, open: true, faults: faults}, nil
}

// Faults returns the mock backend's injected faults (nil for real NVML):
// Inject and Clear take effect on the next query.
func (c *Collector) Faults() *Faults { return c.faults }

// Close shuts the backend down. It is safe to call more than once.
func (c *Collector) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.open {
		return nil
	}
	c.open = false
	c.freeEvents()
	if ret := c.lib.Shutdown(); ret != nvml.SUCCESS {
		return fmt.Errorf("inventory: nvml shutdown: %s", nvml.ErrorString(ret))
	}
	return nil
}

// Report returns the sections asked for (SectionGPUs, SectionHost; empty
// means all). Unknown sections are ignored.
func (c *Collector) Report(ctx context.Context, sections []string) (*agentv1.InventoryReport, error) {
	want := map[string]bool{}
	for _, s := range sections {
		want[s] = true
	}
	all := len(sections) == 0
	r := &agentv1.InventoryReport{}
	if all || want[SectionGPUs] {
		gpus, err := c.GPUs(ctx)
		if err != nil {
			return nil, err
		}
		r.Sections = append(r.Sections, SectionGPUs)
		r.Gpus = gpus
	}
	if all || want[SectionHost] {
		h, err := c.Host(ctx)
		if err != nil {
			return nil, err
		}
		r.Sections = append(r.Sections, SectionHost)
		r.Host = h
	}
	return r, nil
}

// Claims returns the hardware claims a node presents when it joins:
// hostname, machine id, system serial (empty when unreadable) and GPUs.
func (c *Collector) Claims(ctx context.Context) (*agentv1.HardwareClaims, error) {
	gpus, err := c.GPUs(ctx)
	if err != nil {
		return nil, err
	}
	host, err := c.hostname()
	if err != nil {
		return nil, err
	}
	return &agentv1.HardwareClaims{
		Hostname:     host,
		MachineId:    firstNonEmpty(c.cfg.MachineID, readTrim("/etc/machine-id"), readTrim("/var/lib/dbus/machine-id")),
		SystemSerial: firstNonEmpty(c.cfg.SystemSerial, readTrim("/sys/class/dmi/id/product_serial")),
		Gpus:         gpus,
	}, nil
}

// Host returns the host facts with the driver and CUDA versions.
func (c *Collector) Host(_ context.Context) (*agentv1.Host, error) {
	host, err := c.hostname()
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.open {
		return nil, errors.New("inventory: collector closed")
	}
	driver, ret := c.lib.SystemGetDriverVersion()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("inventory: driver version: %s", nvml.ErrorString(ret))
	}
	cuda, ret := c.lib.SystemGetCudaDriverVersion()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("inventory: CUDA version: %s", nvml.ErrorString(ret))
	}
	h := &agentv1.Host{
		Hostname:      host,
		Kernel:        readTrim("/proc/sys/kernel/osrelease"),
		DriverVersion: driver,
		CudaVersion:   fmt.Sprintf("%d.%d", cuda/1000, cuda%1000/10),
		CpuCount:      c.cfg.CPUCount, MemoryBytes: c.cfg.MemoryBytes, DiskBytes: c.cfg.DiskBytes,
	}
	if c.faults != nil { // the mock: a DGX H200
		h.CpuCount = cmp.Or(h.CpuCount, MockCPUCount)
		h.MemoryBytes = cmp.Or(h.MemoryBytes, MockMemoryBytes)
		h.DiskBytes = cmp.Or(h.DiskBytes, MockDiskBytes)
		return h, nil
	}
	h.CpuCount = cmp.Or(h.CpuCount, uint32(runtime.NumCPU()))
	h.MemoryBytes = cmp.Or(h.MemoryBytes, memTotal())
	h.DiskBytes = cmp.Or(h.DiskBytes, diskSize(cmp.Or(c.cfg.DiskPath, "/")))
	return h, nil
}

// memTotal is /proc/meminfo's MemTotal in bytes; 0 when unreadable.
func memTotal() uint64 {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0
	}
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(line, "MemTotal:"); ok {
			f := strings.Fields(rest)
			if len(f) == 2 && f[1] == "kB" {
				if kb, err := strconv.ParseUint(f[0], 10, 64); err == nil {
					return kb << 10
				}
			}
		}
	}
	return 0
}

// diskSize is the size of the file system holding path; 0 when unknown.
func diskSize(path string) uint64 {
	var st syscall.Statfs_t
	if err := syscall.Statfs(path, &st); err != nil || st.Bsize <= 0 {
		return 0
	}
	return st.Blocks * uint64(st.Bsize)
}

// GPUs returns every GPU by index, with its health from a pass of the
// checks (see CheckHealth). A GPU whose identity cannot be read fails the
// call, unless it fell off the bus after it was read once: it is reported
// with the identity last read, unhealthy.
func (c *Collector) GPUs(ctx context.Context) ([]*agentv1.GPU, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.open {
		return nil, errors.New("inventory: collector closed")
	}
	if err := c.prepare(); err != nil {
		return nil, err
	}
	r := c.currentRules()
	gpus := make([]*agentv1.GPU, 0, len(c.devs))
	for i, st := range c.devs {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		id, ret, err := readIdentity(st.d)
		switch {
		case err == nil:
			st.ident = id
		case ret == nvml.ERROR_GPU_IS_LOST && st.ident != nil:
			id = st.ident
		default:
			return nil, fmt.Errorf("inventory: gpu %d: %w", i, err)
		}
		var h GPUHealth
		c.check(st, i, r, &h)
		g := id.gpu(i)
		g.Healthy, g.HealthReason, g.FailedChecks = h.Healthy(), h.Reason, h.Failed.Names()
		if id.mig {
			g.MigSlices = c.migSlices(id.uuid)
		}
		gpus = append(gpus, g)
	}
	return gpus, nil
}

// migSlices are the MIG slices of a GPU in MIG mode; none when they
// cannot be read (the mig section's status says why). c.mu is held.
func (c *Collector) migSlices(uuid string) []*agentv1.MigSlice {
	l, err := mig.Read(c.lib, uuid)
	if err != nil {
		if c.cfg.Logger != nil {
			c.cfg.Logger.Warn("reading the GPU's MIG slices", "gpu", uuid, "err", err)
		}
		return nil
	}
	out := make([]*agentv1.MigSlice, 0, len(l.Instances))
	for _, in := range l.Instances {
		out = append(out, &agentv1.MigSlice{Uuid: in.UUID, Profile: in.Profile, Start: uint32(in.Start),
			MemoryBytes: in.MemoryMiB << 20, GpuInstanceId: uint32(in.GI)})
	}
	return out
}

// DriverVersion returns the NVIDIA driver's version (NVML's), which the
// daemon watches to regenerate the CDI spec after a driver upgrade.
func (c *Collector) DriverVersion(_ context.Context) (string, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.open {
		return "", errors.New("inventory: collector closed")
	}
	v, ret := c.lib.SystemGetDriverVersion()
	if ret != nvml.SUCCESS {
		return "", fmt.Errorf("inventory: driver version: %s", nvml.ErrorString(ret))
	}
	return v, nil
}

// Minors returns each GPU's minor number by UUID (its device node is
// /dev/nvidia<minor>), for the CDI spec.
func (c *Collector) Minors(_ context.Context) (map[string]int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.open {
		return nil, errors.New("inventory: collector closed")
	}
	if err := c.prepare(); err != nil {
		return nil, err
	}
	out := make(map[string]int, len(c.devs))
	for i, st := range c.devs {
		u, ret := st.d.GetUUID()
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("inventory: gpu %d: uuid: %s", i, nvml.ErrorString(ret))
		}
		m, ret := st.d.GetMinorNumber()
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("inventory: gpu %d: minor number: %s", i, nvml.ErrorString(ret))
		}
		out[u] = m
	}
	return out, nil
}

// identity is what names a GPU in the inventory.
type identity struct {
	uuid, model, serial, busID string
	memory                     uint64
	mig                        bool
}

func (id *identity) gpu(index int) *agentv1.GPU {
	return &agentv1.GPU{Index: uint32(index), Uuid: id.uuid, Model: id.model, Serial: id.serial,
		MemoryBytes: id.memory, PciBusId: id.busID, MigEnabled: id.mig}
}

// readIdentity reads one device's identity. UUID, name, memory and PCI
// must be readable (ret is the failing query's code); serial and MIG mode
// are optional (not every board supports them).
func readIdentity(d nvml.Device) (*identity, nvml.Return, error) {
	id := &identity{}
	var ret nvml.Return
	if id.uuid, ret = d.GetUUID(); ret != nvml.SUCCESS {
		return nil, ret, fmt.Errorf("uuid: %s", nvml.ErrorString(ret))
	}
	if id.model, ret = d.GetName(); ret != nvml.SUCCESS {
		return nil, ret, fmt.Errorf("name: %s", nvml.ErrorString(ret))
	}
	mem, ret := d.GetMemoryInfo()
	if ret != nvml.SUCCESS {
		return nil, ret, fmt.Errorf("memory: %s", nvml.ErrorString(ret))
	}
	id.memory = mem.Total
	pci, ret := d.GetPciInfo()
	if ret != nvml.SUCCESS {
		return nil, ret, fmt.Errorf("pci info: %s", nvml.ErrorString(ret))
	}
	id.busID = busID(pci)
	if s, ret := d.GetSerial(); ret == nvml.SUCCESS {
		id.serial = s
	}
	if cur, _, ret := d.GetMigMode(); ret == nvml.SUCCESS {
		id.mig = cur == nvml.DEVICE_MIG_ENABLE
	}
	return id, nvml.SUCCESS, nil
}

// busID formats the PCI address as "0000:18:00.0": NVML's BusId string
// carries an eight-digit domain ("00000000:18:00.0"), shortened here.
func busID(p nvml.PciInfo) string {
	b := make([]byte, 0, len(p.BusId))
	for _, c := range p.BusId {
		if c == 0 {
			break
		}
		b = append(b, byte(c))
	}
	s := strings.ToLower(string(b))
	if s == "" {
		return fmt.Sprintf("%04x:%02x:%02x.0", p.Domain, p.Bus, p.Device)
	}
	if dom, rest, ok := strings.Cut(s, ":"); ok && len(dom) == 8 && strings.HasPrefix(dom, "0000") {
		return dom[4:] + ":" + rest
	}
	return s
}

func (c *Collector) hostname() (string, error) {
	if c.cfg.Hostname != "" {
		return c.cfg.Hostname, nil
	}
	h, err := os.Hostname()
	if err != nil {
		return "", fmt.Errorf("inventory: hostname: %w", err)
	}
	return h, nil
}

func readTrim(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

func firstNonEmpty(ss ...string) string {
	for _, s := range ss {
		if s != "" {
			return s
		}
	}
	return ""
}
