package inventory_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/encoding/protojson"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	nodelife "github.com/bettercompute/bettercompute/pkg/lifecycle"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
	"github.com/bettercompute/bettercompute/services/inventory"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func setup(t *testing.T) (*pgxpool.Pool, *reconcile.Runtime) {
	t.Helper()
	pool, err := db.Open(t.Context(), db.Config{URL: pgtest.NewDB(t), MaxConns: 8})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	rt, err := reconcile.New(pool, nil, reconcile.Config{Roles: []string{reconcile.RoleControllers}, Heartbeat: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range inventory.Reconcilers() {
		if err := rt.Register(r); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(rt.Stop)
	fixture.Pool(t, pool, fixture.PoolOpts{ID: "pool_a"})
	fixture.Node(t, pool, fixture.NodeOpts{ID: "node_1", Pool: "pool_a"})
	return pool, rt
}

// report stores a report as the gateway would and enqueues the controller.
func report(t *testing.T, pool *pgxpool.Pool, gpus ...*agentv1.GPU) {
	t.Helper()
	b, err := protojson.Marshal(&agentv1.InventoryReport{Sections: []string{"gpus", "host"}, Gpus: gpus, Host: &agentv1.Host{Hostname: "h1"}})
	if err != nil {
		t.Fatal(err)
	}
	_, err = pool.Exec(t.Context(), `
		INSERT INTO node_inventory (node_id, session_epoch, report) VALUES ('node_1', 1, $1)
		ON CONFLICT (node_id) DO UPDATE SET report = EXCLUDED.report, received_at = clock_timestamp()`, json.RawMessage(b))
	if err != nil {
		t.Fatal(err)
	}
	if err := workqueue.Enqueue(t.Context(), pool, nodelife.KindInventory, "node_1"); err != nil {
		t.Fatal(err)
	}
}

func gpu(i int, healthy bool) *agentv1.GPU {
	return &agentv1.GPU{Index: uint32(i), Uuid: fmt.Sprintf("GPU-%d", i), Model: "NVIDIA H200", MemoryBytes: 141 << 30, Healthy: healthy}
}

type device struct {
	ID      string
	Healthy bool
	Missing bool
}

func devices(t *testing.T, pool *pgxpool.Pool) []device {
	t.Helper()
	rows, err := pool.Query(t.Context(), `SELECT id, healthy, missing_since IS NOT NULL FROM devices WHERE node_id = 'node_1' ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []device
	for rows.Next() {
		var d device
		_ = rows.Scan(&d.ID, &d.Healthy, &d.Missing)
		out = append(out, d)
	}
	return out
}

func node(t *testing.T, pool *pgxpool.Pool) (state string, conds map[string]inventory.Condition) {
	t.Helper()
	var raw []byte
	if err := pool.QueryRow(t.Context(), `SELECT state, conditions FROM nodes WHERE id = 'node_1'`).Scan(&state, &raw); err != nil {
		t.Fatal(err)
	}
	var list []inventory.Condition
	_ = json.Unmarshal(raw, &list)
	conds = map[string]inventory.Condition{}
	for _, c := range list {
		conds[c.Type] = c
	}
	return state, conds
}

func tick(t *testing.T, rt *reconcile.Runtime, kind string) reconcile.TickResult {
	t.Helper()
	tr, err := rt.Jobs()[kind].Tick(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

func TestInventoryDerivesDevicesAndAdopts(t *testing.T) {
	t.Parallel()
	pool, rt := setup(t)

	report(t, pool, gpu(0, true), gpu(1, true))
	if tr := tick(t, rt, nodelife.KindInventory); tr.Done != 1 {
		t.Fatalf("tick %+v", tr)
	}
	if d := devices(t, pool); len(d) != 2 || d[0] != (device{"GPU-0", true, false}) {
		t.Fatalf("devices %+v", d)
	}
	state, conds := node(t, pool)
	if state != "adopted" || !conds[inventory.InventoryReported].Status || !conds[inventory.GPUsHealthy].Status {
		t.Fatalf("state %s conditions %+v", state, conds)
	}
	since := conds[inventory.GPUsHealthy].Since

	t.Run("a GPU that disappears is marked, not deleted", func(t *testing.T) {
		report(t, pool, gpu(0, false))
		tick(t, rt, nodelife.KindInventory)
		d := devices(t, pool)
		if len(d) != 2 || d[1] != (device{"GPU-1", true, true}) || d[0].Healthy {
			t.Fatalf("devices %+v", d)
		}
		_, conds := node(t, pool)
		if conds[inventory.DevicesPresent].Status || conds[inventory.GPUsHealthy].Status || conds[inventory.GPUsHealthy].Since.Equal(since) {
			t.Fatalf("conditions %+v", conds)
		}
	})

	t.Run("and clears when it comes back", func(t *testing.T) {
		report(t, pool, gpu(0, true), gpu(1, true))
		tick(t, rt, nodelife.KindInventory)
		if d := devices(t, pool); d[1].Missing || !d[0].Healthy {
			t.Fatalf("devices %+v", d)
		}
		if _, conds := node(t, pool); !conds[inventory.DevicesPresent].Status {
			t.Fatalf("conditions %+v", conds)
		}
	})
}

func TestHygieneReenqueuesUnappliedReports(t *testing.T) {
	t.Parallel()
	pool, rt := setup(t)
	report(t, pool, gpu(0, true))
	// The enqueue was lost.
	if _, err := pool.Exec(t.Context(), `DELETE FROM work_queue WHERE kind = $1`, nodelife.KindInventory); err != nil {
		t.Fatal(err)
	}
	if tr := tick(t, rt, nodelife.KindInventory); tr.Claimed != 0 {
		t.Fatalf("nothing should be queued: %+v", tr)
	}
	tick(t, rt, inventory.HygieneKind)
	if tr := tick(t, rt, nodelife.KindInventory); tr.Done != 1 || len(devices(t, pool)) != 1 {
		t.Fatalf("hygiene did not bring the report back: %+v", tr)
	}
	tick(t, rt, inventory.HygieneKind) // nothing left unapplied
	if tr := tick(t, rt, nodelife.KindInventory); tr.Claimed != 0 {
		t.Fatalf("an applied report was re-enqueued: %+v", tr)
	}
}

// settle answers node_1's due commands as its daemon would, through the
// same claim and apply the gateway uses.
func settle(t *testing.T, pool *pgxpool.Pool, outcome agentv1.CommandOutcome, reason string) {
	t.Helper()
	cs, err := commands.Claim(t.Context(), pool, "node_1", 1)
	if err != nil || len(cs) != 1 || cs[0].Kind != "diag.nvml" {
		t.Fatalf("claimed %+v %v; want the diag.nvml check", cs, err)
	}
	err = pgx.BeginFunc(t.Context(), pool, func(tx pgx.Tx) error {
		_, err := commands.Builtin().Apply(t.Context(), tx, commands.TxWaker(tx), "node_1", 1,
			&agentv1.CommandUpdate{Id: cs[0].ID, Seq: cs[0].Seq, Outcome: outcome, Reason: reason})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestAcceptanceChecksGateAdoption(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		outcome agentv1.CommandOutcome
		state   string
	}{
		{"a passing diag.nvml adopts the node", agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED, "adopted"},
		{"a failing diag.nvml keeps it out of service", agentv1.CommandOutcome_COMMAND_OUTCOME_FAILED, "failed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pool, rt := setup(t)
			if _, err := pool.Exec(t.Context(), `UPDATE pools SET acceptance = '{diag.nvml}' WHERE id = 'pool_a';
				UPDATE nodes SET boot_id = 'boot-1', session_epoch = 1 WHERE id = 'node_1'`); err != nil {
				t.Fatal(err)
			}
			report(t, pool, gpu(0, true))
			tick(t, rt, nodelife.KindInventory)
			state, conds := node(t, pool)
			if c := conds[inventory.AcceptancePassed]; state != "adopting" || c.Status || !strings.Contains(c.Reason, "diag.nvml") {
				t.Fatalf("while the check is queued: %s %+v", state, c)
			}
			var gen int64
			_ = pool.QueryRow(t.Context(), `SELECT count(*) FROM work_queue WHERE kind = 'nodespec'`).Scan(&gen)
			if gen != 0 {
				t.Fatal("desired state was invalidated before the node passed its checks")
			}

			// A second report while the check runs queues no second check.
			report(t, pool, gpu(0, true))
			tick(t, rt, nodelife.KindInventory)
			var n int
			_ = pool.QueryRow(t.Context(), `SELECT count(*) FROM commands WHERE node_id = 'node_1'`).Scan(&n)
			if n != 1 {
				t.Fatalf("%d acceptance commands; want 1", n)
			}

			settle(t, pool, tc.outcome, "1 of 1 GPUs unhealthy: GPU-0 too hot")
			// The command's final state woke the controller (its owner).
			if tr := tick(t, rt, nodelife.KindInventory); tr.Done != 1 {
				t.Fatalf("the owner was not woken: %+v", tr)
			}
			state, conds = node(t, pool)
			c := conds[inventory.AcceptancePassed]
			if state != tc.state || c.Status != (tc.state == "adopted") {
				t.Fatalf("after the check: %s %+v", state, c)
			}
			if tc.state == "failed" && !strings.Contains(c.Reason, "too hot") {
				t.Fatalf("the reason is not visible: %+v", c)
			}
			_ = pool.QueryRow(t.Context(), `SELECT count(*) FROM work_queue WHERE kind = 'nodespec'`).Scan(&gen)
			if (gen == 1) != (tc.state == "adopted") {
				t.Fatalf("nodespec work %d for state %s", gen, tc.state)
			}

			// Later reports keep the verdict.
			report(t, pool, gpu(0, true))
			tick(t, rt, nodelife.KindInventory)
			if state, conds := node(t, pool); state != tc.state || conds[inventory.AcceptancePassed].Status != c.Status {
				t.Fatalf("a later report changed the verdict: %s %+v", state, conds)
			}
		})
	}
}

// TestReportWithARepeatedGPU: a report that lists a GPU twice stores it once,
// as its last entry says, instead of failing the whole report.
func TestReportWithARepeatedGPU(t *testing.T) {
	t.Parallel()
	pool, rt := setup(t)
	report(t, pool, gpu(0, true), gpu(1, true), gpu(0, false))
	if tr := tick(t, rt, nodelife.KindInventory); tr.Done != 1 {
		t.Fatalf("tick %+v", tr)
	}
	if d := devices(t, pool); len(d) != 2 || d[0] != (device{"GPU-0", false, false}) || d[1] != (device{"GPU-1", true, false}) {
		t.Fatalf("devices %+v", d)
	}
}
