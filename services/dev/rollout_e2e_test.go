package dev_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/sim"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/dev"
)

// rolloutJSON is a rollout as the REST API answers it.
type rolloutJSON struct {
	ID, PoolID, State, Message string
	CurrentBatch               int
	FailedNodes, SkippedNodes  []string
	Batches                    []struct{ Index, Nodes, Released, Healthy, Failed, Skipped int }
}

// rolloutHealth is the change every rollout test rolls out: the health
// section's GPU temperature limit, which no simulated GPU reaches.
var rolloutHealth = map[string]any{"maxGpuTemperatureCelsius": 95}

// newContent is the SQL condition "the node's desired state has the
// rollout's health section".
const newContent = `coalesce(spec->'health'->>'maxGpuTemperatureCelsius', '') = '95'`

func createRollout(t *testing.T, env *dev.Env, pool string, strategy map[string]any, extra map[string]any) rolloutJSON {
	t.Helper()
	req := map[string]any{"tenantId": "root", "poolId": pool, "idempotencyKey": "rollout-" + pool,
		"change":   map[string]any{"updateMask": "health", "health": rolloutHealth},
		"strategy": strategy}
	for k, v := range extra {
		req[k] = v
	}
	var out struct{ Rollout rolloutJSON }
	call(t, env, "rollouts/create", req, &out)
	if out.Rollout.State != "pending" {
		t.Fatalf("created rollout %+v", out.Rollout)
	}
	return out.Rollout
}

func getRollout(t *testing.T, env *dev.Env, id string) rolloutJSON {
	t.Helper()
	var out struct{ Rollout rolloutJSON }
	call(t, env, "rollouts/get", map[string]any{"tenantId": "root", "rolloutId": id}, &out)
	return out.Rollout
}

func rolloutAction(t *testing.T, env *dev.Env, action, id string) rolloutJSON {
	t.Helper()
	var out struct{ Rollout rolloutJSON }
	call(t, env, "rollouts/"+action, map[string]any{"tenantId": "root", "rolloutId": id}, &out)
	return out.Rollout
}

func poolOf(t *testing.T, db *pgxpool.Pool, node string) string {
	t.Helper()
	var pool string
	if err := db.QueryRow(t.Context(), `SELECT pool_id FROM nodes WHERE id = $1`, node).Scan(&pool); err != nil {
		t.Fatal(err)
	}
	return pool
}

// idsWhere returns the nodes of ids matching cond (a condition on nodes), sorted.
func idsWhere(t *testing.T, db *pgxpool.Pool, ids []string, cond string) []string {
	t.Helper()
	rows, err := db.Query(t.Context(), `SELECT id FROM nodes WHERE id = ANY($1) AND `+cond+` ORDER BY id`, ids)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func generations(t *testing.T, db *pgxpool.Pool, ids []string) map[string]int64 {
	t.Helper()
	rows, err := db.Query(t.Context(), `SELECT id, generation FROM nodes WHERE id = ANY($1)`, ids)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]int64{}
	for rows.Next() {
		var id string
		var g int64
		if err := rows.Scan(&id, &g); err != nil {
			t.Fatal(err)
		}
		out[id] = g
	}
	return out
}

