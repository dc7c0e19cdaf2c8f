package converge

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/bettercompute/bettercompute/agent/mig"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/migcatalog"
)

// MIG reads and applies GPUs' MIG layouts (an *inventory.Collector).
type MIG interface {
	// MIGLayout reads what the GPU with this UUID has.
	MIGLayout(uuid string) (mig.Layout, error)
	// ApplyMIG makes one GPU have w and returns what it then has and the
	// changes made.
	ApplyMIG(w mig.Want) (mig.Layout, []string, error)
}

// outcomeReporter is a handler whose state and reason are known only after
// Apply (and are then its own, not the Plan's).
type outcomeReporter interface {
	outcome() (state agentv1.SectionState, reason string, ok bool)
}

// MaxMigGPUs bounds the mig section's GPUs.
const MaxMigGPUs = 64

// migHandler converges the mig section: per GPU the section names, it
// reads the layout the GPU has and applies the desired one where they
// differ (package mig), touching no other GPU. The status reason has one
// entry per GPU, in section order: its layout with the slices' MIG UUIDs
// ("GPU-…: 3g.71gb@0 MIG-…, 1g.18gb@4 MIG-…"), or its typed failure
// ("GPU-…: reset-required: …", "busy: …", "profile-unsupported: …",
// "invalid-layout: …"). CONVERGED only when every GPU has its layout;
// FAILED (retried) while a GPU is busy, is not in the inventory or failed
// otherwise; FAILED_TERMINAL when the only failures are layouts the GPU
// cannot take or GPUs that wait for a reset (the control plane's gpu.reset
// or node.reboot, which presupposes this generation applied; every pass
// still tries, so the pass after the reset lays them out). A malformed
// section is FAILED_TERMINAL naming the field, and nothing is applied.
//
// Every converge reads the GPUs' layouts, so a node whose instances are
// gone (rebooted, GPU reset) re-creates them before it reports the
// section converged; the daemon's start re-applies the persisted desired
// state (Converger.resume) before the control plane speaks.
type migHandler struct {
	mig MIG

	order   []string            // GPUs in section order
	wants   map[string]mig.Want // by GPU
	apply   []string            // GPUs to apply, in order
	results map[string]migResult
	missing map[string]bool
}

type migResult struct {
	layout mig.Layout
	err    error
}

func (*migHandler) Section() string { return "mig" }

// migWants checks the section's shape (what needs no GPU model) and
// translates it; the problems name their field.
func migWants(sec *agentv1.MigLayout) ([]mig.Want, []string) {
	var bad []string
	if n := len(sec.GetGpus()); n > MaxMigGPUs {
		return nil, []string{fmt.Sprintf("mig.gpus: %d GPUs, at most %d", n, MaxMigGPUs)}
	}
	seen := map[string]int{}
	wants := make([]mig.Want, 0, len(sec.GetGpus()))
	for i, g := range sec.GetGpus() {
		f := fmt.Sprintf("mig.gpus[%d]", i)
		u := g.GetGpuUuid()
		switch j, dup := seen[u]; {
		case u == "":
			bad = append(bad, f+".gpu_uuid: empty")
			continue
		case dup:
			bad = append(bad, fmt.Sprintf("%s.gpu_uuid: %s is also mig.gpus[%d]", f, u, j))
			continue
		}
		seen[u] = i
		w := mig.Want{GPU: u, Enabled: g.GetMigEnabled()}
		if !w.Enabled {
			if len(g.GetProfiles()) > 0 || len(g.GetInstances()) > 0 {
				bad = append(bad, f+".instances: set while mig_enabled is false")
			}
			wants = append(wants, w)
			continue
		}
		if n := len(g.GetInstances()); n > 7 {
			bad = append(bad, fmt.Sprintf("%s.instances: %d, at most 7", f, n))
			continue
		}
		if len(g.GetProfiles()) != len(g.GetInstances()) {
			bad = append(bad, fmt.Sprintf("%s.instances: %d placements for %d profiles", f, len(g.GetInstances()), len(g.GetProfiles())))
			continue
		}
		ok := true
		for j, in := range g.GetInstances() {
			switch {
			case in.GetProfile() != g.GetProfiles()[j]:
				bad = append(bad, fmt.Sprintf("%s.instances[%d].profile: %q, profiles[%d] is %q", f, j, in.GetProfile(), j, g.GetProfiles()[j]))
				ok = false
			case in.GetStart() >= migcatalog.MemorySlices:
				bad = append(bad, fmt.Sprintf("%s.instances[%d].start: %d, a GPU has memory slices 0 to %d", f, j, in.GetStart(), migcatalog.MemorySlices-1))
				ok = false
			}
			w.Instances = append(w.Instances, migcatalog.Placement{Profile: in.GetProfile(), Start: int(in.GetStart())})
		}
		if ok {
			wants = append(wants, w)
		}
	}
	return wants, bad
}

