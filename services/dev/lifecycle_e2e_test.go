package dev_test

import (
	"context"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/sim"
	capstore "github.com/bettercompute/bettercompute/pkg/capacity"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/dev"
)

// lifecycleEnv is a dev control plane for the lifecycle tests: short
// gateway and liveness intervals, capacity.lostNode replace, and an
// eviction rate that does not make the tests wait.
func lifecycleEnv(t *testing.T, dbURL, natsURL string) *dev.Env {
	t.Helper()
	port, none := 0, 0
	cfg := &config.Config{
		Database: config.Database{URL: dbURL},
		NATS:     config.NATS{URL: natsURL},
		Server:   config.Server{Host: "127.0.0.1", Port: &port},
		Dev:      config.Dev{DataDir: t.TempDir(), SimNodes: &none},
		Gateway: config.Gateway{Listen: "127.0.0.1:0", HeartbeatInterval: config.Duration(100 * time.Millisecond),
			LivenessInterval: config.Duration(100 * time.Millisecond)},
		Runtime:  config.Runtime{PollBusDown: config.Duration(50 * time.Millisecond)},
		Commands: config.Commands{SweepInterval: config.Duration(100 * time.Millisecond)},
		Capacity: config.Capacity{LostNode: capstore.LostNodeReplace, TickEvery: config.Duration(200 * time.Millisecond)},
		Nodes: config.Nodes{NotReadyAfter: config.Duration(2 * time.Second), LostAfter: config.Duration(4 * time.Second),
			LivenessEvery: config.Duration(100 * time.Millisecond), EvictionRate: 100, EvictionBurst: 100},
	}
	cfg.Defaults()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	env, err := dev.Start(t.Context(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { env.Stop(context.Background()) })
	return env
}

// device is a GPU as the devices table has it.
type device struct {
	Index       int
	Healthy     bool
	Quarantined bool
	Reason      string
}

func deviceOf(t *testing.T, db *pgxpool.Pool, node, id string) device {
	t.Helper()
	var d device
	err := db.QueryRow(t.Context(), `SELECT index, healthy, quarantined_at IS NOT NULL, quarantine_reason FROM devices
		WHERE node_id = $1 AND id = $2`, node, id).Scan(&d.Index, &d.Healthy, &d.Quarantined, &d.Reason)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// commandsOf returns node's commands of kind, oldest first, as "state".
func commandsOf(t *testing.T, db *pgxpool.Pool, node, kind string) []string {
	t.Helper()
	rows, err := db.Query(t.Context(), `SELECT state FROM commands WHERE node_id = $1 AND kind = $2 ORDER BY created_at, id`, node, kind)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func eventTypes(t *testing.T, db *pgxpool.Pool, resource string) []string {
	t.Helper()
	rows, err := db.Query(t.Context(), `SELECT type FROM outbox WHERE resource_id = $1 ORDER BY id`, resource)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestGPUFaultEndToEnd runs the health path with real simulated daemons and
// the mock NVML's fault injection: the daemon's own health checks find the
// fault, the health job quarantines the GPU, moves its booking, and climbs
// the remediation ladder with real, signed commands.
func TestGPUFaultEndToEnd(t *testing.T) {
	t.Parallel()
	dbURL := pgtest.NewDB(t)
	db, err := pgxpool.New(t.Context(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ns := natstest.New(t)
	env := lifecycleEnv(t, dbURL, ns.URL())
	f := simFleet(t, env, db, "health", 3, func(c *sim.Config) { c.HealthCheckInterval = 100 * time.Millisecond })
	ids := f.Nodes()
	indexOf := func(node string) int { return slices.Index(ids, node) }
	var poolID string
	if err := db.QueryRow(t.Context(), `SELECT pool_id FROM nodes WHERE id = $1`, ids[0]).Scan(&poolID); err != nil {
		t.Fatal(err)
	}

	t.Run("XID 79: quarantined, booking moved, gpu.reset, back in service", func(t *testing.T) {
		var created struct{ Reservation reservation }
		call(t, env, "reservations/create", map[string]any{"tenantId": "root", "poolId": poolID, "gpuCount": 1, "idempotencyKey": "xid"}, &created)
		rsv := created.Reservation.ID
		waitState(t, env, rsv, "bound")
		b := getReservation(t, env, rsv).Bookings[0]
		gpu := deviceOf(t, db, b.NodeID, b.DeviceID)

		if err := f.Faults(indexOf(b.NodeID)).Inject(gpu.Index, inventory.Fault{XIDs: []uint32{79}}); err != nil {
			t.Fatal(err)
		}
		poll.Until(t, 30*time.Second, "the GPU quarantined", func() bool { return deviceOf(t, db, b.NodeID, b.DeviceID).Quarantined })
		if d := deviceOf(t, db, b.NodeID, b.DeviceID); d.Healthy || d.Reason == "" {
			t.Fatalf("quarantined GPU %+v", d)
		}
		poll.Until(t, 30*time.Second, "the booking moved to a healthy GPU, and bound", func() bool {
			r := getReservation(t, env, rsv)
			return r.State == "bound" && len(r.Bookings) == 1 && r.Bookings[0].DeviceID != b.DeviceID
		})
		if got := eventTypes(t, db, rsv); !slices.Contains(got, "reservation.device_unhealthy") {
			t.Fatalf("reservation events %v", got)
		}
		poll.Until(t, 60*time.Second, "the GPU back in service after gpu.reset", func() bool {
			d := deviceOf(t, db, b.NodeID, b.DeviceID)
			return !d.Quarantined && d.Healthy
		})
		if got := commandsOf(t, db, b.NodeID, "gpu.reset"); !slices.Equal(got, []string{"succeeded"}) {
			t.Fatalf("gpu.reset commands %v", got)
		}
		var steps []string
		rows, _ := db.Query(t.Context(), `SELECT step || ':' || state FROM remediations WHERE node_id = $1 ORDER BY started_at`, b.NodeID)
		steps, _ = pgx.CollectRows(rows, pgx.RowTo[string])
		if !slices.Equal(steps, []string{"gpu.reset:succeeded"}) {
			t.Fatalf("remediation steps %v", steps)
		}
	})

	t.Run("reset refused: the node is drained, rebooted, then failed with NeedsRepair", func(t *testing.T) {
		// A node with no booking, so its drain completes at once; a compute
		// process keeps gpu.reset from running, and the ECC errors survive
		// the reboot (the faults file is on the machine's disk).
		var node string
		if err := db.QueryRow(t.Context(), `SELECT id FROM nodes n WHERE id = ANY($1)
			AND NOT EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = n.id AND b.active)
			AND NOT EXISTS (SELECT 1 FROM remediations r WHERE r.node_id = n.id) ORDER BY id LIMIT 1`, ids).Scan(&node); err != nil {
			t.Fatal(err)
		}
		boot := f.BootID(indexOf(node))
		if err := f.Faults(indexOf(node)).Inject(0, inventory.Fault{UncorrectableECC: 3, ComputePIDs: []uint32{4242}}); err != nil {
			t.Fatal(err)
		}
		poll.Until(t, 90*time.Second, "NeedsRepair latched", func() bool {
			var latched bool
			_ = db.QueryRow(t.Context(), `SELECT needs_repair FROM nodes WHERE id = $1`, node).Scan(&latched)
			return latched
		})
		if got := commandsOf(t, db, node, "gpu.reset"); !slices.Equal(got, []string{"failed"}) {
			t.Fatalf("gpu.reset commands %v", got)
		}
		if got := commandsOf(t, db, node, "node.reboot"); !slices.Equal(got, []string{"succeeded"}) {
			t.Fatalf("node.reboot commands %v", got)
		}
		if f.BootID(indexOf(node)) == boot {
			t.Fatal("the node did not reboot")
		}
		var state, drainBy string
		if err := db.QueryRow(t.Context(), `SELECT state, drain_by FROM nodes WHERE id = $1`, node).Scan(&state, &drainBy); err != nil {
			t.Fatal(err)
		}
		if state != "failed" {
			t.Fatalf("node state %s, want failed", state)
		}
		got := eventTypes(t, db, node)
		for _, want := range []string{"node.draining", "node.drained", "node.needs_repair"} {
			if !slices.Contains(got, want) {
				t.Fatalf("node events %v lack %s", got, want)
			}
		}
		var out struct {
			Node struct {
				Conditions []struct {
					Type   string
					Status bool
					Reason string
				}
			}
		}
		call(t, env, "nodes/get", map[string]any{"tenantId": "root", "nodeId": node}, &out)
		i := slices.IndexFunc(out.Node.Conditions, func(c struct {
			Type   string
			Status bool
			Reason string
		}) bool {
			return c.Type == "NeedsRepair"
		})
		if i < 0 || !out.Node.Conditions[i].Status || out.Node.Conditions[i].Reason == "" {
			t.Fatalf("nodes.get conditions %+v", out.Node.Conditions)
		}
	})
}

// bookedNodes returns the nodes reservation rsv has active bookings on, and
// how many on each.
func bookedNodes(t *testing.T, db *pgxpool.Pool, rsv string) map[string]int {
	t.Helper()
	rows, err := db.Query(t.Context(), `SELECT node_id FROM bookings WHERE reservation_id = $1 AND active`, rsv)
	if err != nil {
		t.Fatal(err)
	}
	ns, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	for _, n := range ns {
		out[n]++
	}
	return out
}

// TestLifecycleEndToEnd runs the node lifecycle with real simulated
// daemons: 60 % of a pool lost at once evicts nothing (the circuit
// breaker), a drain with a deadline moves a node's bookings elsewhere, and a
// retired node's session is closed and stays closed.
func TestLifecycleEndToEnd(t *testing.T) {
	t.Parallel()
	dbURL := pgtest.NewDB(t)
	db, err := pgxpool.New(t.Context(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ns := natstest.New(t)
	env := lifecycleEnv(t, dbURL, ns.URL())
	f := simFleet(t, env, db, "lifecycle", 5, nil)
	ids := f.Nodes()
	var poolID string
	if err := db.QueryRow(t.Context(), `SELECT pool_id FROM nodes WHERE id = $1`, ids[0]).Scan(&poolID); err != nil {
		t.Fatal(err)
	}
	var created struct{ Reservation reservation }
	call(t, env, "reservations/create", map[string]any{"tenantId": "root", "poolId": poolID, "gpuCount": 24, "idempotencyKey": "spread"}, &created)
	rsv := created.Reservation.ID
	waitState(t, env, rsv, "bound")
	before := bookedNodes(t, db, rsv)
	if len(before) != 3 {
		t.Fatalf("24 GPUs on %d nodes, want 3: %v", len(before), before)
	}

	t.Run("60% of the pool lost at once: no eviction, fleet.eviction_paused", func(t *testing.T) {
		var halted []int
		for n := range before {
			halted = append(halted, slices.Index(ids, n))
		}
		for _, i := range halted {
			f.Halt(i)
		}
		poll.Until(t, 30*time.Second, "the three nodes Lost", func() bool {
			var k int
			_ = db.QueryRow(t.Context(), `SELECT count(*) FROM nodes WHERE pool_id = $1 AND ready = 'Lost'`, poolID).Scan(&k)
			return k == 3
		})
		poll.Until(t, 10*time.Second, "fleet.eviction_paused for the pool", func() bool {
			var k int
			_ = db.QueryRow(t.Context(), `SELECT count(*) FROM outbox WHERE type = 'fleet.eviction_paused' AND payload->>'scope' = $1`, "pool:"+poolID).Scan(&k)
			return k == 1
		})
		// The placer ticks every 200 ms: give it a dozen passes to act.
		time.Sleep(3 * time.Second)
		if got := bookedNodes(t, db, rsv); !maps.Equal(got, before) {
			t.Fatalf("bookings moved while the pool was paused: %v, were %v", got, before)
		}
		if r := getReservation(t, env, rsv); r.State != "bound" {
			t.Fatalf("reservation %+v", r)
		}
		for _, i := range halted {
			f.Resume(i)
		}
		poll.Until(t, 30*time.Second, "fleet.eviction_resumed once the nodes are back", func() bool {
			var k int
			_ = db.QueryRow(t.Context(), `SELECT count(*) FROM outbox WHERE type = 'fleet.eviction_resumed' AND payload->>'scope' = $1`, "pool:"+poolID).Scan(&k)
			return k == 1
		})
		if got := bookedNodes(t, db, rsv); !maps.Equal(got, before) {
			t.Fatalf("bookings after recovery: %v, were %v", got, before)
		}
	})

	t.Run("drain with a deadline: the bookings move elsewhere", func(t *testing.T) {
		var drained string
		for n := range before {
			drained = n
			break
		}
		var out struct{ Node struct{ State string } }
		call(t, env, "nodes/drain", map[string]any{"tenantId": "root", "nodeId": drained, "deadlineSeconds": 2, "reason": "e2e"}, &out)
		if out.Node.State != "draining" {
			t.Fatalf("drain answered %+v", out.Node)
		}
		if got := eventTypes(t, db, rsv); !slices.Contains(got, "reservation.node_draining") {
			t.Fatalf("reservation events %v", got)
		}
		poll.Until(t, 30*time.Second, "the node drained and its 8 GPUs re-placed and bound", func() bool {
			var state string
			_ = db.QueryRow(t.Context(), `SELECT state FROM nodes WHERE id = $1`, drained).Scan(&state)
			got := bookedNodes(t, db, rsv)
			total := 0
			for _, k := range got {
				total += k
			}
			return state == "drained" && got[drained] == 0 && total == 24 && getReservation(t, env, rsv).State == "bound"
		})
	})

	t.Run("retire: the session is closed and stays closed", func(t *testing.T) {
		var idle string
		if err := db.QueryRow(t.Context(), `SELECT id FROM nodes n WHERE id = ANY($1) AND state = 'adopted'
			AND NOT EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = n.id AND b.active) ORDER BY id LIMIT 1`, ids).Scan(&idle); err != nil {
			t.Fatal(err)
		}
		var out struct{ Node struct{ State string } }
		call(t, env, "nodes/retire", map[string]any{"tenantId": "root", "nodeId": idle, "reason": "e2e"}, &out)
		poll.Until(t, 30*time.Second, "the node retired, its certificates revoked", func() bool {
			var state string
			var live int
			_ = db.QueryRow(t.Context(), `SELECT state, (SELECT count(*) FROM node_certificates WHERE node_id = $1 AND revoked_at IS NULL)
				FROM nodes WHERE id = $1`, idle).Scan(&state, &live)
			return state == "retired" && live == 0
		})
		// Its daemon heartbeats every 100 ms while a session is open.
		poll.Until(t, 30*time.Second, "no heartbeat from the retired node for 2 s", func() bool {
			var quiet bool
			_ = db.QueryRow(t.Context(), `SELECT last_seen_at < now() - interval '2 seconds' FROM nodes WHERE id = $1`, idle).Scan(&quiet)
			return quiet
		})
		time.Sleep(2 * time.Second) // the daemon keeps redialling meanwhile
		var quiet bool
		_ = db.QueryRow(t.Context(), `SELECT last_seen_at < now() - interval '4 seconds' FROM nodes WHERE id = $1`, idle).Scan(&quiet)
		if !quiet {
			t.Fatal("the retired node reconnected")
		}
	})
}
