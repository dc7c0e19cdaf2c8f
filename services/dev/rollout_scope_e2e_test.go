package dev_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/agent/command"
	"github.com/bettercompute/bettercompute/agent/sim"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/dev"
)

// rolloutWith creates a rollout of req (tenant root, idempotency key key)
// and returns it pending.
func rolloutWith(t *testing.T, env *dev.Env, key string, req map[string]any) rolloutJSON {
	t.Helper()
	req["tenantId"], req["idempotencyKey"] = "root", key
	var out struct{ Rollout rolloutJSON }
	call(t, env, "rollouts/create", req, &out)
	if out.Rollout.State != "pending" {
		t.Fatalf("created rollout %+v", out.Rollout)
	}
	return out.Rollout
}

// waitRollout waits for rollout id to reach state.
func waitRollout(t *testing.T, env *dev.Env, id, state string, within time.Duration) rolloutJSON {
	t.Helper()
	var got rolloutJSON
	poll.Until(t, within, "rollout "+id+" "+state, func() bool {
		got = getRollout(t, env, id)
		return got.State == state
	})
	return got
}

// unchanged fails when a node of ids has another generation than before.
func unchanged(t *testing.T, db *pgxpool.Pool, ids []string, before map[string]int64) {
	t.Helper()
	now := generations(t, db, ids)
	for _, n := range ids {
		if now[n] != before[n] {
			t.Fatalf("node %s outside the rollout changed: generation %d -> %d", n, before[n], now[n])
		}
	}
}

// migProfiles is the SQL condition "GPU 0's entry of the node's mig
// section has profiles" (a JSON array; the layouts select every GPU by
// model, so GPU 0 stands for them).
func migProfiles(profiles string) string {
	return `coalesce(spec->'mig'->'gpus'->0->'profiles', '[]'::jsonb) = '` + profiles + `'::jsonb`
}