func (h *migHandler) Plan(cur Current, d *agentv1.NodeSpec) (Plan, error) {
	h.order, h.apply, h.wants, h.results, h.missing = nil, nil, nil, nil, nil
	sec := d.GetMig()
	if empty(sec) {
		return Plan{}, nil
	}
	if h.mig == nil {
		_, would := planMig(d)
		return Plan{Terminal: "this node has no NVML to apply MIG layouts with: would " + would}, nil
	}
	wants, bad := migWants(sec)
	if len(bad) > 0 {
		return Plan{Terminal: "invalid mig section: " + strings.Join(bad, "; ")}, nil
	}
	h.wants, h.results, h.missing = map[string]mig.Want{}, map[string]migResult{}, map[string]bool{}
	var p Plan
	for _, w := range wants {
		h.order = append(h.order, w.GPU)
		h.wants[w.GPU] = w
		if !cur.GPUs[w.GPU] {
			h.missing[w.GPU] = true
			continue
		}
		l, err := h.mig.MIGLayout(w.GPU)
		if err != nil {
			h.results[w.GPU] = migResult{layout: l, err: err}
			continue
		}
		h.results[w.GPU] = migResult{layout: l}
		if !l.Matches(w) {
			h.apply = append(h.apply, w.GPU)
			p.Steps = append(p.Steps, fmt.Sprintf("lay out %s: %s", w.GPU, describe(w)))
		}
	}
	return p, nil
}

// describe is a desired layout: "MIG off", or "3g.71gb@0, 1g.18gb@4".
func describe(w mig.Want) string {
	if !w.Enabled {
		return "MIG off"
	}
	parts := make([]string, len(w.Instances))
	for i, in := range w.Instances {
		parts[i] = fmt.Sprintf("%s@%d", in.Profile, in.Start)
	}
	return "MIG on [" + strings.Join(parts, ", ") + "]"
}

func (h *migHandler) Apply(context.Context, Current, Plan) error {
	for _, u := range h.apply {
		l, _, err := h.mig.ApplyMIG(h.wants[u])
		h.results[u] = migResult{layout: l, err: err}
	}
	return nil
}

func (h *migHandler) outcome() (agentv1.SectionState, string, bool) {
	if h.order == nil {
		return 0, "", false // empty or invalid section: the plan says
	}
	retry, terminal := false, false
	parts := make([]string, 0, len(h.order))
	for _, u := range h.order {
		if h.missing[u] {
			retry = true
			parts = append(parts, u+": not in this node's inventory")
			continue
		}
		r := h.results[u]
		switch {
		case r.err != nil:
			if e := (*mig.Error)(nil); errors.As(r.err, &e) && (e.Terminal() || e.Kind == mig.ResetRequired) {
				// A reset-required GPU cannot progress by itself: the
				// control plane resets it (gpu.reset, or node.reboot), which
				// it can do only once the node has applied this generation,
				// so it does not hold the observed generation back. The
				// next pass after the reset lays the GPU out.
				terminal = true
			} else {
				retry = true
			}
			parts = append(parts, u+": "+r.err.Error())
		case !r.layout.Matches(h.wants[u]):
			retry = true
			parts = append(parts, fmt.Sprintf("%s: has %s, want %s", u, r.layout, describe(h.wants[u])))
		default:
			parts = append(parts, u+": "+r.layout.String())
		}
	}
	reason := strings.Join(parts, "; ")
	switch {
	case retry:
		return agentv1.SectionState_SECTION_STATE_FAILED, reason, true
	case terminal:
		return agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL, reason, true
	}
	return agentv1.SectionState_SECTION_STATE_CONVERGED, reason, true
}
