package api

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/fieldmaskpb"
	"google.golang.org/protobuf/types/known/structpb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/proto/commandkinds"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/miglayouts"
	"github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	poolstore "github.com/bettercompute/bettercompute/pkg/pools"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/rollouts"
)

// rolloutsAPI implements computev1.RolloutsServiceServer: every action is
// decided on the rollout's pool.
type rolloutsAPI struct {
	*Server
	computev1.UnimplementedRolloutsServiceServer
}

// Bounds of a rollout's fields.
const (
	MaxRolloutBatches  = 100
	MaxRolloutNodes    = 100000
	MaxRolloutBake     = 24 * time.Hour
	MaxRolloutGates    = 4
	MaxRolloutGateWait = time.Hour
	// DefaultRolloutGateWait is a gate's timeout when unset.
	DefaultRolloutGateWait = 10 * time.Minute
	maxRolloutPercent      = 100
	rolloutUnsupported     = "not built yet"
)

func (s *rolloutsAPI) Create(ctx context.Context, req *computev1.RolloutsServiceCreateRequest) (*computev1.RolloutsServiceCreateResponse, error) {
	if err := required("poolId", req.GetPoolId()); err != nil {
		return nil, err
	}
	if err := validLabels(req.GetSelector()); err != nil {
		return nil, fault.New(fault.InvalidInput, "selector", "%s", fault.MessageOf(err))
	}
	change, err := rolloutChange(req.GetChange())
	if err != nil {
		return nil, err
	}
	gates, err := rolloutGates(req.GetGates())
	if err != nil {
		return nil, err
	}
	strategy, err := rolloutStrategy(req.GetStrategy())
	if err != nil {
		return nil, err
	}
	success, err := rolloutThreshold(req.GetSuccessThreshold(), "successThreshold")
	if err != nil {
		return nil, err
	}
	failure, err := rolloutThreshold(req.GetFailureThreshold(), "failureThreshold")
	if err != nil {
		return nil, err
	}
	res, err := authz.Get(ctx, s.db, req.GetTenantId(), authz.TypePool, req.GetPoolId(), "poolId")
	if err != nil {
		return nil, err
	}
	out := &computev1.RolloutsServiceCreateResponse{}
	_, err = s.create(ctx, req, req.GetIdempotencyKey(), admission.Create{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Existing: true,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, _ string) (admission.Outcome, error) {
			if err := poolstore.Lock(ctx, tx, req.GetPoolId()); err != nil {
				return admission.Outcome{}, err
			}
			var previous rollouts.Change
			if change.Mig != nil {
				// The pool's layouts now, for a rollback after success.
				p, err := poolstore.Get(ctx, tx, req.GetTenantId(), req.GetPoolId())
				if err != nil {
					return admission.Outcome{}, err
				}
				if p.Class != poolstore.ClassGPU {
					return admission.Outcome{}, fault.New(fault.InvalidInput, "change.mig", "pool %s is a %s pool; MIG layouts apply to gpu pools", p.ID, p.Class)
				}
				cur, err := miglayouts.Of(ctx, tx, []string{p.ID}, nil)
				if err != nil {
					return admission.Outcome{}, err
				}
				previous.Mig = &rollouts.Mig{Layouts: cur.Pools[p.ID]}
			}
			r, err := rollouts.Create(ctx, tx, rollouts.Rollout{
				ID: iam.NewID("rol"), TenantID: req.GetTenantId(), PoolID: req.GetPoolId(), Selector: req.GetSelector(),
				Change: change, Previous: previous, Strategy: strategy, Gates: gates, Success: success, Failure: failure,
			})
			if err != nil {
				return admission.Outcome{}, err
			}
			if err := q.Enqueue(ctx, rollouts.Kind, r.PoolID); err != nil {
				return admission.Outcome{}, err
			}
			pb, err := rolloutPB(ctx, tx, r)
			if err != nil {
				return admission.Outcome{}, err
			}
			o, err := outcome(&computev1.RolloutsServiceCreateResponse{Rollout: pb}, "rollout.created", nil)
			o.Event.Resource = r.ID
			o.Event.Payload = map[string]any{"rolloutId": r.ID, "poolId": r.PoolID, "mask": r.Change.Mask}
			o.Detail = map[string]any{"rolloutId": r.ID}
			return o, err
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

// rolloutChange validates a rollout's change with pools.update's rules.
func rolloutChange(c *computev1.RolloutChange) (rollouts.Change, error) {
	paths := c.GetUpdateMask().GetPaths()
	if len(paths) == 0 {
		return rollouts.Change{}, fault.New(fault.InvalidInput, "change.updateMask", "required: name the sections to change (site, health, runtime, mig, agent)")
	}
	var out rollouts.Change
	for _, path := range paths {
		if slices.Contains(out.Mask, path) {
			return rollouts.Change{}, fault.New(fault.InvalidInput, "change.updateMask", "%q is named twice", path)
		}
		var st *structpb.Struct
		switch path {
		case "labels":
			return rollouts.Change{}, fault.New(fault.Unsupported, "change.updateMask", "%s: a node-level patch (a node's labels or own MIG layouts, as nodes.update takes them); roll a pool section out with a selector instead", rolloutUnsupported)
		case "site":
			st = c.GetSite()
		case "health":
			st = c.GetHealth()
		case "runtime":
			st = c.GetRuntime()
		case "mig":
			// Validated as pools.update validates it; the capacity.mig
			// contributor places the layouts on released nodes.
			layouts, err := migLayouts(c.GetMig(), true)
			if err != nil {
				return rollouts.Change{}, err
			}
			out.Mask = append(out.Mask, path)
			out.Mig = &rollouts.Mig{Layouts: layouts}
			continue
		case "agent":
			// An upgrade of the pool's bcd (docs/agent-upgrades.md).
			b, version, err := agentSection(c.GetAgent(), "change.")
			if err != nil {
				return rollouts.Change{}, err
			}
			out.Mask = append(out.Mask, path)
			out.Agent, out.AgentVersion = b, version
			continue
		default:
			return rollouts.Change{}, fault.New(fault.InvalidInput, "change.updateMask", "%q cannot be rolled out (site, health, runtime, mig, agent can)", path)
		}
		b, err := poolSection(path, st, "change.")
		if err != nil {
			return rollouts.Change{}, err
		}
		out.Mask = append(out.Mask, path)
		switch path {
		case "site":
			out.Site = b
		case "health":
			out.Health = b
		case "runtime":
			out.Runtime = b
		}
	}
	return out, nil
}

// rolloutGates validates a rollout's gates: diag.nvml at a level it knows,
// within a bounded timeout.
func rolloutGates(gs []*computev1.RolloutGate) ([]rollouts.Gate, error) {
	if len(gs) > MaxRolloutGates {
		return nil, fault.New(fault.InvalidInput, "gates", "at most %d gates, got %d", MaxRolloutGates, len(gs))
	}
	out := make([]rollouts.Gate, 0, len(gs))
	for i, g := range gs {
		at := fmt.Sprintf("gates[%d]", i)
		if g.GetCommand() != commands.KindDiagNVML {
			return nil, fault.New(fault.InvalidInput, at+".command", "expected %q, got %q", commands.KindDiagNVML, g.GetCommand())
		}
		if _, ok := commandkinds.DiagRunLevel(g.GetLevel()); !ok {
			return nil, fault.New(fault.InvalidInput, at+".level", "expected one of %v, got %q", commandkinds.DiagLevels, g.GetLevel())
		}
		wait := DefaultRolloutGateWait
		if d := g.GetTimeout(); d != nil {
			if err := d.CheckValid(); err != nil || d.AsDuration() < time.Second || d.AsDuration() > MaxRolloutGateWait {
				return nil, fault.New(fault.InvalidInput, at+".timeout", "expected 1s to %s", MaxRolloutGateWait)
			}
			wait = d.AsDuration()
		}
		out = append(out, rollouts.Gate{Command: g.GetCommand(), Level: g.GetLevel(), TimeoutMs: wait.Milliseconds()})
	}
	return out, nil
}

// rolloutStrategy validates a rollout's strategy.
func rolloutStrategy(st *computev1.RolloutStrategy) (rollouts.Strategy, error) {
	bs := st.GetBatches()
	if len(bs) == 0 || len(bs) > MaxRolloutBatches {
		return rollouts.Strategy{}, fault.New(fault.InvalidInput, "strategy.batches", "expected 1 to %d batches, got %d", MaxRolloutBatches, len(bs))
	}
	out := rollouts.Strategy{}
	for _, b := range bs {
		size, err := rolloutCount(b.GetPercent(), b.GetCount(), "strategy.batches")
		if err != nil {
			return rollouts.Strategy{}, err
		}
		out.Batches = append(out.Batches, rollouts.BatchSize(size))
	}
	if d := st.GetBake(); d != nil {
		if err := d.CheckValid(); err != nil || d.AsDuration() < 0 || d.AsDuration() > MaxRolloutBake {
			return rollouts.Strategy{}, fault.New(fault.InvalidInput, "strategy.bake", "expected 0 to %s", MaxRolloutBake)
		}
		out.BakeMs = d.AsDuration().Milliseconds()
	}
	if n := st.GetMaxUnavailable(); n < 0 || n > MaxRolloutNodes {
		return rollouts.Strategy{}, fault.New(fault.InvalidInput, "strategy.maxUnavailable", "expected 0 (no limit) to %d nodes, got %d", MaxRolloutNodes, n)
	}
	out.MaxUnavailable = int(st.GetMaxUnavailable())
	return out, nil
}

// rolloutThreshold validates a threshold; unset is the default (zero).
func rolloutThreshold(t *computev1.RolloutThreshold, field string) (rollouts.Threshold, error) {
	if t == nil || (t.GetPercent() == 0 && t.GetCount() == 0) {
		return rollouts.Threshold{}, nil
	}
	return rolloutCount(t.GetPercent(), t.GetCount(), field)
}

// rolloutCount checks exactly one of percent (1 to 100) and count (1 to
// MaxRolloutNodes).
func rolloutCount(percent, count int32, field string) (rollouts.Threshold, error) {
	switch {
	case percent != 0 && count != 0:
		return rollouts.Threshold{}, fault.New(fault.InvalidInput, field, "set one of percent and count, not both")
	case percent == 0 && count == 0:
		return rollouts.Threshold{}, fault.New(fault.InvalidInput, field, "set one of percent (1 to 100) and count")
	case percent < 0 || percent > maxRolloutPercent:
		return rollouts.Threshold{}, fault.New(fault.InvalidInput, field+".percent", "expected 1 to 100, got %d", percent)
	case count < 0 || count > MaxRolloutNodes:
		return rollouts.Threshold{}, fault.New(fault.InvalidInput, field+".count", "expected 1 to %d, got %d", MaxRolloutNodes, count)
	}
	return rollouts.Threshold{Percent: int(percent), Count: int(count)}, nil
}

// rolloutPB is r as the API answers it, with its batches and named nodes.
func rolloutPB(ctx context.Context, q rollouts.Querier, r rollouts.Rollout) (*computev1.Rollout, error) {
	pb := &computev1.Rollout{
		Id: r.ID, TenantId: r.TenantID, PoolId: r.PoolID, Selector: r.Selector, State: r.State, Message: r.Message,
		CurrentBatch: int32(r.CurrentBatch), CreateTime: ts(r.CreatedAt), UpdateTime: ts(r.UpdatedAt),
		Change: &computev1.RolloutChange{UpdateMask: &fieldmaskpb.FieldMask{Paths: r.Change.Mask}},
		Strategy: &computev1.RolloutStrategy{
			Bake: durationpb.New(r.Strategy.Bake()), MaxUnavailable: int32(r.Strategy.MaxUnavailable),
		},
		SuccessThreshold: &computev1.RolloutThreshold{Percent: int32(r.Success.Percent), Count: int32(r.Success.Count)},
		FailureThreshold: &computev1.RolloutThreshold{Percent: int32(r.Failure.Percent), Count: int32(r.Failure.Count)},
	}
	for _, b := range r.Strategy.Batches {
		pb.Strategy.Batches = append(pb.Strategy.Batches, &computev1.RolloutBatchSize{Percent: int32(b.Percent), Count: int32(b.Count)})
	}
	for _, sec := range r.Change.Mask {
		if sec == "mig" {
			continue
		}
		var st structpb.Struct
		if err := json.Unmarshal(r.Change.Section(sec), &st); err != nil {
			return nil, err
		}
		switch sec {
		case "site":
			pb.Change.Site = &st
		case "health":
			pb.Change.Health = &st
		case "runtime":
			pb.Change.Runtime = &st
		case "agent":
			pb.Change.Agent = poolAgentPB(r.Change.Agent)
		}
	}
	if r.Change.Mig != nil {
		pb.Change.Mig = migSettingsPB(r.Change.Mig.Layouts)
	}
	for _, g := range r.Gates {
		pb.Gates = append(pb.Gates, &computev1.RolloutGate{Command: g.Command, Level: g.Level, Timeout: durationpb.New(g.Timeout())})
	}
	batches, err := rollouts.Batches(ctx, q, r.ID)
	if err != nil {
		return nil, err
	}
	for _, b := range batches {
		bs := &computev1.RolloutBatchStatus{Index: int32(b.Index), Nodes: int32(b.Nodes), Released: int32(b.Released),
			Healthy: int32(b.Healthy), Failed: int32(b.Failed), Skipped: int32(b.Skipped)}
		if b.ReleasedAt != nil {
			bs.ReleaseTime = ts(*b.ReleasedAt)
		}
		if b.Index == r.CurrentBatch && r.BatchConvergedAt != nil {
			bs.ConvergedTime = ts(*r.BatchConvergedAt)
		}
		pb.Batches = append(pb.Batches, bs)
	}
	if pb.FailedNodes, err = rollouts.NodesIn(ctx, q, r.ID, rollouts.NodeFailed); err != nil {
		return nil, err
	}
	if pb.SkippedNodes, err = rollouts.NodesIn(ctx, q, r.ID, rollouts.NodeSkipped); err != nil {
		return nil, err
	}
	return pb, nil
}

// rolloutResource is the pool the rollout id of tenant belongs to, for the
// decision.
func (s *rolloutsAPI) rolloutResource(ctx context.Context, tenant, id string) (rollouts.Rollout, authz.Resource, error) {
	if err := required("rolloutId", id); err != nil {
		return rollouts.Rollout{}, authz.Resource{}, err
	}
	r, err := rollouts.Get(ctx, s.db, tenant, id)
	if err != nil {
		return rollouts.Rollout{}, authz.Resource{}, err
	}
	res, err := authz.Get(ctx, s.db, tenant, authz.TypePool, r.PoolID, "rolloutId")
	if err != nil {
		return rollouts.Rollout{}, authz.Resource{}, err
	}
	return r, res, nil
}

func (s *rolloutsAPI) Get(ctx context.Context, req *computev1.RolloutsServiceGetRequest) (*computev1.RolloutsServiceGetResponse, error) {
	r, res, err := s.rolloutResource(ctx, req.GetTenantId(), req.GetRolloutId())
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), res); err != nil {
		return nil, err
	}
	pb, err := rolloutPB(ctx, s.db, r)
	if err != nil {
		return nil, err
	}
	return &computev1.RolloutsServiceGetResponse{Rollout: pb}, nil
}

func (s *rolloutsAPI) List(ctx context.Context, req *computev1.RolloutsServiceListRequest) (*computev1.RolloutsServiceListResponse, error) {
	pg, err := readPage(req)
	if err != nil {
		return nil, err
	}
	res := authz.TenantResource(req.GetTenantId())
	if req.GetPoolId() != "" {
		if res, err = authz.Get(ctx, s.db, req.GetTenantId(), authz.TypePool, req.GetPoolId(), "poolId"); err != nil {
			return nil, err
		}
	}
	if err := s.read(ctx, req.GetTenantId(), res); err != nil {
		return nil, err
	}
	rs, err := rollouts.List(ctx, s.db, req.GetTenantId(), req.GetPoolId(), pg.after, pg.size)
	if err != nil {
		return nil, err
	}
	out := &computev1.RolloutsServiceListResponse{}
	for _, r := range rs {
		pb, err := rolloutPB(ctx, s.db, r)
		if err != nil {
			return nil, err
		}
		out.Rollouts = append(out.Rollouts, pb)
	}
	out.NextPageToken = nextPage(pg, rs, func(r rollouts.Rollout) string { return r.ID })
	return out, nil
}

// transition moves a rollout from one of from to state in one admitted
// mutation, writes event and runs then (in the same transaction) on the
// moved rollout; the rollout job is woken after.
func (s *rolloutsAPI) transition(ctx context.Context, tenant, id string, from []string, state, message, event string,
	then func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, r rollouts.Rollout) (map[string]any, error)) (*computev1.Rollout, error) {
	_, res, err := s.rolloutResource(ctx, tenant, id)
	if err != nil {
		return nil, err
	}
	out := &computev1.RolloutsServiceGetResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: tenant},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			if err := poolstore.Lock(ctx, tx, res.ID); err != nil {
				return admission.Outcome{}, err
			}
			r, err := rollouts.Transition(ctx, tx, tenant, id, from, state, message)
			if err != nil {
				return admission.Outcome{}, err
			}
			payload := map[string]any{"rolloutId": r.ID, "poolId": r.PoolID}
			if then != nil {
				extra, err := then(ctx, tx, q, r)
				if err != nil {
					return admission.Outcome{}, err
				}
				for k, v := range extra {
					payload[k] = v
				}
			}
			if err := q.Enqueue(ctx, rollouts.Kind, r.PoolID); err != nil {
				return admission.Outcome{}, err
			}
			pb, err := rolloutPB(ctx, tx, r)
			if err != nil {
				return admission.Outcome{}, err
			}
			o, err := outcome(&computev1.RolloutsServiceGetResponse{Rollout: pb}, event, nil)
			o.Event = outbox.Event{Type: event, Resource: r.ID, Payload: payload}
			o.Detail = map[string]any{"rolloutId": r.ID}
			return o, err
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out.GetRollout(), nil
}

