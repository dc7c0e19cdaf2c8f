package lifecycle_test

import (
	"crypto/ed25519"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/encoding/protojson"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/brakes"
	capstore "github.com/bettercompute/bettercompute/pkg/capacity"
	"github.com/bettercompute/bettercompute/pkg/commands"
	nodelife "github.com/bettercompute/bettercompute/pkg/lifecycle"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/remediations"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
	"github.com/bettercompute/bettercompute/services/capacity"
	"github.com/bettercompute/bettercompute/services/inventory"
	"github.com/bettercompute/bettercompute/services/lifecycle"
)

// clock is the health job's fake clock.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// healthEnv is a database with pool_a and adopted, schedulable nodes, the
// inventory controller, the health job (signing gpu.reset and node.reboot)
// and the capacity rollup on one runtime.
type healthEnv struct {
	pool  *pgxpool.Pool
	rt    *reconcile.Runtime
	clock *clock
	kinds *commands.Registry
	gpus  map[string]int // node → GPUs reported
	bad   map[string]map[int]string
	gone  map[string]map[int]bool
}

func newHealthEnv(t *testing.T, cfg lifecycle.HealthConfig, gpus map[string]int) *healthEnv {
	t.Helper()
	var ids []string
	for id := range gpus {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	pool := newPool(t, ids...)
	_, key, err := ed25519.GenerateKey(nil)
	if err != nil {
		t.Fatal(err)
	}
	e := &healthEnv{pool: pool, clock: &clock{t: time.Now()}, gpus: gpus, bad: map[string]map[int]string{}, gone: map[string]map[int]bool{}}
	e.kinds = commands.Builtin().Signing(commands.NewSigner(key), "test.local")
	cfg.Kinds = e.kinds
	cfg.Now = e.clock.Now
	if cfg.Brakes == (brakes.Config{}) {
		cfg.Brakes = brakes.Config{Rate: 1000, Burst: 1000}
	}
	rt, err := reconcile.New(pool, nil, reconcile.Config{Roles: []string{reconcile.RoleControllers, reconcile.RoleScheduler}, Heartbeat: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	recs, err := lifecycle.Health(cfg)
	if err != nil {
		t.Fatal(err)
	}
	caps, err := capacity.Reconcilers(capacity.Config{LostNode: cfg.LostNode})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range slices.Concat(recs, inventory.Reconcilers(), caps, []reconcile.Reconciler{lifecycle.Drain(lifecycle.DrainConfig{LostNode: cfg.LostNode})}) {
		if err := rt.Register(r); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(rt.Stop)
	e.rt = rt
	for _, id := range ids {
		e.report(t, id)
	}
	e.settle(t)
	if _, err := pool.Exec(t.Context(), `UPDATE nodes SET state = 'adopted', generation = 1, observed_generation = 1, last_seen_at = now()`); err != nil {
		t.Fatal(err)
	}
	return e
}

func uuid(node string, i int) string { return fmt.Sprintf("GPU-%s-%d", node, i) }

// report stores node's inventory report as the gateway would (its GPUs,
// less the gone ones, the bad ones unhealthy) and runs the inventory
// controller, which enqueues the health job.
func (e *healthEnv) report(t *testing.T, node string) {
	t.Helper()
	var gs []*agentv1.GPU
	for i := range e.gpus[node] {
		if e.gone[node][i] {
			continue
		}
		reason, bad := e.bad[node][i]
		gs = append(gs, &agentv1.GPU{Index: uint32(i), Uuid: uuid(node, i), Model: "NVIDIA H200", MemoryBytes: 141 << 30, Healthy: !bad, HealthReason: reason})
	}
	b, err := protojson.Marshal(&agentv1.InventoryReport{Sections: []string{"gpus"}, Gpus: gs})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(t.Context(), `
		INSERT INTO node_inventory (node_id, session_epoch, report) VALUES ($1, 1, $2)
		ON CONFLICT (node_id) DO UPDATE SET report = EXCLUDED.report, received_at = clock_timestamp()`, node, json.RawMessage(b)); err != nil {
		t.Fatal(err)
	}
	if err := workqueue.Enqueue(t.Context(), e.pool, nodelife.KindInventory, node); err != nil {
		t.Fatal(err)
	}
	e.tick(t, nodelife.KindInventory)
}

func (e *healthEnv) fault(t *testing.T, node string, i int, reason string) {
	t.Helper()
	if e.bad[node] == nil {
		e.bad[node] = map[int]string{}
	}
	e.bad[node][i] = reason
	e.report(t, node)
}

func (e *healthEnv) heal(t *testing.T, node string, i int) {
	t.Helper()
	delete(e.bad[node], i)
	delete(e.gone[node], i)
	e.report(t, node)
}

func (e *healthEnv) tick(t *testing.T, kind string) reconcile.TickResult {
	t.Helper()
	tr, err := e.rt.Jobs()[kind].Tick(t.Context())
	if err != nil || tr.Failed > 0 {
		t.Fatalf("tick %s: %+v %v", kind, tr, err)
	}
	return tr
}

// settle runs the health job until nothing is queued for it.
func (e *healthEnv) settle(t *testing.T) {
	t.Helper()
	for range 10 {
		if tr := e.tick(t, nodelife.KindHealth); tr.Done+tr.SyncAgain == 0 {
			return
		}
	}
}

// runHealth enqueues node's health key and runs it.
func (e *healthEnv) runHealth(t *testing.T, node string) {
	t.Helper()
	if err := workqueue.Enqueue(t.Context(), e.pool, nodelife.KindHealth, node); err != nil {
		t.Fatal(err)
	}
	e.settle(t)
}

// answer claims node's due commands of kind and settles them as its daemon
// would (outcome), through the claim and apply the gateway uses; it returns
// them.
func (e *healthEnv) answer(t *testing.T, node, kind string, outcome agentv1.CommandOutcome, reason string) []commands.Command {
	t.Helper()
	cs, err := commands.Claim(t.Context(), e.pool, node, 1)
	if err != nil {
		t.Fatal(err)
	}
	var out []commands.Command
	err = pgx.BeginFunc(t.Context(), e.pool, func(tx pgx.Tx) error {
		for _, c := range cs {
			o := agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED
			if c.Kind == kind {
				o = outcome
				out = append(out, c)
			}
			if _, err := e.kinds.Apply(t.Context(), tx, commands.TxWaker(tx), node, 1,
				&agentv1.CommandUpdate{Id: c.ID, Seq: c.Seq, Outcome: o, Reason: reason}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(out) == 0 {
		t.Fatalf("node %s had no %s command to answer (claimed %d)", node, kind, len(cs))
	}
	return out
}

func (e *healthEnv) device(t *testing.T, node string, i int) nodes.Device {
	t.Helper()
	n, err := nodes.Get(t.Context(), e.pool, "root", node)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range n.Devices {
		if d.ID == uuid(node, i) {
			return d
		}
	}
	t.Fatalf("no device %d on %s", i, node)
	return nodes.Device{}
}

func (e *healthEnv) node(t *testing.T, id string) nodes.Node {
	t.Helper()
	n, err := nodes.Lookup(t.Context(), e.pool, id)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// reserve places a reservation of count GPUs in pool_a now and returns it.
func (e *healthEnv) reserve(t *testing.T, id string, count int) capstore.Reservation {
	t.Helper()
	r := capstore.Reservation{ID: id, TenantID: "root", PoolID: "pool_a", GPUCount: count}
	err := pgx.BeginFunc(t.Context(), e.pool, func(tx pgx.Tx) error {
		if err := capstore.Insert(t.Context(), tx, r); err != nil {
			return err
		}
		_, err := capstore.Place(t.Context(), tx, &r, capstore.PlaceOptions{})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return e.rsv(t, id)
}

func (e *healthEnv) rsv(t *testing.T, id string) capstore.Reservation {
	t.Helper()
	r, err := capstore.Get(t.Context(), e.pool, "root", id)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// events lists the types of the events of the given types' prefix, in order.
func (e *healthEnv) events(t *testing.T, like string) []string {
	t.Helper()
	rows, err := e.pool.Query(t.Context(), `SELECT type FROM outbox WHERE type LIKE $1 ORDER BY id`, like)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func (e *healthEnv) payload(t *testing.T, typ string) map[string]any {
	t.Helper()
	var p map[string]any
	if err := e.pool.QueryRow(t.Context(), `SELECT payload FROM outbox WHERE type = $1 ORDER BY id DESC LIMIT 1`, typ).Scan(&p); err != nil {
		t.Fatalf("no %s event: %v", typ, err)
	}
	return p
}

func (e *healthEnv) commandsOf(t *testing.T, node, kind string) []commands.Command {
	t.Helper()
	cs, err := commands.List(t.Context(), e.pool, node, nil, "", 100)
	if err != nil {
		t.Fatal(err)
	}
	return slices.DeleteFunc(cs, func(c commands.Command) bool { return c.Kind != kind })
}

func (e *healthEnv) steps(t *testing.T, node string) []string {
	t.Helper()
	ms, err := remediations.OfNode(t.Context(), e.pool, node)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, m := range ms {
		out = append(out, m.Step+":"+m.State)
	}
	return out
}

// free counts node's bookable GPUs as placement counts them.
func (e *healthEnv) free(t *testing.T, node string) int {
	t.Helper()
	fs, err := capstore.FreeCounts(t.Context(), e.pool, "pool_a", capstore.Constraints{}, capstore.DefaultLostAfter)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fs {
		if f.NodeID == node {
			return len(f.Free)
		}
	}
	return 0
}

func bookedOn(r capstore.Reservation, node, dev string) bool {
	return slices.ContainsFunc(r.Bookings, func(b capstore.Booking) bool { return b.NodeID == node && b.DeviceID == dev })
}

// TestHealthQuarantineUnderEachPolicy: a booked GPU turns unhealthy → it is
// quarantined (not bookable, gpu.quarantined), its reservation gets
// reservation.device_unhealthy, and capacity.lostNode decides: replace
// books a healthy GPU instead (same count), fail ends the reservation,
// wait keeps it.
func TestHealthQuarantineUnderEachPolicy(t *testing.T) {
	t.Parallel()
	for _, policy := range []string{capstore.LostNodeReplace, capstore.LostNodeFail, capstore.LostNodeWait} {
		t.Run(policy, func(t *testing.T) {
			t.Parallel()
			e := newHealthEnv(t, lifecycle.HealthConfig{LostNode: policy}, map[string]int{"node_1": 2, "node_2": 2})
			r := e.reserve(t, "rsv_1", 2)
			if len(r.Bookings) != 2 {
				t.Fatalf("bookings %+v", r.Bookings)
			}
			b := r.Bookings[0]
			i := slices.IndexFunc([]string{uuid(b.NodeID, 0), uuid(b.NodeID, 1)}, func(s string) bool { return s == b.DeviceID })

			e.fault(t, b.NodeID, i, "XID 79: fallen off the bus")
			e.settle(t)

			d := e.device(t, b.NodeID, i)
			if d.QuarantinedAt == nil || !strings.Contains(d.QuarantineReason, "XID 79") {
				t.Fatalf("device not quarantined: %+v", d)
			}
			if p := e.payload(t, "gpu.quarantined"); p["deviceId"] != b.DeviceID || p["nodeId"] != b.NodeID {
				t.Fatalf("gpu.quarantined %v", p)
			}
			p := e.payload(t, "reservation.device_unhealthy")
			if p["reservationId"] != "rsv_1" || p["deviceId"] != b.DeviceID {
				t.Fatalf("reservation.device_unhealthy %v", p)
			}
			r = e.rsv(t, "rsv_1")
			switch policy {
			case capstore.LostNodeReplace:
				if p["action"] != "replaced" || !capstore.Live(r.State) || len(r.Bookings) != 2 || bookedOn(r, b.NodeID, b.DeviceID) {
					t.Fatalf("replace: %v, reservation %s %+v", p["action"], r.State, r.Bookings)
				}
				var n int
				_ = e.pool.QueryRow(t.Context(), `SELECT count(*) FROM work_queue WHERE kind = 'nodespec' AND key = $1`, b.NodeID).Scan(&n)
				if n != 1 {
					t.Fatal("the node's desired state was not invalidated")
				}
			case capstore.LostNodeFail:
				if p["action"] != "failed" || r.State != capstore.StateFailed {
					t.Fatalf("fail: %v, reservation %s", p["action"], r.State)
				}
			default:
				if p["action"] != "kept" || !capstore.Live(r.State) || !bookedOn(r, b.NodeID, b.DeviceID) {
					t.Fatalf("wait: %v, reservation %s %+v", p["action"], r.State, r.Bookings)
				}
			}
			// Every free GPU of the pool booked: none is the quarantined one.
			var left int
			_ = e.pool.QueryRow(t.Context(), `SELECT count(*) FROM devices WHERE healthy AND quarantined_at IS NULL AND NOT EXISTS (
				SELECT 1 FROM bookings b WHERE b.device_id = devices.id AND b.active)`).Scan(&left)
			if left > 0 {
				r2 := e.reserve(t, "rsv_2", left)
				if bookedOn(r2, b.NodeID, b.DeviceID) || len(r2.Bookings) != left {
					t.Fatalf("a quarantined GPU was booked: %+v", r2.Bookings)
				}
			}
		})
	}
}

// TestRemediationResetSucceeds: a quarantined GPU gets a signed gpu.reset
// (the node's quarantined GPUs, owned by the health job); it succeeds and
// the next report shows the GPU healthy → the step succeeded, the GPU is
// back in service; every step is an event and an audit row.
func TestRemediationResetSucceeds(t *testing.T) {
	t.Parallel()
	e := newHealthEnv(t, lifecycle.HealthConfig{}, map[string]int{"node_1": 4})
	e.fault(t, "node_1", 2, "XID 79")
	e.settle(t)

	resets := e.commandsOf(t, "node_1", "gpu.reset")
	if len(resets) != 1 {
		t.Fatalf("%d gpu.reset commands", len(resets))
	}
	c := resets[0]
	if len(c.Signature) == 0 || c.KeyID == "" || c.OwnerKind != nodelife.KindHealth || c.OwnerKey != "node_1" {
		t.Fatalf("gpu.reset not signed or not owned: %+v", c)
	}
	body, err := c.Body()
	if err != nil || !slices.Equal(body.GetGpuReset().GetGpuUuids(), []string{uuid("node_1", 2)}) {
		t.Fatalf("gpu.reset payload %v %v", body, err)
	}
	// The GPU recovers while the reset runs: it stays quarantined until
	// the step says so.
	e.heal(t, "node_1", 2)
	e.settle(t)
	if d := e.device(t, "node_1", 2); d.QuarantinedAt == nil {
		t.Fatal("quarantine lifted while its reset was running")
	}

	e.answer(t, "node_1", "gpu.reset", agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED, "")
	e.settle(t) // woken as the command's owner: waits for a report after it
	if d := e.device(t, "node_1", 2); d.QuarantinedAt == nil {
		t.Fatal("quarantine lifted before a report after the reset")
	}
	if len(e.commandsOf(t, "node_1", "inventory.refresh")) != 1 {
		t.Fatal("no inventory.refresh asked for after the reset")
	}
	e.report(t, "node_1")
	e.settle(t)
	if d := e.device(t, "node_1", 2); d.QuarantinedAt != nil {
		t.Fatalf("still quarantined after a successful reset and a healthy report: %+v", d)
	}
	if got := e.steps(t, "node_1"); !slices.Equal(got, []string{"gpu.reset:succeeded"}) {
		t.Fatalf("steps %v", got)
	}
	if got := e.events(t, "remediation.%"); !slices.Equal(got, []string{"remediation.started", "remediation.succeeded"}) {
		t.Fatalf("remediation events %v", got)
	}
	if got := e.events(t, "gpu.%"); !slices.Equal(got, []string{"gpu.quarantined", "gpu.recovered"}) {
		t.Fatalf("gpu events %v", got)
	}
	var audits int
	_ = e.pool.QueryRow(t.Context(), `SELECT count(*) FROM audit WHERE actor = 'health' AND resource LIKE '%node_1%'`).Scan(&audits)
	if audits < 2 {
		t.Fatalf("%d audit rows by health", audits)
	}
	if e.free(t, "node_1") != 4 {
		t.Fatalf("free GPUs %d after recovery", e.free(t, "node_1"))
	}
}

// TestRemediationLadderToNeedsRepair: reset fails → the node is drained
// (by remediation) and only then node.reboot is sent; reboot fails → the
// node is failed with NeedsRepair latched, naming the steps tried.
func TestRemediationLadderToNeedsRepair(t *testing.T) {
	t.Parallel()
	e := newHealthEnv(t, lifecycle.HealthConfig{}, map[string]int{"node_1": 2})
	e.fault(t, "node_1", 0, "XID 79")
	e.settle(t)
	e.answer(t, "node_1", "gpu.reset", agentv1.CommandOutcome_COMMAND_OUTCOME_FAILED, "GPU is in use")
	e.settle(t)

	n := e.node(t, "node_1")
	if n.DrainBy != nodes.DrainByRemediation || (n.State != nodes.StateDraining && n.State != nodes.StateDrained) {
		t.Fatalf("after a failed reset: %s by %q", n.State, n.DrainBy)
	}
	if n.State == nodes.StateDraining && len(e.commandsOf(t, "node_1", "node.reboot")) != 0 {
		t.Fatal("node.reboot sent before the node was drained")
	}
	// No booking: the drain job drains it at once; then the reboot goes.
	if err := workqueue.Enqueue(t.Context(), e.pool, nodelife.KindDrain, "node_1"); err != nil {
		t.Fatal(err)
	}
	e.tick(t, nodelife.KindDrain)
	e.runHealth(t, "node_1")
	if e.node(t, "node_1").State != nodes.StateDrained {
		t.Fatalf("node %s, want drained", e.node(t, "node_1").State)
	}
	reboots := e.commandsOf(t, "node_1", "node.reboot")
	if len(reboots) != 1 || len(reboots[0].Signature) == 0 {
		t.Fatalf("node.reboot %+v", reboots)
	}
	e.answer(t, "node_1", "node.reboot", agentv1.CommandOutcome_COMMAND_OUTCOME_FAILED, "reboot refused")
	e.settle(t)

	n = e.node(t, "node_1")
	if n.State != nodes.StateFailed || !n.NeedsRepair || !strings.Contains(n.NeedsRepairReason, "gpu.reset") || !strings.Contains(n.NeedsRepairReason, "node.reboot") {
		t.Fatalf("after a failed reboot: %s needsRepair=%v %q", n.State, n.NeedsRepair, n.NeedsRepairReason)
	}
	if got := e.steps(t, "node_1"); !slices.Equal(got, []string{"gpu.reset:failed", "node.reboot:failed", "needs_repair:failed"}) {
		t.Fatalf("steps %v", got)
	}
	if p := e.payload(t, "node.needs_repair"); p["failed"] != true {
		t.Fatalf("node.needs_repair %v", p)
	}
	// Latched: nothing more is tried.
	e.runHealth(t, "node_1")
	if len(e.commandsOf(t, "node_1", "gpu.reset")) != 1 {
		t.Fatal("a ladder started on a node that needs repair")
	}
}

// TestRemediationBudget: with health.maxRemediationsPerNode 2, a third
// ladder within 7 days latches NeedsRepair at once; outside the window it
// would run.
func TestRemediationBudget(t *testing.T) {
	t.Parallel()
	e := newHealthEnv(t, lifecycle.HealthConfig{}, map[string]int{"node_1": 2})
	for range 2 {
		e.fault(t, "node_1", 1, "ECC")
		e.settle(t)
		e.heal(t, "node_1", 1)
		e.answer(t, "node_1", "gpu.reset", agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED, "")
		e.settle(t)
		e.report(t, "node_1")
		e.settle(t)
		e.clock.Add(24 * time.Hour)
	}
	if got := e.steps(t, "node_1"); !slices.Equal(got, []string{"gpu.reset:succeeded", "gpu.reset:succeeded"}) {
		t.Fatalf("steps %v", got)
	}
	e.fault(t, "node_1", 1, "ECC")
	e.settle(t)
	n := e.node(t, "node_1")
	if !n.NeedsRepair || !strings.Contains(n.NeedsRepairReason, "budget") || n.State != nodes.StateAdopted {
		t.Fatalf("third ladder: needsRepair=%v %q state %s", n.NeedsRepair, n.NeedsRepairReason, n.State)
	}
	if len(e.commandsOf(t, "node_1", "gpu.reset")) != 2 {
		t.Fatal("a third gpu.reset was sent")
	}
}

// TestRemediationConcurrencyPerPool: with health.maxConcurrentRemediations
// 1, two nodes of a pool with quarantined GPUs run one ladder at a time;
// the second starts when the first ends.
func TestRemediationConcurrencyPerPool(t *testing.T) {
	t.Parallel()
	e := newHealthEnv(t, lifecycle.HealthConfig{}, map[string]int{"node_1": 1, "node_2": 1})
	e.fault(t, "node_1", 0, "XID 79")
	e.fault(t, "node_2", 0, "XID 79")
	e.settle(t)
	n1, n2 := len(e.commandsOf(t, "node_1", "gpu.reset")), len(e.commandsOf(t, "node_2", "gpu.reset"))
	if n1+n2 != 1 {
		t.Fatalf("gpu.reset on node_1 %d, node_2 %d: want one ladder at a time", n1, n2)
	}
	first, second := "node_1", "node_2"
	if n2 == 1 {
		first, second = second, first
	}
	e.heal(t, first, 0)
	e.answer(t, first, "gpu.reset", agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED, "")
	e.settle(t)
	e.report(t, first)
	e.settle(t) // the first ends and wakes the second
	if len(e.commandsOf(t, second, "gpu.reset")) != 1 {
		t.Fatalf("the second node's ladder did not start after the first ended: %v", e.steps(t, second))
	}
}

// TestHealthMissingGPU: a GPU that stops being reported is quarantined like
// an unhealthy one, and its booking is not left on it under replace.
func TestHealthMissingGPU(t *testing.T) {
	t.Parallel()
	e := newHealthEnv(t, lifecycle.HealthConfig{LostNode: capstore.LostNodeReplace}, map[string]int{"node_1": 3})
	r := e.reserve(t, "rsv_1", 1)
	b := r.Bookings[0]
	i := slices.Index([]string{uuid("node_1", 0), uuid("node_1", 1), uuid("node_1", 2)}, b.DeviceID)
	e.gone["node_1"] = map[int]bool{i: true}
	e.report(t, "node_1")
	e.settle(t)
	d := e.device(t, "node_1", i)
	if d.MissingSince == nil || d.QuarantinedAt == nil || !strings.Contains(d.QuarantineReason, "missing") {
		t.Fatalf("missing GPU %+v", d)
	}
	r = e.rsv(t, "rsv_1")
	if bookedOn(r, "node_1", b.DeviceID) || len(r.Bookings) != 1 {
		t.Fatalf("booking left on a missing GPU: %+v", r.Bookings)
	}
}

// TestCapacityCountsQuarantinedApart: the rollup counts quarantined GPUs
// apart from free, booked and unavailable.
func TestCapacityCountsQuarantinedApart(t *testing.T) {
	t.Parallel()
	e := newHealthEnv(t, lifecycle.HealthConfig{}, map[string]int{"node_1": 4})
	e.reserve(t, "rsv_1", 1)
	booked := e.rsv(t, "rsv_1").Bookings[0].DeviceID
	bad := 0
	for uuid("node_1", bad) == booked {
		bad++
	}
	e.fault(t, "node_1", bad, "thermal")
	e.settle(t)
	if err := workqueue.Enqueue(t.Context(), e.pool, capstore.KindRollup, "all"); err != nil {
		t.Fatal(err)
	}
	e.tick(t, capstore.KindRollup)
	var free, bk, unavailable, quarantined int
	if err := e.pool.QueryRow(t.Context(), `SELECT free, booked, unavailable, quarantined FROM capacity_rollup WHERE pool_id = 'pool_a' AND model = ''`).
		Scan(&free, &bk, &unavailable, &quarantined); err != nil {
		t.Fatal(err)
	}
	if free != 2 || bk != 1 || unavailable != 0 || quarantined != 1 {
		t.Fatalf("free %d booked %d unavailable %d quarantined %d", free, bk, unavailable, quarantined)
	}
}

// TestRemediationResetPresupposesTheQuarantineSpec: the ladder's gpu.reset
// carries min_generation, so a node still on a spec older than the
// quarantine holds it. An unbooked GPU's quarantine leaves the spec as it
// is (the node's current generation); a booked one's moves the booking off
// the node, so the spec that carries the quarantine is the next generation.
// Before, gpu.reset went with min_generation 0 and could reset a GPU the
// node's applied spec still gave a workload.
func TestRemediationResetPresupposesTheQuarantineSpec(t *testing.T) {
	t.Parallel()
	t.Run("unbooked GPU: the current generation", func(t *testing.T) {
		t.Parallel()
		e := newHealthEnv(t, lifecycle.HealthConfig{}, map[string]int{"node_1": 2})
		if _, err := e.pool.Exec(t.Context(), `UPDATE nodes SET generation = 7 WHERE id = 'node_1'`); err != nil {
			t.Fatal(err)
		}
		e.fault(t, "node_1", 1, "XID 79")
		e.settle(t)
		resets := e.commandsOf(t, "node_1", "gpu.reset")
		if len(resets) != 1 || resets[0].MinGeneration != 7 {
			t.Fatalf("gpu.reset %+v, want one with min_generation 7", resets)
		}
	})
	t.Run("booked GPU moved off the node: the next generation", func(t *testing.T) {
		t.Parallel()
		e := newHealthEnv(t, lifecycle.HealthConfig{LostNode: capstore.LostNodeReplace}, map[string]int{"node_1": 2, "node_2": 2})
		r := e.reserve(t, "rsv_1", 1)
		b := r.Bookings[0]
		i := slices.IndexFunc([]string{uuid(b.NodeID, 0), uuid(b.NodeID, 1)}, func(s string) bool { return s == b.DeviceID })
		if _, err := e.pool.Exec(t.Context(), `UPDATE nodes SET generation = 4 WHERE id = $1`, b.NodeID); err != nil {
			t.Fatal(err)
		}
		e.fault(t, b.NodeID, i, "XID 79")
		e.settle(t)
		if r := e.rsv(t, "rsv_1"); bookedOn(r, b.NodeID, b.DeviceID) {
			t.Fatalf("the booking stayed on the quarantined GPU: %+v", r.Bookings)
		}
		resets := e.commandsOf(t, b.NodeID, "gpu.reset")
		if len(resets) != 1 || resets[0].MinGeneration != 5 {
			t.Fatalf("gpu.reset %+v, want one with min_generation 5", resets)
		}
		body, err := resets[0].Body()
		if err != nil || !slices.Equal(body.GetGpuReset().GetGpuUuids(), []string{b.DeviceID}) {
			t.Fatalf("gpu.reset payload %v %v", body, err)
		}
	})
}
