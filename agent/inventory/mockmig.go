package inventory

import (
	"crypto/sha256"
	"fmt"
	"slices"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"

	"github.com/bettercompute/bettercompute/proto/migcatalog"
)

// The mock's MIG, made as strict as the driver where the daemon depends
// on it (go-nvml's mock server creates and destroys instances but checks
// nothing):
//
//   - placements are in memory slices, as the driver reports them and
//     proto/migcatalog places them (a 3g takes 4 slices at 0 or 4); a GPU
//     instance that overlaps another, or one more than a profile's count
//     or the GPU's 7 compute slices, is refused with
//     ERROR_INSUFFICIENT_RESOURCES; a start the profile does not have with
//     ERROR_INVALID_ARGUMENT;
//   - a GPU instance with compute instances, or MIG mode turned off with
//     GPU instances, answers ERROR_IN_USE;
//   - each compute instance is a MIG device (GetMigDeviceHandleByIndex)
//     whose UUID (MIG-…) follows the GPU's UUID and the instance ids;
//   - a mode change waits for a reset with the MIGNeedsReset fault
//     (GetMigMode's pending mode differs until gpu.reset or a reboot);
//     MIGBusy makes destroying answer ERROR_IN_USE; MIGUnsupportedProfiles
//     makes profiles answer ERROR_NOT_SUPPORTED.
//
// The state lives in the Collector: a simulated daemon that restarts over
// the same Collector keeps it; SimulateReboot loses the instances and
// applies a pending mode, as a machine's reboot does.

// mockMaxMigDevices is an H200's most MIG devices.
const mockMaxMigDevices = 7

// mockMIG is one mock GPU's MIG state.
type mockMIG struct {
	mu            sync.Mutex
	mode, pending int
	gis           []*mockGI
	nextGI        int
}

// mockGI is one GPU instance of a mock GPU.
type mockGI struct {
	mock.GpuInstance
	dev       *mockDevice
	id        int
	info      nvml.GpuInstanceProfileInfo
	placement nvml.GpuInstancePlacement
	cis       []*mockCI
	nextCI    int
}

// mockCI is one compute instance: a MIG device.
type mockCI struct {
	mock.ComputeInstance
	gi   *mockGI
	id   int
	info nvml.ComputeInstanceProfileInfo
}

// mockMigDevice is a MIG device handle.
type mockMigDevice struct {
	mock.Device
	ci *mockCI
}

// model is the GPU's catalog model (nil for a model the catalog lacks).
func (d *mockDevice) model() *migcatalog.Model {
	m, _ := migcatalog.ByPCIDeviceID(d.Config.PciDeviceId)
	return m
}

// catalogProfile is the catalog's profile of NVML profile id.
func (d *mockDevice) catalogProfile(id int) (migcatalog.Profile, bool) {
	m := d.model()
	if m == nil {
		return migcatalog.Profile{}, false
	}
	for _, p := range m.Profiles {
		if p.NVMLID == id {
			return p, true
		}
	}
	return migcatalog.Profile{}, false
}

func (d *mockDevice) GetMigMode() (int, int, nvml.Return) {
	d.mig.mu.Lock()
	defer d.mig.mu.Unlock()
	return d.mig.mode, d.mig.pending, nvml.SUCCESS
}

func (d *mockDevice) SetMigMode(mode int) (nvml.Return, nvml.Return) {
	if mode != nvml.DEVICE_MIG_ENABLE && mode != nvml.DEVICE_MIG_DISABLE {
		return nvml.ERROR_INVALID_ARGUMENT, nvml.ERROR_INVALID_ARGUMENT
	}
	f := d.fault()
	d.mig.mu.Lock()
	defer d.mig.mu.Unlock()
	if len(d.mig.gis) > 0 {
		return nvml.ERROR_IN_USE, nvml.ERROR_IN_USE
	}
	d.mig.pending = mode
	if f.MIGNeedsReset && d.mig.mode != mode {
		return nvml.SUCCESS, nvml.ERROR_RESET_REQUIRED
	}
	d.mig.mode = mode
	return nvml.SUCCESS, nvml.SUCCESS
}

// resetMIG is the GPU reset: the pending mode applies, every instance is
// gone.
func (d *mockDevice) resetMIG() {
	d.mig.mu.Lock()
	defer d.mig.mu.Unlock()
	d.mig.mode = d.mig.pending
	d.mig.gis, d.mig.nextGI = nil, 0
}

func (d *mockDevice) GetGpuInstanceProfileInfo(id int) (nvml.GpuInstanceProfileInfo, nvml.Return) {
	if p, ok := d.catalogProfile(id); ok && slices.Contains(d.fault().MIGUnsupportedProfiles, p.Name) {
		return nvml.GpuInstanceProfileInfo{}, nvml.ERROR_NOT_SUPPORTED
	}
	return d.GetGpuInstanceProfileInfoFunc(id)
}

