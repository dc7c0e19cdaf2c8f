package lifecycle

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/audit"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/brakes"
	"github.com/bettercompute/bettercompute/pkg/commands"
	invstore "github.com/bettercompute/bettercompute/pkg/inventory"
	"github.com/bettercompute/bettercompute/pkg/lifecycle"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/pools"
	"github.com/bettercompute/bettercompute/pkg/remediations"
)

// The remediation ladder (DESIGN §12), one step at a time per node, each a
// row in remediations, an event (remediation.started, .succeeded, .failed)
// and an audit row (actor "health"):
//
//  1. gpu.reset of the node's quarantined GPUs. Succeeded, and the node's
//     next inventory report shows them healthy → the step succeeded, their
//     quarantine is lifted. Failed or expired, or still unhealthy → 2.
//  2. node.reboot: the node is drained first (StartDrain, by remediation,
//     with a short deadline); once it is drained node.reboot is sent (it
//     succeeds when the node reconnects with a new boot id). Succeeded and
//     healthy → quarantine lifted, the node undrained (only if the ladder
//     drained it). Failed or still unhealthy → 3.
//  3. the node is failed with NeedsRepair latched (node.needs_repair),
//     for a human; nodes.clearRepair clears it.
//
// Brakes before a ladder starts (never between its steps): nothing while
// NeedsRepair is latched; a node that started MaxRemediationsPerNode
// ladders within the window latches NeedsRepair instead; at most
// MaxConcurrentRemediations steps run per pool (the others wait, and are
// woken when one ends); and the fleet's eviction brakes (brakes.Allow:
// the pool's and the tenant's gateway circuit breakers, the tenant's rate
// under the fleet's) must allow it. nodes.clearRepair, which resets the
// per-node budget, has its own budget that no clear resets.

// quarantinedGPUs lists the node's quarantined GPUs, in index order.
func quarantinedGPUs(n nodes.Node, lifted []string) []string {
	var out []string
	for _, d := range n.Devices {
		if d.Kind == "gpu" && d.QuarantinedAt != nil && !slices.Contains(lifted, d.ID) {
			out = append(out, d.ID)
		}
	}
	return out
}

