package api

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/lifecycle"
	"github.com/bettercompute/bettercompute/pkg/miglayouts"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	nodestore "github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/rollouts"
	"github.com/bettercompute/bettercompute/pkg/tunnels"
)

// nodes implements computev1.NodesServiceServer.
type nodes struct {
	*Server
	computev1.UnimplementedNodesServiceServer
}

func nodePB(n nodestore.Node) *computev1.Node {
	out := &computev1.Node{
		Id: n.ID, TenantId: n.TenantID, PoolId: n.PoolID, State: n.State, Labels: n.Labels, Hostname: n.Hostname,
		LastSeenAt: tsp(n.LastSeenAt), SessionEpoch: n.SessionEpoch, GatewayId: n.GatewayID,
		Generation: n.Generation, ObservedGeneration: n.ObservedGeneration, SpecError: n.SpecError,
		CreateTime: ts(n.CreatedAt), UpdateTime: ts(n.UpdatedAt), Schedulable: n.Schedulable(),
		DrainDeadline: tsp(n.DrainDeadline), DrainReason: n.DrainReason, Retiring: n.Retiring,
		AgentVersion: n.AgentVersion,
	}
	for _, st := range n.Sections {
		out.Sections = append(out.Sections, &computev1.SectionStatus{Section: st.Section, State: st.State, Reason: st.Reason, Generation: st.Generation})
	}
	// Ready (the liveness job's, in columns of its own) comes first.
	if n.Ready != "" {
		r := n.ReadyCondition()
		out.Conditions = append(out.Conditions, &computev1.NodeCondition{Type: r.Type, Status: r.Status, Reason: r.Reason, Since: ts(r.Since), Value: n.Ready})
	}
	// Draining (while draining or drained), NeedsRepair (while latched)
	// and UpgradeFailed (while the agent section reports it) are shown
	// only while they hold.
	if n.State == nodestore.StateDraining || n.State == nodestore.StateDrained {
		c := &computev1.NodeCondition{Type: nodestore.ConditionDraining, Status: true, Value: "True", Reason: drainReason(n)}
		if n.DrainStartedAt != nil {
			c.Since = ts(*n.DrainStartedAt)
		}
		out.Conditions = append(out.Conditions, c)
	}
	if n.NeedsRepair {
		c := &computev1.NodeCondition{Type: nodestore.ConditionNeedsRepair, Status: true, Value: "True", Reason: n.NeedsRepairReason}
		if n.NeedsRepairSince != nil {
			c.Since = ts(*n.NeedsRepairSince)
		}
		out.Conditions = append(out.Conditions, c)
	}
	if n.UpgradeFailed != "" {
		c := &computev1.NodeCondition{Type: nodestore.ConditionUpgradeFailed, Status: true, Value: "True", Reason: n.UpgradeFailed}
		if n.UpgradeFailedSince != nil {
			c.Since = ts(*n.UpgradeFailedSince)
		}
		out.Conditions = append(out.Conditions, c)
	}
	for _, c := range n.Conditions {
		v := "False"
		if c.Status {
			v = "True"
		}
		out.Conditions = append(out.Conditions, &computev1.NodeCondition{Type: c.Type, Status: c.Status, Reason: c.Reason, Since: ts(c.Since), Value: v,
			Reasons: c.Reasons})
	}
	for _, d := range n.Devices {
		out.Devices = append(out.Devices, &computev1.Device{
			Id: d.ID, Kind: d.Kind, Index: int32(d.Index), Model: d.Model, Serial: d.Serial, MemoryBytes: d.MemoryBytes,
			PciBusId: d.PCIBusID, MigEnabled: d.MIGEnabled, Healthy: d.Healthy, HealthReason: d.HealthReason,
			MissingSince: tsp(d.MissingSince), Quarantined: d.QuarantinedAt != nil, QuarantineReason: d.QuarantineReason,
			QuarantineTime: tsp(d.QuarantinedAt),
			MigSlices:      migSlicesPB(d.MigSlices),
		})
	}
	return out
}

// migSlicesPB is a GPU's MIG slices in the API.
func migSlicesPB(ss []nodestore.MigSlice) []*computev1.MigSlice {
	var out []*computev1.MigSlice
	for _, s := range ss {
		out = append(out, &computev1.MigSlice{Id: s.ID, Profile: s.Profile, Start: int32(s.Start), MemoryBytes: s.MemoryBytes,
			ComputeSlices: int32(s.ComputeSlices), MissingSince: tsp(s.MissingSince), ReservationId: s.ReservationID})
	}
	return out
}