// GetGpuInstancePossiblePlacements gives the catalog's placements in
// memory slices, as the driver does (go-nvml's mock counts a 3g as 3
// slices and a 7g as 7).
func (d *mockDevice) GetGpuInstancePossiblePlacements(info *nvml.GpuInstanceProfileInfo) ([]nvml.GpuInstancePlacement, nvml.Return) {
	p, ok := d.catalogProfile(int(info.Id))
	if !ok {
		return nil, nvml.ERROR_NOT_SUPPORTED
	}
	out := make([]nvml.GpuInstancePlacement, len(p.Starts))
	for i, s := range p.Starts {
		out[i] = nvml.GpuInstancePlacement{Start: uint32(s), Size: uint32(p.Size)}
	}
	return out, nvml.SUCCESS
}

func (d *mockDevice) CreateGpuInstanceWithPlacement(info *nvml.GpuInstanceProfileInfo, pl *nvml.GpuInstancePlacement) (nvml.GpuInstance, nvml.Return) {
	p, ok := d.catalogProfile(int(info.Id))
	if !ok || slices.Contains(d.fault().MIGUnsupportedProfiles, p.Name) {
		return nil, nvml.ERROR_NOT_SUPPORTED
	}
	if !slices.Contains(p.Starts, int(pl.Start)) || int(pl.Size) != p.Size {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	d.mig.mu.Lock()
	defer d.mig.mu.Unlock()
	if d.mig.mode != nvml.DEVICE_MIG_ENABLE {
		return nil, nvml.ERROR_NOT_SUPPORTED
	}
	same, compute := 0, p.ComputeSlices
	for _, g := range d.mig.gis {
		if g.info.Id == info.Id {
			same++
		}
		if o, ok := d.catalogProfile(int(g.info.Id)); ok {
			compute += o.ComputeSlices
		}
		if pl.Start < g.placement.Start+g.placement.Size && g.placement.Start < pl.Start+pl.Size {
			return nil, nvml.ERROR_INSUFFICIENT_RESOURCES
		}
	}
	if same >= p.MaxInstances || compute > 7 {
		return nil, nvml.ERROR_INSUFFICIENT_RESOURCES
	}
	g := &mockGI{dev: d, id: d.mig.nextGI, info: *info, placement: *pl}
	d.mig.nextGI++
	d.mig.gis = append(d.mig.gis, g)
	return g, nvml.SUCCESS
}

func (d *mockDevice) GetGpuInstances(info *nvml.GpuInstanceProfileInfo) ([]nvml.GpuInstance, nvml.Return) {
	d.mig.mu.Lock()
	defer d.mig.mu.Unlock()
	if d.mig.mode != nvml.DEVICE_MIG_ENABLE {
		return nil, nvml.ERROR_NOT_SUPPORTED
	}
	var out []nvml.GpuInstance
	for _, g := range d.mig.gis {
		if g.info.Id == info.Id {
			out = append(out, g)
		}
	}
	return out, nvml.SUCCESS
}

func (d *mockDevice) GetMaxMigDeviceCount() (int, nvml.Return) {
	return mockMaxMigDevices, nvml.SUCCESS
}

// migDevices are the compute instances by GPU instance start.
func (d *mockDevice) migDevices() []*mockCI {
	d.mig.mu.Lock()
	defer d.mig.mu.Unlock()
	gis := slices.Clone(d.mig.gis)
	slices.SortFunc(gis, func(a, b *mockGI) int { return int(a.placement.Start) - int(b.placement.Start) })
	var out []*mockCI
	for _, g := range gis {
		out = append(out, g.cis...)
	}
	return out
}

func (d *mockDevice) GetMigDeviceHandleByIndex(i int) (nvml.Device, nvml.Return) {
	if i < 0 || i >= mockMaxMigDevices {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	cis := d.migDevices()
	if i >= len(cis) {
		return nil, nvml.ERROR_NOT_FOUND
	}
	return &mockMigDevice{ci: cis[i]}, nvml.SUCCESS
}

func (g *mockGI) GetInfo() (nvml.GpuInstanceInfo, nvml.Return) {
	return nvml.GpuInstanceInfo{Device: g.dev, Id: uint32(g.id), ProfileId: g.info.Id, Placement: g.placement}, nvml.SUCCESS
}

func (g *mockGI) GetComputeInstanceProfileInfo(ci, eng int) (nvml.ComputeInstanceProfileInfo, nvml.Return) {
	if eng != nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED {
		return nvml.ComputeInstanceProfileInfo{}, nvml.ERROR_NOT_SUPPORTED
	}
	info, ok := g.dev.Config.MIGProfiles.ComputeInstanceProfiles[int(g.info.Id)][ci]
	if !ok {
		return nvml.ComputeInstanceProfileInfo{}, nvml.ERROR_NOT_SUPPORTED
	}
	return info, nvml.SUCCESS
}

func (g *mockGI) CreateComputeInstance(info *nvml.ComputeInstanceProfileInfo) (nvml.ComputeInstance, nvml.Return) {
	d := g.dev
	d.mig.mu.Lock()
	defer d.mig.mu.Unlock()
	if !slices.Contains(d.mig.gis, g) {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	used := info.SliceCount
	for _, c := range g.cis {
		used += c.info.SliceCount
	}
	if used > g.info.SliceCount {
		return nil, nvml.ERROR_INSUFFICIENT_RESOURCES
	}
	c := &mockCI{gi: g, id: g.nextCI, info: *info}
	g.nextCI++
	g.cis = append(g.cis, c)
	return c, nvml.SUCCESS
}

func (g *mockGI) GetComputeInstances(info *nvml.ComputeInstanceProfileInfo) ([]nvml.ComputeInstance, nvml.Return) {
	g.dev.mig.mu.Lock()
	defer g.dev.mig.mu.Unlock()
	var out []nvml.ComputeInstance
	for _, c := range g.cis {
		if c.info.Id == info.Id {
			out = append(out, c)
		}
	}
	return out, nvml.SUCCESS
}

func (g *mockGI) Destroy() nvml.Return {
	d := g.dev
	busy := d.fault().MIGBusy
	d.mig.mu.Lock()
	defer d.mig.mu.Unlock()
	i := slices.Index(d.mig.gis, g)
	switch {
	case i < 0:
		return nvml.ERROR_INVALID_ARGUMENT
	case busy || len(g.cis) > 0:
		return nvml.ERROR_IN_USE
	}
	d.mig.gis = slices.Delete(d.mig.gis, i, i+1)
	return nvml.SUCCESS
}

func (c *mockCI) GetInfo() (nvml.ComputeInstanceInfo, nvml.Return) {
	return nvml.ComputeInstanceInfo{Device: c.gi.dev, GpuInstance: c.gi, Id: uint32(c.id), ProfileId: c.info.Id}, nvml.SUCCESS
}

func (c *mockCI) Destroy() nvml.Return {
	d := c.gi.dev
	busy := d.fault().MIGBusy
	d.mig.mu.Lock()
	defer d.mig.mu.Unlock()
	i := slices.Index(c.gi.cis, c)
	switch {
	case i < 0:
		return nvml.ERROR_INVALID_ARGUMENT
	case busy:
		return nvml.ERROR_IN_USE
	}
	c.gi.cis = slices.Delete(c.gi.cis, i, i+1)
	return nvml.SUCCESS
}

// MockMigUUID is the UUID the mock gives the MIG device of compute
// instance ci of GPU instance gi on the GPU with this UUID: the same
// instance ids on the same GPU give the same UUID.
func MockMigUUID(gpu string, gi, ci int) string {
	u := sha256.Sum256(fmt.Appendf(nil, "%s/mig/%d/%d", gpu, gi, ci))
	return fmt.Sprintf("MIG-%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}

func (m *mockMigDevice) GetUUID() (string, nvml.Return) {
	return MockMigUUID(m.ci.gi.dev.UUID, m.ci.gi.id, m.ci.id), nvml.SUCCESS
}

func (m *mockMigDevice) GetGpuInstanceId() (int, nvml.Return)     { return m.ci.gi.id, nvml.SUCCESS }
func (m *mockMigDevice) GetComputeInstanceId() (int, nvml.Return) { return m.ci.id, nvml.SUCCESS }
func (m *mockMigDevice) IsMigDeviceHandle() (bool, nvml.Return)   { return true, nvml.SUCCESS }
func (m *mockMigDevice) GetDeviceHandleFromMigDeviceHandle() (nvml.Device, nvml.Return) {
	return m.ci.gi.dev, nvml.SUCCESS
}
func (m *mockMigDevice) GetMinorNumber() (int, nvml.Return) { return m.ci.gi.dev.Minor, nvml.SUCCESS }

func (m *mockMigDevice) GetMemoryInfo() (nvml.Memory, nvml.Return) {
	return nvml.Memory{Total: m.ci.gi.info.MemorySizeMB << 20}, nvml.SUCCESS
}

// resetMIG resets GPU index's MIG state (gpu.reset on the mock).
func (m *mockLib) resetMIG(i int) {
	if d, ret := m.device(i); ret == nvml.SUCCESS {
		if md, ok := d.(*mockDevice); ok {
			md.resetMIG()
		}
	}
}

// SimulateReboot is the mock machine's reboot: every GPU's MIG instances
// are gone and a pending MIG mode applies (the mode itself persists, as
// on the driver). The real backend ignores it.
func (c *Collector) SimulateReboot() {
	c.mu.Lock()
	defer c.mu.Unlock()
	m, ok := c.lib.(*mockLib)
	if !ok {
		return
	}
	for i := range m.Devices {
		m.resetMIG(i)
	}
}
