package lifecycle

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/brakes"
	capstore "github.com/bettercompute/bettercompute/pkg/capacity"
	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/lifecycle"
	"github.com/bettercompute/bettercompute/pkg/miglayouts"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/pools"
	"github.com/bettercompute/bettercompute/pkg/remediations"
)

// The MIG reset (issue 28): a GPU whose MIG mode change the driver holds
// until a reset reports "GPU-…: reset-required: …" in its node's mig
// section (agent/converge). The health job then runs one remediation step
// of cause mig, under the ladder's brakes (NeedsRepair, the per-node
// budget — each MIG step counts as a ladder —, the per-pool concurrency
// and the fleet's eviction brakes):
//
//   - the pool's MIG resetPolicy gpu-reset (the default): gpu.reset of
//     those GPUs that no reservation books (a GPU or any of its slices),
//     with min_generation the node's generation, which the node has
//     applied (a reset-required GPU does not hold the node's observed
//     generation back), so the reset runs against the spec that gives the
//     GPU to no workload;
//   - node-reboot: the node is drained (by remediation), then node.reboot.
//
// The step succeeds when the node reports its mig section with none of
// the step's GPUs reset-required any more (after the reset the daemon
// converges again and lays them out), and fails when the command fails or
// that report does not come within health's report wait; either way it
// ends there (no escalation: a GPU still reset-required starts another
// step while the budget lasts, then NeedsRepair is latched). A node the
// step drained is undrained.

// resetRequiredRE finds the GPUs of a mig section reason that wait for a
// reset: "GPU-…: reset-required: …", entries joined by "; ".
var resetRequiredRE = regexp.MustCompile(`(?:^|; )([^\s;:]+): reset-required: `)

// migResetGPUs lists the GPUs n's last report of its mig section says wait
// for a reset, for its current generation (a stale report says nothing);
// empty otherwise.
func migResetGPUs(n nodes.Node) []string {
	for _, s := range n.Sections {
		if s.Section != "mig" || s.Generation != n.Generation {
			continue
		}
		var out []string
		for _, m := range resetRequiredRE.FindAllStringSubmatch(s.Reason, -1) {
			if !slices.Contains(out, m[1]) {
				out = append(out, m[1])
			}
		}
		return out
	}
	return nil
}

// WaitingForMigReset returns which of nodeIDs, whose convergence reports
// were just stored in tx, the health job should look at for MIG: a GPU
// waiting for a reset, or a running MIG step. The gateway enqueues them.
func WaitingForMigReset(ctx context.Context, tx pgx.Tx, nodeIDs []string) ([]string, error) {
	return nodes.WaitingForMigReset(ctx, tx, nodeIDs)
}

