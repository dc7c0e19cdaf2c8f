package lifecycle

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/encoding/protojson"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/miglayouts"
	nodestore "github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/pools"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/rollouts"
	"github.com/bettercompute/bettercompute/pkg/shard"
)

// RolloutConfig configures the rollout job.
type RolloutConfig struct {
	// Now is the clock the bake is measured with; nil is time.Now.
	Now func() time.Time
	// Kinds is the command-kind registry the gates are queued through
	// (signing, as the health job's); nil is commands.Builtin() unsigned.
	Kinds *commands.Registry
}

// Rollout is the rollout job (docs/rollouts.md): a ShardByPool reconciler
// of the controllers role whose keys are pools with an active rollout. It
// is level-triggered: each run reads the rollout, its planned nodes and
// their health from the database and moves it one step, so it converges
// from the database alone (the bus only wakes it sooner); while a rollout
// progresses its pool's key comes back every second.
//
//   - pending: the pool's nodes (those carrying the selector's labels) are
//     cut into the strategy's batches, spread across failure domains
//     (gateway, and the rack and zone labels), and the rollout progresses.
//   - progressing: released nodes are judged (healthy once they report the
//     new content — MIG layouts included — with every section converged,
//     Ready True, GPUsHealthy holding and no NeedsRepair, and passed every
//     gate, queued once they reported it; failed when unhealthy after their
//     change or when a gate did not pass);
//     the failure threshold reached pauses the rollout naming the nodes; the
//     current batch's waiting nodes are released while the disruption
//     budget allows (a node unhealthy before its batch is skipped); a batch
//     whose released nodes are all judged and that stayed so for the bake
//     is done, and the next batch comes; after the last the change is
//     written into the pool's settings and MIG layouts (succeeded; with a
//     selector it stays the planned nodes' layer instead), or, below the
//     success threshold, the rollout failed and its nodes return to the
//     pool's.
//   - paused: nothing happens until rollouts.resume.
func Rollout(cfg RolloutConfig) reconcile.Reconciler {
	j := &rolloutJob{now: cfg.Now, kinds: cfg.Kinds}
	if j.now == nil {
		j.now = time.Now
	}
	if j.kinds == nil {
		j.kinds = commands.Builtin()
	}
	return reconcile.Reconciler{Name: rollouts.Kind, ShardBy: reconcile.ShardByPool, Role: reconcile.RoleControllers,
		Run: j.run, Keys: rolloutKeys}
}

// rolloutKeys lists the pools of shards with an active rollout, for resync.
func rolloutKeys(ctx context.Context, q reconcile.Querier, shards []int) ([]string, error) {
	ids, err := rollouts.ActivePools(ctx, q)
	if err != nil {
		return nil, err
	}
	return slices.DeleteFunc(ids, func(id string) bool { return !slices.Contains(shards, shard.Of(id)) }), nil
}

type rolloutJob struct {
	now   func() time.Time
	kinds *commands.Registry
}

func (j *rolloutJob) run(ctx context.Context, rc *reconcile.RunContext, pool string) (reconcile.Result, error) {
	result := reconcile.Done
	err := rc.InTx(ctx, func(tx pgx.Tx, q *reconcile.Queue) error {
		r, ok, err := rollouts.ActiveOf(ctx, tx, pool)
		if err != nil || !ok {
			return err
		}
		s := &rolloutStep{tx: tx, q: q, r: r, now: j.now(), kinds: j.kinds}
		switch r.State {
		case rollouts.Pending:
			err = s.start(ctx)
		case rollouts.Progressing:
			err = s.progress(ctx)
		default:
			return nil // paused: rollouts.resume enqueues the pool again
		}
		if err != nil {
			return err
		}
		if err := outbox.WriteMany(ctx, tx, s.events); err != nil {
			return err
		}
		if err := rollouts.Progress(ctx, tx, s.r); err != nil {
			return err
		}
		if s.r.State == rollouts.Pending || s.r.State == rollouts.Progressing {
			result = reconcile.SyncAgain
		}
		return nil
	})
	return result, err
}