// TestRolloutScope: selectors, gates and MIG layouts rolled out over
// simulated nodes with the real daemons, gateway, nodespec controller,
// capacity.mig contributor and rollout job.
func TestRolloutScope(t *testing.T) {
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
	health := map[string]any{"updateMask": "health", "health": rolloutHealth}

	t.Run("NATS stopped, a selector changes only matching nodes, which keep the change after success", func(t *testing.T) {
		f := simFleet(t, env, db, "rollsel", 6, fast)
		ids := f.Nodes()
		pool := poolOf(t, db, ids[0])
		var matching, others []string
		for i, n := range ids {
			if i%2 == 0 {
				matching = append(matching, n)
				var upd struct{ Node struct{ ID string } }
				call(t, env, "nodes/update", map[string]any{"tenantId": "root", "nodeId": n, "updateMask": "labels",
					"labels": map[string]string{"tier": "canary"}}, &upd)
			} else {
				others = append(others, n)
			}
		}
		slices.Sort(matching)
		poll.Until(t, time.Minute, "the labels converged", func() bool {
			return len(idsWhere(t, db, matching, `spec->'identity'->'labels'->>'tier' = 'canary' AND observed_generation = generation`)) == len(matching)
		})
		ns.Stop()
		defer ns.Restart()
		before := generations(t, db, ids)
		r := rolloutWith(t, env, "sel", map[string]any{"poolId": pool, "selector": map[string]string{"tier": "canary"},
			"change": health, "strategy": map[string]any{"batches": []any{map[string]any{"count": 1}}, "bake": "0.2s"}})
		poll.Until(t, 2*time.Minute, "the selector rollout succeeded", func() bool {
			if changed := idsWhere(t, db, others, newContent); len(changed) != 0 {
				t.Fatalf("nodes outside the selector have the new content: %v", changed)
			}
			unchanged(t, db, others, before)
			return getRollout(t, env, r.ID).State == "succeeded"
		})
		got := getRollout(t, env, r.ID)
		if len(got.Batches) != 2 || got.Batches[0].Nodes+got.Batches[1].Nodes != len(matching) {
			t.Fatalf("batches of the selector rollout: %+v", got.Batches)
		}
		planned := rolloutNodes(t, db, r.ID, `true`)
		if !slices.Equal(planned, matching) {
			t.Fatalf("planned %v, matching %v", planned, matching)
		}
		// After success: the matching nodes keep the change (their layer),
		// the pool's settings are unchanged, the others never changed.
		poll.Until(t, time.Minute, "the matching nodes converged on the change", func() bool {
			return len(idsWhere(t, db, matching, newContent+` AND observed_generation = generation`)) == len(matching)
		})
		var poolHealth string
		if err := db.QueryRow(t.Context(), `SELECT health::text FROM pools WHERE id = $1`, pool).Scan(&poolHealth); err != nil || poolHealth != "{}" {
			t.Fatalf("pool health after a selector rollout: %s %v", poolHealth, err)
		}
		// A later pools.update of another section recomputes every node:
		// the matching ones still have the change.
		call(t, env, "pools/update", map[string]any{"tenantId": "root", "poolId": pool, "updateMask": "site", "site": map[string]any{"logLevel": "debug"}}, &struct{}{})
		poll.Until(t, time.Minute, "the site change converged", func() bool {
			return len(idsWhere(t, db, ids, `spec->'site'->>'logLevel' = 'debug' AND observed_generation = generation`)) == len(ids)
		})
		if have := idsWhere(t, db, ids, newContent); !slices.Equal(have, matching) {
			t.Fatalf("after pools.update the change is on %v, want %v", have, matching)
		}
		before = generations(t, db, ids)

		// Rolling it back takes the layer away from the matching nodes only.
		if rb := rolloutAction(t, env, "rollback", r.ID); rb.State != "rolled-back" {
			t.Fatalf("rollback answered %+v", rb)
		}
		poll.Until(t, time.Minute, "the matching nodes back on the pool's settings", func() bool {
			return len(idsWhere(t, db, matching, `NOT `+newContent+` AND observed_generation = generation`)) == len(matching)
		})
		unchanged(t, db, others, before)
	})

	t.Run("NATS stopped, a gate runs diag.nvml on each released node before it counts healthy", func(t *testing.T) {
		f := simFleet(t, env, db, "rollgate", 4, fast)
		ids := f.Nodes()
		pool := poolOf(t, db, ids[0])
		ns.Stop()
		defer ns.Restart()
		r := rolloutWith(t, env, "gate", map[string]any{"poolId": pool, "change": health,
			"strategy": map[string]any{"batches": []any{map[string]any{"count": 2}}, "bake": "0.2s"},
			"gates":    []any{map[string]any{"command": "diag.nvml", "level": "quick", "timeout": "120s"}}})
		poll.Until(t, 2*time.Minute, "the gated rollout succeeded with the bus down", func() bool {
			// A node counts healthy only once its gate succeeded.
			var early int
			if err := db.QueryRow(t.Context(), `SELECT count(*) FROM rollout_nodes rn WHERE rn.rollout_id = $1 AND rn.state = 'healthy'
				AND NOT EXISTS (SELECT 1 FROM commands c WHERE c.id = ANY(rn.gate_commands) AND c.state = 'succeeded')`, r.ID).Scan(&early); err != nil {
				t.Fatal(err)
			}
			if early > 0 {
				t.Fatalf("%d nodes healthy before their gate passed", early)
			}
			return getRollout(t, env, r.ID).State == "succeeded"
		})
		// One diag.nvml per node, presupposing the generation that carries
		// the change (the node's generation now: success moved the change
		// into the pool's settings without a new one).
		rows, err := db.Query(t.Context(), `SELECT n.id, c.state, c.min_generation = n.generation
			FROM nodes n JOIN commands c ON c.node_id = n.id AND c.kind = 'diag.nvml' AND c.created_by = 'rollout'
			WHERE n.id = ANY($1) ORDER BY n.id`, ids)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		var gated []string
		for rows.Next() {
			var id, state string
			var atGen bool
			if err := rows.Scan(&id, &state, &atGen); err != nil {
				t.Fatal(err)
			}
			if state != "succeeded" || !atGen {
				t.Fatalf("gate of %s: %s, at the change's generation %v", id, state, atGen)
			}
			gated = append(gated, id)
		}
		if slices.Sort(ids); !slices.Equal(gated, ids) {
			t.Fatalf("gated nodes %v, want each of %v once", gated, ids)
		}
	})

	t.Run("a failing gate counts towards the failure threshold", func(t *testing.T) {
		// Every daemon of this fleet fails diag.nvml (a GPU that fails its
		// diagnostics); nothing else is wrong with it.
		failing := func(c *sim.Config) {
			fast(c)
			c.Executors = map[string]command.Func{"diag.nvml": func(context.Context, *agentv1.CommandBody) (*agentv1.CommandResult, error) {
				return nil, errors.New("1 of 8 GPUs unhealthy: gpu 0: diagnostics failed")
			}}
		}
		f := simFleet(t, env, db, "rollgatefail", 4, failing)
		ids := f.Nodes()
		pool := poolOf(t, db, ids[0])
		r := rolloutWith(t, env, "gatefail", map[string]any{"poolId": pool, "change": health,
			"strategy":         map[string]any{"batches": []any{map[string]any{"count": 2}}},
			"failureThreshold": map[string]any{"count": 2},
			"gates":            []any{map[string]any{"command": "diag.nvml"}}})
		got := waitRollout(t, env, r.ID, "paused", 2*time.Minute)
		first := rolloutNodes(t, db, r.ID, `batch = 0`)
		if !slices.Equal(got.FailedNodes, first) {
			t.Fatalf("failed nodes %v, first batch %v", got.FailedNodes, first)
		}
		for _, n := range first {
			if !strings.Contains(got.Message, n) {
				t.Fatalf("pause message %q does not name %s", got.Message, n)
			}
		}
		if reasons := rolloutNodes(t, db, r.ID, `reason LIKE 'gate diag.nvml%failed%'`); !slices.Equal(reasons, first) {
			t.Fatalf("nodes failed by their gate: %v, want %v", reasons, first)
		}
		if n := rolloutNodes(t, db, r.ID, `batch > 0 AND state <> 'waiting'`); len(n) != 0 {
			t.Fatalf("a later batch was released: %v", n)
		}
		if got := rolloutAction(t, env, "cancel", r.ID); got.State != "cancelled" {
			t.Fatalf("cancel answered %+v", got)
		}
	})

	t.Run("MIG layouts roll out in batches; rollback restores the previous ones on the touched nodes", func(t *testing.T) {
		f := simFleet(t, env, db, "rollmig", 4, fast)
		ids := f.Nodes()
		pool := poolOf(t, db, ids[0])
		whole := map[string]any{"layouts": []any{map[string]any{"name": "whole", "gpuSelector": map[string]any{"model": "H200 141GB"},
			"profiles": []any{"7g.141gb"}}}}
		halves := map[string]any{"layouts": []any{map[string]any{"name": "halves", "gpuSelector": map[string]any{"model": "H200 141GB"},
			"profiles": []any{"3g.71gb", "3g.71gb"}}}}
		const wholeP, halvesP = `["7g.141gb"]`, `["3g.71gb", "3g.71gb"]`
		call(t, env, "pools/update", map[string]any{"tenantId": "root", "poolId": pool, "updateMask": "mig", "mig": whole}, &struct{}{})
		poll.Until(t, time.Minute, "every node laid out whole", func() bool {
			return len(idsWhere(t, db, ids, migProfiles(wholeP)+` AND observed_generation = generation`)) == len(ids)
		})
		before := generations(t, db, ids)
		mig := map[string]any{"updateMask": "mig", "mig": halves}
		r := rolloutWith(t, env, "mig1", map[string]any{"poolId": pool, "change": mig,
			"strategy": map[string]any{"batches": []any{map[string]any{"count": 2}}, "bake": "3600s"}})
		poll.Until(t, 2*time.Minute, "the first batch healthy on the new layouts", func() bool {
			return len(rolloutNodes(t, db, r.ID, `batch = 0 AND state = 'healthy'`)) == 2
		})
		first := rolloutNodes(t, db, r.ID, `batch = 0`)
		rest := rolloutNodes(t, db, r.ID, `batch = 1`)
		if have := idsWhere(t, db, first, migProfiles(halvesP)+` AND observed_generation = generation`); !slices.Equal(have, first) {
			t.Fatalf("first batch %v, on the new layouts and converged: %v", first, have)
		}
		if have := idsWhere(t, db, rest, migProfiles(wholeP)); !slices.Equal(have, rest) {
			t.Fatalf("the rest %v, on the old layouts: %v", rest, have)
		}
		unchanged(t, db, rest, before)
		if status, body := post(t, env, "pools/update", map[string]any{"tenantId": "root", "poolId": pool, "updateMask": "mig", "mig": whole}); status != 409 {
			t.Fatalf("pools.update of mig during a rollout of mig: %d %s", status, body)
		}

		if rb := rolloutAction(t, env, "rollback", r.ID); rb.State != "rolled-back" {
			t.Fatalf("rollback answered %+v", rb)
		}
		poll.Until(t, time.Minute, "the first batch back on the previous layouts", func() bool {
			return len(idsWhere(t, db, first, migProfiles(wholeP)+` AND observed_generation = generation`)) == len(first)
		})
		unchanged(t, db, rest, before)

		// Rolled out to the end (NATS stopped), the layouts become the
		// pool's.
		ns.Stop()
		defer ns.Restart()
		r = rolloutWith(t, env, "mig2", map[string]any{"poolId": pool, "change": mig,
			"strategy": map[string]any{"batches": []any{map[string]any{"count": 2}}, "bake": "0.2s"}})
		waitRollout(t, env, r.ID, "succeeded", 2*time.Minute)
		var profiles string
		if err := db.QueryRow(t.Context(), `SELECT to_jsonb(profiles)::text FROM mig_layouts WHERE pool_id = $1`, pool).Scan(&profiles); err != nil || profiles != halvesP {
			t.Fatalf("the pool's layouts after success: %s %v", profiles, err)
		}
		poll.Until(t, time.Minute, "every node on the new layouts", func() bool {
			return len(idsWhere(t, db, ids, migProfiles(halvesP)+` AND observed_generation = generation`)) == len(ids)
		})

		// With a selector, the layouts stay on the selected nodes after
		// success; the pool's and the others' do not change.
		var upd struct{ Node struct{ ID string } }
		call(t, env, "nodes/update", map[string]any{"tenantId": "root", "nodeId": ids[0], "updateMask": "labels",
			"labels": map[string]string{"tier": "canary"}}, &upd)
		poll.Until(t, time.Minute, "the label converged", func() bool {
			return len(idsWhere(t, db, ids[:1], `spec->'identity'->'labels'->>'tier' = 'canary' AND observed_generation = generation`)) == 1
		})
		before = generations(t, db, ids)
		r = rolloutWith(t, env, "mig3", map[string]any{"poolId": pool, "selector": map[string]string{"tier": "canary"},
			"change":   map[string]any{"updateMask": "mig", "mig": whole},
			"strategy": map[string]any{"batches": []any{map[string]any{"count": 1}}}})
		waitRollout(t, env, r.ID, "succeeded", 2*time.Minute)
		poll.Until(t, time.Minute, "the selected node on its layouts", func() bool {
			return len(idsWhere(t, db, ids[:1], migProfiles(wholeP)+` AND observed_generation = generation`)) == 1
		})
		if err := db.QueryRow(t.Context(), `SELECT to_jsonb(profiles)::text FROM mig_layouts WHERE pool_id = $1`, pool).Scan(&profiles); err != nil || profiles != halvesP {
			t.Fatalf("the pool's layouts after a selector rollout: %s %v", profiles, err)
		}
		unchanged(t, db, ids[1:], before)
		if have := idsWhere(t, db, ids[1:], migProfiles(halvesP)); len(have) != len(ids)-1 {
			t.Fatalf("unselected nodes on the pool's layouts: %v of %v", have, ids[1:])
		}
	})
}
