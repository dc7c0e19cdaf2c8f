package capacity

import (
	"context"
	"fmt"
	"slices"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/migcatalog"

	capstore "github.com/bettercompute/bettercompute/pkg/capacity"
	"github.com/bettercompute/bettercompute/pkg/miglayouts"
	nodestore "github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/rollouts"
)

// ModuleMig is the capacity.mig job: the nodespec contributor of the mig
// section.
const ModuleMig = "capacity.mig"

// DrainReasonMig is the reason of the reservation.device_draining events
// capacity.mig writes.
const DrainReasonMig = "mig layout change"

// RegisterMig adds the capacity.mig contributor to reg: the mig section.
func RegisterMig(reg *nodespec.Registry) error { return reg.RegisterBatch(ModuleMig, ContributeMig) }

// ContributeMig is capacity.mig's part of nodes' desired state: the mig
// section, one entry per GPU a layout matches (the node's own layouts
// first, then its pool's; pkg/miglayouts — a node a rollout of MIG layouts
// released has the rollout's instead of its pool's, pkg/rollouts.Layers),
// in index order, with its
// instances placed by proto/migcatalog keeping the placements the GPU has
// (until the node reports them: the last contributed ones, from the stored
// spec), so an unchanged layout places the same and a change moves as few
// instances as it can.
//
// A GPU with an active booking whose entry would change, or whose new
// entry would remove one of its booked MIG slices (one of the same profile
// at the same start stays: that change proceeds), keeps its current
// entry (none if it had none) until the booking is gone: the booking's
// reservation gets one reservation.device_draining event, and the change
// applies when a later computation finds the GPU free (ending a booking
// recomputes the node). No other GPU's entry depends on it. A GPU whose
// layout cannot be placed on it (an index selector on a model it does not
// fit) keeps its current entry.
func ContributeMig(ctx context.Context, q reconcile.Querier, nodes []nodespec.Node) ([]*agentv1.NodeSpec, error) {
	var poolIDs, nodeIDs []string // nodeIDs: every node of the batch
	for _, n := range nodes {
		nodeIDs = append(nodeIDs, n.ID)
		if !slices.Contains(poolIDs, n.PoolID) {
			poolIDs = append(poolIDs, n.PoolID)
		}
	}
	layouts, err := miglayouts.Of(ctx, q, poolIDs, nodeIDs)
	if err != nil {
		return nil, err
	}
	// A rollout of MIG layouts: its layouts replace the pool's on the
	// nodes it released (or, with a selector, planned and succeeded on).
	layers, err := rollouts.Layers(ctx, q, nodeIDs)
	if err != nil {
		return nil, err
	}
	poolLayouts := make(map[string][]miglayouts.Layout, len(nodes))
	for _, n := range nodes {
		poolLayouts[n.ID] = layouts.Pools[n.PoolID]
		for _, c := range layers[n.ID] {
			if c.Mig != nil {
				poolLayouts[n.ID] = c.Mig.Layouts
			}
		}
	}
	var managed, marked []string
	for _, n := range nodes {
		if len(layouts.Nodes[n.ID]) > 0 || len(poolLayouts[n.ID]) > 0 {
			managed = append(managed, n.ID)
			marked = append(marked, n.ID)
		} else if layouts.Draining[n.ID] {
			marked = append(marked, n.ID)
		}
	}
	out := make([]*agentv1.NodeSpec, len(nodes))
	draining := map[string][]string{}
	if len(managed) > 0 {
		inputs, err := nodestore.MigInputsOf(ctx, q, managed)
		if err != nil {
			return nil, err
		}
		booked, err := capstore.NodesAssignments(ctx, q, managed)
		if err != nil {
			return nil, err
		}
		for i, n := range nodes {
			in := inputs[n.ID]
			if in == nil {
				continue
			}
			sec, waiting, err := migSection(in, layouts.Nodes[n.ID], poolLayouts[n.ID], booked[n.ID])
			if err != nil {
				return nil, fmt.Errorf("node %s: %w", n.ID, err)
			}
			if len(sec.GetGpus()) > 0 {
				out[i] = &agentv1.NodeSpec{Mig: sec}
			}
			if len(waiting) > 0 {
				draining[n.ID] = waiting
			}
		}
		if err := drainEvents(ctx, q, draining, booked, inputs); err != nil {
			return nil, err
		}
	}
	// Marks of GPUs no longer waiting go (one statement, only where a
	// node has a layout or a mark: a fleet without MIG pays only the read
	// of layouts).
	if len(marked) > 0 {
		if err := miglayouts.ClearDraining(ctx, q, marked, draining); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// migSection computes one node's mig section and the GPUs whose change
// waits for a booking.
func migSection(in *nodestore.MigInputs, nodeLayouts, poolLayouts []miglayouts.Layout, booked *capstore.Assignments) (*agentv1.MigLayout, []string, error) {
	var stored agentv1.NodeSpec
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(in.Spec, &stored); err != nil {
		return nil, nil, fmt.Errorf("stored spec: %w", err)
	}
	prev := map[string]*agentv1.GpuMigLayout{}
	for _, g := range stored.GetMig().GetGpus() {
		prev[g.GetGpuUuid()] = g
	}
	inUse := map[string]bool{}
	if booked != nil {
		for _, devs := range booked.Devices {
			for _, d := range devs {
				inUse[d] = true
			}
		}
	}
	// A GPU's booked MIG slices: a change may keep them (same profile and
	// start) and proceed, but not remove one.
	bookedSlices := map[string][]migcatalog.Placement{}
	for _, d := range in.Devices {
		for _, sl := range d.MigSlices {
			if inUse[sl.ID] && sl.MissingSince == nil {
				bookedSlices[d.ID] = append(bookedSlices[d.ID], migcatalog.Placement{Profile: sl.Profile, Start: sl.Start})
			}
		}
	}
	gpus := miglayouts.GPUsOf(in.Devices)
	chosen := miglayouts.Resolve(nodeLayouts, poolLayouts, gpus)
	sec := &agentv1.MigLayout{}
	var waiting []string
	for _, g := range gpus {
		l, ok := chosen[g.UUID]
		if !ok {
			continue
		}
		cur := prev[g.UUID]
		want, err := placeGPU(g, l, cur, bookedSlices[g.UUID])
		if err != nil {
			// Admission checked the layout against the models it could
			// know; this GPU's cannot hold it. It stays as it is.
			if cur != nil {
				sec.Gpus = append(sec.Gpus, proto.CloneOf(cur))
			}
			continue
		}
		if (inUse[g.UUID] && changes(cur, want, g)) || !keepsAll(want, bookedSlices[g.UUID]) {
			waiting = append(waiting, g.UUID)
			if cur != nil {
				sec.Gpus = append(sec.Gpus, proto.CloneOf(cur))
			}
			continue
		}
		sec.Gpus = append(sec.Gpus, want)
	}
	return sec, waiting, nil
}

// keepsAll reports whether want keeps every booked slice: MIG on and an
// instance of the same profile at the same start.
func keepsAll(want *agentv1.GpuMigLayout, booked []migcatalog.Placement) bool {
	for _, b := range booked {
		if !want.GetMigEnabled() || !slices.ContainsFunc(want.GetInstances(), func(in *agentv1.MigInstance) bool {
			return in.GetProfile() == b.Profile && int(in.GetStart()) == b.Start
		}) {
			return false
		}
	}
	return true
}

// placeGPU is g's entry under layout l, keeping cur's placements, the
// booked slices' first.
func placeGPU(g miglayouts.GPU, l miglayouts.Layout, cur *agentv1.GpuMigLayout, booked []migcatalog.Placement) (*agentv1.GpuMigLayout, error) {
	if l.Disabled {
		return &agentv1.GpuMigLayout{GpuUuid: g.UUID}, nil
	}
	if g.Model == nil {
		return nil, fmt.Errorf("GPU %s is not a MIG-capable model", g.UUID)
	}
	keep := slices.Clone(booked)
	if cur.GetMigEnabled() {
		for _, in := range cur.GetInstances() {
			keep = append(keep, migcatalog.Placement{Profile: in.GetProfile(), Start: int(in.GetStart())})
		}
	}
	placed, err := g.Model.Place(l.Profiles, keep)
	if err != nil {
		return nil, err
	}
	out := &agentv1.GpuMigLayout{GpuUuid: g.UUID, MigEnabled: true, Profiles: slices.Clone(l.Profiles)}
	for _, p := range placed {
		out.Instances = append(out.Instances, &agentv1.MigInstance{Profile: p.Profile, Start: uint32(p.Start)})
	}
	return out, nil
}

// changes reports whether applying want changes the GPU: its entry differs
// from cur, or, with none yet, want turns MIG on or creates instances on a
// GPU whose reported mode differs or that is in MIG mode.
func changes(cur, want *agentv1.GpuMigLayout, g miglayouts.GPU) bool {
	if cur != nil {
		return !proto.Equal(cur, want)
	}
	return want.GetMigEnabled() || g.MIGEnabled
}

// drainEvents marks the waiting GPUs and writes one
// reservation.device_draining event per reservation booking each newly
// marked GPU.
func drainEvents(ctx context.Context, q reconcile.Querier, draining map[string][]string, booked map[string]*capstore.Assignments,
	inputs map[string]*nodestore.MigInputs) error {
	type ev struct{ rsv, node, gpu string }
	var evs []ev
	var rsvs []string
	nodes := make([]string, 0, len(draining))
	for n := range draining {
		nodes = append(nodes, n)
	}
	slices.Sort(nodes)
	for _, n := range nodes {
		fresh, err := miglayouts.MarkDraining(ctx, q, n, draining[n])
		if err != nil {
			return err
		}
		a := booked[n]
		for _, g := range fresh {
			// The GPU and its slices: a reservation booking either.
			on := []string{g}
			for _, d := range inputs[n].Devices {
				if d.ID == g {
					for _, sl := range d.MigSlices {
						on = append(on, sl.ID)
					}
				}
			}
			for _, rsv := range a.Order {
				if slices.ContainsFunc(a.Devices[rsv], func(d string) bool { return slices.Contains(on, d) }) {
					evs = append(evs, ev{rsv, n, g})
					rsvs = append(rsvs, rsv)
				}
			}
		}
	}
	if len(evs) == 0 {
		return nil
	}
	tenants, err := capstore.ReservationTenants(ctx, q, rsvs)
	if err != nil {
		return err
	}
	events := make([]outbox.Event, 0, len(evs))
	for _, e := range evs {
		events = append(events, outbox.Event{TenantID: tenants[e.rsv], Type: "reservation.device_draining", Resource: e.rsv,
			Payload: map[string]any{"reservationId": e.rsv, "nodeId": e.node, "gpuUuid": e.gpu, "reason": DrainReasonMig}})
	}
	return outbox.WriteMany(ctx, q, events)
}
