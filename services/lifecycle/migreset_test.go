package lifecycle_test

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	nodelife "github.com/bettercompute/bettercompute/pkg/lifecycle"
	"github.com/bettercompute/bettercompute/pkg/miglayouts"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/remediations"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
	"github.com/bettercompute/bettercompute/services/lifecycle"
)

// migStatus stores node's section status as its daemon reports it for
// the node's current generation: its mig section says each of resets
// waits for a reset, every other GPU laid out; none converged.
func (e *healthEnv) migStatus(t *testing.T, node string, resets ...string) {
	t.Helper()
	var parts []string
	for i := range e.gpus[node] {
		u := uuid(node, i)
		if slices.Contains(resets, u) {
			parts = append(parts, u+": reset-required: MIG mode on is pending (current off): the GPU must be reset (gpu.reset) or the node rebooted")
		} else {
			parts = append(parts, u+": 7g.141gb@0 MIG-x")
		}
	}
	state := "SECTION_STATE_CONVERGED"
	if len(resets) > 0 {
		state = "SECTION_STATE_FAILED_TERMINAL"
	}
	var gen int64
	if err := e.pool.QueryRow(t.Context(), `SELECT generation FROM nodes WHERE id = $1`, node).Scan(&gen); err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal([]nodes.SectionStatus{{Section: "mig", State: state, Reason: strings.Join(parts, "; "), Generation: gen}})
	if _, err := e.pool.Exec(t.Context(), `UPDATE nodes SET section_status = $2, observed_generation = generation WHERE id = $1`, node, b); err != nil {
		t.Fatal(err)
	}
	// As the gateway does on a stored report.
	ids, err := nodes.WaitingForMigReset(t.Context(), e.pool, []string{node})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		if err := workqueue.Enqueue(t.Context(), e.pool, nodelife.KindHealth, id); err != nil {
			t.Fatal(err)
		}
	}
	e.settle(t)
}

// TestMigResetRequiredRunsBrakedGPUReset: GPUs of two nodes of a pool
// report reset-required. The health job sends one signed gpu.reset (the
// pool runs one step at a time) for the unbooked ones only, with the
// node's generation as min_generation; the step succeeds once the node
// reports them laid out, and the second node's starts then.
func TestMigResetRequiredRunsBrakedGPUReset(t *testing.T) {
	t.Parallel()
	e := newHealthEnv(t, lifecycle.HealthConfig{}, map[string]int{"node_1": 4, "node_2": 4})
	r := e.reserve(t, "rsv_1", 1)
	booked := r.Bookings[0]
	first, second := "node_1", "node_2"
	if booked.NodeID == "node_2" {
		first, second = second, first
	}
	var free []string // two of the first node's GPUs that are not booked
	for i := range 4 {
		if u := uuid(first, i); u != booked.DeviceID && len(free) < 2 {
			free = append(free, u)
		}
	}
	e.migStatus(t, first, free[0], booked.DeviceID, free[1])
	e.migStatus(t, second, uuid(second, 1))

	resets := e.commandsOf(t, first, "gpu.reset")
	if len(resets) != 1 || len(e.commandsOf(t, second, "gpu.reset")) != 0 {
		t.Fatalf("gpu.reset: %d on %s, %d on %s; want one, on the first node", len(resets), first, len(e.commandsOf(t, second, "gpu.reset")), second)
	}
	c := resets[0]
	body, err := c.Body()
	if err != nil || !slices.Equal(body.GetGpuReset().GetGpuUuids(), free) {
		t.Fatalf("gpu.reset payload %v %v (the booked %s must not be reset)", body, err, booked.DeviceID)
	}
	n := e.node(t, first)
	if c.MinGeneration != n.Generation || c.MinGeneration < 1 || len(c.Signature) == 0 || c.OwnerKind != nodelife.KindHealth {
		t.Fatalf("gpu.reset min_generation %d (node generation %d), signed %v, owner %q", c.MinGeneration, n.Generation, len(c.Signature) > 0, c.OwnerKind)
	}
	ms, err := remediations.OfNode(t.Context(), e.pool, first)
	if err != nil || len(ms) != 1 || ms[0].Cause != remediations.CauseMIG || ms[0].State != remediations.Running {
		t.Fatalf("steps %+v %v", ms, err)
	}
	if p := e.payload(t, "remediation.started"); p["step"] != "gpu.reset" || !strings.Contains(p["reason"].(string), "MIG") {
		t.Fatalf("remediation.started %v", p)
	}

	e.answer(t, first, "gpu.reset", agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED, "")
	e.settle(t)
	if got := e.steps(t, first); !slices.Equal(got, []string{"gpu.reset:running"}) {
		t.Fatalf("steps before the node reported the GPUs laid out: %v", got)
	}
	// The node converges again after the reset: only the booked GPU (not
	// reset) still waits.
	e.migStatus(t, first, booked.DeviceID)
	if got := e.steps(t, first); !slices.Equal(got, []string{"gpu.reset:succeeded"}) {
		t.Fatalf("steps after the report: %v", got)
	}
	if len(e.commandsOf(t, first, "gpu.reset")) != 1 {
		t.Fatal("a second gpu.reset for the booked GPU")
	}
	if got := e.commandsOf(t, second, "gpu.reset"); len(got) != 1 {
		t.Fatalf("the second node's step did not start when the first ended: %v", e.steps(t, second))
	}
}

