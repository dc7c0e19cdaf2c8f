package dev_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/agent/converge"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
)

// TestDriftEndToEnd: real agents (mock DGX H200s) against the real control
// plane. A booked node's CDI spec edited by hand on one node is restored by its daemon,
// which reports the devices section "drifted: …"; the gateway wakes
// fleet.drift and the node is Drifted with that reason (nodes.get,
// nodes.list condition=Drifted, capacity.get); the daemon's next pass
// (here: a new desired state) reports the plain reason and it clears.
func TestDriftEndToEnd(t *testing.T) {
	t.Parallel()
	dbURL := pgtest.NewDB(t)
	db, err := pgxpool.New(t.Context(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ns := natstest.New(t)
	env := chaosEnv(t, dbURL, t.TempDir(), freePort(t), ns.URL())
	defer env.Stop(context.Background())
	poolID, agents := joinAgents(t, env, 2)
	waitSessions(t, db, 2, 1, time.Now().Add(-time.Minute), "the agents joining")
	waitConverged(t, db, 2, 1, "", "the agents applying generation 1")
	// A booking, so that the node has a CDI spec to edit.
	var created struct{ Reservation reservation }
	call(t, env, "reservations/create", map[string]any{"tenantId": "root", "poolId": poolID, "gpuCount": 2,
		"constraints": map[string]any{"sameNode": true}, "idempotencyKey": "drift-1"}, &created)
	waitState(t, env, created.Reservation.ID, "bound")
	var a *agentNode
	for _, x := range agents {
		if x.id == created.Reservation.Bookings[0].NodeID {
			a = x
		}
	}

	type cond struct {
		Type, Value, Reason string
		Status              bool
		Reasons             []string
	}
	drifted := func() (cond, bool) {
		var out struct{ Node struct{ Conditions []cond } }
		call(t, env, "nodes/get", map[string]any{"tenantId": "root", "nodeId": a.id}, &out)
		for _, c := range out.Node.Conditions {
			if c.Type == "Drifted" {
				return c, true
			}
		}
		return cond{}, false
	}
	listed := func() []string {
		var out struct{ Nodes []struct{ ID string } }
		call(t, env, "nodes/list", map[string]any{"tenantId": "root", "condition": "Drifted"}, &out)
		var ids []string
		for _, n := range out.Nodes {
			ids = append(ids, n.ID)
		}
		return ids
	}
	driftedNodes := func() int {
		var out struct{ DriftedNodes int }
		call(t, env, "capacity/get", map[string]any{"tenantId": "root", "poolId": poolID}, &out)
		return out.DriftedNodes
	}

	spec := filepath.Join(a.dir, converge.CDISpecFile)
	poll.UntilNil(t, 30*time.Second, "the node's CDI spec", func() error { _, err := os.Stat(spec); return err })
	if err := os.WriteFile(spec, []byte(`{"cdiVersion":"0.6.0","kind":"`+converge.CDIKind+`","devices":[]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	var c cond
	poll.UntilNil(t, 60*time.Second, "the node Drifted", func() error {
		var ok bool
		if c, ok = drifted(); ok && c.Status {
			return nil
		}
		return fmt.Errorf("Drifted %+v", c)
	})
	if c.Value != "True" || len(c.Reasons) != 1 || !strings.HasPrefix(c.Reasons[0], "section devices reports drifted: "+spec) {
		t.Fatalf("Drifted %+v", c)
	}
	if got := listed(); !slices.Equal(got, []string{a.id}) {
		t.Fatalf("condition=Drifted lists %v, want [%s]", got, a.id)
	}
	if n := driftedNodes(); n != 1 {
		t.Fatalf("capacity.get driftedNodes %d, want 1", n)
	}

	// A new desired state: the daemon's pass reports the plain reason.
	var upd map[string]any
	call(t, env, "nodes/update", map[string]any{"tenantId": "root", "nodeId": a.id, "labels": map[string]string{"rack": "r1"}, "updateMask": "labels"}, &upd)
	poll.UntilNil(t, 60*time.Second, "Drifted to clear", func() error {
		if c, ok := drifted(); ok && !c.Status {
			return nil
		}
		return fmt.Errorf("Drifted %+v", c)
	})
	if got := listed(); len(got) != 0 {
		t.Fatalf("condition=Drifted lists %v after clearing", got)
	}
	if n := driftedNodes(); n != 0 {
		t.Fatalf("capacity.get driftedNodes %d after clearing", n)
	}
	var events []string
	rows, err := db.Query(t.Context(), `SELECT type FROM outbox WHERE resource_id = $1 AND type LIKE 'node.drift%' ORDER BY id`, a.id)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var s string
		_ = rows.Scan(&s)
		events = append(events, s)
	}
	if !slices.Equal(events, []string{"node.drifted", "node.drift_cleared"}) {
		t.Fatalf("events %v", events)
	}
}