// rolloutStep is one run's step of one rollout.
type rolloutStep struct {
	tx     pgx.Tx
	q      *reconcile.Queue
	r      rollouts.Rollout
	now    time.Time
	kinds  *commands.Registry
	events []outbox.Event
}

func (s *rolloutStep) event(typ string, payload map[string]any) {
	p := map[string]any{"rolloutId": s.r.ID, "poolId": s.r.PoolID}
	for k, v := range payload {
		p[k] = v
	}
	s.events = append(s.events, outbox.Event{TenantID: s.r.TenantID, Type: typ, Resource: s.r.ID, Payload: p})
}

// start plans the rollout: its nodes spread over the batches.
func (s *rolloutStep) start(ctx context.Context) error {
	cands, err := rollouts.Candidates(ctx, s.tx, s.r.PoolID, s.r.Selector)
	if err != nil {
		return err
	}
	plan := PlanBatches(cands, s.r.Strategy.Batches)
	if err := rollouts.Plan(ctx, s.tx, s.r.ID, plan); err != nil {
		return err
	}
	batches := 0
	if len(plan) > 0 {
		batches = plan[len(plan)-1].Batch + 1
	}
	s.r.State, s.r.CurrentBatch, s.r.BatchReleasedAt, s.r.BatchConvergedAt = rollouts.Progressing, 0, nil, nil
	s.event("rollout.started", map[string]any{"nodes": len(plan), "batches": batches})
	return nil
}

// PlanBatches orders cands so that consecutive nodes come from different
// failure domains (zone, rack, gateway: round robin over the domains, each
// in id order) and cuts them into sizes' batches in that order; nodes left
// after the last size form one final batch. Empty batches are dropped.
func PlanBatches(cands []rollouts.Candidate, sizes []rollouts.BatchSize) []rollouts.Planned {
	domains := map[string][]string{}
	var keys []string
	for _, c := range cands {
		k := c.Zone + "\x00" + c.Rack + "\x00" + c.Gateway
		if _, ok := domains[k]; !ok {
			keys = append(keys, k)
		}
		domains[k] = append(domains[k], c.ID)
	}
	slices.Sort(keys)
	order := make([]string, 0, len(cands))
	for i := 0; len(order) < len(cands); i++ {
		for _, k := range keys {
			if i < len(domains[k]) {
				order = append(order, domains[k][i])
			}
		}
	}
	total := len(order)
	var plan []rollouts.Planned
	batch, next := 0, 0
	for _, sz := range sizes {
		if next >= total {
			break
		}
		n := sz.Count
		if sz.Percent > 0 {
			n = (total*sz.Percent + 99) / 100
		}
		n = min(max(n, 1), total-next)
		for _, id := range order[next : next+n] {
			plan = append(plan, rollouts.Planned{NodeID: id, Batch: batch})
		}
		next += n
		batch++
	}
	for _, id := range order[next:] {
		plan = append(plan, rollouts.Planned{NodeID: id, Batch: batch})
	}
	return plan
}

