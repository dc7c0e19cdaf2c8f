package dev_test

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/agent/sim"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/dev"
)

// instanceJSON is the part of an instance the tests read.
type instanceJSON struct {
	ID, NodeID, State, Reason, PowerState, ObservedState string
	Generation, ObservedGeneration                       string
}

func getInstance(t testing.TB, env *dev.Env, id string) instanceJSON {
	t.Helper()
	var out struct{ Instance instanceJSON }
	call(t, env, "instances/get", map[string]any{"tenantId": "root", "instanceId": id}, &out)
	return out.Instance
}

// waitInstance polls instances.get until the instance is in state with its
// current generation observed.
func waitInstance(t testing.TB, env *dev.Env, id, state string) instanceJSON {
	t.Helper()
	var in instanceJSON
	poll.UntilNil(t, 90*time.Second, "instance "+id+" to be "+state, func() error {
		in = getInstance(t, env, id)
		if in.State == state && (state == "deleted" || in.ObservedGeneration == in.Generation) {
			return nil
		}
		return fmt.Errorf("it is %s (observed %s at generation %s of %s: %s)", in.State, in.ObservedState, in.ObservedGeneration, in.Generation, in.Reason)
	})
	return in
}

// vpsFleet joins n simulated daemons with the simulated VPS runtime to a
// new vps-host pool and returns the fleet and the pool. The fleet stops at
// the end of the test, and then every instance process it left is ended.
func vpsFleet(t *testing.T, env *dev.Env, db *pgxpool.Pool, n int) (*sim.Fleet, string) {
	t.Helper()
	var pool struct{ Pool struct{ ID string } }
	call(t, env, "pools/create", map[string]any{"tenantId": "root", "name": "vps", "class": "vps-host", "idempotencyKey": "pool-vps"}, &pool)
	var tok struct{ Token string }
	call(t, env, "joinTokens/create", map[string]any{"tenantId": "root", "poolId": pool.Pool.ID, "uses": n, "idempotencyKey": "token-vps"}, &tok)
	pub, keyID, roots := joinMaterial(t, env)
	cfg := sim.Config{
		Gateway: env.App.GatewayAddr(), RootCAs: roots, Token: tok.Token,
		JoinserviceKey: pub, JoinserviceKeyID: keyID, Root: filepath.Join(t.TempDir(), "vps"), Prefix: "vps",
		CommandKey: env.CommandKey, VPS: true,
	}
	f := startFleet(t, db, cfg, n, 1)
	t.Cleanup(func() {
		f.Stop()
		if err := f.DeleteInstances(context.Background()); err != nil {
			t.Errorf("ending the instances' processes: %v", err)
		}
	})
	return f, pool.Pool.ID
}

// pidOf is the pid of instance id's process on daemon i; 0 when none runs.
func pidOf(t testing.TB, f *sim.Fleet, i int, id string) int {
	t.Helper()
	rt, err := f.VPSRuntime(i)
	if err != nil {
		t.Fatal(err)
	}
	pid, ok := rt.PID(id)
	if !ok {
		return 0
	}
	if err := syscall.Kill(pid, 0); err != nil {
		t.Fatalf("instance %s: pid %d is not alive: %v", id, pid, err)
	}
	return pid
}

