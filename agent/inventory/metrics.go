package inventory

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// GPUMetrics are one GPU's telemetry readings at one moment. A reading the
// GPU or driver does not support is absent: its bit in Has is clear.
type GPUMetrics struct {
	Index int
	UUID  string
	// Has says which readings below were read (Metric* bits).
	Has MetricSet
	// UtilizationPercent and MemoryUtilizationPercent are the share of
	// the last sample period the GPU's kernels and its memory were busy.
	UtilizationPercent       uint32
	MemoryUtilizationPercent uint32
	// MemoryUsedBytes and MemoryTotalBytes are the frame buffer's.
	MemoryUsedBytes  uint64
	MemoryTotalBytes uint64
	// TemperatureCelsius is the GPU die's.
	TemperatureCelsius uint32
	// PowerWatts is the board's draw.
	PowerWatts float64
	// SMClockMHz and MemoryClockMHz are the current clocks.
	SMClockMHz     uint32
	MemoryClockMHz uint32
	// ThrottleReasons is NVML's clocks event (throttle) reason bit mask.
	ThrottleReasons uint64
	// ECCCorrected and ECCUncorrected are the volatile ECC error counts
	// (since the last driver load).
	ECCCorrected   uint64
	ECCUncorrected uint64
	// XIDEvents counts the XID events NVML delivered for the GPU since the
	// collector first read it; it is always present.
	XIDEvents uint64
	// PCIeReplays is the PCIe replay counter.
	PCIeReplays uint64
}

// MetricSet is a set of GPUMetrics readings.
type MetricSet uint16

// The readings of GPUMetrics.
const (
	MetricUtilization MetricSet = 1 << iota
	MetricMemory
	MetricTemperature
	MetricPower
	MetricClocks
	MetricThrottle
	MetricECC
	MetricPCIeReplays
)

// Metrics reads every GPU's telemetry into dst (reused: a steady pass
// allocates nothing) in index order. A reading that fails on one GPU is left
// out of that GPU's Has; an error is returned only when NVML cannot be
// queried at all. It also drains the XID events the health checks read
// (they stay latched for them).
func (c *Collector) Metrics(ctx context.Context, dst []GPUMetrics) (_ []GPUMetrics, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.open {
		return dst[:0], errors.New("inventory: collector closed")
	}
	if err := c.prepare(); err != nil {
		return dst[:0], err
	}
	defer func() {
		if r := recover(); r != nil {
			dst, err = dst[:0], fmt.Errorf("inventory: nvml: %v", r)
		}
	}()
	dst = slices.Grow(dst[:0], len(c.devs))[:len(c.devs)]
	for i, st := range c.devs {
		if err := ctx.Err(); err != nil {
			return dst[:0], err
		}
		readMetrics(st, i, &dst[i])
	}
	return dst, nil
}

func readMetrics(st *devState, index int, m *GPUMetrics) {
	*m = GPUMetrics{Index: index, UUID: st.uuid, XIDEvents: st.xidEvents}
	d := st.d
	if u, ret := d.GetUtilizationRates(); ret == nvml.SUCCESS {
		m.Has |= MetricUtilization
		m.UtilizationPercent, m.MemoryUtilizationPercent = u.Gpu, u.Memory
	}
	if mem, ret := d.GetMemoryInfo(); ret == nvml.SUCCESS {
		m.Has |= MetricMemory
		m.MemoryUsedBytes, m.MemoryTotalBytes = mem.Used, mem.Total
	}
	if t, ret := d.GetTemperature(nvml.TEMPERATURE_GPU); ret == nvml.SUCCESS {
		m.Has |= MetricTemperature
		m.TemperatureCelsius = t
	}
	if mw, ret := d.GetPowerUsage(); ret == nvml.SUCCESS {
		m.Has |= MetricPower
		m.PowerWatts = float64(mw) / 1000
	}
	sm, ret1 := d.GetClockInfo(nvml.CLOCK_SM)
	mc, ret2 := d.GetClockInfo(nvml.CLOCK_MEM)
	if ret1 == nvml.SUCCESS && ret2 == nvml.SUCCESS {
		m.Has |= MetricClocks
		m.SMClockMHz, m.MemoryClockMHz = sm, mc
	}
	if r, ret := d.GetCurrentClocksEventReasons(); ret == nvml.SUCCESS {
		m.Has |= MetricThrottle
		m.ThrottleReasons = r
	} else if r, ret := d.GetCurrentClocksThrottleReasons(); ret == nvml.SUCCESS {
		m.Has |= MetricThrottle
		m.ThrottleReasons = r
	}
	ce, ret1 := d.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_CORRECTED, nvml.VOLATILE_ECC)
	ue, ret2 := d.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.VOLATILE_ECC)
	if ret1 == nvml.SUCCESS && ret2 == nvml.SUCCESS {
		m.Has |= MetricECC
		m.ECCCorrected, m.ECCUncorrected = ce, ue
	}
	if n, ret := d.GetPcieReplayCounter(); ret == nvml.SUCCESS && n >= 0 {
		m.Has |= MetricPCIeReplays
		m.PCIeReplays = uint64(n)
	}
}
