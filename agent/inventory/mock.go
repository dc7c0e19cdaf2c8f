package inventory

import (
	"crypto/sha256"
	"fmt"
	"slices"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// NewMock returns go-nvml's simulated DGX H200 (eight H200 GPUs, driver
// 550.54.15, CUDA 12.4) with the queries the mock leaves out filled in: a
// board serial derived from each GPU's UUID, the PCI bus id in PciInfo, and
// healthy page-retirement and row-remapping status, a temperature of
// 34 °C plus the index, no ECC errors, no clock slowdown, a Gen 5 x16 PCIe
// link and no compute processes. Every call makes new GPU UUIDs, so
// simulated nodes differ. Tests may change the returned devices' mock
// functions (for example to make a GPU unhealthy); [New] over it adds
// fault injection ([Collector.Faults]).
func NewMock() *server.Server { return NewMockSeeded("") }

// Mock PCIe link: what a healthy H200 trains at, and a degraded one.
const (
	mockPCIeWidth, mockPCIeWidthDegraded = 16, 8
	mockPCIeGen, mockPCIeGenDegraded     = 5, 3
)

// NewMockSeeded is [NewMock] with GPU UUIDs (and so serials) derived from
// seed, e.g. the machine id: a simulated machine that restarts keeps its
// GPUs, as a real one does, so its bookings and devices survive it. An empty
// seed makes random UUIDs.
func NewMockSeeded(seed string) *server.Server {
	s := dgxh200.New()
	for _, d := range s.Devices {
		dev, ok := d.(*server.Device)
		if !ok {
			continue
		}
		if seed != "" {
			u := sha256.Sum256(fmt.Appendf(nil, "%s/gpu/%d", seed, dev.Index))
			dev.UUID = fmt.Sprintf("GPU-%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
		}
		sum := sha256.Sum256([]byte(dev.UUID))
		serial := fmt.Sprintf("MOCK%012X", sum[:6])
		dev.GetSerialFunc = func() (string, nvml.Return) { return serial, nvml.SUCCESS }
		var pci nvml.PciInfo
		pci.PciDeviceId, pci.Bus = dev.Config.PciDeviceId, uint32(dev.Index)
		for i, c := range []byte(dev.PciBusID) {
			if i < len(pci.BusId)-1 {
				pci.BusId[i] = int8(c)
			}
		}
		dev.GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) { return pci, nvml.SUCCESS }
		dev.GetRetiredPagesPendingStatusFunc = func() (nvml.EnableState, nvml.Return) {
			return nvml.FEATURE_DISABLED, nvml.SUCCESS
		}
		dev.GetRemappedRowsFunc = func() (int, int, bool, bool, nvml.Return) {
			return 0, 0, false, false, nvml.SUCCESS
		}
		dev.GetRetiredPagesFunc = func(nvml.PageRetirementCause) ([]uint64, nvml.Return) { return nil, nvml.SUCCESS }
		dev.GetTemperatureFunc = func(nvml.TemperatureSensors) (uint32, nvml.Return) {
			return 34 + uint32(dev.Index), nvml.SUCCESS
		}
		dev.GetTotalEccErrorsFunc = func(nvml.MemoryErrorType, nvml.EccCounterType) (uint64, nvml.Return) {
			return 0, nvml.SUCCESS
		}
		dev.GetCurrentClocksEventReasonsFunc = func() (uint64, nvml.Return) { return nvml.ClocksEventReasonNone, nvml.SUCCESS }
		dev.GetCurrPcieLinkWidthFunc = func() (int, nvml.Return) { return mockPCIeWidth, nvml.SUCCESS }
		dev.GetMaxPcieLinkWidthFunc = func() (int, nvml.Return) { return mockPCIeWidth, nvml.SUCCESS }
		dev.GetCurrPcieLinkGenerationFunc = func() (int, nvml.Return) { return mockPCIeGen, nvml.SUCCESS }
		dev.GetMaxPcieLinkGenerationFunc = func() (int, nvml.Return) { return mockPCIeGen, nvml.SUCCESS }
		dev.GetComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) { return nil, nvml.SUCCESS }
		// Telemetry readings: an idle H200 (the index shifts them so GPUs
		// differ).
		dev.GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) {
			return nvml.Utilization{Gpu: uint32(dev.Index), Memory: 0}, nvml.SUCCESS
		}
		dev.GetPowerUsageFunc = func() (uint32, nvml.Return) { return 75_000 + uint32(dev.Index)*1000, nvml.SUCCESS }
		dev.GetClockInfoFunc = func(t nvml.ClockType) (uint32, nvml.Return) {
			switch t {
			case nvml.CLOCK_SM, nvml.CLOCK_GRAPHICS:
				return 345, nvml.SUCCESS
			case nvml.CLOCK_MEM:
				return 2619, nvml.SUCCESS
			}
			return 0, nvml.ERROR_NOT_SUPPORTED
		}
		dev.GetPcieReplayCounterFunc = func() (int, nvml.Return) { return 0, nvml.SUCCESS }
	}
	return s
}