// migReset starts a MIG step on the node when a GPU of it waits for a
// reset (no quarantined GPU: that ladder goes first).
func (h *health) migReset(ctx context.Context, p *pass) error {
	n := p.n
	gpus := migResetGPUs(n)
	if len(gpus) == 0 || n.NeedsRepair || n.State != nodes.StateAdopted || n.ObservedGeneration < n.Generation {
		// Nothing waits, or the node has not applied its current spec
		// (another GPU still converging): its next report wakes the job.
		return nil
	}
	booked, err := capstore.NodesAssignments(ctx, p.tx, []string{n.ID})
	if err != nil {
		return err
	}
	inUse := map[string]bool{}
	if a := booked[n.ID]; a != nil {
		for _, devs := range a.Devices {
			for _, d := range devs {
				inUse[d] = true
			}
		}
	}
	gpus = slices.DeleteFunc(gpus, func(g string) bool {
		i := slices.IndexFunc(n.Devices, func(d nodes.Device) bool { return d.ID == g && d.Kind == "gpu" })
		if i < 0 || inUse[g] {
			return true // not this node's, or booked whole: its change waits
		}
		return slices.ContainsFunc(n.Devices[i].MigSlices, func(s nodes.MigSlice) bool { return inUse[s.ID] })
	})
	if len(gpus) == 0 {
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
		reason := fmt.Sprintf("remediation budget spent: %d ladders started in the last %s (health.maxRemediationsPerNode is %d); GPUs %s wait for a reset to change their MIG mode",
			started, h.cfg.Window, h.cfg.MaxRemediationsPerNode, strings.Join(gpus, ", "))
		return h.needsRepair(ctx, p, gpus, reason, false)
	}
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
		p.again = !d.Paused
		return nil
	}
	policy, err := miglayouts.ResetPolicyOf(ctx, p.tx, n.PoolID)
	if err != nil {
		return err
	}
	reason := "MIG mode change waits for a reset: " + strings.Join(gpus, ", ")
	if policy == miglayouts.ResetNodeReboot {
		m, err := remediations.Start(ctx, p.tx, remediations.Remediation{
			TenantID: n.TenantID, NodeID: n.ID, PoolID: n.PoolID, Step: remediations.StepNodeReboot, Devices: gpus, Cause: remediations.CauseMIG,
			Reason: reason + " (the pool's MIG resetPolicy is node-reboot)",
		}, p.now)
		if err != nil {
			return err
		}
		if err := h.record(ctx, p, m, "remediation.started", m.Reason); err != nil {
			return err
		}
		if _, err := lifecycle.StartDrain(ctx, p.tx, p.q, n.ID, lifecycle.DrainRequest{
			Deadline: time.Now().Add(h.cfg.RemediationDrain), By: nodes.DrainByRemediation,
			Reason: "remediation " + m.ID + ": node.reboot for a MIG mode change",
		}); err != nil {
			return err
		}
		if p.n, err = nodes.LockForHealth(ctx, p.tx, n.ID); err != nil {
			return err
		}
		return h.reboot(ctx, p, m)
	}
	m, err := remediations.Start(ctx, p.tx, remediations.Remediation{
		TenantID: n.TenantID, NodeID: n.ID, PoolID: n.PoolID, Step: remediations.StepGPUReset, Devices: gpus, Cause: remediations.CauseMIG,
		Reason: reason,
	}, p.now)
	if err != nil {
		return err
	}
	c, err := h.send(ctx, p, m, commands.KindGPUReset, &agentv1.GpuReset{GpuUuids: gpus, Reason: "remediation " + m.ID + ": MIG mode change"},
		h.cfg.ResetDeadline, n.Generation)
	if err != nil {
		return err
	}
	m.CommandID = c.ID
	return h.record(ctx, p, m, "remediation.started", m.Reason)
}

// advanceMig moves the node's running MIG step m on: it succeeds once the
// node reports none of m's GPUs reset-required after the command
// succeeded, and fails with the command, or without that report within
// the report wait.
func (h *health) advanceMig(ctx context.Context, p *pass, m remediations.Remediation) error {
	if m.Step == remediations.StepNodeReboot && m.CommandID == "" {
		return h.reboot(ctx, p, m)
	}
	c, err := commands.Lookup(ctx, p.tx, p.n.ID, m.CommandID)
	if err != nil {
		return err
	}
	if !c.State.Final() {
		return nil
	}
	if c.State != commands.Succeeded {
		return h.endMig(ctx, p, m, remediations.Failed, fmt.Sprintf("%s (%s) %s: %s", m.Step, c.ID, c.State, c.Reason))
	}
	waiting := migResetGPUs(p.n)
	still := slices.DeleteFunc(slices.Clone(m.Devices), func(g string) bool { return !slices.Contains(waiting, g) })
	if len(still) == 0 && migReported(p.n) {
		return h.endMig(ctx, p, m, remediations.Succeeded,
			fmt.Sprintf("%s (%s) succeeded and the node laid out GPUs %s", m.Step, c.ID, strings.Join(m.Devices, ", ")))
	}
	finished := c.UpdatedAt
	if c.FinishedAt != nil {
		finished = *c.FinishedAt
	}
	if time.Since(finished) > h.cfg.ReportWait {
		return h.endMig(ctx, p, m, remediations.Failed,
			fmt.Sprintf("%s (%s) succeeded but GPUs %s still wait for a reset after %s", m.Step, c.ID, strings.Join(m.Devices, ", "), h.cfg.ReportWait))
	}
	return nil // the node's next report wakes the job
}

// migReported reports whether n's last report has its mig section for its
// current generation.
func migReported(n nodes.Node) bool {
	return slices.ContainsFunc(n.Sections, func(s nodes.SectionStatus) bool { return s.Section == "mig" && s.Generation == n.Generation })
}

// endMig finishes MIG step m in state, undrains a node the step drained,
// and wakes the pool's waiting nodes.
func (h *health) endMig(ctx context.Context, p *pass, m remediations.Remediation, state, reason string) error {
	if err := h.finish(ctx, p, m, state, reason); err != nil {
		return err
	}
	if p.n.DrainBy == nodes.DrainByRemediation && (p.n.State == nodes.StateDraining || p.n.State == nodes.StateDrained) {
		if err := h.undrain(ctx, p); err != nil {
			return err
		}
	}
	return h.wakePool(ctx, p)
}
