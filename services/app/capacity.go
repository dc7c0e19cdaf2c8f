package app

import (
	"slices"

	capstore "github.com/bettercompute/bettercompute/pkg/capacity"
	"github.com/bettercompute/bettercompute/pkg/config"
	nodelife "github.com/bettercompute/bettercompute/pkg/lifecycle"
	desired "github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/tunnels"
	"github.com/bettercompute/bettercompute/services/api"
	"github.com/bettercompute/bettercompute/services/capacity"
	"github.com/bettercompute/bettercompute/services/gateway"
	"github.com/bettercompute/bettercompute/services/lifecycle"
	"github.com/bettercompute/bettercompute/services/nodespec"
	"github.com/bettercompute/bettercompute/services/vps"
)

// nodeSpecRegistry is the contributors of every node's desired state, in
// merge order: the built-in system and pool parts, then capacity's devices
// section, capacity.mig's mig section, then vps's instances section.
func nodeSpecRegistry() (*desired.Registry, error) {
	reg := nodespec.Builtin()
	if err := capacity.Register(reg); err != nil {
		return nil, err
	}
	if err := capacity.RegisterMig(reg); err != nil {
		return nil, err
	}
	if err := vps.Register(reg); err != nil {
		return nil, err
	}
	if err := tunnels.Register(reg); err != nil {
		return nil, err
	}
	return reg, nil
}

// schedulerHosted reports whether the process hosts the scheduler
// membership: the scheduler role, or the placer deployable that runs it.
func (a *App) schedulerHosted() bool {
	return slices.Contains(a.roles, config.RoleScheduler) || slices.Contains(a.roles, config.RolePlacer)
}

// registerCapacity registers the capacity reconcilers (bind, the pool-lease
// placer, tick, rollup, usage) and the capacity gauges on rt.
func (a *App) registerCapacity(rt *reconcile.Runtime) error {
	c := a.cfg.Capacity
	recs, err := capacity.Reconcilers(capacity.Config{
		Placer: c.Placer, LostNode: c.LostNode, LostAfter: c.LostAfter.Std(),
		TickEvery: c.TickEvery.Std(), RollupEvery: c.RollupEvery.Std(),
		Brakes: a.cfg.Nodes.Brakes(),
	})
	if err != nil {
		return err
	}
	for _, r := range recs {
		if err := rt.Register(r); err != nil {
			return err
		}
	}
	return a.reg.Register(&capacity.Collector{Pool: a.pool})
}

// apiCapacity is the API's inline-placement options from the configuration.
func (a *App) apiCapacity() api.CapacityOptions {
	return api.CapacityOptions{LostAfter: a.cfg.Capacity.LostAfter.Std()}
}

// observedKinds are the work kinds the gateway enqueues, with the node id,
// when it stores a node's observed generation: capacity's bind check, for
// the nodes with a booking waiting to bind, and the health job, for the
// nodes with a GPU waiting for a MIG reset or a MIG step running.
var observedKinds = []gateway.ObservedKind{
	{Kind: capstore.KindBind, Waiting: capacity.AwaitingBind},
	{Kind: nodelife.KindHealth, Waiting: lifecycle.WaitingForMigReset},
}
