package session

import (
	"context"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/bettercompute/bettercompute/agent/converge"
	"github.com/bettercompute/bettercompute/agent/inventory"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// healthChecker is an inventory that runs the GPU health checks (an
// *inventory.Collector). Without it the daemon runs no health loop.
type healthChecker interface {
	SetHealthConfig(inventory.HealthConfig)
	CheckHealth(ctx context.Context, dst []inventory.GPUHealth) ([]inventory.GPUHealth, error)
}

// gpuKey is what a report said of one GPU's health.
type gpuKey struct {
	uuid   string
	failed inventory.CheckSet
}

// reported is the GPU health the control plane last heard, from any
// InventoryReport with the GPU section (an inventory request answered,
// inventory.refresh, gpu.reset, the health loop). known is false until the
// first: the loop has nothing to compare with before.
type reported struct {
	mu    sync.Mutex
	known bool
	gpus  []gpuKey
}

// note records the GPUs of a report that carries them.
func (h *reported) note(rep *agentv1.InventoryReport) {
	has := false
	for _, s := range rep.GetSections() {
		has = has || s == inventory.SectionGPUs
	}
	if !has {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.known = true
	h.gpus = h.gpus[:0]
	for _, g := range rep.GetGpus() {
		h.gpus = append(h.gpus, gpuKey{uuid: g.GetUuid(), failed: inventory.ParseChecks(g.GetFailedChecks())})
	}
}

// changed reports whether cur differs from the last report (false before
// any report).
func (h *reported) changed(cur []inventory.GPUHealth) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.known {
		return false
	}
	if len(cur) != len(h.gpus) {
		return true
	}
	for i := range cur {
		if cur[i].UUID != h.gpus[i].uuid || cur[i].Failed != h.gpus[i].failed {
			return true
		}
	}
	return false
}

// healthLoop runs the GPU health checks every check interval (the health
// section's, or Config.HealthCheckInterval) with the section's thresholds,
// and queues an InventoryReport of the GPUs whenever a GPU's health
// (healthy, failed checks) differs from what the control plane last heard.
// The first check comes after a random part of the interval, so that a
// fleet started at once does not check in step.
func (r *runner) healthLoop(ctx context.Context) {
	hc, ok := r.cfg.Inventory.(healthChecker)
	if !ok {
		return
	}
	interval := func(h converge.Health) time.Duration {
		if r.cfg.HealthCheckInterval > 0 {
			return r.cfg.HealthCheckInterval
		}
		return h.Interval()
	}
	settings := r.conv.Health()
	hc.SetHealthConfig(settings.Checks())
	every := interval(settings)
	t := time.NewTimer(rand.N(every) + 1)
	defer t.Stop()
	var cur []inventory.GPUHealth
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if h := r.conv.Health(); !h.Equal(settings) {
			settings = h
			hc.SetHealthConfig(h.Checks())
			every = interval(h)
		}
		t.Reset(every)
		var err error
		cur, err = hc.CheckHealth(ctx, cur)
		changed := err == nil && r.health.changed(cur)
		if err != nil {
			r.log.WarnContext(ctx, "GPU health checks", "err", err)
		}
		if changed {
			rep, err := r.cfg.Inventory.Report(ctx, []string{inventory.SectionGPUs})
			if err != nil {
				r.log.WarnContext(ctx, "inventory after a GPU health change", "err", err)
			} else {
				r.log.InfoContext(ctx, "GPU health changed; reporting", "unhealthy", unhealthy(cur))
				r.health.note(rep)
				r.queue(&agentv1.SessionRequest{Body: &agentv1.SessionRequest_Inventory{Inventory: rep}})
			}
		}
		if r.cfg.OnHealthCheck != nil {
			r.cfg.OnHealthCheck(changed)
		}
	}
}

// unhealthy is how many of hs failed a check.
func unhealthy(hs []inventory.GPUHealth) int {
	n := 0
	for i := range hs {
		if !hs[i].Healthy() {
			n++
		}
	}
	return n
}