// remediate takes the ladder's next step on the node.
func (h *health) remediate(ctx context.Context, p *pass) error {
	run, running, err := remediations.RunningOn(ctx, p.tx, p.n.ID)
	if err != nil {
		return err
	}
	if running {
		if run.Cause == remediations.CauseMIG {
			return h.advanceMig(ctx, p, run)
		}
		return h.advance(ctx, p, run)
	}
	// Re-read the devices: this run may have quarantined or lifted some.
	n, err := nodes.LockForHealth(ctx, p.tx, p.n.ID)
	if err != nil {
		return err
	}
	p.n = n
	gpus := quarantinedGPUs(n, nil)
	if len(gpus) == 0 {
		return h.migReset(ctx, p)
	}
	if n.NeedsRepair || n.State != nodes.StateAdopted {
		return nil
	}
	if len(gpus) > commands.MaxResetGPUs {
		gpus = gpus[:commands.MaxResetGPUs]
	}
	started, err := remediations.LaddersSince(ctx, p.tx, n.ID, p.now.Add(-h.cfg.Window))
	if err != nil {
		return err
	}
	if started >= h.cfg.MaxRemediationsPerNode {
		reason := fmt.Sprintf("remediation budget spent: %d ladders started in the last %s (health.maxRemediationsPerNode is %d); GPUs %s are quarantined",
			started, h.cfg.Window, h.cfg.MaxRemediationsPerNode, strings.Join(gpus, ", "))
		return h.needsRepair(ctx, p, gpus, reason, false)
	}
	// One ladder start at a time per pool: the pool row serializes the
	// count of running steps with the insert.
	if err := pools.Lock(ctx, p.tx, n.PoolID); err != nil {
		return err
	}
	inPool, err := remediations.RunningInPool(ctx, p.tx, n.PoolID, n.ID)
	if err != nil {
		return err
	}
	if inPool >= h.cfg.MaxConcurrentRemediations {
		return nil // woken when a ladder of the pool ends
	}
	d, err := brakes.Allow(ctx, p.tx, h.cfg.Brakes, brakes.Subject{NodeID: n.ID, PoolID: n.PoolID, GatewayID: n.GatewayID}, p.now)
	if err != nil {
		return err
	}
	if !d.Allowed {
		// Paused: resync (or the next report) tries again; rate-limited:
		// a second later.
		p.again = !d.Paused
		return nil
	}
	m, err := remediations.Start(ctx, p.tx, remediations.Remediation{
		TenantID: n.TenantID, NodeID: n.ID, PoolID: n.PoolID, Step: remediations.StepGPUReset, Devices: gpus,
		Reason: "GPUs quarantined: " + strings.Join(gpus, ", "),
	}, p.now)
	if err != nil {
		return err
	}
	// The reset presupposes the spec that carries the quarantine (the
	// quarantined GPUs' bookings moved off or ended): the daemon holds it
	// until it has applied that generation, so a GPU is never reset under a
	// workload the node's applied spec still gives it.
	minGen := n.Generation
	if p.respec {
		minGen++
	}
	c, err := h.send(ctx, p, m, commands.KindGPUReset, &agentv1.GpuReset{GpuUuids: gpus, Reason: "remediation " + m.ID + ": quarantined GPUs"},
		h.cfg.ResetDeadline, minGen)
	if err != nil {
		return err
	}
	m.CommandID = c.ID
	return h.record(ctx, p, m, "remediation.started", m.Reason)
}

// send queues step m's command (idempotency key per step) owned by the
// health job, and records it on the row.
// minGen is the desired-state generation the command presupposes (0: none).
func (h *health) send(ctx context.Context, p *pass, m remediations.Remediation, kind string, payload any, deadline time.Duration, minGen int64) (commands.Command, error) {
	c, created, err := h.cfg.Kinds.Enqueue(ctx, p.tx, commands.Request{
		NodeID: p.n.ID, Kind: kind, Payload: payload, IdempotencyKey: "health:" + m.ID, MinGeneration: minGen,
		NotAfter: time.Now().Add(deadline), OwnerKind: lifecycle.KindHealth, OwnerKey: p.n.ID, CreatedBy: "health", System: true,
	})
	if err != nil {
		return commands.Command{}, fmt.Errorf("queue %s for %s: %w", kind, m.ID, err)
	}
	if created {
		p.q.WakeCommands(p.n.ID)
	}
	if err := remediations.SetCommand(ctx, p.tx, m.ID, c.ID); err != nil {
		return commands.Command{}, err
	}
	return c, nil
}

// refresh asks the node for a new GPU report after step m's command
// succeeded (once per step), so that the step sees the GPUs' health after it.
func (h *health) refresh(ctx context.Context, p *pass, m remediations.Remediation) error {
	_, created, err := h.cfg.Kinds.Enqueue(ctx, p.tx, commands.Request{
		NodeID: p.n.ID, Kind: commands.KindInventoryRefresh, Payload: &agentv1.InventoryRefresh{Sections: []string{"gpus"}, Rescan: true},
		IdempotencyKey: "health:refresh:" + m.ID, NotAfter: time.Now().Add(2 * time.Minute), CreatedBy: "health", System: true,
	})
	if err != nil {
		return fmt.Errorf("queue inventory.refresh for %s: %w", m.ID, err)
	}
	if created {
		p.q.WakeCommands(p.n.ID)
	}
	return nil
}

// reportSince reports whether the node's latest inventory report arrived
// after t and has been applied to its devices.
func reportSince(ctx context.Context, tx pgx.Tx, node string, t time.Time) (bool, error) {
	return invstore.AppliedSince(ctx, tx, node, t)
}