// TestMigResetBudgetSpentSendsNothing: a node that spent its remediation
// budget (health.maxRemediationsPerNode ladders in the window) gets no
// gpu.reset for a reset-required GPU: NeedsRepair is latched, naming it.
func TestMigResetBudgetSpentSendsNothing(t *testing.T) {
	t.Parallel()
	e := newHealthEnv(t, lifecycle.HealthConfig{MaxRemediationsPerNode: 1}, map[string]int{"node_1": 2})
	if _, err := remediations.Start(t.Context(), e.pool, remediations.Remediation{TenantID: "root", NodeID: "node_1", PoolID: "pool_a",
		Step: remediations.StepGPUReset, State: remediations.Succeeded, Cause: remediations.CauseMIG, Reason: "earlier"}, e.clock.Now().Add(-time.Hour)); err != nil {
		t.Fatal(err)
	}
	e.migStatus(t, "node_1", uuid("node_1", 1))
	if got := e.commandsOf(t, "node_1", "gpu.reset"); len(got) != 0 {
		t.Fatalf("%d gpu.reset sent with the budget spent", len(got))
	}
	n := e.node(t, "node_1")
	if !n.NeedsRepair || !strings.Contains(n.NeedsRepairReason, "budget") || !strings.Contains(n.NeedsRepairReason, uuid("node_1", 1)) {
		t.Fatalf("needsRepair=%v %q", n.NeedsRepair, n.NeedsRepairReason)
	}
	// Latched: nothing more is tried.
	e.runHealth(t, "node_1")
	if got := e.commandsOf(t, "node_1", "gpu.reset"); len(got) != 0 {
		t.Fatalf("%d gpu.reset sent after NeedsRepair", len(got))
	}
}

// TestMigResetPolicyNodeReboot: with the pool's MIG resetPolicy
// node-reboot, a reset-required GPU drains the node (by remediation) and
// sends node.reboot once drained; the node is undrained when the step ends.
func TestMigResetPolicyNodeReboot(t *testing.T) {
	t.Parallel()
	e := newHealthEnv(t, lifecycle.HealthConfig{}, map[string]int{"node_1": 2})
	if err := miglayouts.SetResetPolicy(t.Context(), e.pool, "pool_a", miglayouts.ResetNodeReboot); err != nil {
		t.Fatal(err)
	}
	e.migStatus(t, "node_1", uuid("node_1", 0))
	n := e.node(t, "node_1")
	if n.DrainBy != nodes.DrainByRemediation || (n.State != nodes.StateDraining && n.State != nodes.StateDrained) {
		t.Fatalf("node %s by %q, want drained by remediation", n.State, n.DrainBy)
	}
	if len(e.commandsOf(t, "node_1", "gpu.reset")) != 0 {
		t.Fatal("gpu.reset sent under node-reboot")
	}
	if err := workqueue.Enqueue(t.Context(), e.pool, nodelife.KindDrain, "node_1"); err != nil {
		t.Fatal(err)
	}
	e.tick(t, nodelife.KindDrain)
	e.runHealth(t, "node_1")
	reboots := e.commandsOf(t, "node_1", "node.reboot")
	if len(reboots) != 1 || len(reboots[0].Signature) == 0 {
		t.Fatalf("node.reboot %+v", reboots)
	}
	e.answer(t, "node_1", "node.reboot", agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED, "")
	e.settle(t)
	e.migStatus(t, "node_1")
	if got := e.steps(t, "node_1"); !slices.Equal(got, []string{"node.reboot:succeeded"}) {
		t.Fatalf("steps %v", got)
	}
	if n := e.node(t, "node_1"); n.State != nodes.StateAdopted || n.NeedsRepair {
		t.Fatalf("after the step: %s needsRepair=%v", n.State, n.NeedsRepair)
	}
}
