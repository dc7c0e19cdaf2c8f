package dev_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/agent/inventory"

	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
)

// TestMigResetRequiredConverges: a simulated node whose GPU 0 needs a
// reset to enter MIG mode (the mock's MIGNeedsReset fault) gets an index
// layout on that GPU. Its mig section reports reset-required, the health
// job sends the signed gpu.reset (cause mig, min_generation the node's
// generation), the daemon resets the GPU and lays it out, the section
// converges and the GPU's four slices reach nodes.get.
func TestMigResetRequiredConverges(t *testing.T) {
	t.Parallel()
	migResetE2E(t, false)
}

// TestMigResetRequiredConvergesBusStopped: the same with NATS stopped
// before the layout is set: every step goes through the database.
func TestMigResetRequiredConvergesBusStopped(t *testing.T) {
	t.Parallel()
	migResetE2E(t, true)
}

func migResetE2E(t *testing.T, stopBus bool) {
	dbURL := pgtest.NewDB(t)
	db, err := pgxpool.New(context.Background(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ns := natstest.New(t)
	env := commandEnvOn(t, dbURL, t.TempDir(), "127.0.0.1:0", ns.URL(), 100*time.Millisecond, 100*time.Millisecond)
	defer env.Stop(context.Background())
	f := simFleet(t, env, db, "migreset", 1, nil)
	node := f.Nodes()[0]
	if err := f.Faults(0).Inject(0, inventory.Fault{MIGNeedsReset: true}); err != nil {
		t.Fatal(err)
	}
	if stopBus {
		ns.Stop()
	}
	var upd struct{}
	call(t, env, "nodes/update", map[string]any{"tenantId": "root", "nodeId": node, "updateMask": "mig",
		"mig": map[string]any{"layouts": []any{map[string]any{"name": "mixed", "gpuSelector": map[string]any{"indices": []int{0}},
			"profiles": []string{"3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb"}}}}}, &upd)

	migSection := func() nodes.SectionStatus {
		var raw []byte
		if err := db.QueryRow(context.Background(), `SELECT section_status FROM nodes WHERE id = $1`, node).Scan(&raw); err != nil {
			t.Fatal(err)
		}
		var ss []nodes.SectionStatus
		_ = json.Unmarshal(raw, &ss)
		for _, s := range ss {
			if s.Section == "mig" {
				return s
			}
		}
		return nodes.SectionStatus{}
	}
	// The section converges after a gpu.reset (only the health job sends
	// one, and only for a GPU reported reset-required).
	poll.UntilNil(t, 90*time.Second, "the mig section converged after a gpu.reset", func() error {
		s := migSection()
		var resets int
		if err := db.QueryRow(context.Background(), `SELECT count(*) FROM commands WHERE node_id = $1 AND kind = 'gpu.reset' AND state = 'succeeded'`,
			node).Scan(&resets); err != nil {
			return err
		}
		if resets == 0 || s.State != "SECTION_STATE_CONVERGED" {
			return fmt.Errorf("%d gpu.reset succeeded, mig %s %q", resets, s.State, s.Reason)
		}
		return nil
	})
	var minGen, gen int64
	var payload []byte // the GpuReset body's protobuf bytes: the UUIDs are in it as they are
	if err := db.QueryRow(context.Background(), `SELECT c.min_generation, n.generation, c.payload FROM commands c JOIN nodes n ON n.id = c.node_id
		WHERE c.node_id = $1 AND c.kind = 'gpu.reset'`, node).Scan(&minGen, &gen, &payload); err != nil {
		t.Fatalf("one gpu.reset: %v", err)
	}
	if minGen < 1 || minGen > gen {
		t.Fatalf("gpu.reset min_generation %d, node generation %d", minGen, gen)
	}
	var gpu0 string
	if err := db.QueryRow(context.Background(), `SELECT id FROM devices WHERE node_id = $1 AND kind = 'gpu' AND index = 0`, node).Scan(&gpu0); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(payload), gpu0) || strings.Count(string(payload), "GPU-") != 1 {
		t.Fatalf("gpu.reset payload %q, want GPU 0 (%s) only", payload, gpu0)
	}
	// The step ends when the health job sees the node's report of the GPU
	// laid out.
	poll.UntilNil(t, 30*time.Second, "the MIG step succeeded", func() error {
		var state, reason string
		if err := db.QueryRow(context.Background(), `SELECT state, reason FROM remediations WHERE node_id = $1 AND cause = 'mig' AND step = 'gpu.reset'`,
			node).Scan(&state, &reason); err != nil {
			return err
		}
		if state != "succeeded" {
			return fmt.Errorf("MIG step %s: %s", state, reason)
		}
		return nil
	})
	poll.UntilNil(t, 60*time.Second, "GPU 0's four slices in the inventory", func() error {
		var n int
		if err := db.QueryRow(context.Background(), `SELECT count(*) FROM devices WHERE node_id = $1 AND kind = 'mig' AND parent_id = $2 AND missing_since IS NULL`,
			node, gpu0).Scan(&n); err != nil {
			return err
		}
		if n != 4 {
			return fmt.Errorf("%d slices", n)
		}
		return nil
	})
}