// unhealthy lists those of gpus that are not healthy and present now.
func unhealthy(n nodes.Node, gpus []string) []string {
	var out []string
	for _, id := range gpus {
		i := slices.IndexFunc(n.Devices, func(d nodes.Device) bool { return d.ID == id })
		if i < 0 || !n.Devices[i].Healthy || n.Devices[i].MissingSince != nil {
			out = append(out, id)
		}
	}
	return out
}

// verdict is what a finished command says of its step: done (false: wait),
// and the failure, "" when the GPUs are healthy after it.
func (h *health) verdict(ctx context.Context, p *pass, m remediations.Remediation, c commands.Command) (bool, string, error) {
	if !c.State.Final() {
		return false, "", nil
	}
	if c.State != commands.Succeeded {
		return true, fmt.Sprintf("%s (%s) %s: %s", m.Step, c.ID, c.State, c.Reason), nil
	}
	finished := c.UpdatedAt
	if c.FinishedAt != nil {
		finished = *c.FinishedAt
	}
	seen, err := reportSince(ctx, p.tx, p.n.ID, finished)
	if err != nil {
		return false, "", err
	}
	if !seen {
		if time.Since(finished) > h.cfg.ReportWait {
			return true, fmt.Sprintf("%s (%s) succeeded but the node sent no inventory report within %s", m.Step, c.ID, h.cfg.ReportWait), nil
		}
		return false, "", h.refresh(ctx, p, m)
	}
	if bad := unhealthy(p.n, m.Devices); len(bad) > 0 {
		return true, fmt.Sprintf("%s (%s) succeeded but GPUs %s are still unhealthy or missing", m.Step, c.ID, strings.Join(bad, ", ")), nil
	}
	return true, "", nil
}

// advance moves the node's running step m on.
func (h *health) advance(ctx context.Context, p *pass, m remediations.Remediation) error {
	if m.Step == remediations.StepNodeReboot && m.CommandID == "" {
		return h.reboot(ctx, p, m)
	}
	c, err := commands.Lookup(ctx, p.tx, p.n.ID, m.CommandID)
	if err != nil {
		return err
	}
	done, failure, err := h.verdict(ctx, p, m, c)
	if err != nil || !done {
		return err
	}
	if failure == "" {
		return h.succeed(ctx, p, m, fmt.Sprintf("%s (%s) succeeded and GPUs %s are healthy", m.Step, c.ID, strings.Join(m.Devices, ", ")))
	}
	if err := h.finish(ctx, p, m, remediations.Failed, failure); err != nil {
		return err
	}
	if m.Step == remediations.StepGPUReset {
		return h.startReboot(ctx, p, m, failure)
	}
	return h.needsRepair(ctx, p, m.Devices, h.tried(ctx, p), true)
}

// succeed ends the ladder well: the step succeeded, its GPUs are back in
// service, and a node the ladder drained is undrained.
func (h *health) succeed(ctx context.Context, p *pass, m remediations.Remediation, reason string) error {
	if err := h.finish(ctx, p, m, remediations.Succeeded, reason); err != nil {
		return err
	}
	lifted, err := nodes.LiftQuarantine(ctx, p.tx, p.n.ID, nil, m.Devices)
	if err != nil {
		return err
	}
	if err := h.recovered(ctx, p, lifted, "remediation "+m.ID+" ("+m.Step+") succeeded"); err != nil {
		return err
	}
	if p.n.DrainBy == nodes.DrainByRemediation && (p.n.State == nodes.StateDraining || p.n.State == nodes.StateDrained) {
		if err := h.undrain(ctx, p); err != nil {
			return err
		}
	}
	return h.wakePool(ctx, p)
}