// progress judges the released nodes, pauses at the failure threshold,
// releases what the budget allows and moves to the next batch or ends.
func (s *rolloutStep) progress(ctx context.Context) error {
	nodes, err := rollouts.Nodes(ctx, s.tx, s.r)
	if err != nil {
		return err
	}
	if err := s.checkMig(ctx, nodes); err != nil {
		return err
	}
	// Judge the released nodes.
	var healthy []string
	for i := range nodes {
		n := &nodes[i]
		if n.State == rollouts.NodeUpdating && n.Unhealthy == "" && strings.HasPrefix(n.Gate, "gate ") {
			n.Unhealthy = n.Gate // a gate that did not pass
		}
		if n.State == rollouts.NodeUpdating && n.Unhealthy == "" && n.HasContent && len(s.r.Gates) > 0 && n.Gate == "" {
			refused, err := s.queueGates(ctx, n)
			if err != nil {
				return err
			}
			n.Unhealthy = refused
		}
		switch {
		case (n.State == rollouts.NodeUpdating || n.State == rollouts.NodeHealthy) && n.Unhealthy != "":
			n.State = rollouts.NodeFailed
			s.event("rollout.node_failed", map[string]any{"nodeId": n.NodeID, "reason": n.Unhealthy})
			if err := rollouts.SetNodes(ctx, s.tx, s.r.ID, []string{n.NodeID}, rollouts.NodeFailed, n.Unhealthy); err != nil {
				return err
			}
		case n.State == rollouts.NodeUpdating && n.HasContent && (len(s.r.Gates) == 0 || n.Gate == "passed"):
			healthy = append(healthy, n.NodeID)
			n.State = rollouts.NodeHealthy
		}
	}
	if err := rollouts.SetNodes(ctx, s.tx, s.r.ID, healthy, rollouts.NodeHealthy, ""); err != nil {
		return err
	}
	// The failure threshold: unacknowledged failures of the counted
	// (not skipped) nodes.
	var counted int
	var failures []string
	for _, n := range nodes {
		if n.State != rollouts.NodeSkipped {
			counted++
		}
		if n.State == rollouts.NodeFailed && !n.Acked {
			failures = append(failures, n.NodeID)
		}
	}
	if limit := s.r.Failure.Of(counted); limit > 0 && len(failures) >= limit {
		s.r.State = rollouts.Paused
		s.r.Message = fmt.Sprintf("failure threshold reached (%d of %d nodes failed, threshold %d): %s",
			len(failures), counted, limit, strings.Join(failures, ", "))
		s.event("rollout.paused", map[string]any{"reason": s.r.Message, "nodes": failures})
		return nil
	}
	// Release the current batch's waiting nodes within the budget.
	k := s.r.CurrentBatch
	batches, unavailable := 0, 0
	for _, n := range nodes {
		batches = max(batches, n.Batch+1)
		if n.Unavailable || n.State == rollouts.NodeUpdating {
			unavailable++
		}
	}
	if s.r.Strategy.MaxUnavailable > 0 {
		outside, err := rollouts.UnavailableOutside(ctx, s.tx, s.r.PoolID, s.r.ID)
		if err != nil {
			return err
		}
		unavailable += outside
	}
	var released []string
	pending := false // the batch has a node not judged yet
	for i := range nodes {
		n := &nodes[i]
		if n.Batch != k {
			continue
		}
		switch n.State {
		case rollouts.NodeWaiting:
			if n.Unhealthy != "" {
				n.State = rollouts.NodeSkipped
				s.event("rollout.node_skipped", map[string]any{"nodeId": n.NodeID, "reason": n.Unhealthy})
				if err := rollouts.SetNodes(ctx, s.tx, s.r.ID, []string{n.NodeID}, rollouts.NodeSkipped, n.Unhealthy); err != nil {
					return err
				}
				continue
			}
			pending = true
			if s.r.Strategy.MaxUnavailable > 0 && unavailable >= s.r.Strategy.MaxUnavailable {
				continue
			}
			unavailable++
			released = append(released, n.NodeID)
		case rollouts.NodeUpdating:
			pending = true
		}
	}
	if len(released) > 0 {
		if err := rollouts.SetNodes(ctx, s.tx, s.r.ID, released, rollouts.NodeUpdating, ""); err != nil {
			return err
		}
		for _, id := range released {
			if err := nodespec.Invalidate(ctx, s.q, id); err != nil {
				return err
			}
		}
		if s.r.BatchReleasedAt == nil {
			t := s.now
			s.r.BatchReleasedAt = &t
		}
		s.event("rollout.batch_released", map[string]any{"batch": k, "nodes": released})
	}
	switch {
	case pending:
		s.r.BatchConvergedAt = nil
		if s.r.Strategy.MaxUnavailable > 0 && len(released) == 0 && unavailable >= s.r.Strategy.MaxUnavailable {
			s.r.Message = fmt.Sprintf("batch %d waits for the disruption budget (%d of %d nodes unavailable)", k, unavailable, s.r.Strategy.MaxUnavailable)
		} else {
			s.r.Message = fmt.Sprintf("batch %d of %d rolling out", k+1, batches)
		}
		return nil
	case s.r.BatchConvergedAt == nil:
		t := s.now
		s.r.BatchConvergedAt = &t
		s.r.Message = fmt.Sprintf("batch %d of %d baking", k+1, batches)
		if s.r.Strategy.Bake() > 0 {
			return nil
		}
	}
	if s.now.Sub(*s.r.BatchConvergedAt) < s.r.Strategy.Bake() {
		return nil
	}
	if k < batches {
		s.event("rollout.batch_succeeded", map[string]any{"batch": k})
	}
	s.r.CurrentBatch, s.r.BatchReleasedAt, s.r.BatchConvergedAt = k+1, nil, nil
	if k+1 < batches {
		// The next batch is released in this run, not the next one.
		return s.progress(ctx)
	}
	return s.finish(ctx, nodes, counted)
}