// drainReason is the Draining condition's reason: why, and until when (or
// that the drain is over).
func drainReason(n nodestore.Node) string {
	var b strings.Builder
	if n.Retiring {
		b.WriteString("retiring")
	} else {
		b.WriteString("draining")
	}
	if n.DrainReason != "" {
		b.WriteString(": " + n.DrainReason)
	}
	switch {
	case n.State == nodestore.StateDrained:
		b.WriteString("; drained")
	case n.DrainDeadline != nil:
		b.WriteString("; deadline " + n.DrainDeadline.UTC().Format(time.RFC3339))
	}
	return b.String()
}

func (s *nodes) Get(ctx context.Context, req *computev1.NodesServiceGetRequest) (*computev1.NodesServiceGetResponse, error) {
	if err := required("nodeId", req.GetNodeId()); err != nil {
		return nil, err
	}
	res, err := authz.Get(ctx, s.db, req.GetTenantId(), authz.TypeNode, req.GetNodeId(), "nodeId")
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), res); err != nil {
		return nil, err
	}
	n, err := nodestore.Get(ctx, s.db, req.GetTenantId(), req.GetNodeId())
	if err != nil {
		return nil, err
	}
	layouts, err := nodestore.MigLayoutOf(ctx, s.db, n.ID)
	if err != nil {
		return nil, err
	}
	pb := nodePB(n)
	for _, d := range pb.Devices {
		d.MigLayout = layouts[d.GetId()]
	}
	pb.RolloutBatch = -1
	// Which active rollout and batch the node is in (docs/rollouts.md).
	m, ok, err := rollouts.MembershipOf(ctx, s.db, n.ID)
	if err != nil {
		return nil, err
	}
	if ok {
		pb.RolloutId, pb.RolloutBatch, pb.RolloutReleased = m.RolloutID, int32(m.Batch), m.Released
	}
	return &computev1.NodesServiceGetResponse{Node: pb}, nil
}

func (s *nodes) List(ctx context.Context, req *computev1.NodesServiceListRequest) (*computev1.NodesServiceListResponse, error) {
	pg, err := readPage(req)
	if err != nil {
		return nil, err
	}
	if st := req.GetState(); st != "" && !slices.Contains(nodestore.States, st) {
		return nil, fault.New(fault.InvalidInput, "state", "expected one of %s, got %q", strings.Join(nodestore.States, ", "), st)
	}
	if err := validLabels(req.GetLabels()); err != nil {
		return nil, err
	}
	if c := req.GetCondition(); c != "" {
		if len(c) > maxCondition {
			return nil, fault.New(fault.InvalidInput, "condition", "at most %d characters, got %d", maxCondition, len(c))
		}
		if _, err := nodestore.ParseCondition(c); err != nil {
			return nil, err
		}
	}
	if err := s.read(ctx, req.GetTenantId(), authz.TenantResource(req.GetTenantId())); err != nil {
		return nil, err
	}
	ns, err := nodestore.List(ctx, s.db, nodestore.Filter{
		TenantID: req.GetTenantId(), PoolID: req.GetPoolId(), State: req.GetState(), Labels: req.GetLabels(),
		Condition: req.GetCondition(),
	}, pg.after, pg.size)
	if err != nil {
		return nil, err
	}
	out := &computev1.NodesServiceListResponse{}
	for _, n := range ns {
		out.Nodes = append(out.Nodes, nodePB(n))
	}
	out.NextPageToken = nextPage(pg, ns, func(n nodestore.Node) string { return n.ID })
	return out, nil
}

func (s *nodes) GetSpec(ctx context.Context, req *computev1.NodesServiceGetSpecRequest) (*computev1.NodesServiceGetSpecResponse, error) {
	if err := required("nodeId", req.GetNodeId()); err != nil {
		return nil, err
	}
	res, err := authz.Get(ctx, s.db, req.GetTenantId(), authz.TypeNode, req.GetNodeId(), "nodeId")
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), res); err != nil {
		return nil, err
	}
	sp, err := nodestore.GetSpec(ctx, s.db, req.GetTenantId(), req.GetNodeId())
	if err != nil {
		return nil, err
	}
	spec := &structpb.Struct{}
	if err := protojson.Unmarshal(sp.JSON, spec); err != nil {
		return nil, fmt.Errorf("decode spec of %s: %w", req.GetNodeId(), err)
	}
	return &computev1.NodesServiceGetSpecResponse{
		Spec: spec, Generation: sp.Generation, ObservedGeneration: sp.ObservedGeneration, SpecError: sp.Error,
	}, nil
}

