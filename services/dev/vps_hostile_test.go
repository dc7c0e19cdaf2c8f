package dev_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/poll"
)

// TestBadInstanceDoesNotFreezeItsHostEndToEnd: one bad instance on a host
// (here a row whose image is a path, as one written before the API held
// images to the daemon's rule) made the host daemon fail its whole
// instances section, so the host's other instances were neither deleted
// nor changed until the bad one went. Through the whole system — the real
// API, nodespec controller and gateway, the real agent with the simulated
// VPS runtime — the other instance's delete now completes, and the bad
// instance is failed with its reason, its process left alone.
func TestBadInstanceDoesNotFreezeItsHostEndToEnd(t *testing.T) {
	t.Parallel()
	ns := natstest.New(t)
	env, db := commandEnv(t, ns.URL())
	t.Cleanup(func() { env.Stop(context.Background()) }) // after the fleet's cleanup
	f, pool := vpsFleet(t, env, db, 1)
	poll.UntilNil(t, 60*time.Second, "host capacity from inventory", func() error {
		var n int
		if err := db.QueryRow(t.Context(), `SELECT count(*) FROM host_capacity h JOIN nodes n ON n.id = h.node_id
			WHERE n.pool_id = $1 AND h.vcpus_total > 0`, pool).Scan(&n); err != nil || n != 1 {
			return fmt.Errorf("%d hosts sized (%v)", n, err)
		}
		return nil
	})
	create := func(key string) string {
		var created struct{ Instance instanceJSON }
		call(t, env, "instances/create", map[string]any{"tenantId": "root", "poolId": pool, "vcpus": 1, "memoryMiB": 1024, "diskGiB": 10,
			"image": "ubuntu-24.04", "sshKeys": []string{"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI e2e@example"}, "idempotencyKey": key}, &created)
		return created.Instance.ID
	}
	good, bad := create("good"), create("bad")
	waitInstance(t, env, good, "running")
	waitInstance(t, env, bad, "running")
	badPID := pidOf(t, f, 0, bad)

	if _, err := db.Exec(t.Context(), `UPDATE instances SET image = '../../../etc/passwd' WHERE id = $1`, bad); err != nil {
		t.Fatal(err)
	}
	// Deleting the good instance recomputes the host's spec, bad image
	// and all.
	call(t, env, "instances/delete", map[string]any{"tenantId": "root", "instanceId": good}, &map[string]any{})
	waitInstance(t, env, good, "deleted")
	if pidOf(t, f, 0, good) != 0 {
		t.Fatal("the deleted instance's process still runs")
	}
	poll.UntilNil(t, 60*time.Second, "the bad instance to be failed", func() error {
		in := getInstance(t, env, bad)
		if in.State != "failed" || !strings.Contains(in.Reason, "image") {
			return fmt.Errorf("it is %s: %s", in.State, in.Reason)
		}
		return nil
	})
	if now := pidOf(t, f, 0, bad); now != badPID {
		t.Fatalf("the bad instance's process: pid %d, was %d", now, badPID)
	}
}
