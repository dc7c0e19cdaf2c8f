package lifecycle_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/bus"
	capstore "github.com/bettercompute/bettercompute/pkg/capacity"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	nodelife "github.com/bettercompute/bettercompute/pkg/lifecycle"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
	"github.com/bettercompute/bettercompute/services/capacity"
	"github.com/bettercompute/bettercompute/services/lifecycle"
)

// drainFixture is a database with pool_p and its nodes (adopted,
// schedulable, live, gpus H200s each, one live certificate each), and a
// runtime with the drain job and the capacity reconcilers (the controllers
// and scheduler roles) driven by Tick.
type drainFixture struct {
	db *pgxpool.Pool
	rt *reconcile.Runtime
}

func newDrainFixture(t *testing.T, lostNode string, ids []string, gpus int) *drainFixture {
	t.Helper()
	pool, err := db.Open(t.Context(), db.Config{URL: pgtest.NewDB(t), MaxConns: 8})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	f := &drainFixture{db: pool}
	fixture.Pool(t, pool, fixture.PoolOpts{ID: "pool_p"})
	for _, id := range ids {
		fixture.Node(t, pool, fixture.NodeOpts{ID: id, Pool: "pool_p", State: nodes.StateAdopted, Live: true, GPUs: gpus})
		f.exec(t, `INSERT INTO node_certificates (serial, node_id, not_before, not_after) VALUES ($1, $2, now(), now() + interval '1 day')`, "serial-"+id, id)
	}
	f.rt, err = reconcile.New(pool, nil, reconcile.Config{Roles: []string{reconcile.RoleControllers, reconcile.RoleScheduler}, Heartbeat: time.Hour, LeaseTTL: 3 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := f.rt.Register(lifecycle.Drain(lifecycle.DrainConfig{LostNode: lostNode})); err != nil {
		t.Fatal(err)
	}
	recs, err := capacity.Reconcilers(capacity.Config{LostNode: lostNode})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range recs {
		if err := f.rt.Register(r); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(f.rt.Stop)
	return f
}

func (f *drainFixture) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	if _, err := f.db.Exec(t.Context(), sql, args...); err != nil {
		t.Fatal(err)
	}
}

func (f *drainFixture) count(t *testing.T, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := f.db.QueryRow(t.Context(), sql, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// tick runs one pass of each kind (after enqueuing the drain job's due key
// and capacity's tick, as their timers would).
func (f *drainFixture) tick(t *testing.T, kinds ...string) {
	t.Helper()
	for _, k := range kinds {
		switch k {
		case nodelife.KindDrain:
			f.enqueue(t, k, lifecycle.DrainDueKey)
		case capstore.KindTick:
			f.enqueue(t, k, "all")
		}
		if tr, err := f.rt.Jobs()[k].Tick(t.Context()); err != nil || tr.Failed > 0 {
			t.Fatalf("tick %s: %+v %v", k, tr, err)
		}
	}
}

// settle runs the drain job twice (its due pass enqueues node keys), then
// the placer.
func (f *drainFixture) settle(t *testing.T) {
	t.Helper()
	f.tick(t, nodelife.KindDrain, nodelife.KindDrain, capstore.KindTick, capstore.KindReservations)
}

func (f *drainFixture) enqueue(t *testing.T, kind, key string) {
	t.Helper()
	if err := workqueue.Enqueue(t.Context(), f.db, kind, key); err != nil {
		t.Fatal(err)
	}
}

func (f *drainFixture) reserve(t *testing.T, id string, n int) {
	t.Helper()
	if err := capstore.Insert(t.Context(), f.db, capstore.Reservation{ID: id, TenantID: "root", PoolID: "pool_p", GPUCount: n}); err != nil {
		t.Fatal(err)
	}
}

func (f *drainFixture) rsv(t *testing.T, id string) capstore.Reservation {
	t.Helper()
	r, err := capstore.Get(t.Context(), f.db, "root", id)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func (f *drainFixture) node(t *testing.T, id string) nodes.Node {
	t.Helper()
	n, err := nodes.Lookup(t.Context(), f.db, id)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func (f *drainFixture) drain(t *testing.T, id string, r nodelife.DrainRequest) nodes.Node {
	t.Helper()
	var n nodes.Node
	err := reconcile.InTx(t.Context(), f.db, nil, func(tx pgx.Tx, q *reconcile.Queue) error {
		var err error
		n, err = nodelife.StartDrain(t.Context(), tx, q, id, r)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func bookedNodes(r capstore.Reservation) []string {
	var out []string
	for _, b := range r.Bookings {
		out = append(out, b.NodeID)
	}
	return out
}

// TestDrainWithABookedGPU drains a node holding a booking under each
// lost-node policy: it takes no new booking at once, its reservation is
// told, it is drained at its (short) deadline, and the booking is then
// re-placed (replace), ended (fail) or kept (wait).
func TestDrainWithABookedGPU(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ policy, state string }{
		{capstore.LostNodeReplace, capstore.StatePlaced},
		{capstore.LostNodeFail, capstore.StateFailed},
		{capstore.LostNodeWait, capstore.StatePlaced},
	} {
		t.Run(tc.policy, func(t *testing.T) {
			t.Parallel()
			f := newDrainFixture(t, tc.policy, []string{"node_a", "node_b"}, 2)
			// rsv_1 lands on node_a: node_b is out of service meanwhile.
			f.exec(t, `UPDATE nodes SET state = 'adopting' WHERE id = 'node_b'`)
			f.reserve(t, "rsv_1", 1)
			f.settle(t)
			if r := f.rsv(t, "rsv_1"); r.State != capstore.StatePlaced || len(r.Bookings) != 1 || r.Bookings[0].NodeID != "node_a" {
				t.Fatalf("rsv_1 before the drain: %+v", r)
			}

			n := f.drain(t, "node_a", nodelife.DrainRequest{Deadline: time.Now().Add(1500 * time.Millisecond), Reason: "rack move", By: nodes.DrainByOperator})
			if n.State != nodes.StateDraining {
				t.Fatalf("after StartDrain: %+v", n)
			}
			var payload map[string]any
			if err := f.db.QueryRow(t.Context(), `SELECT payload FROM outbox WHERE type = 'reservation.node_draining' AND resource_id = 'rsv_1'`).Scan(&payload); err != nil {
				t.Fatalf("reservation.node_draining: %v", err)
			}
			if payload["reservationId"] != "rsv_1" || payload["nodeId"] != "node_a" || payload["reason"] != "rack move" || payload["deadline"] == "" {
				t.Fatalf("reservation.node_draining payload: %v", payload)
			}
			if c := f.count(t, `SELECT count(*) FROM outbox WHERE type = 'node.draining' AND resource_id = 'node_a'`); c != 1 {
				t.Fatalf("%d node.draining events", c)
			}

			// No new booking on it at once, though it has a free GPU.
			f.reserve(t, "rsv_2", 1)
			f.settle(t)
			if r := f.rsv(t, "rsv_2"); r.State != capstore.StatePending {
				t.Fatalf("rsv_2 with only a draining node: %+v", r)
			}
			if st := f.node(t, "node_a").State; st != nodes.StateDraining {
				t.Fatalf("node_a with a booking before its deadline: %s", st)
			}
			if _, _, err := capstore.Finish(t.Context(), f.db, "rsv_2", capstore.StateReleased, "test"); err != nil {
				t.Fatal(err)
			}
			f.exec(t, `UPDATE nodes SET state = 'adopted' WHERE id = 'node_b'`)

			// Drained at the deadline.
			poll.Until(t, 20*time.Second, "node_a drained at its deadline", func() bool {
				f.settle(t)
				return f.node(t, "node_a").State == nodes.StateDrained
			})
			var reason string
			if err := f.db.QueryRow(t.Context(), `SELECT payload->>'reason' FROM outbox WHERE type = 'node.drained' AND resource_id = 'node_a'`).Scan(&reason); err != nil || reason != "deadline" {
				t.Fatalf("node.drained: %q %v", reason, err)
			}
			f.settle(t)
			r := f.rsv(t, "rsv_1")
			switch tc.policy {
			case capstore.LostNodeReplace:
				if r.State != tc.state || len(r.Bookings) != 1 || r.Bookings[0].NodeID != "node_b" {
					t.Fatalf("rsv_1 under replace: %+v", r)
				}
				if c := f.count(t, `SELECT count(*) FROM outbox WHERE type = 'reservation.replaced' AND resource_id = 'rsv_1'`); c != 1 {
					t.Fatalf("%d reservation.replaced", c)
				}
			case capstore.LostNodeFail:
				if r.State != tc.state || f.count(t, `SELECT count(*) FROM bookings WHERE reservation_id = 'rsv_1' AND active`) != 0 {
					t.Fatalf("rsv_1 under fail: %+v", r)
				}
			default:
				if r.State != tc.state || len(r.Bookings) != 1 || r.Bookings[0].NodeID != "node_a" {
					t.Fatalf("rsv_1 under wait: %+v", r)
				}
			}
			if c := f.count(t, `SELECT count(*) FROM bookings WHERE node_id = 'node_a' AND active AND reservation_id <> 'rsv_1'`); c != 0 {
				t.Fatalf("%d new bookings on the drained node", c)
			}
		})
	}
}

// TestDrainWithoutBookingsAndUndrain: a node with no active booking is
// drained as soon as the job looks, takes nothing while drained, and is
// bookable again once undrained.
func TestDrainWithoutBookingsAndUndrain(t *testing.T) {
	t.Parallel()
	f := newDrainFixture(t, capstore.LostNodeReplace, []string{"node_a"}, 2)
	f.drain(t, "node_a", nodelife.DrainRequest{Deadline: time.Now().Add(time.Hour), By: nodes.DrainByOperator})
	f.tick(t, nodelife.KindDrain) // the node key StartDrain enqueued
	if n := f.node(t, "node_a"); n.State != nodes.StateDrained {
		t.Fatalf("a node without bookings after one pass: %+v", n)
	}
	var reason string
	if err := f.db.QueryRow(t.Context(), `SELECT payload->>'reason' FROM outbox WHERE type = 'node.drained' AND resource_id = 'node_a'`).Scan(&reason); err != nil || reason != "no_bookings" {
		t.Fatalf("node.drained: %q %v", reason, err)
	}
	if c := f.count(t, `SELECT count(*) FROM outbox WHERE type = 'reservation.node_draining'`); c != 0 {
		t.Fatalf("%d reservation.node_draining for a node without bookings", c)
	}
	f.reserve(t, "rsv_1", 1)
	f.settle(t)
	if r := f.rsv(t, "rsv_1"); r.State != capstore.StatePending {
		t.Fatalf("rsv_1 with only a drained node: %+v", r)
	}
	err := reconcile.InTx(t.Context(), f.db, nil, func(tx pgx.Tx, q *reconcile.Queue) error {
		_, err := nodelife.Undrain(t.Context(), tx, q, "node_a")
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	// Undrain enqueued the pool's placer: one placer pass places rsv_1.
	f.tick(t, capstore.KindReservations)
	if r := f.rsv(t, "rsv_1"); r.State != capstore.StatePlaced || len(r.Bookings) != 1 || r.Bookings[0].NodeID != "node_a" {
		t.Fatalf("rsv_1 after the undrain: %+v", r)
	}
	// Nothing more to do: the node is no drain key any more.
	f.settle(t)
	if n := f.node(t, "node_a"); n.State != nodes.StateAdopted {
		t.Fatalf("after the undrain: %+v", n)
	}
}

// TestRetireRevokesAfterBookingsAreHandled: a retiring node is drained at
// its deadline, and retired (certificates revoked, node.retired, an audit
// row) only once the placer moved its booking away.
func TestRetireRevokesAfterBookingsAreHandled(t *testing.T) {
	t.Parallel()
	f := newDrainFixture(t, capstore.LostNodeReplace, []string{"node_a", "node_b"}, 1)
	f.exec(t, `UPDATE nodes SET state = 'adopting' WHERE id = 'node_b'`)
	f.reserve(t, "rsv_1", 1)
	f.settle(t)
	if got := bookedNodes(f.rsv(t, "rsv_1")); len(got) != 1 || got[0] != "node_a" {
		t.Fatalf("rsv_1: %v", got)
	}
	f.exec(t, `UPDATE nodes SET state = 'adopted' WHERE id = 'node_b'`)
	f.drain(t, "node_a", nodelife.DrainRequest{Deadline: time.Now().Add(time.Hour), By: nodes.DrainByOperator, Retire: true})
	f.tick(t, nodelife.KindDrain, nodelife.KindDrain)
	if n := f.node(t, "node_a"); n.State != nodes.StateDraining || !n.Retiring {
		t.Fatalf("a retiring node with a booking before its deadline: %+v", n)
	}
	f.exec(t, `UPDATE nodes SET drain_deadline = now() WHERE id = 'node_a'`)
	// One drain pass drains it but cannot retire it: its booking is
	// still there until the placer runs.
	f.tick(t, nodelife.KindDrain, nodelife.KindDrain)
	if n := f.node(t, "node_a"); n.State != nodes.StateDrained {
		t.Fatalf("past its deadline: %+v", n)
	}
	if c := f.count(t, `SELECT count(*) FROM node_certificates WHERE node_id = 'node_a' AND revoked_at IS NULL`); c != 1 {
		t.Fatalf("%d live certificates before the bookings were handled", c)
	}
	f.tick(t, capstore.KindReservations, nodelife.KindDrain, nodelife.KindDrain)
	if got := bookedNodes(f.rsv(t, "rsv_1")); len(got) != 1 || got[0] != "node_b" {
		t.Fatalf("rsv_1 after the drain: %v", got)
	}
	n := f.node(t, "node_a")
	if n.State != nodes.StateRetired || n.RetiredAt == nil {
		t.Fatalf("after its bookings were handled: %+v", n)
	}
	if c := f.count(t, `SELECT count(*) FROM node_certificates WHERE node_id = 'node_a' AND revoked_at IS NULL`); c != 0 {
		t.Fatalf("%d live certificates of a retired node", c)
	}
	if c := f.count(t, `SELECT count(*) FROM node_certificates WHERE node_id = 'node_b' AND revoked_at IS NULL`); c != 1 {
		t.Fatal("another node's certificate was revoked")
	}
	if c := f.count(t, `SELECT count(*) FROM outbox WHERE type = 'node.retired' AND resource_id = 'node_a' AND (payload->>'revokedCertificates')::int = 1`); c != 1 {
		t.Fatalf("%d node.retired events", c)
	}
	if c := f.count(t, `SELECT count(*) FROM audit WHERE action = 'compute:nodes:retire' AND actor = 'drain'`); c != 1 {
		t.Fatalf("%d audit rows of the retirement", c)
	}
	// Settled: another pass changes nothing.
	f.settle(t)
	if c := f.count(t, `SELECT count(*) FROM outbox WHERE type IN ('node.retired', 'node.drained') AND resource_id = 'node_a'`); c != 2 {
		t.Fatalf("%d drained/retired events after settling, want one each", c)
	}
}

// TestDrainChaosBusStopped runs the drain job on the runtime's own timers
// with NATS stopped: the due key is enqueued and polled without pokes, and
// the drain completes at its deadline.
func TestDrainChaosBusStopped(t *testing.T) {
	t.Parallel()
	pool := newPool(t, "node_1")
	if _, err := pool.Exec(t.Context(), `UPDATE nodes SET state = 'adopted', generation = 1, observed_generation = 1`); err != nil {
		t.Fatal(err)
	}
	fixture.Device(t, pool, fixture.DeviceOpts{Node: "node_1", ID: "GPU-1", MemoryBytes: 1})
	if err := capstore.Insert(t.Context(), pool, capstore.Reservation{ID: "rsv_1", TenantID: "root", PoolID: "pool_a", GPUCount: 1}); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(t.Context(), `INSERT INTO bookings (reservation_id, node_id, device_id, tenant_id, pool_id) VALUES ('rsv_1', 'node_1', 'GPU-1', 'root', 'pool_a')`); err != nil {
		t.Fatal(err)
	}
	ns := natstest.New(t)
	nc, err := bus.Connect(ns.URL(), "drain", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	poll.Until(t, 10*time.Second, "the bus to connect", nc.IsConnected)

	rt, err := reconcile.New(pool, nc, reconcile.Config{
		Roles: []string{reconcile.RoleControllers}, Heartbeat: 200 * time.Millisecond,
		Poll: time.Hour, PollBusDown: 50 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := rt.Register(lifecycle.Drain(lifecycle.DrainConfig{Every: 100 * time.Millisecond, LostNode: capstore.LostNodeReplace})); err != nil {
		t.Fatal(err)
	}
	if err := rt.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rt.Stop)

	// The drain starts with the bus up; the bus goes down before its
	// deadline.
	deadline := time.Now().Add(2 * time.Second)
	err = rt.InTx(t.Context(), func(tx pgx.Tx, q *reconcile.Queue) error {
		_, err := nodelife.StartDrain(t.Context(), tx, q, "node_1", nodelife.DrainRequest{Deadline: deadline, By: nodes.DrainByOperator})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	ns.Stop()
	poll.Until(t, 15*time.Second, "the client to notice", func() bool { return !nc.IsConnected() })
	var state string
	if err := pool.QueryRow(t.Context(), `SELECT state FROM nodes WHERE id = 'node_1'`).Scan(&state); err != nil || state != nodes.StateDraining {
		t.Fatalf("node_1 before its deadline: %s %v", state, err)
	}
	poll.Until(t, 30*time.Second, "node_1 drained at its deadline with the bus down", func() bool {
		var s string
		_ = pool.QueryRow(context.Background(), `SELECT state FROM nodes WHERE id = 'node_1'`).Scan(&s)
		return s == nodes.StateDrained
	})
	var drainedAt time.Time
	if err := pool.QueryRow(t.Context(), `SELECT created_at FROM outbox WHERE type = 'node.drained' AND resource_id = 'node_1'`).Scan(&drainedAt); err != nil {
		t.Fatal(err)
	}
	if drainedAt.Before(deadline) {
		t.Fatalf("drained at %s, before its deadline %s, with a booking", drainedAt, deadline)
	}
}