func (s *rolloutsAPI) Pause(ctx context.Context, req *computev1.RolloutsServicePauseRequest) (*computev1.RolloutsServicePauseResponse, error) {
	r, err := s.transition(ctx, req.GetTenantId(), req.GetRolloutId(), []string{rollouts.Pending, rollouts.Progressing},
		rollouts.Paused, "paused by rollouts.pause", "rollout.paused",
		func(context.Context, pgx.Tx, *reconcile.Queue, rollouts.Rollout) (map[string]any, error) {
			return map[string]any{"reason": "rollouts.pause"}, nil
		})
	if err != nil {
		return nil, err
	}
	return &computev1.RolloutsServicePauseResponse{Rollout: r}, nil
}

func (s *rolloutsAPI) Resume(ctx context.Context, req *computev1.RolloutsServiceResumeRequest) (*computev1.RolloutsServiceResumeResponse, error) {
	r, err := s.transition(ctx, req.GetTenantId(), req.GetRolloutId(), []string{rollouts.Paused},
		rollouts.Progressing, "", "rollout.resumed",
		func(ctx context.Context, tx pgx.Tx, _ *reconcile.Queue, r rollouts.Rollout) (map[string]any, error) {
			return nil, rollouts.AckFailures(ctx, tx, r.ID)
		})
	if err != nil {
		return nil, err
	}
	return &computev1.RolloutsServiceResumeResponse{Rollout: r}, nil
}

