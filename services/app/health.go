package app

import (
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/services/lifecycle"
)

// registerHealth registers the health job (quarantine and the remediation
// ladder) and health.prune on rt, for the controllers role. It queues
// gpu.reset and node.reboot, destructive kinds, through the signing view
// of the command registry (admitKinds), as commands.run does.
func (a *App) registerHealth(rt *reconcile.Runtime) error {
	n, h := a.cfg.Nodes, a.cfg.Health
	recs, err := lifecycle.Health(lifecycle.HealthConfig{
		Kinds:    a.admitKinds,
		LostNode: a.cfg.Capacity.LostNode, LostAfter: n.LostAfter.Std(),
		MaxRemediationsPerNode: h.MaxRemediationsPerNode, MaxConcurrentRemediations: h.MaxConcurrentRemediations,
		Brakes: n.Brakes(),
	})
	if err != nil {
		return err
	}
	for _, r := range recs {
		if err := rt.Register(r); err != nil {
			return err
		}
	}
	return nil
}