// undrain undrains the node (the ladder drained it) and writes
// node.undrained.
func (h *health) undrain(ctx context.Context, p *pass) error {
	n, err := lifecycle.Undrain(ctx, p.tx, p.q, p.n.ID)
	if err != nil {
		return err
	}
	// node.undrained's payload is nodes.undrain's response, in its proto3
	// JSON: the node (its identity and state; nodes.get has the rest). API
	// types stay at the edges, so it is spelled out here.
	b, err := json.Marshal(map[string]any{"node": map[string]any{
		"id": n.ID, "tenantId": n.TenantID, "poolId": n.PoolID, "state": n.State,
	}})
	if err != nil {
		return err
	}
	_, err = outbox.Write(ctx, p.tx, outbox.Event{TenantID: n.TenantID, Type: "node.undrained", Resource: n.ID, Payload: json.RawMessage(b)})
	return err
}

// startReboot starts step 2 after reset step m failed: a node.reboot step
// whose first act is draining the node.
func (h *health) startReboot(ctx context.Context, p *pass, m remediations.Remediation, failure string) error {
	r, err := remediations.Start(ctx, p.tx, remediations.Remediation{
		TenantID: p.n.TenantID, NodeID: p.n.ID, PoolID: p.n.PoolID, Step: remediations.StepNodeReboot, Devices: m.Devices,
		Reason: "after " + failure,
	}, p.now)
	if err != nil {
		return err
	}
	if err := h.record(ctx, p, r, "remediation.started", r.Reason); err != nil {
		return err
	}
	if p.n.State == nodes.StateAdopted || p.n.State == nodes.StateDraining {
		_, err := lifecycle.StartDrain(ctx, p.tx, p.q, p.n.ID, lifecycle.DrainRequest{
			Deadline: time.Now().Add(h.cfg.RemediationDrain), By: nodes.DrainByRemediation,
			Reason: "remediation " + r.ID + ": node.reboot after " + m.Step + " failed",
		})
		if err != nil {
			return err
		}
		n, err := nodes.LockForHealth(ctx, p.tx, p.n.ID)
		if err != nil {
			return err
		}
		p.n = n
	}
	return h.reboot(ctx, p, r)
}

// reboot sends step m's node.reboot once the node is drained; while it
// drains, the job looks again a second later.
func (h *health) reboot(ctx context.Context, p *pass, m remediations.Remediation) error {
	switch p.n.State {
	case nodes.StateDrained:
		c, err := h.send(ctx, p, m, commands.KindNodeReboot, &agentv1.NodeReboot{Reason: "remediation " + m.ID}, h.cfg.RebootDeadline, 0)
		if err != nil {
			return err
		}
		return h.audit(ctx, p, m, "command_sent", map[string]any{"commandId": c.ID})
	case nodes.StateDraining:
		p.again = true
		return nil
	default:
		failure := fmt.Sprintf("node.reboot not sent: the node is %s, not drained", p.n.State)
		if m.Cause == remediations.CauseMIG {
			return h.endMig(ctx, p, m, remediations.Failed, failure)
		}
		if err := h.finish(ctx, p, m, remediations.Failed, failure); err != nil {
			return err
		}
		return h.needsRepair(ctx, p, m.Devices, h.tried(ctx, p), true)
	}
}

// tried says what the node's last ladder tried, for NeedsRepair's reason.
func (h *health) tried(ctx context.Context, p *pass) string {
	ms, err := remediations.OfNode(ctx, p.tx, p.n.ID)
	if err != nil {
		return "remediation gave up"
	}
	last := 0
	for i, m := range ms {
		if m.Step == remediations.StepGPUReset {
			last = i
		}
	}
	var steps []string
	for _, m := range ms[last:] {
		if m.Step != remediations.StepNeedsRepair {
			steps = append(steps, m.Reason)
		}
	}
	return "remediation gave up after " + strings.Join(steps, "; then ")
}

