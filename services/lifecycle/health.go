package lifecycle

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/brakes"
	capstore "github.com/bettercompute/bettercompute/pkg/capacity"
	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/lifecycle"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/remediations"
)

// Kinds of the health job's reconcilers.
const (
	HealthPruneKind = "health.prune"
)

// Defaults of [HealthConfig].
const (
	DefaultMaxRemediationsPerNode    = 2
	DefaultMaxConcurrentRemediations = 1
	// DefaultRemediationWindow is the per-node budget's window.
	DefaultRemediationWindow = 7 * 24 * time.Hour
	// DefaultResetDeadline is gpu.reset's not_after from when it is sent.
	DefaultResetDeadline = 5 * time.Minute
	// DefaultRemediationDrain is the drain deadline before a reboot.
	DefaultRemediationDrain = 10 * time.Minute
	// DefaultRebootDeadline is node.reboot's not_after from when it is sent.
	DefaultRebootDeadline = 10 * time.Minute
	// DefaultReportWait is how long a step whose command succeeded waits
	// for the node's next inventory report before it fails.
	DefaultReportWait = 10 * time.Minute
	// DefaultPruneEvery is health.prune's period.
	DefaultPruneEvery = time.Hour
)

// HealthConfig configures the health job (config health.*, and
// capacity.lostNode for the bookings of quarantined GPUs).
type HealthConfig struct {
	// Kinds is the command-kind registry gpu.reset, node.reboot and
	// inventory.refresh are queued through: the controllers' signing view
	// (commands.Registry.Signing), since gpu.reset and node.reboot are
	// destructive. Nil means commands.Builtin() (unsigned: daemons refuse
	// them BAD_SIGNATURE). gpu.reset is registered on it when missing.
	Kinds *commands.Registry
	// LostNode is capacity.lostNode: what happens to a reservation's
	// booking of a quarantined GPU (replace, fail, or wait — the default).
	LostNode string
	// LostAfter is nodes.lostAfter, for placing replacements; 0 means 2m.
	LostAfter time.Duration
	// MaxRemediationsPerNode is how many ladders may start on a node in
	// Window; the next latches NeedsRepair instead. 0 means 2.
	MaxRemediationsPerNode int
	// MaxConcurrentRemediations bounds the steps running per pool; 0
	// means 1.
	MaxConcurrentRemediations int
	// Window is the budget's window; 0 means 7 days.
	Window time.Duration
	// Brakes are the fleet's eviction brakes, asked before a ladder starts.
	Brakes brakes.Config
	// ResetDeadline, RemediationDrain, RebootDeadline and ReportWait: see
	// the defaults.
	ResetDeadline, RemediationDrain, RebootDeadline, ReportWait time.Duration
	// PruneEvery is health.prune's period; 0 means 1h.
	PruneEvery time.Duration
	// Now is the clock of the budget's window, the brakes and the
	// remediations' times; nil means time.Now.
	Now func() time.Time
}

func (c *HealthConfig) defaults() error {
	if c.Kinds == nil {
		c.Kinds = commands.Builtin()
	}
	if _, ok := c.Kinds.Lookup(commands.KindGPUReset); !ok {
		return fault.New(fault.InvalidConfig, "kinds", "the command registry has no %s kind", commands.KindGPUReset)
	}
	c.LostNode = cmp.Or(c.LostNode, capstore.LostNodeWait)
	switch c.LostNode {
	case capstore.LostNodeWait, capstore.LostNodeReplace, capstore.LostNodeFail:
	default:
		return fault.New(fault.InvalidConfig, "capacity.lostNode", "expected wait, replace or fail, got %q", c.LostNode)
	}
	c.LostAfter = cmp.Or(c.LostAfter, capstore.DefaultLostAfter)
	c.MaxRemediationsPerNode = cmp.Or(c.MaxRemediationsPerNode, DefaultMaxRemediationsPerNode)
	c.MaxConcurrentRemediations = cmp.Or(c.MaxConcurrentRemediations, DefaultMaxConcurrentRemediations)
	c.Window = cmp.Or(c.Window, DefaultRemediationWindow)
	c.ResetDeadline = cmp.Or(c.ResetDeadline, DefaultResetDeadline)
	c.RemediationDrain = cmp.Or(c.RemediationDrain, DefaultRemediationDrain)
	c.RebootDeadline = cmp.Or(c.RebootDeadline, DefaultRebootDeadline)
	c.ReportWait = cmp.Or(c.ReportWait, DefaultReportWait)
	c.PruneEvery = cmp.Or(c.PruneEvery, DefaultPruneEvery)
	if c.Now == nil {
		c.Now = time.Now
	}
	return nil
}

