package inventory

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// MaxTemperatureCelsius is the GPU temperature above which Diagnose
// reports a GPU unhealthy when the health section sets no limit.
const MaxTemperatureCelsius = 90

// Diagnose checks each GPU (only those whose UUID is in uuids; all when
// empty) with the health checks (CheckHealth, the health section's
// settings), failing a GPU above MaxTemperatureCelsius when the section
// sets no temperature limit. A UUID asked for that no GPU has is reported
// unhealthy with the reason "no such GPU". It returns an error only when
// NVML itself cannot be queried.
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
	if err := c.prepare(); err != nil {
		return nil, err
	}
	cfg := c.currentRules().cfg
	if cfg.MaxGPUTemperatureCelsius == 0 {
		cfg.MaxGPUTemperatureCelsius = MaxTemperatureCelsius
	}
	r := newRules(cfg)
	want := map[string]bool{}
	for _, u := range uuids {
		want[u] = true
	}
	res := &agentv1.DiagNvmlResult{DriverVersion: driver}
	for i, st := range c.devs {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		// Asked for GPUs: only those (want empties as they are found).
		if len(uuids) > 0 && !want[st.uuid] {
			continue
		}
		delete(want, st.uuid)
		res.Gpus = append(res.Gpus, c.diagnose(st, i, r))
	}
	for _, u := range uuids {
		if want[u] {
			res.Gpus = append(res.Gpus, &agentv1.GpuCheck{Uuid: u, Reason: "no such GPU"})
			delete(want, u)
		}
	}
	return res, nil
}

// DiagnoseAt is Diagnose and, at a DCGM run level above zero, DCGM's
// diagnostics (RunDCGM, the Config.DCGMI binary) on the GPUs found: a GPU
// a DCGM test failed on is unhealthy, its reason naming the test. The
// DCGM part runs without holding the collector, so health checks go on.
func (c *Collector) DiagnoseAt(ctx context.Context, uuids []string, runLevel int) (*agentv1.DiagNvmlResult, error) {
	res, err := c.Diagnose(ctx, uuids)
	if err != nil || runLevel <= 0 {
		return res, err
	}
	var ids []uint32
	byIndex := map[uint32]string{}
	for _, g := range res.GetGpus() {
		if g.GetReason() == "no such GPU" {
			continue
		}
		ids = append(ids, g.GetIndex())
		byIndex[g.GetIndex()] = g.GetUuid()
	}
	res.Dcgm = RunDCGM(ctx, c.cfg.DCGMI, runLevel, ids, byIndex)
	for _, t := range res.GetDcgm().GetTests() {
		if t.GetResult() != "fail" || t.GetGpuUuid() == "" {
			continue
		}
		for _, g := range res.GetGpus() {
			if g.GetUuid() == t.GetGpuUuid() {
				g.Healthy = false
				g.Reason = strings.TrimPrefix(g.GetReason()+"; DCGM "+t.GetName()+" failed", "; ")
			}
		}
	}
	return res, nil
}

// diagnose runs one GPU's checks. c.mu is held.
func (c *Collector) diagnose(st *devState, index int, r *rules) *agentv1.GpuCheck {
	var h GPUHealth
	c.check(st, index, r, &h)
	return &agentv1.GpuCheck{Index: uint32(index), Uuid: h.UUID, Healthy: h.Healthy(), Reason: h.Reason,
		TemperatureCelsius: h.TemperatureCelsius, UncorrectableEccErrors: h.UncorrectableECC}
}

// Check re-runs the checks on the
// GPUs with these UUIDs (in that order; an unknown one is "no such GPU").
func (c *Collector) Check(ctx context.Context, uuids []string) ([]*agentv1.GpuCheck, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.open {
		return nil, errors.New("inventory: collector closed")
	}
	if err := c.prepare(); err != nil {
		return nil, err
	}
	r := c.currentRules()
	out := make([]*agentv1.GpuCheck, 0, len(uuids))
	for _, u := range uuids {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		i := slices.IndexFunc(c.devs, func(st *devState) bool { return st.uuid == u })
		if i < 0 {
			out = append(out, &agentv1.GpuCheck{Uuid: u, Reason: "no such GPU"})
			continue
		}
		out = append(out, c.diagnose(c.devs[i], i, r))
	}
	return out, nil
}

// freeEvents releases the XID event set and forgets the devices (their
// handles end with the library); the XIDs they raised are kept by UUID for
// the next pass. c.mu is held.
func (c *Collector) freeEvents() {
	if c.events != nil {
		_ = c.events.Free()
	}
	for _, st := range c.devs {
		if len(st.xids) > 0 {
			if c.carried == nil {
				c.carried = map[string][]uint32{}
			}
			c.carried[st.uuid] = st.xids
		}
	}
	c.events, c.eventsFailed, c.devs = nil, false, nil
}

// Rescan re-initialises NVML (shut down, then init again), so devices that
// appeared or disappeared since Open are seen by the next query.
func (c *Collector) Rescan(_ context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.open {
		return errors.New("inventory: collector closed")
	}
	c.freeEvents()
	if ret := c.lib.Shutdown(); ret != nvml.SUCCESS {
		return fmt.Errorf("inventory: rescan: shutdown: %s", nvml.ErrorString(ret))
	}
	if ret := c.lib.Init(); ret != nvml.SUCCESS {
		c.open = false
		return fmt.Errorf("%w: rescan: init: %s", ErrNVMLUnavailable, nvml.ErrorString(ret))
	}
	return nil
}