// TestInstancesEndToEnd runs VPS instances on a hosted pool through the
// whole system: the real API, nodespec controller and gateway on real
// PostgreSQL and NATS, and the real agent with the simulated VPS runtime (a
// real process per instance). A created instance joins its host's spec and
// runs; it survives its host agent's restart (the same process, re-applied
// from the spec); reboot is a command with a deadline, refused past it;
// stop, start and delete converge through desired state with NATS stopped;
// delete releases the host's capacity.
func TestInstancesEndToEnd(t *testing.T) {
	t.Parallel()
	ns := natstest.New(t)
	env, db := commandEnv(t, ns.URL())
	t.Cleanup(func() { env.Stop(context.Background()) }) // after the fleet's cleanup
	f, pool := vpsFleet(t, env, db, 2)

	// Host capacity comes from the hosts' inventory: a DGX H200's 224
	// CPUs, 2 TiB and 30.72 TB.
	poll.UntilNil(t, 60*time.Second, "host capacity from inventory", func() error {
		var n int
		err := db.QueryRow(t.Context(), `SELECT count(*) FROM host_capacity h JOIN nodes n ON n.id = h.node_id
			WHERE n.pool_id = $1 AND h.vcpus_total = 224 AND h.memory_mib_total = 2097152 AND h.disk_gib_total = 28610`, pool).Scan(&n)
		if err != nil || n != 2 {
			var rows []string
			r, _ := db.Query(t.Context(), `SELECT node_id || ' ' || vcpus_total || ' ' || memory_mib_total || ' ' || disk_gib_total FROM host_capacity`)
			for r != nil && r.Next() {
				var s string
				_ = r.Scan(&s)
				rows = append(rows, s)
			}
			return fmt.Errorf("%d hosts sized from inventory (%v): %v", n, err, rows)
		}
		return nil
	})

	var created struct{ Instance instanceJSON }
	call(t, env, "instances/create", map[string]any{"tenantId": "root", "poolId": pool, "vcpus": 2, "memoryMiB": 2048, "diskGiB": 20,
		"image": "ubuntu-24.04", "sshKeys": []string{"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI e2e@example"}, "idempotencyKey": "inst-1"}, &created)
	id, node := created.Instance.ID, created.Instance.NodeID
	host := slices.Index(f.Nodes(), node)
	if !strings.HasPrefix(id, "inst_") || host < 0 {
		t.Fatalf("created %+v on a node outside the fleet %v", created.Instance, f.Nodes())
	}

	t.Run("the host's spec lists it and the agent runs it", func(t *testing.T) {
		var spec struct {
			Spec struct {
				Instances struct {
					Instances []struct {
						ID, State, Image  string
						Vcpus             int
						MemoryBytes       string
						SSHAuthorizedKeys []string `json:"sshAuthorizedKeys"`
					}
				}
			}
		}
		poll.UntilNil(t, 60*time.Second, "the host's spec to list the instance", func() error {
			call(t, env, "nodes/getSpec", map[string]any{"tenantId": "root", "nodeId": node}, &spec)
			got := spec.Spec.Instances.Instances
			if len(got) != 1 || got[0].ID != id || got[0].State != "running" || got[0].Vcpus != 2 || got[0].MemoryBytes != "2147483648" ||
				got[0].Image != "ubuntu-24.04" || len(got[0].SSHAuthorizedKeys) != 1 {
				return fmt.Errorf("host spec's instances: %+v", got)
			}
			return nil
		})
		waitInstance(t, env, id, "running")
		if pidOf(t, f, host, id) == 0 {
			t.Fatal("no process runs the instance")
		}
	})

	t.Run("it survives its host agent's restart", func(t *testing.T) {
		pid := pidOf(t, f, host, id)
		var epoch int64
		if err := db.QueryRow(t.Context(), `SELECT session_epoch FROM nodes WHERE id = $1`, node).Scan(&epoch); err != nil {
			t.Fatal(err)
		}
		f.Restart(host, false)
		poll.Until(t, 60*time.Second, "the restarted agent's new session converged", func() bool {
			var ok bool
			err := db.QueryRow(t.Context(), `SELECT session_epoch > $2 AND observed_generation = generation FROM nodes WHERE id = $1`, node, epoch).Scan(&ok)
			return err == nil && ok
		})
		// A re-applied spec of the same generation: the same process.
		waitInstance(t, env, id, "running")
		if now := pidOf(t, f, host, id); now != pid {
			t.Fatalf("the instance was re-created: pid %d, was %d", now, pid)
		}
	})

	t.Run("reboot is a command", func(t *testing.T) {
		pid := pidOf(t, f, host, id)
		var r struct{ Command cmdJSON }
		call(t, env, "instances/reboot", map[string]any{"tenantId": "root", "instanceId": id, "notAfterSeconds": 60, "idempotencyKey": "rb-1"}, &r)
		if r.Command.Kind != "instance.reboot" || r.Command.NodeID != node {
			t.Fatalf("reboot answered %+v", r.Command)
		}
		c := waitFinal(t, env, node, r.Command.ID)
		if c.State != "succeeded" {
			t.Fatalf("reboot: %+v", c)
		}
		now := pidOf(t, f, host, id)
		if now == 0 || now == pid {
			t.Fatalf("after reboot pid %d, was %d: want a new process", now, pid)
		}
	})

	t.Run("reboot is refused past its deadline", func(t *testing.T) {
		pid := pidOf(t, f, host, id)
		f.Halt(host)
		var r struct{ Command cmdJSON }
		call(t, env, "instances/reboot", map[string]any{"tenantId": "root", "instanceId": id, "notAfterSeconds": 10, "idempotencyKey": "rb-late"}, &r)
		// The deadline passes while the host's agent is down.
		poll.Until(t, 90*time.Second, "the reboot to expire", func() bool { return getCmd(t, env, node, r.Command.ID).State == "expired" })
		f.Resume(host)
		poll.Until(t, 60*time.Second, "the host back", func() bool {
			var ok bool
			err := db.QueryRow(t.Context(), `SELECT last_seen_at > now() - interval '2 seconds' FROM nodes WHERE id = $1`, node).Scan(&ok)
			return err == nil && ok
		})
		if c := getCmd(t, env, node, r.Command.ID); c.State != "expired" {
			t.Fatalf("an expired reboot became %+v", c)
		}
		if now := pidOf(t, f, host, id); now != pid {
			t.Fatalf("an expired reboot ran: pid %d, was %d", now, pid)
		}
	})

	t.Run("stop, start and delete converge with NATS stopped", func(t *testing.T) {
		ns.Stop()
		call(t, env, "instances/stop", map[string]any{"tenantId": "root", "instanceId": id}, &map[string]any{})
		waitInstance(t, env, id, "stopped")
		if pid := pidOf(t, f, host, id); pid != 0 {
			t.Fatalf("a stopped instance runs pid %d", pid)
		}
		call(t, env, "instances/start", map[string]any{"tenantId": "root", "instanceId": id}, &map[string]any{})
		waitInstance(t, env, id, "running")
		if pidOf(t, f, host, id) == 0 {
			t.Fatal("a started instance runs no process")
		}
		call(t, env, "instances/delete", map[string]any{"tenantId": "root", "instanceId": id}, &map[string]any{})
		waitInstance(t, env, id, "deleted")
		rt, err := f.VPSRuntime(host)
		if err != nil {
			t.Fatal(err)
		}
		if obs, err := rt.List(t.Context()); err != nil || len(obs) != 0 {
			t.Fatalf("the host still has %v (%v)", obs, err)
		}
	})

	t.Run("delete released the capacity", func(t *testing.T) {
		var used int
		if err := db.QueryRow(t.Context(), `SELECT vcpus_used + memory_mib_used + disk_gib_used FROM host_capacity WHERE node_id = $1`, node).Scan(&used); err != nil {
			t.Fatal(err)
		}
		if used != 0 {
			t.Fatalf("the host still has %d units in use", used)
		}
		// The whole host fits again.
		var big struct{ Instance instanceJSON }
		call(t, env, "instances/create", map[string]any{"tenantId": "root", "poolId": pool, "vcpus": 224, "memoryMiB": 2097152, "diskGiB": 28610,
			"image": "ubuntu-24.04", "idempotencyKey": "inst-big"}, &big)
		if big.Instance.NodeID == "" {
			t.Fatalf("a whole-host instance was not placed: %+v", big.Instance)
		}
		waitInstance(t, env, big.Instance.ID, "running")
	})
}
