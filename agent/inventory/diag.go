package inventory

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// MaxTemperatureCelsius is the GPU temperature at or above which Diagnose
// reports a GPU unhealthy.
const MaxTemperatureCelsius = 90

// Diagnose checks each GPU (only those whose UUID is in uuids; all when
// empty): the health Report derives from page retirement and row
// remapping, the temperature (unhealthy at MaxTemperatureCelsius or above)
// and the volatile uncorrectable ECC error count (unhealthy when above
// zero; boards without ECC skip the check). A UUID asked for that no GPU
// has is reported unhealthy with the reason "no such GPU". It returns an
// error only when NVML itself cannot be queried.
func (c *Collector) Diagnose(ctx context.Context, uuids []string) (*agentv1.DiagNvmlResult, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.open {
		return nil, errors.New("inventory: collector closed")
	}
	driver, ret := c.lib.SystemGetDriverVersion()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("inventory: driver version: %s", nvml.ErrorString(ret))
	}
	n, ret := c.lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("inventory: device count: %s", nvml.ErrorString(ret))
	}
	want := map[string]bool{}
	for _, u := range uuids {
		want[u] = true
	}
	res := &agentv1.DiagNvmlResult{DriverVersion: driver}
	for i := range n {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		d, ret := c.lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("inventory: gpu %d: handle: %s", i, nvml.ErrorString(ret))
		}
		uuid, ret := d.GetUUID()
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("inventory: gpu %d: uuid: %s", i, nvml.ErrorString(ret))
		}
		if len(want) > 0 && !want[uuid] {
			continue
		}
		delete(want, uuid)
		res.Gpus = append(res.Gpus, diagnose(d, i))
	}
	for _, u := range uuids {
		if want[u] {
			res.Gpus = append(res.Gpus, &agentv1.GpuCheck{Uuid: u, Reason: "no such GPU"})
			delete(want, u)
		}
	}
	return res, nil
}

// diagnose runs one GPU's checks.
func diagnose(d nvml.Device, index int) *agentv1.GpuCheck {
	chk := &agentv1.GpuCheck{Index: uint32(index)}
	chk.Uuid, _ = d.GetUUID()
	var reasons []string
	if g, err := gpu(d, index); err != nil {
		reasons = append(reasons, err.Error())
	} else if !g.GetHealthy() {
		reasons = append(reasons, g.GetHealthReason())
	}
	switch t, ret := d.GetTemperature(nvml.TEMPERATURE_GPU); {
	case ret == nvml.SUCCESS:
		chk.TemperatureCelsius = t
		if t >= MaxTemperatureCelsius {
			reasons = append(reasons, fmt.Sprintf("temperature %d °C at or above %d °C", t, MaxTemperatureCelsius))
		}
	case ret != nvml.ERROR_NOT_SUPPORTED:
		reasons = append(reasons, "temperature query failed: "+nvml.ErrorString(ret))
	}
	switch e, ret := d.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.VOLATILE_ECC); {
	case ret == nvml.SUCCESS:
		chk.UncorrectableEccErrors = e
		if e > 0 {
			reasons = append(reasons, fmt.Sprintf("%d volatile uncorrectable ECC errors", e))
		}
	case ret != nvml.ERROR_NOT_SUPPORTED:
		reasons = append(reasons, "ECC query failed: "+nvml.ErrorString(ret))
	}
	chk.Healthy = len(reasons) == 0
	chk.Reason = strings.Join(reasons, "; ")
	return chk
}

// Rescan re-initialises NVML (shut down, then init again), so devices that
// appeared or disappeared since Open are seen by the next query.
func (c *Collector) Rescan(_ context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.open {
		return errors.New("inventory: collector closed")
	}
	if ret := c.lib.Shutdown(); ret != nvml.SUCCESS {
		return fmt.Errorf("inventory: rescan: shutdown: %s", nvml.ErrorString(ret))
	}
	if ret := c.lib.Init(); ret != nvml.SUCCESS {
		c.open = false
		return fmt.Errorf("%w: rescan: init: %s", ErrNVMLUnavailable, nvml.ErrorString(ret))
	}
	return nil
}