// Health returns the health job's reconcilers:
//
//   - health (ShardByNode, controllers role): one node per run, in one
//     transaction under the node's row lock. A GPU that is unhealthy or
//     missing is quarantined (gpu.quarantined; placement and the capacity
//     counts leave it out); each live reservation booking it gets
//     reservation.device_unhealthy and capacity.lostNode applies to that
//     one booking: replace books a healthy GPU instead (and invalidates the
//     node's desired state, so it stops exposing the quarantined one), fail
//     ends the reservation, wait keeps it. A quarantined GPU healthy and
//     present again, that no running remediation step is for, is returned
//     to service (gpu.recovered). Then the remediation ladder (see
//     remediation.go) takes its next step. The inventory controller
//     enqueues the node after applying a report, the ladder's commands wake
//     it as their owner, and resync finds nodes with unhealthy, missing or
//     quarantined GPUs or a running step.
//   - health.prune (singleton, periodic): deletes remediation rows
//     finished more than 30 days ago.
func Health(cfg HealthConfig) ([]reconcile.Reconciler, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	h := &health{cfg: cfg}
	return []reconcile.Reconciler{
		{Name: lifecycle.KindHealth, ShardBy: reconcile.ShardByNode, Role: reconcile.RoleControllers, Run: h.run, Keys: healthKeys},
		{Name: HealthPruneKind, ShardBy: reconcile.ShardByNone, Role: reconcile.RoleControllers, Run: h.prune,
			Periodic: []reconcile.Periodic{{Key: "all", Every: cfg.PruneEvery}}},
	}, nil
}

// healthKeys lists the nodes in shards with an unhealthy, missing or
// quarantined GPU, or a running remediation step.
func healthKeys(ctx context.Context, q reconcile.Querier, shards []int) ([]string, error) {
	return nodes.NeedingHealthInShards(ctx, q, shards)
}

type health struct{ cfg HealthConfig }

// pass is one run's state: what to do after commit.
type pass struct {
	tx    pgx.Tx
	q     *reconcile.Queue
	n     nodes.Node
	now   time.Time
	again bool // run again in a second (waiting for a drain, or the rate)
	// respec: this pass's quarantine moved or ended a booking on the node,
	// so its spec changes with the quarantine: the generation that carries
	// it is the node's next one.
	respec bool
}

func (h *health) run(ctx context.Context, rc *reconcile.RunContext, nodeID string) (reconcile.Result, error) {
	var p *pass
	err := rc.InTx(ctx, func(tx pgx.Tx, q *reconcile.Queue) error {
		n, err := nodes.LockForHealth(ctx, tx, nodeID)
		if errors.Is(err, pgx.ErrNoRows) {
			p = nil
			return nil // the node is gone
		}
		if err != nil {
			return err
		}
		p = &pass{tx: tx, q: q, n: n, now: h.cfg.Now()}
		if err := h.quarantine(ctx, p); err != nil {
			return err
		}
		return h.remediate(ctx, p)
	})
	if err != nil || p == nil {
		return reconcile.Done, err
	}
	if p.again {
		return reconcile.SyncAgain, nil
	}
	return reconcile.Done, nil
}

func (h *health) prune(ctx context.Context, rc *reconcile.RunContext, _ string) (reconcile.Result, error) {
	var n int
	err := rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
		var err error
		n, err = remediations.Prune(ctx, tx, h.cfg.Now().Add(-remediations.Retention), 10000)
		if err != nil {
			return err
		}
		c, err := remediations.PruneClears(ctx, tx, h.cfg.Now().Add(-remediations.Retention), 10000)
		n = max(n, c)
		return err
	})
	if err != nil {
		return reconcile.Done, err
	}
	if n >= 10000 {
		return reconcile.SyncAgain, nil
	}
	return reconcile.Done, nil
}

// quarantine quarantines the node's unhealthy and missing GPUs, applies
// the lost-node policy to their bookings, and lifts the quarantine of GPUs
// healthy again that no running step is for.
func (h *health) quarantine(ctx context.Context, p *pass) error {
	n := p.n
	var bad []string
	for _, d := range n.Devices {
		if d.Kind == "gpu" && d.QuarantinedAt == nil && (!d.Healthy || d.MissingSince != nil) {
			bad = append(bad, d.ID)
		}
	}
	if len(bad) > 0 {
		// Lock the reservations booking them before the devices (whose
		// update recounts the node's capacity row): the placer locks a
		// reservation, then capacity rows.
		booked := map[string][]string{}
		var rsvs []string
		for _, dev := range bad {
			ids, err := capstore.DeviceBookings(ctx, p.tx, n.ID, dev)
			if err != nil {
				return err
			}
			booked[dev] = ids
			rsvs = append(rsvs, ids...)
		}
		slices.Sort(rsvs)
		locked := map[string]capstore.Reservation{}
		for _, id := range slices.Compact(rsvs) {
			r, err := capstore.Lock(ctx, p.tx, id)
			if err != nil {
				return err
			}
			locked[id] = r
		}
		qs, err := nodes.Quarantine(ctx, p.tx, n.ID, p.now)
		if err != nil {
			return err
		}
		es := make([]outbox.Event, 0, len(qs))
		for _, d := range qs {
			es = append(es, outbox.Event{TenantID: n.TenantID, Type: "gpu.quarantined", Resource: n.ID, Payload: map[string]any{
				"nodeId": n.ID, "poolId": n.PoolID, "deviceId": d.DeviceID, "reason": d.Reason,
			}})
		}
		if err := outbox.WriteMany(ctx, p.tx, es); err != nil {
			return err
		}
		for _, d := range qs {
			for _, id := range booked[d.DeviceID] {
				r := locked[id]
				if err := h.unhealthyBooking(ctx, p, &r, d); err != nil {
					return err
				}
				locked[id] = r
			}
		}
		if len(qs) > 0 {
			if err := nodespec.Invalidate(ctx, p.q, n.ID); err != nil {
				return err
			}
		}
	}
	run, running, err := remediations.RunningOn(ctx, p.tx, n.ID)
	if err != nil {
		return err
	}
	var keep []string
	if running {
		keep = run.Devices
	}
	lifted, err := nodes.LiftQuarantine(ctx, p.tx, n.ID, keep, nil)
	if err != nil {
		return err
	}
	return h.recovered(ctx, p, lifted, "healthy and present again")
}

