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
// in index order, with its instances placed by proto/migcatalog keeping
// the placements the GPU has: the slices it reports (devices of kind mig),
// or while it reports none its last entry (the stored spec). An unchanged
// layout places the same (the same instances as the entry keep the entry),
// a change moves as few instances as it can, and a GPU whose actual layout
// differs from its entry (changed by hand) is re-laid keeping what matches.
//
// A GPU with an active booking whose entry would change, or whose new
// entry would remove one of its booked MIG slices (one of the same profile
// at the same start stays: that change proceeds), keeps its current
// entry (none if it had none) until the booking is gone: it is marked
// draining with the booked devices the change removes (a draining GPU
// takes no new booking), the booking's reservation gets one
// reservation.device_draining event, and the change applies when a later
// computation finds the GPU free (ending a booking recomputes the node).
// Under capacity.lostNode replace or fail the placer moves or fails those
// bookings (services/capacity placer.migDrains). No other GPU's entry
// depends on it. A GPU whose layout cannot be placed on it (an index
// selector on a model it does not fit) keeps its current entry.
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
	draining := map[string][]miglayouts.Waiting{}
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
		if err := drainEvents(ctx, q, draining, booked); err != nil {
			return nil, err
		}
	}
	// Marks of GPUs no longer waiting go (one statement, only where a
	// node has a layout or a mark: a fleet without MIG pays only the read
	// of layouts).
	if len(marked) > 0 {
		keep := map[string][]string{}
		for n, ws := range draining {
			for _, w := range ws {
				keep[n] = append(keep[n], w.GPU)
			}
		}
		if err := miglayouts.ClearDraining(ctx, q, marked, keep); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// bookedSlice is a booked MIG slice of a GPU: its placement and id.
type bookedSlice struct {
	migcatalog.Placement
	ID string
}

// migSection computes one node's mig section and the GPUs whose change
// waits for a booking, each with the booked devices the change removes.
func migSection(in *nodestore.MigInputs, nodeLayouts, poolLayouts []miglayouts.Layout, booked *capstore.Assignments) (*agentv1.MigLayout, []miglayouts.Waiting, error) {
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
	// start) and proceed, but not remove one. reported: the slices each
	// GPU reports now (what it has), which placement keeps first after
	// the booked ones.
	bookedSlices := map[string][]bookedSlice{}
	reported := map[string][]migcatalog.Placement{}
	for _, d := range in.Devices {
		for _, sl := range d.MigSlices {
			if sl.MissingSince != nil {
				continue
			}
			pl := migcatalog.Placement{Profile: sl.Profile, Start: sl.Start}
			reported[d.ID] = append(reported[d.ID], pl)
			if inUse[sl.ID] {
				bookedSlices[d.ID] = append(bookedSlices[d.ID], bookedSlice{pl, sl.ID})
			}
		}
	}
	gpus := miglayouts.GPUsOf(in.Devices)
	chosen := miglayouts.Resolve(nodeLayouts, poolLayouts, gpus)
	sec := &agentv1.MigLayout{}
	var waiting []miglayouts.Waiting
	for _, g := range gpus {
		l, ok := chosen[g.UUID]
		if !ok {
			continue
		}
		cur := prev[g.UUID]
		var keep []migcatalog.Placement
		for _, b := range bookedSlices[g.UUID] {
			keep = append(keep, b.Placement)
		}
		// What the GPU reports it has wins over its last entry (a node
		// whose actual layout differs, say changed by hand, is re-laid
		// keeping what matches); the entry counts only while it reports
		// no slice (MIG off, or not laid out yet).
		keepCur := true
		if len(reported[g.UUID]) > 0 {
			keep, keepCur = append(keep, reported[g.UUID]...), false
		}
		want, err := placeGPU(g, l, cur, keepCur, keep)
		if err != nil {
			// Admission checked the layout against the models it could
			// know; this GPU's cannot hold it. It stays as it is.
			if cur != nil {
				sec.Gpus = append(sec.Gpus, proto.CloneOf(cur))
			}
			continue
		}
		var removed []string
		if inUse[g.UUID] && changes(cur, want, g) {
			removed = append(removed, g.UUID)
		}
		removed = append(removed, dropped(want, bookedSlices[g.UUID])...)
		if len(removed) > 0 {
			waiting = append(waiting, miglayouts.Waiting{GPU: g.UUID, Devices: removed})
			if cur != nil {
				sec.Gpus = append(sec.Gpus, proto.CloneOf(cur))
			}
			continue
		}
		sec.Gpus = append(sec.Gpus, want)
	}
	return sec, waiting, nil
}

// dropped lists the booked slices want removes: MIG off, or no instance of
// the same profile at the same start.
func dropped(want *agentv1.GpuMigLayout, booked []bookedSlice) []string {
	var out []string
	for _, b := range booked {
		if !want.GetMigEnabled() || !slices.ContainsFunc(want.GetInstances(), func(in *agentv1.MigInstance) bool {
			return in.GetProfile() == b.Profile && int(in.GetStart()) == b.Start
		}) {
			out = append(out, b.ID)
		}
	}
	return out
}

// placeGPU is g's entry under layout l, keeping the placements of keep
// (the booked slices, then those the GPU reports), then, with keepCur
// (the GPU reports no slice), cur's, each where the rest still fits. A
// placement of the same instances as cur is cur.
func placeGPU(g miglayouts.GPU, l miglayouts.Layout, cur *agentv1.GpuMigLayout, keepCur bool, keep []migcatalog.Placement) (*agentv1.GpuMigLayout, error) {
	if l.Disabled {
		return &agentv1.GpuMigLayout{GpuUuid: g.UUID}, nil
	}
	if g.Model == nil {
		return nil, fmt.Errorf("GPU %s is not a MIG-capable model", g.UUID)
	}
	keep = slices.Clone(keep)
	if keepCur && cur.GetMigEnabled() {
		for _, in := range cur.GetInstances() {
			keep = append(keep, migcatalog.Placement{Profile: in.GetProfile(), Start: int(in.GetStart())})
		}
	}
	// Each placement once (the booked slices are also reported, and what
	// the GPU reports is mostly cur), in the order given.
	var seen []migcatalog.Placement
	keep = slices.DeleteFunc(keep, func(p migcatalog.Placement) bool {
		if slices.Contains(seen, p) {
			return true
		}
		seen = append(seen, p)
		return false
	})
	placed, err := g.Model.Place(l.Profiles, keep)
	if err != nil {
		return nil, err
	}
	out := &agentv1.GpuMigLayout{GpuUuid: g.UUID, MigEnabled: true, Profiles: slices.Clone(l.Profiles)}
	for _, p := range placed {
		out.Instances = append(out.Instances, &agentv1.MigInstance{Profile: p.Profile, Start: uint32(p.Start)})
	}
	if sameLayout(cur, out) {
		// The same instances, perhaps placed in another order: the entry
		// stays byte for byte (the generation does not move).
		return proto.CloneOf(cur), nil
	}
	return out, nil
}

// sameLayout reports whether a and b have MIG on, the same profiles and
// the same set of instances, in any order.
func sameLayout(a, b *agentv1.GpuMigLayout) bool {
	if !a.GetMigEnabled() || !b.GetMigEnabled() || !slices.Equal(a.GetProfiles(), b.GetProfiles()) || len(a.GetInstances()) != len(b.GetInstances()) {
		return false
	}
	key := func(g *agentv1.GpuMigLayout) []string {
		var out []string
		for _, in := range g.GetInstances() {
			out = append(out, fmt.Sprintf("%s@%d", in.GetProfile(), in.GetStart()))
		}
		slices.Sort(out)
		return out
	}
	return slices.Equal(key(a), key(b))
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
// reservation.device_draining event per reservation booking a device that
// a newly marked GPU's change removes.
func drainEvents(ctx context.Context, q reconcile.Querier, draining map[string][]miglayouts.Waiting, booked map[string]*capstore.Assignments) error {
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
			// The booked devices the change removes (the GPU, or its
			// slices): a reservation booking one. One whose slice stays
			// is not drained.
			var on []string
			for _, w := range draining[n] {
				if w.GPU == g {
					on = w.Devices
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
