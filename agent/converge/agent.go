package converge

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/bettercompute/bettercompute/agent/upgrade"
	"github.com/bettercompute/bettercompute/proto/agentrelease"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// Agent wires the agent section: which bcd runs, and how it upgrades
// itself (docs/agent-upgrades.md).
type Agent struct {
	// Version is the running bcd's version: a release manifest of this
	// version is converged.
	Version string
	// Installer admits, fetches and stages builds; nil (no --release-key)
	// refuses every release manifest.
	Installer *upgrade.Installer
	// Handover is called, on the converging goroutine, with a build staged
	// and checked: the daemon ends its session, runs the build's trial and
	// execs it, or rolls back and latches UpgradeFailed. It must not block.
	// Nil stages only.
	Handover func(upgrade.Staged)
}

// agentHandler converges the agent section. Without a release manifest it
// answers as before: a desired version alone is not built yet.
type agentHandler struct {
	cfg Agent
	mu  sync.Mutex
	// pending is the manifest Plan admitted, for Apply; refused are the
	// refusals of Stage by manifest digest, reported terminal from then on.
	pending *agentrelease.Manifest
	refused map[string]error
}

func (*agentHandler) Section() string { return "agent" }

func (h *agentHandler) Plan(_ Current, d *agentv1.NodeSpec) (Plan, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.pending = nil
	raw := d.GetAgent().GetReleaseManifest()
	if len(raw) == 0 {
		m, would := planAgent(d)
		if empty(m) {
			return Plan{}, nil
		}
		return Plan{Terminal: "not built yet: would " + would}, nil
	}
	m, err := agentrelease.Parse(raw)
	if err != nil {
		return Plan{Terminal: "release manifest: " + err.Error()}, nil
	}
	if m.Version == h.cfg.Version {
		return Plan{Summary: "running bcd " + m.Version}, nil
	}
	if h.cfg.Installer == nil {
		return Plan{Terminal: fmt.Sprintf("upgrade to bcd %s refused: %v", m.Version, upgrade.ErrNoKey)}, nil
	}
	if err := h.refused[agentrelease.Digest(m)]; err != nil {
		return Plan{Terminal: refusal(m, err)}, nil
	}
	installed, err := h.cfg.Installer.Admit(m)
	switch {
	case errors.Is(err, upgrade.ErrLatched):
		return Plan{Terminal: "UpgradeFailed: " + err.Error()}, nil
	case err != nil:
		return Plan{Terminal: refusal(m, err)}, nil
	case installed:
		return Plan{Terminal: fmt.Sprintf("bcd %s is installed (%s) but this process runs %s: the service must run <root>/bin/current", m.Version, h.cfg.Installer.CurrentPath(), h.cfg.Version)}, nil
	}
	h.pending = m
	return Plan{Steps: []string{"upgrade bcd " + h.cfg.Version + " to " + m.Version}, Failure: "upgrading bcd to " + m.Version + ": staged, handing over"}, nil
}

func refusal(m *agentrelease.Manifest, err error) string {
	return fmt.Sprintf("upgrade to bcd %s (counter %d) refused: %v", m.Version, m.Counter, err)
}

func (h *agentHandler) Apply(ctx context.Context, _ Current, _ Plan) error {
	h.mu.Lock()
	m := h.pending
	h.mu.Unlock()
	if m == nil {
		return nil
	}
	st, err := h.cfg.Installer.Stage(ctx, m)
	if err != nil {
		if errors.Is(err, upgrade.ErrDigestMismatch) || errors.Is(err, upgrade.ErrTooLarge) {
			// The same manifest cannot fetch another build: terminal from
			// the next converge on.
			h.mu.Lock()
			if h.refused == nil {
				h.refused = map[string]error{}
			}
			h.refused[agentrelease.Digest(m)] = err
			h.mu.Unlock()
		}
		return err
	}
	if h.cfg.Handover != nil {
		h.cfg.Handover(st)
	}
	return nil
}