// checkMig clears HasContent of the updating nodes whose desired state
// does not hold the change's MIG layouts yet: each GPU a layout selects
// (the node's own layouts first, then the change's, as capacity.mig
// resolves them) has an entry with that layout's mode and profiles, and no
// other GPU has one. A GPU whose change waits for a booking keeps its old
// entry, so its node keeps converging.
func (s *rolloutStep) checkMig(ctx context.Context, nodes []rollouts.NodeStatus) error {
	if s.r.Change.Mig == nil {
		return nil
	}
	var ids []string
	for _, n := range nodes {
		if n.State == rollouts.NodeUpdating && n.HasContent {
			ids = append(ids, n.NodeID)
		}
	}
	if len(ids) == 0 {
		return nil
	}
	inputs, err := nodestore.MigInputsOf(ctx, s.tx, ids)
	if err != nil {
		return err
	}
	own, err := miglayouts.Of(ctx, s.tx, nil, ids)
	if err != nil {
		return err
	}
	for i := range nodes {
		n := &nodes[i]
		if n.State != rollouts.NodeUpdating || !n.HasContent {
			continue
		}
		in := inputs[n.NodeID]
		var gpus []miglayouts.GPU
		var spec agentv1.NodeSpec
		if in != nil {
			gpus = miglayouts.GPUsOf(in.Devices)
			if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(in.Spec, &spec); err != nil {
				return fmt.Errorf("node %s: stored spec: %w", n.NodeID, err)
			}
		}
		n.HasContent = migHolds(spec.GetMig(), miglayouts.Resolve(own.Nodes[n.NodeID], s.r.Change.Mig.Layouts, gpus))
	}
	return nil
}

// migHolds reports whether sec gives each GPU of chosen its layout, and no
// other GPU an entry.
func migHolds(sec *agentv1.MigLayout, chosen map[string]miglayouts.Layout) bool {
	if len(sec.GetGpus()) != len(chosen) {
		return false
	}
	for _, g := range sec.GetGpus() {
		l, ok := chosen[g.GetGpuUuid()]
		if !ok || g.GetMigEnabled() == l.Disabled || (!l.Disabled && !slices.Equal(g.GetProfiles(), l.Profiles)) {
			return false
		}
	}
	return true
}

