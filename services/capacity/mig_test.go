package capacity_test

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/encoding/protojson"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/bus"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/miglayouts"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	desired "github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/services/capacity"
	"github.com/bettercompute/bettercompute/services/nodespec"
)

// migRegistry is the app's contributors that matter here: the built-in
// ones, capacity's devices section and capacity.mig.
func migRegistry(t *testing.T) *desired.Registry {
	t.Helper()
	reg := nodespec.Builtin()
	if err := capacity.Register(reg); err != nil {
		t.Fatal(err)
	}
	if err := capacity.RegisterMig(reg); err != nil {
		t.Fatal(err)
	}
	return reg
}

// migEnv is a database with pool "pool_p" of nodes node_00, node_01 (8
// mock-DGX H200s each, adopted) and a nodespec runtime driven by Tick.
type migEnv struct {
	db *pgxpool.Pool
	rt *reconcile.Runtime
}

func migSetup(t *testing.T) *migEnv {
	t.Helper()
	pool, err := db.Open(t.Context(), db.Config{URL: pgtest.NewDB(t), MaxConns: 8})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	fixture.Pool(t, pool, fixture.PoolOpts{ID: "pool_p"})
	for i := range 2 {
		fixture.Node(t, pool, fixture.NodeOpts{ID: fmt.Sprintf("node_%02d", i), Pool: "pool_p", State: nodes.StateAdopted, Live: true,
			GPUs: 8, Model: "NVIDIA H200 141GB HBM3e", MemoryBytes: 144384 << 20})
	}
	rt, err := reconcile.New(pool, nil, reconcile.Config{Roles: []string{reconcile.RoleNodeSpec}, Heartbeat: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := rt.Register(nodespec.Reconciler(nodespec.Config{Registry: migRegistry(t)})); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rt.Stop)
	return &migEnv{db: pool, rt: rt}
}

// inTx runs fn in a transaction whose enqueues commit with it.
func (e *migEnv) inTx(t *testing.T, fn func(tx pgx.Tx, q *reconcile.Queue) error) {
	t.Helper()
	if err := reconcile.InTx(t.Context(), e.db, nil, fn); err != nil {
		t.Fatal(err)
	}
}

// setPool sets pool_p's layouts as pools.update does.
func (e *migEnv) setPool(t *testing.T, layouts ...miglayouts.Layout) {
	t.Helper()
	e.inTx(t, func(tx pgx.Tx, q *reconcile.Queue) error {
		if err := miglayouts.SetPool(t.Context(), tx, "pool_p", layouts); err != nil {
			return err
		}
		return desired.InvalidatePool(t.Context(), tx, q, "pool_p")
	})
}

// setNode sets node's overrides as nodes.update does.
func (e *migEnv) setNode(t *testing.T, node string, layouts ...miglayouts.Layout) {
	t.Helper()
	e.inTx(t, func(tx pgx.Tx, q *reconcile.Queue) error {
		if err := miglayouts.SetNode(t.Context(), tx, node, layouts); err != nil {
			return err
		}
		return desired.Invalidate(t.Context(), q, node)
	})
}

func (e *migEnv) converge(t *testing.T) {
	t.Helper()
	tr, err := e.rt.Jobs()[desired.Kind].Tick(t.Context())
	if err != nil || tr.Failed > 0 {
		var last string
		_ = e.db.QueryRow(t.Context(), `SELECT coalesce(last_error, '') FROM work_queue WHERE kind = $1`, desired.Kind).Scan(&last)
		t.Fatalf("nodespec: %+v %v %s", tr, err, last)
	}
}

func (e *migEnv) count(t *testing.T, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := e.db.QueryRow(t.Context(), sql, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// mig reads node's stored mig section, by GPU UUID, and its generation.
func (e *migEnv) mig(t *testing.T, node string) (map[string]*agentv1.GpuMigLayout, int64) {
	t.Helper()
	return readMig(t, e.db, node)
}

func readMig(t *testing.T, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, node string) (map[string]*agentv1.GpuMigLayout, int64) {
	t.Helper()
	var raw string
	var gen int64
	if err := q.QueryRow(t.Context(), `SELECT spec::text, generation FROM nodes WHERE id = $1`, node).Scan(&raw, &gen); err != nil {
		t.Fatal(err)
	}
	var spec agentv1.NodeSpec
	if err := protojson.Unmarshal([]byte(raw), &spec); err != nil {
		t.Fatal(err)
	}
	out := map[string]*agentv1.GpuMigLayout{}
	for _, g := range spec.GetMig().GetGpus() {
		out[g.GetGpuUuid()] = g
	}
	return out, gen
}

func gpu(node string, i int) string { return fmt.Sprintf("GPU-%s-%d", node, i) }

// placements renders an entry's instances, "profile@start" in order.
func placements(g *agentv1.GpuMigLayout) []string {
	var out []string
	for _, in := range g.GetInstances() {
		out = append(out, fmt.Sprintf("%s@%d", in.GetProfile(), in.GetStart()))
	}
	return out
}

// entryJSON is one entry's wire form, for byte comparisons.
func entryJSON(t *testing.T, g *agentv1.GpuMigLayout) string {
	t.Helper()
	b, err := protojson.Marshal(g)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

var (
	mixed   = []string{"3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb"}
	sevenG1 = []string{"1g.18gb", "1g.18gb", "1g.18gb", "1g.18gb", "1g.18gb", "1g.18gb", "1g.18gb"}
	h200    = miglayouts.Selector{Model: "H200 141GB"}
)

// TestMigPoolLayoutReachesEveryNode: a pool's layout by model gives every
// GPU of every node of the pool its placed instances, in index order.
func TestMigPoolLayoutReachesEveryNode(t *testing.T) {
	t.Parallel()
	e := migSetup(t)
	e.setPool(t, miglayouts.Layout{Name: "mixed", Selector: h200, Profiles: mixed})
	e.converge(t)
	for _, node := range []string{"node_00", "node_01"} {
		sec, gen := e.mig(t, node)
		if len(sec) != 8 || gen != 2 {
			t.Fatalf("%s: %d GPUs in its mig section at generation %d, want 8 at 2", node, len(sec), gen)
		}
		for i := range 8 {
			g := sec[gpu(node, i)]
			// The one arrangement of 3g+2g+1g+1g on 8 memory slices: a 1g
			// cannot start at slice 7, so the 3g takes 4-7.
			want := []string{"3g.71gb@4", "2g.35gb@0", "1g.18gb@2", "1g.18gb@3"}
			if !g.GetMigEnabled() || !slices.Equal(g.GetProfiles(), mixed) || !slices.Equal(placements(g), want) {
				t.Fatalf("%s GPU %d: %v", node, i, g)
			}
		}
	}
	// Recomputing changes nothing: the same placements, no new generation.
	e.setPool(t, miglayouts.Layout{Name: "mixed", Selector: h200, Profiles: mixed})
	e.converge(t)
	if _, gen := e.mig(t, "node_00"); gen != 2 {
		t.Fatalf("an unchanged layout moved the generation to %d", gen)
	}

	// Clearing the layouts drops the section: the GPUs are left as they are.
	e.setPool(t)
	e.converge(t)
	if sec, _ := e.mig(t, "node_00"); len(sec) != 0 {
		t.Fatalf("mig section after clearing: %v", sec)
	}
}

// TestMigNodeOverrideWins: a node's own layout applies to the GPUs it
// matches; the node's other GPUs and the other nodes keep the pool's.
func TestMigNodeOverrideWins(t *testing.T) {
	t.Parallel()
	e := migSetup(t)
	e.setPool(t, miglayouts.Layout{Name: "small", Selector: h200, Profiles: sevenG1})
	e.setNode(t, "node_01",
		miglayouts.Layout{Name: "whole", Selector: miglayouts.Selector{Indices: []int{0}}, Profiles: []string{"7g.141gb"}},
		miglayouts.Layout{Name: "off", Selector: miglayouts.Selector{Indices: []int{7}}, Disabled: true})
	e.converge(t)
	sec, _ := e.mig(t, "node_01")
	if g := sec[gpu("node_01", 0)]; !slices.Equal(placements(g), []string{"7g.141gb@0"}) {
		t.Fatalf("node_01 GPU 0 under its override: %v", g)
	}
	if g := sec[gpu("node_01", 7)]; g == nil || g.GetMigEnabled() || len(g.GetInstances()) > 0 {
		t.Fatalf("node_01 GPU 7, MIG off by its override: %v", g)
	}
	for i := 1; i < 7; i++ {
		if g := sec[gpu("node_01", i)]; len(g.GetInstances()) != 7 {
			t.Fatalf("node_01 GPU %d, the pool's layout: %v", i, g)
		}
	}
	other, _ := e.mig(t, "node_00")
	if g := other[gpu("node_00", 0)]; len(g.GetInstances()) != 7 {
		t.Fatalf("node_00 GPU 0 follows the pool: %v", g)
	}
	// Dropping the override gives GPU 0 the pool's layout again.
	e.setNode(t, "node_01")
	e.converge(t)
	sec, _ = e.mig(t, "node_01")
	if g := sec[gpu("node_01", 0)]; len(g.GetInstances()) != 7 {
		t.Fatalf("node_01 GPU 0 after its override went: %v", g)
	}
}

// TestMigChangeOnGPU0LeavesOthersIdentical: changing GPU 0's layout
// changes its entry only, keeping the instances it can; GPUs 1-7's
// entries are byte-identical.
func TestMigChangeOnGPU0LeavesOthersIdentical(t *testing.T) {
	t.Parallel()
	e := migSetup(t)
	e.setPool(t, miglayouts.Layout{Name: "small", Selector: h200, Profiles: sevenG1})
	e.converge(t)
	before, gen := e.mig(t, "node_00")
	e.setNode(t, "node_00", miglayouts.Layout{Name: "gpu0", Selector: miglayouts.Selector{Indices: []int{0}}, Profiles: mixed})
	e.converge(t)
	after, gen2 := e.mig(t, "node_00")
	if gen2 != gen+1 {
		t.Fatalf("generation %d after the change, want %d", gen2, gen+1)
	}
	// The two 1g instances that stay keep slices 0 and 1; the rest fits
	// around them.
	if got := placements(after[gpu("node_00", 0)]); !slices.Equal(got, []string{"3g.71gb@4", "2g.35gb@2", "1g.18gb@0", "1g.18gb@1"}) {
		t.Fatalf("GPU 0 after its change: %v", got)
	}
	for i := 1; i < 8; i++ {
		if b, a := entryJSON(t, before[gpu("node_00", i)]), entryJSON(t, after[gpu("node_00", i)]); a != b {
			t.Fatalf("GPU %d's entry changed with GPU 0's layout:\n%s\n%s", i, b, a)
		}
	}
}

// TestMigBookedGPUWaitsForItsBooking: a GPU with a booking keeps its entry
// while the other GPUs change, its reservation gets one
// reservation.device_draining event, and the change applies once the
// booking is gone.
func TestMigBookedGPUWaitsForItsBooking(t *testing.T) {
	t.Parallel()
	e := migSetup(t)
	e.setPool(t, miglayouts.Layout{Name: "small", Selector: h200, Profiles: sevenG1})
	e.converge(t)
	before, _ := e.mig(t, "node_00")

	fixture.Reservation(t, e.db, fixture.ReservationOpts{ID: "rsv_1", Pool: "pool_p"})
	if _, err := e.db.Exec(t.Context(), `INSERT INTO bookings (reservation_id, node_id, device_id, tenant_id, pool_id)
		VALUES ('rsv_1', 'node_00', $1, 'root', 'pool_p')`, gpu("node_00", 3)); err != nil {
		t.Fatal(err)
	}
	e.setPool(t, miglayouts.Layout{Name: "mixed", Selector: h200, Profiles: mixed})
	e.converge(t)
	after, _ := e.mig(t, "node_00")
	if b, a := entryJSON(t, before[gpu("node_00", 3)]), entryJSON(t, after[gpu("node_00", 3)]); a != b {
		t.Fatalf("the booked GPU changed:\n%s\n%s", b, a)
	}
	for _, i := range []int{0, 1, 2, 4, 5, 6, 7} {
		if g := after[gpu("node_00", i)]; !slices.Equal(g.GetProfiles(), mixed) {
			t.Fatalf("free GPU %d did not take the new layout: %v", i, g)
		}
	}
	drains := `SELECT count(*) FROM outbox WHERE type = 'reservation.device_draining' AND resource_id = 'rsv_1'
		AND payload->>'gpuUuid' = $1 AND payload->>'nodeId' = 'node_00'`
	if n := e.count(t, drains, gpu("node_00", 3)); n != 1 {
		t.Fatalf("%d reservation.device_draining events, want 1", n)
	}
	// Recomputing while it waits writes no second event.
	e.inTx(t, func(_ pgx.Tx, q *reconcile.Queue) error { return desired.Invalidate(t.Context(), q, "node_00") })
	e.converge(t)
	if n := e.count(t, drains, gpu("node_00", 3)); n != 1 {
		t.Fatalf("%d reservation.device_draining events after a recompute, want 1", n)
	}

	// The booking ends (as a release does: the node is recomputed): GPU 3
	// takes the layout, the others do not move.
	e.inTx(t, func(tx pgx.Tx, q *reconcile.Queue) error {
		if _, err := tx.Exec(t.Context(), `UPDATE bookings SET active = false, released_at = now() WHERE reservation_id = 'rsv_1'`); err != nil {
			return err
		}
		return desired.Invalidate(t.Context(), q, "node_00")
	})
	e.converge(t)
	released, _ := e.mig(t, "node_00")
	if g := released[gpu("node_00", 3)]; !slices.Equal(g.GetProfiles(), mixed) {
		t.Fatalf("GPU 3 after its booking ended: %v", g)
	}
	for _, i := range []int{0, 1, 2, 4, 5, 6, 7} {
		if b, a := entryJSON(t, after[gpu("node_00", i)]), entryJSON(t, released[gpu("node_00", i)]); a != b {
			t.Fatalf("GPU %d moved when GPU 3's booking ended:\n%s\n%s", i, b, a)
		}
	}
	if n := e.count(t, `SELECT count(*) FROM mig_layouts_draining`); n != 0 {
		t.Fatalf("%d draining marks left after the layout applied", n)
	}
}

// TestMigConvergesWithBusStopped: with NATS stopped, a pool's new layouts
// reach every node's mig section through the work queue in the database
// (the runtime polls it).
func TestMigConvergesWithBusStopped(t *testing.T) {
	t.Parallel()
	e := migSetup(t)
	ns := natstest.New(t)
	nc, err := bus.Connect(ns.URL(), "mig", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	rt, err := reconcile.New(e.db, nc, reconcile.Config{Roles: []string{reconcile.RoleNodeSpec},
		Heartbeat: 200 * time.Millisecond, Poll: time.Hour, PollBusDown: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := rt.Register(nodespec.Reconciler(nodespec.Config{Registry: migRegistry(t)})); err != nil {
		t.Fatal(err)
	}
	if err := rt.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rt.Stop)
	ns.Stop()
	poll.Until(t, 15*time.Second, "the client to notice", func() bool { return !nc.IsConnected() })

	e.setPool(t, miglayouts.Layout{Name: "mixed", Selector: h200, Profiles: mixed})
	poll.UntilNil(t, 30*time.Second, "every node's mig section with the bus down", func() error {
		for _, node := range []string{"node_00", "node_01"} {
			sec, _ := readMig(t, e.db, node)
			for i := range 8 {
				if g := sec[gpu(node, i)]; len(g.GetInstances()) != 4 {
					return fmt.Errorf("%s GPU %d: %v", node, i, g)
				}
			}
		}
		return nil
	})
}