// invalidateTouched gives the nodes r touched a new desired state (their
// layer is gone with r's state) and returns them for the event.
func invalidateTouched(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, r rollouts.Rollout) (map[string]any, error) {
	touched, err := rollouts.Touched(ctx, tx, r.ID)
	if err != nil {
		return nil, err
	}
	for _, n := range touched {
		if err := nodespec.Invalidate(ctx, q, n); err != nil {
			return nil, err
		}
	}
	return map[string]any{"nodes": touched}, nil
}

func (s *rolloutsAPI) Cancel(ctx context.Context, req *computev1.RolloutsServiceCancelRequest) (*computev1.RolloutsServiceCancelResponse, error) {
	r, err := s.transition(ctx, req.GetTenantId(), req.GetRolloutId(), rollouts.Active,
		rollouts.Cancelled, "cancelled by rollouts.cancel", "rollout.cancelled", invalidateTouched)
	if err != nil {
		return nil, err
	}
	return &computev1.RolloutsServiceCancelResponse{Rollout: r}, nil
}

func (s *rolloutsAPI) Rollback(ctx context.Context, req *computev1.RolloutsServiceRollbackRequest) (*computev1.RolloutsServiceRollbackResponse, error) {
	var wasSucceeded bool
	if cur, err := rollouts.Get(ctx, s.db, req.GetTenantId(), req.GetRolloutId()); err == nil {
		wasSucceeded = cur.State == rollouts.Succeeded
	}
	from := []string{rollouts.Progressing, rollouts.Paused, rollouts.Failed}
	if wasSucceeded {
		from = []string{rollouts.Succeeded}
	}
	r, err := s.transition(ctx, req.GetTenantId(), req.GetRolloutId(), from,
		rollouts.RolledBack, "rolled back by rollouts.rollback", "rollout.rolled_back",
		func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, r rollouts.Rollout) (map[string]any, error) {
			if !wasSucceeded {
				return invalidateTouched(ctx, tx, q, r)
			}
			// The change is the pool's settings (or, with a selector, its
			// nodes' layer) now: they go back to what they were, unless a
			// later rollout changed them since.
			later, ok, err := rollouts.Later(ctx, tx, r)
			if err != nil {
				return nil, err
			}
			if ok {
				return nil, fault.New(fault.Conflict, "rolloutId", "rollout %s came after %s on pool %s", later, r.ID, r.PoolID)
			}
			if len(r.Selector) > 0 {
				// Its layer went with its state: every node it planned
				// recomputes from what is beneath.
				planned, err := rollouts.PlanOf(ctx, tx, r.ID)
				if err != nil {
					return nil, err
				}
				for _, n := range planned {
					if err := nodespec.Invalidate(ctx, q, n); err != nil {
						return nil, err
					}
				}
				return map[string]any{"nodes": planned}, nil
			}
			if _, err := poolstore.Apply(ctx, tx, r.TenantID, r.PoolID, poolstore.Update{
				Site: r.Previous.Section("site"), Health: r.Previous.Section("health"), Runtime: r.Previous.Section("runtime"),
				Agent: r.Previous.Section("agent"),
			}); err != nil {
				return nil, err
			}
			if r.Previous.Mig != nil {
				if err := miglayouts.SetPool(ctx, tx, r.PoolID, r.Previous.Mig.Layouts); err != nil {
					return nil, err
				}
			}
			if err := nodespec.InvalidatePool(ctx, tx, q, r.PoolID); err != nil {
				return nil, err
			}
			return invalidateTouched(ctx, tx, q, r)
		})
	if err != nil {
		return nil, err
	}
	return &computev1.RolloutsServiceRollbackResponse{Rollout: r}, nil
}

// migSettingsPB is layouts as the API takes them.
func migSettingsPB(layouts []miglayouts.Layout) *computev1.MigSettings {
	out := &computev1.MigSettings{}
	for _, l := range layouts {
		spec := &computev1.MigLayoutSpec{Name: l.Name, Profiles: l.Profiles, Disabled: l.Disabled,
			GpuSelector: &computev1.MigGpuSelector{Model: l.Selector.Model}}
		for _, ix := range l.Selector.Indices {
			spec.GpuSelector.Indices = append(spec.GpuSelector.Indices, uint32(max(ix, 0)))
		}
		out.Layouts = append(out.Layouts, spec)
	}
	return out
}