// mockLib is the mock server with its devices wrapped in mockDevice: the
// queries the inventory and the health checks make read the injected
// faults first and go straight to the device's mock functions, not through
// go-nvml's generated mock methods, which record every call (a simulated
// fleet checking every 30 s would grow those records without end). The
// event set delivers injected XIDs.
type mockLib struct {
	*server.Server
	faults *Faults

	mu   sync.Mutex
	devs map[*server.Device]*mockDevice
}

func newMockLib(s *server.Server, f *Faults) *mockLib {
	return &mockLib{Server: s, faults: f, devs: map[*server.Device]*mockDevice{}}
}

// device wraps s.Devices[i] (the same wrapper every time).
func (m *mockLib) device(i int) (nvml.Device, nvml.Return) {
	if i < 0 || i >= len(m.Devices) {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	sd, ok := m.Devices[i].(*server.Device)
	if !ok {
		return m.Devices[i], nvml.SUCCESS
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	d := m.devs[sd]
	if d == nil {
		d = &mockDevice{Device: sd, faults: m.faults, mig: &mockMIG{}}
		m.devs[sd] = d
	}
	return d, nvml.SUCCESS
}

func (m *mockLib) DeviceGetCount() (int, nvml.Return) { return len(m.Devices), nvml.SUCCESS }

// SystemGetDriverVersion goes straight to the mock function (the daemon
// asks at every drift check).
func (m *mockLib) SystemGetDriverVersion() (string, nvml.Return) {
	return m.SystemGetDriverVersionFunc()
}

func (m *mockLib) DeviceGetHandleByIndex(i int) (nvml.Device, nvml.Return) { return m.device(i) }

func (m *mockLib) DeviceGetHandleByUUID(uuid string) (nvml.Device, nvml.Return) {
	for i, d := range m.Devices {
		if sd, ok := d.(*server.Device); ok && sd.UUID == uuid {
			return m.device(i)
		}
	}
	return nil, nvml.ERROR_INVALID_ARGUMENT
}

func (m *mockLib) EventSetCreate() (nvml.EventSet, nvml.Return) {
	return &mockEventSet{lib: m, delivered: map[int][]uint32{}}, nvml.SUCCESS
}

// mockDevice is one mock GPU whose health queries see its faults, with
// its MIG state (mockmig.go).
type mockDevice struct {
	*server.Device
	faults *Faults
	mig    *mockMIG
}

func (d *mockDevice) fault() Fault { return d.faults.Get(d.Index) }

func (d *mockDevice) GetIndex() (int, nvml.Return) { return d.Index, nvml.SUCCESS }

func (d *mockDevice) GetMinorNumber() (int, nvml.Return) { return d.GetMinorNumberFunc() }

func (d *mockDevice) GetUUID() (string, nvml.Return) { return d.GetUUIDFunc() }

func (d *mockDevice) GetName() (string, nvml.Return) { return d.GetNameFunc() }

func (d *mockDevice) GetMemoryInfo() (nvml.Memory, nvml.Return) { return d.GetMemoryInfoFunc() }

func (d *mockDevice) GetPciInfo() (nvml.PciInfo, nvml.Return) { return d.GetPciInfoFunc() }

func (d *mockDevice) GetSerial() (string, nvml.Return) {
	if d.GetSerialFunc == nil {
		return "", nvml.ERROR_NOT_SUPPORTED
	}
	return d.GetSerialFunc()
}

func (d *mockDevice) GetRetiredPagesPendingStatus() (nvml.EnableState, nvml.Return) {
	switch f := d.fault(); {
	case f.lost():
		return 0, nvml.ERROR_GPU_IS_LOST
	case f.RetirementPending:
		return nvml.FEATURE_ENABLED, nvml.SUCCESS
	}
	if d.GetRetiredPagesPendingStatusFunc == nil {
		return 0, nvml.ERROR_NOT_SUPPORTED
	}
	return d.GetRetiredPagesPendingStatusFunc()
}

func (d *mockDevice) GetRemappedRows() (int, int, bool, bool, nvml.Return) {
	switch f := d.fault(); {
	case f.lost():
		return 0, 0, false, false, nvml.ERROR_GPU_IS_LOST
	case f.RowRemapPending || f.RowRemapFailed:
		return 0, 1, f.RowRemapPending, f.RowRemapFailed, nvml.SUCCESS
	}
	if d.GetRemappedRowsFunc == nil {
		return 0, 0, false, false, nvml.ERROR_NOT_SUPPORTED
	}
	return d.GetRemappedRowsFunc()
}

// mockRetired backs injected retired pages (their addresses do not matter).
var mockRetired = make([]uint64, 4096)

func (d *mockDevice) GetRetiredPages(cause nvml.PageRetirementCause) ([]uint64, nvml.Return) {
	switch f := d.fault(); {
	case f.lost():
		return nil, nvml.ERROR_GPU_IS_LOST
	case f.RetiredPages > 0:
		// All of them double-bit retirements.
		if cause == nvml.PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR {
			return mockRetired[:min(int(f.RetiredPages), len(mockRetired))], nvml.SUCCESS
		}
		return nil, nvml.SUCCESS
	}
	if d.GetRetiredPagesFunc == nil {
		return nil, nvml.ERROR_NOT_SUPPORTED
	}
	return d.GetRetiredPagesFunc(cause)
}

func (d *mockDevice) GetTemperature(s nvml.TemperatureSensors) (uint32, nvml.Return) {
	switch f := d.fault(); {
	case f.lost():
		return 0, nvml.ERROR_GPU_IS_LOST
	case f.TemperatureCelsius > 0:
		return f.TemperatureCelsius, nvml.SUCCESS
	}
	if d.GetTemperatureFunc == nil {
		return 0, nvml.ERROR_NOT_SUPPORTED
	}
	return d.GetTemperatureFunc(s)
}

func (d *mockDevice) GetTotalEccErrors(t nvml.MemoryErrorType, c nvml.EccCounterType) (uint64, nvml.Return) {
	f := d.fault()
	if f.lost() {
		return 0, nvml.ERROR_GPU_IS_LOST
	}
	var n uint64
	if d.GetTotalEccErrorsFunc != nil {
		var ret nvml.Return
		if n, ret = d.GetTotalEccErrorsFunc(t, c); ret != nvml.SUCCESS {
			return 0, ret
		}
	}
	switch t {
	case nvml.MEMORY_ERROR_TYPE_UNCORRECTED:
		n = max(n, f.UncorrectableECC)
	case nvml.MEMORY_ERROR_TYPE_CORRECTED:
		n = max(n, f.CorrectableECC)
	}
	return n, nvml.SUCCESS
}

func (d *mockDevice) GetCurrentClocksEventReasons() (uint64, nvml.Return) {
	f := d.fault()
	if f.lost() {
		return 0, nvml.ERROR_GPU_IS_LOST
	}
	var r uint64
	if d.GetCurrentClocksEventReasonsFunc != nil {
		var ret nvml.Return
		if r, ret = d.GetCurrentClocksEventReasonsFunc(); ret != nvml.SUCCESS {
			return 0, ret
		}
	}
	if f.ThermalSlowdown {
		r |= nvml.ClocksThrottleReasonHwThermalSlowdown | nvml.ClocksThrottleReasonHwSlowdown
	}
	if f.PowerBrake {
		r |= nvml.ClocksThrottleReasonHwPowerBrakeSlowdown | nvml.ClocksThrottleReasonHwSlowdown
	}
	return r, nvml.SUCCESS
}

func (d *mockDevice) GetCurrentClocksThrottleReasons() (uint64, nvml.Return) {
	return d.GetCurrentClocksEventReasons()
}

func (d *mockDevice) pcie(fn func() (int, nvml.Return), degraded bool, to int) (int, nvml.Return) {
	if d.fault().lost() {
		return 0, nvml.ERROR_GPU_IS_LOST
	}
	if fn == nil {
		return 0, nvml.ERROR_NOT_SUPPORTED
	}
	v, ret := fn()
	if ret == nvml.SUCCESS && degraded {
		v = min(v, to)
	}
	return v, ret
}

func (d *mockDevice) GetCurrPcieLinkWidth() (int, nvml.Return) {
	return d.pcie(d.GetCurrPcieLinkWidthFunc, d.fault().PCIeWidthDegraded, mockPCIeWidthDegraded)
}

func (d *mockDevice) GetMaxPcieLinkWidth() (int, nvml.Return) {
	return d.pcie(d.GetMaxPcieLinkWidthFunc, false, 0)
}

func (d *mockDevice) GetCurrPcieLinkGeneration() (int, nvml.Return) {
	return d.pcie(d.GetCurrPcieLinkGenerationFunc, d.fault().PCIeGenDegraded, mockPCIeGenDegraded)
}

func (d *mockDevice) GetMaxPcieLinkGeneration() (int, nvml.Return) {
	return d.pcie(d.GetMaxPcieLinkGenerationFunc, false, 0)
}

func (d *mockDevice) GetComputeRunningProcesses() ([]nvml.ProcessInfo, nvml.Return) {
	f := d.fault()
	if f.lost() {
		return nil, nvml.ERROR_GPU_IS_LOST
	}
	var ps []nvml.ProcessInfo
	if d.GetComputeRunningProcessesFunc != nil {
		var ret nvml.Return
		if ps, ret = d.GetComputeRunningProcessesFunc(); ret != nvml.SUCCESS {
			return nil, ret
		}
	}
	for _, pid := range f.ComputePIDs {
		ps = append(ps, nvml.ProcessInfo{Pid: pid, UsedGpuMemory: 1 << 30})
	}
	return ps, nvml.SUCCESS
}

// reading is a telemetry query: lost with the GPU, unsupported without a
// mock function.
func reading[T any](d *mockDevice, fn func() (T, nvml.Return)) (T, nvml.Return) {
	var zero T
	if d.fault().lost() {
		return zero, nvml.ERROR_GPU_IS_LOST
	}
	if fn == nil {
		return zero, nvml.ERROR_NOT_SUPPORTED
	}
	return fn()
}

func (d *mockDevice) GetUtilizationRates() (nvml.Utilization, nvml.Return) {
	return reading(d, d.GetUtilizationRatesFunc)
}

func (d *mockDevice) GetPowerUsage() (uint32, nvml.Return) { return reading(d, d.GetPowerUsageFunc) }

func (d *mockDevice) GetPcieReplayCounter() (int, nvml.Return) {
	return reading(d, d.GetPcieReplayCounterFunc)
}

func (d *mockDevice) GetClockInfo(t nvml.ClockType) (uint32, nvml.Return) {
	if d.GetClockInfoFunc == nil {
		return reading[uint32](d, nil)
	}
	return reading(d, func() (uint32, nvml.Return) { return d.GetClockInfoFunc(t) })
}

func (d *mockDevice) RegisterEvents(uint64, nvml.EventSet) nvml.Return { return nvml.SUCCESS }

// mockEventSet delivers each XID injected on a registered mock GPU once
// while it stays injected (cleared and injected again, once more).
type mockEventSet struct {
	mock.EventSet
	lib *mockLib

	mu        sync.Mutex
	delivered map[int][]uint32
}

func (e *mockEventSet) Free() nvml.Return { return nvml.SUCCESS }

func (e *mockEventSet) Wait(uint32) (nvml.EventData, nvml.Return) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for i := range e.lib.Devices {
		f := e.lib.faults.Get(i)
		got := e.delivered[i]
		if len(got) > 0 {
			// Forget what is no longer injected.
			got = slices.DeleteFunc(got, func(x uint32) bool { return !slices.Contains(f.XIDs, x) })
			e.delivered[i] = got
		}
		for _, x := range f.XIDs {
			if slices.Contains(got, x) {
				continue
			}
			e.delivered[i] = append(got, x)
			d, _ := e.lib.device(i)
			return nvml.EventData{Device: d, EventType: nvml.EventTypeXidCriticalError, EventData: uint64(x)}, nvml.SUCCESS
		}
	}
	return nvml.EventData{}, nvml.ERROR_TIMEOUT
}