// queueGates queues the rollout's gate commands on n, which reported the
// new content: each presupposes the generation that carries it (the
// daemon holds it until it applied that generation), within the gate's
// timeout; owned by the rollout job, which a gate's end wakes. A gate the
// commands registry refuses (the node's command slots full, the node gone)
// is returned as the reason the node failed.
func (s *rolloutStep) queueGates(ctx context.Context, n *rollouts.NodeStatus) (string, error) {
	ids := make([]string, 0, len(s.r.Gates))
	for i, g := range s.r.Gates {
		var payload any
		switch g.Command {
		case commands.KindDiagNVML:
			payload = &agentv1.DiagNvml{Level: g.Level, Label: "rollout " + s.r.ID}
		default:
			return fmt.Sprintf("gate %d: unknown command %q", i, g.Command), nil
		}
		c, created, err := s.kinds.Enqueue(ctx, s.tx, commands.Request{
			NodeID: n.NodeID, Kind: g.Command, Payload: payload, IdempotencyKey: fmt.Sprintf("rollout:%s:gate:%d", s.r.ID, i),
			NotAfter: s.now.Add(g.Timeout()), MinGeneration: n.Generation,
			OwnerKind: rollouts.Kind, OwnerKey: s.r.PoolID, CreatedBy: "rollout", System: true,
		})
		if _, refused := fault.As(err); refused {
			return fmt.Sprintf("gate %s could not be queued: %s", g.Command, fault.MessageOf(err)), nil
		}
		if err != nil {
			return "", fmt.Errorf("rollout %s: queue gate %s on %s: %w", s.r.ID, g.Command, n.NodeID, err)
		}
		if created {
			s.q.WakeCommands(n.NodeID)
		}
		ids = append(ids, c.ID)
	}
	n.Gate = "running"
	return "", rollouts.SetGateCommands(ctx, s.tx, s.r.ID, n.NodeID, ids)
}

// finish ends a rollout whose batches are all done: succeeded (the change
// becomes the pool's settings) or, below the success threshold, failed.
func (s *rolloutStep) finish(ctx context.Context, nodes []rollouts.NodeStatus, counted int) error {
	var healthy, skipped int
	var touched []string
	for _, n := range nodes {
		switch n.State {
		case rollouts.NodeHealthy:
			healthy++
		case rollouts.NodeSkipped:
			skipped++
		}
		if n.State == rollouts.NodeHealthy || n.State == rollouts.NodeFailed || n.State == rollouts.NodeUpdating {
			touched = append(touched, n.NodeID)
		}
	}
	if required := s.r.Success.Of(counted); healthy < required {
		s.r.State = rollouts.Failed
		s.r.Message = fmt.Sprintf("%d of %d nodes ended healthy; the success threshold is %d", healthy, counted, required)
		s.event("rollout.failed", map[string]any{"healthy": healthy, "required": required})
		for _, id := range touched {
			if err := nodespec.Invalidate(ctx, s.q, id); err != nil {
				return err
			}
		}
		return nil
	}
	if len(s.r.Selector) > 0 {
		// A selector's change stays the layer of the nodes it planned (the
		// pool's settings do not change): the released ones keep their
		// content, the skipped ones get it now.
		for _, n := range nodes {
			if err := nodespec.Invalidate(ctx, s.q, n.NodeID); err != nil {
				return err
			}
		}
	} else {
		c := s.r.Change
		if _, err := pools.Apply(ctx, s.tx, s.r.TenantID, s.r.PoolID, pools.Update{
			Site: c.Section("site"), Health: c.Section("health"), Runtime: c.Section("runtime"), Agent: c.Section("agent"),
		}); err != nil {
			return err
		}
		if c.Mig != nil {
			if err := miglayouts.SetPool(ctx, s.tx, s.r.PoolID, c.Mig.Layouts); err != nil {
				return err
			}
		}
		// The layer goes with the state: the nodes that had it get the same
		// content from the pool's settings (no new generation), the skipped
		// ones and those that joined since get it now.
		if err := nodespec.InvalidatePool(ctx, s.tx, s.q, s.r.PoolID); err != nil {
			return err
		}
	}
	s.r.State = rollouts.Succeeded
	s.r.Message = fmt.Sprintf("%d of %d nodes healthy, %d skipped", healthy, counted, skipped)
	s.event("rollout.succeeded", map[string]any{"healthy": healthy, "skipped": skipped})
	return nil
}
