package dev_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/dev"
)

// heldCommand starts a control plane with one hooked simulated node, queues
// a diag.nvml (level = name) through commands.run with minGeneration ahead
// of the node's generation by ahead and the deadline secs, and waits until
// the gateway has sent it and the daemon holds it: in flight, not
// accepted, not run. It returns the node's generation before.
func heldCommand(t *testing.T, name string, ahead int64, secs int) (*dev.Env, *pgxpool.Pool, *hooks, string, int64, cmdJSON) {
	t.Helper()
	env, db := commandEnv(t, "")
	t.Cleanup(func() { env.Stop(context.Background()) })
	h := newHooks()
	node := simFleet(t, env, db, name, 1, h.install).Nodes()[0]
	gen := nodeGeneration(t, db, node)

	var out struct{ Command cmdJSON }
	r := runReq(node, "diag.nvml", diagLevel(name), "mingen-"+name)
	r["minGeneration"], r["notAfterSeconds"] = gen+ahead, secs
	call(t, env, "commands/run", r, &out)
	c := out.Command
	if c.MinGeneration != strconv.FormatInt(gen+ahead, 10) {
		t.Fatalf("commands.run answered minGeneration %q, want %d", c.MinGeneration, gen+ahead)
	}
	poll.Until(t, 30*time.Second, "the command sent", func() bool { return dbCmd(t, db, node, c.ID).DispatchedAt != nil })
	if got := dbCmd(t, db, node, c.ID); got.State != commands.InFlight || got.AcceptedAt != nil || got.MinGeneration != gen+ahead || h.count(name) != 0 {
		t.Fatalf("held command: %s accepted %v min_generation %d runs %d", got.State, got.AcceptedAt, got.MinGeneration, h.count(name))
	}
	return env, db, h, node, gen, c
}

// TestMinGenerationAheadOfSpecEndsStaleGeneration: commands.run with a
// minGeneration the node's spec never reaches: the gateway sends it, the
// real (simulated) daemon holds it without running it, and at its
// not_after it ends failed STALE_GENERATION, never run.
func TestMinGenerationAheadOfSpecEndsStaleGeneration(t *testing.T) {
	t.Parallel()
	env, _, h, node, _, c := heldCommand(t, "stale", 5, 10)
	got := wantFinal(t, env, node, c.ID, "failed", "STALE_GENERATION")
	if got.Attempts != 1 || h.count("stale") != 0 {
		t.Fatalf("attempts %d, runs %d: a stale command must be sent once and never run", got.Attempts, h.count("stale"))
	}
}

// TestMinGenerationReachedInTimeRuns: commands.run with minGeneration one
// ahead of the node's spec is held by the daemon; a spec change (a label,
// through nodes.update) brings the node to that generation before
// not_after, and the command runs once and succeeds.
func TestMinGenerationReachedInTimeRuns(t *testing.T) {
	t.Parallel()
	env, db, h, node, gen, c := heldCommand(t, "reached", 1, 600)
	var upd struct{}
	call(t, env, "nodes/update", map[string]any{"tenantId": "root", "nodeId": node, "labels": map[string]string{"step": "min-generation"}, "updateMask": "labels"}, &upd)
	got := wantFinal(t, env, node, c.ID, "succeeded", "")
	if h.count("reached") != 1 || nodeGeneration(t, db, node) <= gen {
		t.Fatalf("runs %d, generation %d (was %d)", h.count("reached"), nodeGeneration(t, db, node), gen)
	}
	if got.Result["driverVersion"] != "reached" {
		t.Fatalf("result %v", got.Result)
	}
}