// Update replaces a node's labels and invalidates its desired state in the
// same transaction.
func (s *nodes) Update(ctx context.Context, req *computev1.NodesServiceUpdateRequest) (*computev1.NodesServiceUpdateResponse, error) {
	if err := required("nodeId", req.GetNodeId()); err != nil {
		return nil, err
	}
	paths := req.GetUpdateMask().GetPaths()
	if len(paths) == 0 {
		return nil, fault.New(fault.InvalidInput, "updateMask", "required: name the fields to change (labels, mig, tunnels)")
	}
	var setLabels bool
	var mig *[]miglayouts.Layout
	var tunnelRules *[]*agentv1.TunnelRule
	for _, p := range paths {
		switch p {
		case "tunnels":
			r, err := tunnelRulesOf(req.GetTunnels(), "tunnels")
			if err != nil {
				return nil, err
			}
			tunnelRules = &r
		case "labels":
			if err := validLabels(req.GetLabels()); err != nil {
				return nil, err
			}
			setLabels = true
		case "mig":
			l, err := migLayouts(req.GetMig(), false)
			if err != nil {
				return nil, err
			}
			mig = &l
		default:
			return nil, fault.New(fault.InvalidInput, "updateMask", "field %q cannot be updated (labels, mig, tunnels can)", p)
		}
	}
	res, err := authz.Get(ctx, s.db, req.GetTenantId(), authz.TypeNode, req.GetNodeId(), "nodeId")
	if err != nil {
		return nil, err
	}
	labels := req.GetLabels()
	if labels == nil {
		labels = map[string]string{}
	}
	out := &computev1.NodesServiceUpdateResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			if setLabels {
				if err := nodestore.SetLabels(ctx, tx, req.GetTenantId(), req.GetNodeId(), labels); err != nil {
					return admission.Outcome{}, err
				}
			}
			if mig != nil {
				if err := setNodeMig(ctx, tx, q, req.GetTenantId(), req.GetNodeId(), *mig); err != nil {
					return admission.Outcome{}, err
				}
			}
			if tunnelRules != nil {
				if err := tunnels.SetNodeRules(ctx, tx, req.GetNodeId(), *tunnelRules); err != nil {
					return admission.Outcome{}, err
				}
			}
			if err := nodespec.Invalidate(ctx, q, req.GetNodeId()); err != nil {
				return admission.Outcome{}, err
			}
			n, err := nodestore.Get(ctx, tx, req.GetTenantId(), req.GetNodeId())
			if err != nil {
				return admission.Outcome{}, err
			}
			r := res
			r.Labels = n.Labels
			return outcome(&computev1.NodesServiceUpdateResponse{Node: nodePB(n)}, "node.updated", &r)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

// maxRevokeReason bounds nodes.revoke's reason.
const maxRevokeReason = 1024

// Revoke revokes every certificate of a node, in the same transaction as
// its audit row and node.revoked event; the gateway holding its session
// closes it at its next liveness tick.
func (s *nodes) Revoke(ctx context.Context, req *computev1.NodesServiceRevokeRequest) (*computev1.NodesServiceRevokeResponse, error) {
	if err := required("nodeId", req.GetNodeId()); err != nil {
		return nil, err
	}
	if len(req.GetReason()) > maxRevokeReason {
		return nil, fault.New(fault.InvalidInput, "reason", "at most %d characters, got %d", maxRevokeReason, len(req.GetReason()))
	}
	res, err := authz.Get(ctx, s.db, req.GetTenantId(), authz.TypeNode, req.GetNodeId(), "nodeId")
	if err != nil {
		return nil, err
	}
	out := &computev1.NodesServiceRevokeResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, _ *reconcile.Queue) (admission.Outcome, error) {
			revoked, err := nodeca.RevokeNode(ctx, tx, req.GetNodeId())
			if err != nil {
				return admission.Outcome{}, err
			}
			n, err := nodestore.Get(ctx, tx, req.GetTenantId(), req.GetNodeId())
			if err != nil {
				return admission.Outcome{}, err
			}
			return outcome(&computev1.NodesServiceRevokeResponse{Node: nodePB(n), RevokedCertificates: revoked}, "node.revoked", &res)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

// Bounds of nodes.drain and nodes.retire.
const (
	maxDrainSeconds     = 7 * 24 * 3600
	defaultDrainSeconds = 3600
	maxDrainReason      = 1024
	// maxCondition bounds nodes.list's condition filter.
	maxCondition = 64
)

// drainArgs validates a drain's or retire's fields and returns its deadline.
func (s *nodes) drainArgs(nodeID string, seconds int64, reason string) (time.Time, error) {
	if err := required("nodeId", nodeID); err != nil {
		return time.Time{}, err
	}
	if seconds < 0 || seconds > maxDrainSeconds {
		return time.Time{}, fault.New(fault.InvalidInput, "deadlineSeconds", "expected 0 to %d (0 means %d), got %d", maxDrainSeconds, defaultDrainSeconds, seconds)
	}
	if len(reason) > maxDrainReason {
		return time.Time{}, fault.New(fault.InvalidInput, "reason", "at most %d characters, got %d", maxDrainReason, len(reason))
	}
	if seconds == 0 {
		seconds = defaultDrainSeconds
	}
	return s.now().Add(time.Duration(seconds) * time.Second), nil
}

// Drain drains a node (lifecycle.StartDrain) in the same transaction as
// its audit row and node.drain_requested event.
func (s *nodes) Drain(ctx context.Context, req *computev1.NodesServiceDrainRequest) (*computev1.NodesServiceDrainResponse, error) {
	deadline, err := s.drainArgs(req.GetNodeId(), req.GetDeadlineSeconds(), req.GetReason())
	if err != nil {
		return nil, err
	}
	out := &computev1.NodesServiceDrainResponse{}
	err = s.drain(ctx, req.GetTenantId(), req.GetNodeId(), lifecycle.DrainRequest{Deadline: deadline, Reason: req.GetReason(), By: nodestore.DrainByOperator},
		func(n nodestore.Node) proto.Message { return &computev1.NodesServiceDrainResponse{Node: nodePB(n)} }, "node.drain_requested", out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

// Retire drains a node towards retirement: once drained and its bookings
// handled, the drain job revokes its certificates.
func (s *nodes) Retire(ctx context.Context, req *computev1.NodesServiceRetireRequest) (*computev1.NodesServiceRetireResponse, error) {
	deadline, err := s.drainArgs(req.GetNodeId(), req.GetDeadlineSeconds(), req.GetReason())
	if err != nil {
		return nil, err
	}
	out := &computev1.NodesServiceRetireResponse{}
	err = s.drain(ctx, req.GetTenantId(), req.GetNodeId(), lifecycle.DrainRequest{Deadline: deadline, Reason: req.GetReason(), By: nodestore.DrainByOperator, Retire: true},
		func(n nodestore.Node) proto.Message { return &computev1.NodesServiceRetireResponse{Node: nodePB(n)} }, "node.retire_requested", out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

// drain is Drain's and Retire's admitted mutation.
func (s *nodes) drain(ctx context.Context, tenant, id string, r lifecycle.DrainRequest, resp func(nodestore.Node) proto.Message, event string, out proto.Message) error {
	res, err := authz.Get(ctx, s.db, tenant, authz.TypeNode, id, "nodeId")
	if err != nil {
		return err
	}
	return s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: tenant},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			if _, err := lifecycle.StartDrain(ctx, tx, q, id, r); err != nil {
				return admission.Outcome{}, err
			}
			n, err := nodestore.Get(ctx, tx, tenant, id)
			if err != nil {
				return admission.Outcome{}, err
			}
			o, err := outcome(resp(n), event, nil)
			o.Detail = map[string]any{"deadline": r.Deadline.UTC().Format(time.RFC3339), "reason": r.Reason, "retire": r.Retire}
			return o, err
		},
	}, out)
}

// Undrain returns a draining or drained node to service.
func (s *nodes) Undrain(ctx context.Context, req *computev1.NodesServiceUndrainRequest) (*computev1.NodesServiceUndrainResponse, error) {
	if err := required("nodeId", req.GetNodeId()); err != nil {
		return nil, err
	}
	res, err := authz.Get(ctx, s.db, req.GetTenantId(), authz.TypeNode, req.GetNodeId(), "nodeId")
	if err != nil {
		return nil, err
	}
	out := &computev1.NodesServiceUndrainResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			if _, err := lifecycle.Undrain(ctx, tx, q, req.GetNodeId()); err != nil {
				return admission.Outcome{}, err
			}
			n, err := nodestore.Get(ctx, tx, req.GetTenantId(), req.GetNodeId())
			if err != nil {
				return admission.Outcome{}, err
			}
			return outcome(&computev1.NodesServiceUndrainResponse{Node: nodePB(n)}, "node.undrained", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}