// recovered writes gpu.recovered for each lifted device.
func (h *health) recovered(ctx context.Context, p *pass, lifted []string, reason string) error {
	es := make([]outbox.Event, 0, len(lifted))
	for _, id := range lifted {
		es = append(es, outbox.Event{TenantID: p.n.TenantID, Type: "gpu.recovered", Resource: p.n.ID, Payload: map[string]any{
			"nodeId": p.n.ID, "poolId": p.n.PoolID, "deviceId": id, "reason": reason,
		}})
	}
	if len(lifted) > 0 {
		// Placement may use them again: wake the pool's placer for pending
		// reservations that now fit.
		if err := p.q.Enqueue(ctx, capstore.KindReservations, p.n.PoolID); err != nil {
			return err
		}
	}
	return outbox.WriteMany(ctx, p.tx, es)
}

// Actions on a booking of a quarantined GPU (reservation.device_unhealthy's
// action).
const (
	actionReplaced = "replaced"
	actionFailed   = "failed"
	actionKept     = "kept"
)

// unhealthyBooking applies the lost-node policy to r's booking of the
// quarantined device d: replace books one healthy GPU instead (the
// reservation keeps its GPU count) or, when none fits, fails it; fail ends
// it; wait keeps it.
func (h *health) unhealthyBooking(ctx context.Context, p *pass, r *capstore.Reservation, d nodes.Quarantined) error {
	if !capstore.Live(r.State) {
		return nil
	}
	n := p.n
	payload := map[string]any{"reservationId": r.ID, "nodeId": n.ID, "deviceId": d.DeviceID, "reason": d.Reason}
	event := func(action string) error {
		payload["action"] = action
		_, err := outbox.Write(ctx, p.tx, outbox.Event{TenantID: r.TenantID, Type: "reservation.device_unhealthy", Resource: r.ID, Payload: payload})
		return err
	}
	switch h.cfg.LostNode {
	case capstore.LostNodeReplace:
		k, err := capstore.UnbookDevice(ctx, p.tx, r.ID, n.ID, d.DeviceID)
		if err != nil || k == 0 {
			return err
		}
		p.respec = true
		placed, err := capstore.Place(ctx, p.tx, r, capstore.PlaceOptions{LostAfter: h.cfg.LostAfter, Count: k})
		if err == nil {
			for _, id := range placed {
				if err := nodespec.Invalidate(ctx, p.q, id); err != nil {
					return err
				}
			}
			return event(actionReplaced)
		}
		if !capstore.Refused(err) {
			return err
		}
		if err := event(actionFailed); err != nil {
			return err
		}
		return h.failReservation(ctx, p, r, fmt.Sprintf("GPU %s of node %s was quarantined (%s) and could not be replaced: %s",
			d.DeviceID, n.ID, d.Reason, fault.MessageOf(err)))
	case capstore.LostNodeFail:
		if err := event(actionFailed); err != nil {
			return err
		}
		p.respec = true
		return h.failReservation(ctx, p, r, fmt.Sprintf("GPU %s of node %s was quarantined (%s; capacity.lostNode is fail)", d.DeviceID, n.ID, d.Reason))
	default:
		return event(actionKept)
	}
}

// failReservation ends r as the placer's fail does: state failed, its
// bookings freed, the nodes that held them invalidated, reservation.failed.
func (h *health) failReservation(ctx context.Context, p *pass, r *capstore.Reservation, reason string) error {
	held, changed, err := capstore.Finish(ctx, p.tx, r.ID, capstore.StateFailed, reason)
	if err != nil || !changed {
		return err
	}
	r.State = capstore.StateFailed
	for _, id := range held {
		if err := nodespec.Invalidate(ctx, p.q, id); err != nil {
			return err
		}
	}
	_, err = outbox.Write(ctx, p.tx, outbox.Event{TenantID: r.TenantID, Type: "reservation.failed", Resource: r.ID,
		Payload: map[string]any{"reservationId": r.ID, "reason": reason}})
	return err
}