func rolloutNodes(t *testing.T, db *pgxpool.Pool, rollout, cond string) []string {
	t.Helper()
	rows, err := db.Query(t.Context(), `SELECT node_id FROM rollout_nodes WHERE rollout_id = $1 AND `+cond+` ORDER BY node_id`, rollout)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestRolloutEndToEnd rolls a pool settings change out over simulated
// nodes with the real daemons, gateway, nodespec controller and rollout
// job.
func TestRolloutEndToEnd(t *testing.T) {
	t.Parallel()
	dbURL := pgtest.NewDB(t)
	db, err := pgxpool.New(t.Context(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ns := natstest.New(t)
	env := lifecycleEnv(t, dbURL, ns.URL())
	fast := func(c *sim.Config) { c.HealthCheckInterval = 100 * time.Millisecond }

	t.Run("100 nodes in 10 % batches with a bake: only released batches change", func(t *testing.T) {
		f := simFleet(t, env, db, "roll100", 100, fast)
		ids := f.Nodes()
		pool := poolOf(t, db, ids[0])
		batches := make([]map[string]any, 10)
		for i := range batches {
			batches[i] = map[string]any{"percent": 10}
		}
		r := createRollout(t, env, pool, map[string]any{"batches": batches, "bake": "0.3s"}, nil)
		seen := map[int]bool{} // the batches seen running, their nodes the only ones changed
		poll.Until(t, 3*time.Minute, "the rollout succeeded", func() bool {
			// One snapshot: the nodes with the new content, the released
			// ones and the current batch.
			tx, err := db.BeginTx(t.Context(), pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback(t.Context()) }()
			var state string
			var current int
			if err := tx.QueryRow(t.Context(), `SELECT state, current_batch FROM rollouts WHERE id = $1`, r.ID).Scan(&state, &current); err != nil {
				t.Fatal(err)
			}
			var changed, strays, beyond int
			err = tx.QueryRow(t.Context(), `SELECT
				count(*) FILTER (WHERE `+newContent+`),
				count(*) FILTER (WHERE `+newContent+` AND NOT EXISTS (SELECT 1 FROM rollout_nodes rn
					WHERE rn.rollout_id = $2 AND rn.node_id = nodes.id AND rn.state IN ('updating', 'healthy'))),
				(SELECT count(*) FROM rollout_nodes rn WHERE rn.rollout_id = $2 AND rn.state <> 'waiting' AND rn.batch > $3)
				FROM nodes WHERE id = ANY($1)`, ids, r.ID, current).Scan(&changed, &strays, &beyond)
			if err != nil {
				t.Fatal(err)
			}
			if state != "succeeded" {
				if strays > 0 || beyond > 0 {
					t.Fatalf("batch %d: %d nodes have the new content outside a released batch, %d released beyond the current batch", current, strays, beyond)
				}
				if limit := (current + 1) * 10; changed > limit {
					t.Fatalf("batch %d: %d nodes changed, at most %d may", current, changed, limit)
				}
				seen[current] = true
			}
			return state == "succeeded"
		})
		if len(seen) < 5 {
			t.Fatalf("saw only batches %v running", seen)
		}
		got := getRollout(t, env, r.ID)
		if len(got.Batches) != 10 || len(got.FailedNodes) != 0 || len(got.SkippedNodes) != 0 {
			t.Fatalf("finished rollout %+v", got)
		}
		for _, b := range got.Batches {
			if b.Nodes != 10 || b.Healthy != 10 {
				t.Fatalf("batch %+v", b)
			}
		}
		poll.Until(t, time.Minute, "every node converged on the new content", func() bool {
			return len(idsWhere(t, db, ids, newContent+` AND observed_generation = generation`)) == 100
		})
		var health string
		if err := db.QueryRow(t.Context(), `SELECT health->>'maxGpuTemperatureCelsius' FROM pools WHERE id = $1`, pool).Scan(&health); err != nil || health != "95" {
			t.Fatalf("pool health after success: %q %v", health, err)
		}
		var released int
		_ = db.QueryRow(t.Context(), `SELECT count(*) FROM outbox WHERE type = 'rollout.batch_released' AND resource_id = $1`, r.ID).Scan(&released)
		if released < 10 || !slices.Contains(eventTypes(t, db, r.ID), "rollout.succeeded") {
			t.Fatalf("events of %s: %v", r.ID, eventTypes(t, db, r.ID))
		}
	})

	t.Run("XID 79 in the first batch pauses at the threshold; rollback restores exactly the touched nodes", func(t *testing.T) {
		f := simFleet(t, env, db, "rollfault", 10, fast)
		ids := f.Nodes()
		pool := poolOf(t, db, ids[0])
		before := generations(t, db, ids)
		r := createRollout(t, env, pool, map[string]any{"batches": []any{map[string]any{"percent": 50}}, "bake": "3600s"},
			map[string]any{"failureThreshold": map[string]any{"count": 2}})
		poll.Until(t, time.Minute, "the first batch healthy", func() bool {
			return len(rolloutNodes(t, db, r.ID, `batch = 0 AND state = 'healthy'`)) == 5
		})
		first := rolloutNodes(t, db, r.ID, `batch = 0`)
		faulty := first[:2]
		for _, n := range faulty {
			if err := f.Faults(slices.Index(ids, n)).Inject(0, inventory.Fault{XIDs: []uint32{79}}); err != nil {
				t.Fatal(err)
			}
		}
		poll.Until(t, time.Minute, "the rollout paused at its threshold", func() bool { return getRollout(t, env, r.ID).State == "paused" })
		got := getRollout(t, env, r.ID)
		if !slices.Equal(got.FailedNodes, faulty) {
			t.Fatalf("failed nodes %v, faults injected into %v", got.FailedNodes, faulty)
		}
		for _, n := range faulty {
			if !strings.Contains(got.Message, n) {
				t.Fatalf("pause message %q does not name %s", got.Message, n)
			}
		}
		if len(rolloutNodes(t, db, r.ID, `batch > 0 AND state <> 'waiting'`)) != 0 {
			t.Fatal("a later batch was released")
		}
		for _, n := range faulty {
			if err := f.Faults(slices.Index(ids, n)).ClearAll(); err != nil {
				t.Fatal(err)
			}
		}

		rb := rolloutAction(t, env, "rollback", r.ID)
		if rb.State != "rolled-back" {
			t.Fatalf("rollback answered %+v", rb)
		}
		poll.Until(t, time.Minute, "the touched nodes back on their previous content", func() bool {
			return len(idsWhere(t, db, first, `NOT `+newContent+` AND observed_generation = generation`)) == len(first)
		})
		if changed := idsWhere(t, db, ids, newContent); len(changed) != 0 {
			t.Fatalf("nodes still on the new content: %v", changed)
		}
		after := generations(t, db, ids)
		for _, n := range ids {
			touched := slices.Contains(first, n)
			if moved := after[n] != before[n]; moved != touched {
				t.Errorf("node %s: touched %v, generation %d -> %d", n, touched, before[n], after[n])
			}
		}
	})

	t.Run("a node unhealthy before the rollout is skipped, not counted", func(t *testing.T) {
		f := simFleet(t, env, db, "rollskip", 4, fast)
		ids := f.Nodes()
		pool := poolOf(t, db, ids[0])
		sick := ids[1]
		// Its daemon stops: Ready goes Unknown after nodes.notReadyAfter.
		f.Halt(1)
		poll.Until(t, time.Minute, "the node not ready", func() bool {
			return len(idsWhere(t, db, []string{sick}, `ready <> 'True'`)) == 1
		})
		r := createRollout(t, env, pool, map[string]any{"batches": []any{map[string]any{"count": 2}}}, nil)
		poll.Until(t, time.Minute, "the rollout succeeded", func() bool { return getRollout(t, env, r.ID).State == "succeeded" })
		got := getRollout(t, env, r.ID)
		if !slices.Equal(got.SkippedNodes, []string{sick}) || len(got.FailedNodes) != 0 {
			t.Fatalf("skipped %v failed %v", got.SkippedNodes, got.FailedNodes)
		}
		if !slices.Contains(eventTypes(t, db, r.ID), "rollout.node_skipped") {
			t.Fatalf("events %v", eventTypes(t, db, r.ID))
		}
		f.Resume(1)
	})

	t.Run("the budget counts drained and quarantined nodes", func(t *testing.T) {
		f := simFleet(t, env, db, "rollbudget", 5, fast)
		ids := f.Nodes()
		pool := poolOf(t, db, ids[0])
		var out struct{ Node struct{ State string } }
		call(t, env, "nodes/drain", map[string]any{"tenantId": "root", "nodeId": ids[0], "deadlineSeconds": 1, "reason": "e2e"}, &out)
		// A failed row remapper under a running process: gpu.reset refuses
		// the GPU, so it stays quarantined (the simulated ladder's reset
		// mends an idle GPU at once).
		if err := f.Faults(1).Inject(0, inventory.Fault{RowRemapFailed: true, ComputePIDs: []uint32{4242}}); err != nil {
			t.Fatal(err)
		}
		poll.Until(t, time.Minute, "one node drained, one quarantined", func() bool {
			return len(idsWhere(t, db, ids[:2], `(state = 'drained' OR EXISTS (SELECT 1 FROM devices d WHERE d.node_id = nodes.id AND d.quarantined_at IS NOT NULL))`)) == 2
		})
		r := createRollout(t, env, pool, map[string]any{"batches": []any{map[string]any{"percent": 100}}, "maxUnavailable": 2}, nil)
		poll.Until(t, time.Minute, "the rollout waits for the budget", func() bool {
			return strings.Contains(getRollout(t, env, r.ID).Message, "disruption budget")
		})
		if n := rolloutNodes(t, db, r.ID, `state NOT IN ('waiting', 'skipped')`); len(n) != 0 {
			t.Fatalf("released with the budget spent: %v", n)
		}
		call(t, env, "nodes/undrain", map[string]any{"tenantId": "root", "nodeId": ids[0]}, &out)
		// One node of budget: the three healthy nodes go one at a time.
		poll.Until(t, 2*time.Minute, "the rollout succeeded", func() bool {
			if n := rolloutNodes(t, db, r.ID, `state = 'updating'`); len(n) > 1 {
				t.Fatalf("%d nodes updating at once with one node of budget: %v", len(n), n)
			}
			return getRollout(t, env, r.ID).State == "succeeded"
		})
		_ = f.Faults(1).ClearAll()
	})

	t.Run("pause, resume, cancel", func(t *testing.T) {
		f := simFleet(t, env, db, "rollpause", 4, fast)
		ids := f.Nodes()
		pool := poolOf(t, db, ids[0])
		r := createRollout(t, env, pool, map[string]any{"batches": []any{map[string]any{"count": 2}}, "bake": "3600s"}, nil)
		poll.Until(t, time.Minute, "the first batch healthy", func() bool {
			return len(rolloutNodes(t, db, r.ID, `batch = 0 AND state = 'healthy'`)) == 2
		})
		if got := rolloutAction(t, env, "pause", r.ID); got.State != "paused" {
			t.Fatalf("pause answered %+v", got)
		}
		// nodes.get says which rollout and batch a node is in.
		for batch, want := range map[int]bool{0: true, 1: false} {
			node := rolloutNodes(t, db, r.ID, fmt.Sprintf("batch = %d", batch))[0]
			var got struct {
				Node struct {
					RolloutID       string `json:"rolloutId"`
					RolloutBatch    int    `json:"rolloutBatch"`
					RolloutReleased bool   `json:"rolloutReleased"`
				}
			}
			call(t, env, "nodes/get", map[string]any{"tenantId": "root", "nodeId": node}, &got)
			if got.Node.RolloutID != r.ID || got.Node.RolloutBatch != batch || got.Node.RolloutReleased != want {
				t.Fatalf("nodes.get of %s (batch %d): %+v", node, batch, got.Node)
			}
		}
		if status, body := post(t, env, "pools/update", map[string]any{"tenantId": "root", "poolId": pool, "updateMask": "health", "health": map[string]any{}}); status != 409 {
			t.Fatalf("pools.update during a rollout: %d %s", status, body)
		}
		if got := rolloutAction(t, env, "resume", r.ID); got.State != "progressing" {
			t.Fatalf("resume answered %+v", got)
		}
		if status, body := post(t, env, "rollouts/resume", map[string]any{"tenantId": "root", "rolloutId": r.ID}); status != 409 {
			t.Fatalf("resume of a progressing rollout: %d %s", status, body)
		}
		first := rolloutNodes(t, db, r.ID, `batch = 0`)
		if got := rolloutAction(t, env, "cancel", r.ID); got.State != "cancelled" {
			t.Fatalf("cancel answered %+v", got)
		}
		poll.Until(t, time.Minute, "the first batch back on the pool's settings", func() bool {
			return len(idsWhere(t, db, first, `NOT `+newContent+` AND observed_generation = generation`)) == 2
		})
		if status, _ := post(t, env, "rollouts/pause", map[string]any{"tenantId": "root", "rolloutId": r.ID}); status != 409 {
			t.Fatalf("pause of a cancelled rollout: %d", status)
		}
	})

	t.Run("NATS stopped, the rollout still progresses", func(t *testing.T) {
		f := simFleet(t, env, db, "rollnats", 4, fast)
		ids := f.Nodes()
		pool := poolOf(t, db, ids[0])
		ns.Stop()
		defer ns.Restart()
		r := createRollout(t, env, pool, map[string]any{"batches": []any{map[string]any{"count": 2}}, "bake": "0.2s"}, nil)
		poll.Until(t, 2*time.Minute, "the rollout succeeded with the bus down", func() bool { return getRollout(t, env, r.ID).State == "succeeded" })
		poll.Until(t, time.Minute, "every node converged on the new content", func() bool {
			return len(idsWhere(t, db, ids, newContent+` AND observed_generation = generation`)) == len(ids)
		})

		// Rolling back a succeeded rollout puts the pool's previous
		// settings back, and every node follows.
		if got := rolloutAction(t, env, "rollback", r.ID); got.State != "rolled-back" {
			t.Fatalf("rollback answered %+v", got)
		}
		var health string
		if err := db.QueryRow(t.Context(), `SELECT health::text FROM pools WHERE id = $1`, pool).Scan(&health); err != nil || health != "{}" {
			t.Fatalf("pool health after rollback: %s %v", health, err)
		}
		poll.Until(t, time.Minute, "every node back on the previous content", func() bool {
			return len(idsWhere(t, db, ids, `NOT `+newContent+` AND observed_generation = generation`)) == len(ids)
		})
	})
}

// TestRolloutValidation: every field bounded, each refusal naming it.
func TestRolloutValidation(t *testing.T) {
	t.Parallel()
	dbURL := pgtest.NewDB(t)
	ns := natstest.New(t)
	env := lifecycleEnv(t, dbURL, ns.URL())
	var pool struct{ Pool struct{ ID string } }
	call(t, env, "pools/create", map[string]any{"tenantId": "root", "name": "rollval", "class": "gpu"}, &pool)
	ok := map[string]any{"batches": []any{map[string]any{"percent": 50}}}
	health := map[string]any{"updateMask": "health", "health": rolloutHealth}
	for _, c := range []struct {
		name        string
		change      any
		strategy    any
		extra       map[string]any
		status      int
		code, field string
	}{
		{"no mask", map[string]any{}, ok, nil, 400, "INVALID_INPUT", "change.updateMask"},
		{"unknown section", map[string]any{"updateMask": "vps"}, ok, nil, 400, "INVALID_INPUT", "change.updateMask"},
		{"node-level patch", map[string]any{"updateMask": "labels"}, ok, nil, 400, "UNSUPPORTED", "change.updateMask"},
		{"bad agent", map[string]any{"updateMask": "agent", "agent": map[string]any{"releaseManifest": "{}"}}, ok, nil, 400, "INVALID_INPUT", "change.agent.releaseManifest"},
		{"bad site", map[string]any{"updateMask": "site", "site": map[string]any{"logLevel": "loud"}}, ok, nil, 400, "INVALID_INPUT", "change.site.logLevel"},
		{"bad runtime", map[string]any{"updateMask": "runtime", "runtime": map[string]any{"nope": 1}}, ok, nil, 400, "INVALID_INPUT", "change.runtime"},
		{"no batches", health, map[string]any{}, nil, 400, "INVALID_INPUT", "strategy.batches"},
		{"both sizes", health, map[string]any{"batches": []any{map[string]any{"percent": 5, "count": 1}}}, nil, 400, "INVALID_INPUT", "strategy.batches"},
		{"percent over 100", health, map[string]any{"batches": []any{map[string]any{"percent": 101}}}, nil, 400, "INVALID_INPUT", "strategy.batches.percent"},
		{"bake over a day", health, map[string]any{"batches": []any{map[string]any{"percent": 5}}, "bake": "90000s"}, nil, 400, "INVALID_INPUT", "strategy.bake"},
		{"negative budget", health, map[string]any{"batches": []any{map[string]any{"percent": 5}}, "maxUnavailable": -1}, nil, 400, "INVALID_INPUT", "strategy.maxUnavailable"},
		{"failure threshold", health, ok, map[string]any{"failureThreshold": map[string]any{"percent": 200}}, 400, "INVALID_INPUT", "failureThreshold.percent"},
		{"success threshold", health, ok, map[string]any{"successThreshold": map[string]any{"count": -3}}, 400, "INVALID_INPUT", "successThreshold.count"},
		{"bad selector", health, ok, map[string]any{"selector": map[string]any{"no spaces": "r1"}}, 400, "INVALID_INPUT", "selector"},
		{"gate command", health, ok, map[string]any{"gates": []any{map[string]any{"command": "node.reboot"}}}, 400, "INVALID_INPUT", "gates[0].command"},
		{"gate level", health, ok, map[string]any{"gates": []any{map[string]any{"command": "diag.nvml", "level": "forever"}}}, 400, "INVALID_INPUT", "gates[0].level"},
		{"gate timeout", health, ok, map[string]any{"gates": []any{map[string]any{"command": "diag.nvml", "timeout": "7200s"}}}, 400, "INVALID_INPUT", "gates[0].timeout"},
		{"too many gates", health, ok, map[string]any{"gates": []any{map[string]any{}, map[string]any{}, map[string]any{}, map[string]any{}, map[string]any{}}}, 400, "INVALID_INPUT", "gates"},
		{"bad mig", map[string]any{"updateMask": "mig", "mig": map[string]any{"layouts": []any{map[string]any{"name": "x", "gpuSelector": map[string]any{"indices": []any{0}}, "profiles": []any{"9g.999gb"}}}}}, ok, nil, 400, "INVALID_INPUT", "mig.layouts[0].profiles"},
	} {
		t.Run(c.name, func(t *testing.T) {
			req := map[string]any{"tenantId": "root", "poolId": pool.Pool.ID, "change": c.change, "strategy": c.strategy}
			for k, v := range c.extra {
				req[k] = v
			}
			status, body := post(t, env, "rollouts/create", req)
			want := fmt.Sprintf(`"code":%q`, c.code)
			if status != c.status || !strings.Contains(string(body), want) || !strings.Contains(string(body), fmt.Sprintf(`"field":%q`, c.field)) {
				t.Fatalf("got %d %s, want %d %s on %s", status, body, c.status, c.code, c.field)
			}
		})
	}
	// One active rollout per pool.
	first := createRollout(t, env, pool.Pool.ID, ok, nil)
	status, body := post(t, env, "rollouts/create", map[string]any{"tenantId": "root", "poolId": pool.Pool.ID,
		"change": health, "strategy": ok, "idempotencyKey": "second"})
	if status != 409 || !strings.Contains(string(body), `"field":"poolId"`) {
		t.Fatalf("second active rollout: %d %s", status, body)
	}
	if got := getRollout(t, env, first.ID); got.PoolID != pool.Pool.ID {
		t.Fatalf("get %+v", got)
	}
}
