package inventory

import (
	"crypto/sha256"
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// NewMock returns go-nvml's simulated DGX H200 (eight H200 GPUs, driver
// 550.54.15, CUDA 12.4) with the queries the mock leaves out filled in: a
// board serial derived from each GPU's UUID, the PCI bus id in PciInfo, and
// healthy page-retirement and row-remapping status, a temperature of
// 34 °C plus the index and no ECC errors (for Diagnose). Every call makes new
// GPU UUIDs, so simulated nodes differ. Tests may change the returned
// devices' mock functions (for example to make a GPU unhealthy).
func NewMock() *server.Server { return NewMockSeeded("") }

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
		dev.GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) {
			p := nvml.PciInfo{PciDeviceId: dev.Config.PciDeviceId, Bus: uint32(dev.Index)}
			for i, c := range []byte(dev.PciBusID) {
				if i < len(p.BusId)-1 {
					p.BusId[i] = int8(c)
				}
			}
			return p, nvml.SUCCESS
		}
		dev.GetRetiredPagesPendingStatusFunc = func() (nvml.EnableState, nvml.Return) {
			return nvml.FEATURE_DISABLED, nvml.SUCCESS
		}
		dev.GetRemappedRowsFunc = func() (int, int, bool, bool, nvml.Return) {
			return 0, 0, false, false, nvml.SUCCESS
		}
		dev.GetTemperatureFunc = func(nvml.TemperatureSensors) (uint32, nvml.Return) {
			return 34 + uint32(dev.Index), nvml.SUCCESS
		}
		dev.GetTotalEccErrorsFunc = func(nvml.MemoryErrorType, nvml.EccCounterType) (uint64, nvml.Return) {
			return 0, nvml.SUCCESS
		}
	}
	return s
}
