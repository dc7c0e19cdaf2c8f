package api

import (
	"context"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/miglayouts"
	nodestore "github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/nodespec"
	poolstore "github.com/bettercompute/bettercompute/pkg/pools"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// migLayouts converts the mig field of pools.update or nodes.update; with
// check, it validates them as a pool's (miglayouts.Validate: bounds,
// names, selectors, and every layout against each catalog model its
// selector can match). A node's are validated against its inventory
// ([setNodeMig]).
func migLayouts(m *computev1.MigSettings, check bool) ([]miglayouts.Layout, error) {
	if p := m.GetResetPolicy(); p != "" && !check {
		return nil, fault.New(fault.InvalidInput, "mig.resetPolicy", "a pool's setting (pools.update); a node takes its pool's")
	} else if p != "" && !slices.Contains(miglayouts.ResetPolicies, p) {
		return nil, fault.New(fault.InvalidInput, "mig.resetPolicy", "expected %s, got %q", strings.Join(miglayouts.ResetPolicies, " or "), p)
	}
	if len(m.GetLayouts()) > miglayouts.MaxLayouts {
		return nil, fault.New(fault.InvalidInput, "mig.layouts", "at most %d layouts, got %d", miglayouts.MaxLayouts, len(m.GetLayouts()))
	}
	out := make([]miglayouts.Layout, len(m.GetLayouts()))
	for i, l := range m.GetLayouts() {
		out[i] = miglayouts.Layout{Name: l.GetName(), Profiles: l.GetProfiles(), Disabled: l.GetDisabled(),
			Selector: miglayouts.Selector{Model: l.GetGpuSelector().GetModel()}}
		for _, ix := range l.GetGpuSelector().GetIndices() {
			out[i].Selector.Indices = append(out[i].Selector.Indices, int(min(ix, 1<<16)))
		}
	}
	if check {
		if err := miglayouts.Validate(out, "mig", nil); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// setPoolMig stores pool p's layouts and reset policy (checked by
// migLayouts) and invalidates its nodes' desired state in tx: capacity.mig
// recomputes each one's mig section.
func setPoolMig(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, p poolstore.Pool, layouts []miglayouts.Layout, resetPolicy string) error {
	if p.Class != poolstore.ClassGPU && (len(layouts) > 0 || resetPolicy != "") {
		return fault.New(fault.InvalidInput, "mig", "pool %s is a %s pool; MIG layouts apply to gpu pools", p.ID, p.Class)
	}
	if err := miglayouts.SetPool(ctx, tx, p.ID, layouts); err != nil {
		return err
	}
	if err := miglayouts.SetResetPolicy(ctx, tx, p.ID, resetPolicy); err != nil {
		return err
	}
	return nodespec.InvalidatePool(ctx, tx, q, p.ID)
}

// setNodeMig validates node's layouts against its inventory (index
// selectors name GPUs it reports; each layout fits the models of the GPUs
// it matches; before it reported any, as a pool's), stores them and
// invalidates its desired state in tx.
func setNodeMig(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, tenant, node string, layouts []miglayouts.Layout) error {
	n, err := nodestore.Get(ctx, tx, tenant, node)
	if err != nil {
		return err
	}
	if len(layouts) > 0 {
		class, err := poolstore.ClassOf(ctx, tx, n.PoolID)
		if err != nil {
			return err
		}
		if class != poolstore.ClassGPU {
			return fault.New(fault.InvalidInput, "mig", "node %s is in a %s pool; MIG layouts apply to nodes of gpu pools", node, class)
		}
	}
	if err := miglayouts.Validate(layouts, "mig", miglayouts.GPUsOf(n.Devices)); err != nil {
		return err
	}
	if err := miglayouts.SetNode(ctx, tx, node, layouts); err != nil {
		return err
	}
	return nodespec.Invalidate(ctx, q, node)
}