// needsRepair latches NeedsRepair (with fail, the node also goes failed)
// and records it as a finished needs_repair step.
func (h *health) needsRepair(ctx context.Context, p *pass, gpus []string, reason string, fail bool) error {
	latched, err := nodes.LatchNeedsRepair(ctx, p.tx, p.n.ID, reason, fail, p.now)
	if err != nil || !latched {
		return err
	}
	m, err := remediations.Start(ctx, p.tx, remediations.Remediation{
		TenantID: p.n.TenantID, NodeID: p.n.ID, PoolID: p.n.PoolID, Step: remediations.StepNeedsRepair, State: remediations.Failed,
		Devices: gpus, Reason: reason,
	}, p.now)
	if err != nil {
		return err
	}
	if _, err := outbox.Write(ctx, p.tx, outbox.Event{TenantID: p.n.TenantID, Type: "node.needs_repair", Resource: p.n.ID, Payload: map[string]any{
		"nodeId": p.n.ID, "poolId": p.n.PoolID, "reason": reason, "failed": fail,
	}}); err != nil {
		return err
	}
	if err := h.audit(ctx, p, m, "needs_repair", map[string]any{"failed": fail}); err != nil {
		return err
	}
	return h.wakePool(ctx, p)
}

// finish ends step m in state with reason: its event and audit row.
func (h *health) finish(ctx context.Context, p *pass, m remediations.Remediation, state, reason string) error {
	ok, err := remediations.Finish(ctx, p.tx, m.ID, state, reason, p.now)
	if err != nil || !ok {
		return err
	}
	m.State = state
	return h.record(ctx, p, m, "remediation."+state, reason)
}

// record writes step m's event typ and its audit row.
func (h *health) record(ctx context.Context, p *pass, m remediations.Remediation, typ, reason string) error {
	if _, err := outbox.Write(ctx, p.tx, outbox.Event{TenantID: p.n.TenantID, Type: typ, Resource: p.n.ID, Payload: map[string]any{
		"nodeId": p.n.ID, "poolId": p.n.PoolID, "remediationId": m.ID, "step": m.Step, "commandId": m.CommandID,
		"gpuUuids": m.Devices, "reason": reason,
	}}); err != nil {
		return err
	}
	return h.audit(ctx, p, m, strings.TrimPrefix(typ, "remediation."), map[string]any{"reason": reason})
}

// audit writes the audit row of what the ladder did in step m.
func (h *health) audit(ctx context.Context, p *pass, m remediations.Remediation, what string, detail map[string]any) error {
	action := authz.NodesExec
	if m.Step == remediations.StepNeedsRepair {
		action = authz.NodesRepair
	}
	d := map[string]any{"remediationId": m.ID, "step": m.Step, "what": what, "commandId": m.CommandID, "gpuUuids": m.Devices}
	for k, v := range detail {
		d[k] = v
	}
	res := authz.Resource{Type: authz.TypeNode, ID: p.n.ID, TenantID: p.n.TenantID, PoolID: p.n.PoolID, Labels: p.n.Labels}
	if err := audit.Write(ctx, p.tx, audit.Record{
		TenantID: p.n.TenantID, Actor: "health", ActorTenantID: p.n.TenantID, Action: string(action),
		Resource: res.UID(), Decision: audit.Allow, Method: "job:" + lifecycle.KindHealth, Detail: d,
	}); err != nil {
		return fmt.Errorf("audit remediation %s: %w", m.ID, err)
	}
	return nil
}

// wakePool enqueues the pool's nodes that wait for a ladder (quarantined
// GPUs, no running step, no NeedsRepair), now that one ended.
func (h *health) wakePool(ctx context.Context, p *pass) error {
	ids, err := nodes.WaitingForLadder(ctx, p.tx, p.n.PoolID, p.n.ID)
	if err != nil {
		return err
	}
	for _, id := range ids {
		if err := p.q.Enqueue(ctx, lifecycle.KindHealth, id); err != nil {
			return err
		}
	}
	return nil
}
