package dev_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/agent/sim"

	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
)

// TestAcceptanceChecksWithRealDaemons joins simulated daemons to a pool that
// requires diag.nvml before adoption: the lifecycle queues the check, the
// daemon runs it on its (mock) GPUs, and only then is the node adopted and
// given generation 1. A daemon that refuses the check stays out of service
// (failed) with the reason in nodes.get.
func TestAcceptanceChecksWithRealDaemons(t *testing.T) {
	t.Parallel()
	ns := natstest.New(t)
	env := chaosEnv(t, pgtest.NewDB(t), t.TempDir(), freePort(t), ns.URL())
	var pool struct{ Pool struct{ ID string } }
	call(t, env, "pools/create", map[string]any{"tenantId": "root", "name": "checked", "class": "gpu", "acceptance": []string{"diag.nvml"}}, &pool)

	pub, keyID, roots := joinMaterial(t, env)
	start := func(prefix string, deny []string) string {
		var tok struct{ Token string }
		call(t, env, "joinTokens/create", map[string]any{"tenantId": "root", "poolId": pool.Pool.ID, "uses": 1}, &tok)
		f, err := sim.Start(t.Context(), sim.Config{
			Gateway: env.App.GatewayAddr(), RootCAs: roots, Token: tok.Token,
			JoinserviceKey: pub, JoinserviceKeyID: keyID, Root: t.TempDir(), Prefix: prefix,
			CommandKey: env.CommandKey, DenyKinds: deny,
		}, 1)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(f.Stop)
		return f.Nodes()[0]
	}
	good := start("good", nil)
	refuses := start("refuses", []string{"diag.nvml"})

	type node struct {
		State              string
		Generation         string
		ObservedGeneration string
		Conditions         []struct {
			Type, Reason string
			Status       bool
		}
	}
	wait := func(id, state string) node {
		t.Helper()
		var n node
		poll.UntilNil(t, 30*time.Second, "node "+id+" to be "+state, func() error {
			var got struct{ Node node }
			call(t, env, "nodes/get", map[string]any{"tenantId": "root", "nodeId": id}, &got)
			if n = got.Node; n.State == state {
				return nil
			}
			return fmt.Errorf("node %s is %+v", id, n)
		})
		return n
	}
	accepted := func(n node) (bool, string, bool) {
		for _, c := range n.Conditions {
			if c.Type == "AcceptancePassed" {
				return c.Status, c.Reason, true
			}
		}
		return false, "", false
	}

	n := wait(good, "adopted")
	if ok, reason, found := accepted(n); !found || !ok {
		t.Fatalf("adopted without passing: %v %q %v", ok, reason, found)
	}
	var cmds struct {
		Commands []struct{ Kind, State string }
	}
	call(t, env, "commands/list", map[string]any{"tenantId": "root", "nodeId": good}, &cmds)
	if len(cmds.Commands) != 1 || cmds.Commands[0].Kind != "diag.nvml" || cmds.Commands[0].State != "succeeded" {
		t.Fatalf("the acceptance check: %+v", cmds.Commands)
	}

	n = wait(refuses, "failed")
	ok, reason, found := accepted(n)
	if !found || ok || !strings.Contains(reason, "UNSUPPORTED") {
		t.Fatalf("the failed check's reason is not visible: %v %q %v", ok, reason, found)
	}
	if n.Generation != "" && n.Generation != "0" {
		t.Fatalf("a node that failed acceptance got desired state: generation %s", n.Generation)
	}
}
