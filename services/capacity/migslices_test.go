package capacity_test

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"google.golang.org/protobuf/encoding/protojson"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/migcatalog"

	"github.com/bettercompute/bettercompute/pkg/bus"
	capstore "github.com/bettercompute/bettercompute/pkg/capacity"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/miglayouts"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	desired "github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/services/nodespec"
)

// sliceID is the MIG UUID the tests' simulated nodes give the slice of
// profile at start on node's GPU i: the same placement keeps its UUID.
func sliceID(node string, i int, profile string, start int) string {
	return fmt.Sprintf("MIG-%s-%d-%s-%d", node, i, profile, start)
}

// reportSlices stores node's slices as its inventory would after applying
// its stored mig section (what the node made): one per instance.
func (e *migEnv) reportSlices(t *testing.T, node string) {
	t.Helper()
	m, _ := e.mig(t, node)
	h200, _ := migcatalog.ByName("H200 141GB")
	var out []nodes.ReportedSlice
	for i := range 8 {
		g := m[gpu(node, i)]
		if !g.GetMigEnabled() {
			continue
		}
		for _, in := range g.GetInstances() {
			p, _ := h200.Profile(in.GetProfile())
			out = append(out, nodes.ReportedSlice{ID: sliceID(node, i, in.GetProfile(), int(in.GetStart())), Parent: gpu(node, i),
				Profile: in.GetProfile(), Start: int32(in.GetStart()), MemoryBytes: int64(p.MemoryMiB) << 20,
				ComputeSlices: int32(p.ComputeSlices), GPUInstanceID: int32(in.GetStart()) + 1})
		}
	}
	if err := nodes.StoreMigSlices(t.Context(), e.db, node, out); err != nil {
		t.Fatal(err)
	}
}

// book creates and places reservation id (tenant root, pool_p) of n
// slices of profile (whole GPUs when ""), as reservations.create does, and
// invalidates the booked nodes.
func (e *migEnv) book(t *testing.T, id, profile string, n int) ([]capstore.Booking, error) {
	t.Helper()
	var err error
	e.inTx(t, func(tx pgx.Tx, q *reconcile.Queue) error {
		r := capstore.Reservation{ID: id, TenantID: "root", PoolID: "pool_p", GPUCount: n, MigProfile: profile}
		if ierr := capstore.Insert(t.Context(), tx, r); ierr != nil {
			return ierr
		}
		sp, serr := tx.Begin(t.Context())
		if serr != nil {
			return serr
		}
		var booked []string
		if booked, err = capstore.Place(t.Context(), sp, &r, capstore.PlaceOptions{}); err != nil {
			return sp.Rollback(t.Context())
		}
		for _, nd := range booked {
			if ierr := desired.Invalidate(t.Context(), q, nd); ierr != nil {
				return ierr
			}
		}
		return sp.Commit(t.Context())
	})
	if err != nil {
		return nil, err
	}
	r, gerr := capstore.Get(t.Context(), e.db, "root", id)
	if gerr != nil {
		t.Fatal(gerr)
	}
	return r.Bookings, nil
}

// release ends reservation id as reservations.release does.
func (e *migEnv) release(t *testing.T, id string) {
	t.Helper()
	e.inTx(t, func(tx pgx.Tx, q *reconcile.Queue) error {
		ns, _, err := capstore.Finish(t.Context(), tx, id, capstore.StateReleased, "")
		if err != nil {
			return err
		}
		for _, n := range ns {
			if err := desired.Invalidate(t.Context(), q, n); err != nil {
				return err
			}
		}
		return nil
	})
}

// sliceEnv is migSetup with every GPU laid out as seven 1g.18gb and the
// slices reported: 112 slices on 16 GPUs.
func sliceEnv(t *testing.T) *migEnv {
	t.Helper()
	e := migSetup(t)
	e.setPool(t, miglayouts.Layout{Name: "small", Selector: h200, Profiles: sevenG1})
	e.converge(t)
	e.reportSlices(t, "node_00")
	e.reportSlices(t, "node_01")
	return e
}

func devicesSection(t *testing.T, e *migEnv, node string) map[string][]string {
	t.Helper()
	var raw string
	if err := e.db.QueryRow(t.Context(), `SELECT spec::text FROM nodes WHERE id = $1`, node).Scan(&raw); err != nil {
		t.Fatal(err)
	}
	var spec agentv1.NodeSpec
	if err := protojson.Unmarshal([]byte(raw), &spec); err != nil {
		t.Fatal(err)
	}
	out := map[string][]string{}
	for _, a := range spec.GetDevices().GetAssignments() {
		out[a.GetReservationId()] = a.GetGpuUuids()
	}
	return out
}

func deviceIDs(bs []capstore.Booking) []string {
	var out []string
	for _, b := range bs {
		out = append(out, b.DeviceID)
	}
	slices.Sort(out)
	return out
}

// TestSliceBookingPacksAndReachesTheNode: slices are booked by profile,
// packed onto the GPU that already has booked slices, and the node's
// devices section names exactly the booked MIG UUIDs.
func TestSliceBookingPacksAndReachesTheNode(t *testing.T) {
	t.Parallel()
	e := sliceEnv(t)
	b1, err := e.book(t, "rsv_1", "1g.18gb", 1)
	if err != nil {
		t.Fatal(err)
	}
	if len(b1) != 1 || b1[0].MigProfile != "1g.18gb" || b1[0].ParentID == "" {
		t.Fatalf("bookings %+v", b1)
	}
	parent, node := b1[0].ParentID, b1[0].NodeID
	b2, err := e.book(t, "rsv_2", "1g.18gb", 3)
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range b2 {
		if b.ParentID != parent || b.NodeID != node || b.DeviceID == b1[0].DeviceID {
			t.Fatalf("not packed onto %s (partly used): %+v", parent, b2)
		}
	}
	e.converge(t)
	sec := devicesSection(t, e, node)
	if got := slices.Sorted(slices.Values(sec["rsv_2"])); !slices.Equal(got, deviceIDs(b2)) || !slices.Equal(sec["rsv_1"], deviceIDs(b1)) {
		t.Fatalf("devices section %v, want rsv_1 %v rsv_2 %v", sec, deviceIDs(b1), deviceIDs(b2))
	}

	// A profile the GPUs have but no slice of: NO_CAPACITY on count.
	if _, err := e.book(t, "rsv_3", "3g.71gb", 1); fault.CodeOf(err) != fault.NoCapacity || fieldOf(err) != "count" {
		t.Fatalf("3g.71gb with none laid out: %v", err)
	}
	// More than free: NO_CAPACITY saying how many are free.
	if _, err := e.book(t, "rsv_4", "1g.18gb", 109); fault.CodeOf(err) != fault.NoCapacity {
		t.Fatalf("109 of 108 free: %v", err)
	}
	if _, err := e.book(t, "rsv_5", "1g.18gb", 108); err != nil {
		t.Fatalf("the last 108: %v", err)
	}
}

// TestSliceOfUnhealthyOrBookedGPUIsNotBooked: slices of a quarantined or
// unhealthy GPU, or of a GPU booked whole, are never booked.
func TestSliceOfUnhealthyOrBookedGPUIsNotBooked(t *testing.T) {
	t.Parallel()
	e := sliceEnv(t)
	if _, err := e.db.Exec(t.Context(), `UPDATE devices SET quarantined_at = now() WHERE id = $1`, gpu("node_00", 0)); err != nil {
		t.Fatal(err)
	}
	if _, err := e.db.Exec(t.Context(), `UPDATE devices SET healthy = false WHERE id = $1`, gpu("node_00", 1)); err != nil {
		t.Fatal(err)
	}
	// GPU 2 booked whole (as before its layout: the drain keeps it).
	fixture.Reservation(t, e.db, fixture.ReservationOpts{ID: "rsv_w", Pool: "pool_p"})
	if _, err := e.db.Exec(t.Context(), `INSERT INTO bookings (reservation_id, node_id, device_id, tenant_id, pool_id)
		VALUES ('rsv_w', 'node_00', $1, 'root', 'pool_p')`, gpu("node_00", 2)); err != nil {
		t.Fatal(err)
	}
	b, err := e.book(t, "rsv_1", "1g.18gb", 91) // 13 usable GPUs × 7
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range b {
		if slices.Contains([]string{gpu("node_00", 0), gpu("node_00", 1), gpu("node_00", 2)}, x.ParentID) {
			t.Fatalf("booked %s of %s", x.DeviceID, x.ParentID)
		}
	}
	if _, err := e.book(t, "rsv_2", "1g.18gb", 1); fault.CodeOf(err) != fault.NoCapacity {
		t.Fatalf("a slice of an unusable GPU was booked: %v", err)
	}
}

// TestWholeGPUNeverTakesAMigGPU: a GPU that its node's desired state puts
// in MIG mode (before any slice exists), or that has slices, is not
// bookable whole.
func TestWholeGPUNeverTakesAMigGPU(t *testing.T) {
	t.Parallel()
	e := migSetup(t)
	e.setNode(t, "node_00", miglayouts.Layout{Name: "g0", Selector: miglayouts.Selector{Indices: []int{0}}, Profiles: []string{"7g.141gb"}})
	e.converge(t)
	// node_01's GPU 1 reports a slice its spec does not ask for.
	if err := nodes.StoreMigSlices(t.Context(), e.db, "node_01", []nodes.ReportedSlice{{ID: "MIG-x", Parent: gpu("node_01", 1),
		Profile: "7g.141gb", ComputeSlices: 7}}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.book(t, "rsv_1", "", 15); fault.CodeOf(err) != fault.NoCapacity {
		t.Fatalf("15 whole GPUs of 14 bookable: %v", err)
	}
	b, err := e.book(t, "rsv_2", "", 14)
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range b {
		if x.DeviceID == gpu("node_00", 0) || x.DeviceID == gpu("node_01", 1) {
			t.Fatalf("booked MIG GPU %s whole", x.DeviceID)
		}
	}
	// The counts placement reads agree (capacity_recount).
	if n := e.count(t, `SELECT coalesce(sum(free), 0) FROM node_capacity_free`); n != 0 {
		t.Fatalf("%d whole GPUs counted free", n)
	}
}

// TestConcurrentSliceBookingsNeverDoubleBook: ten creates race for seven
// slices; seven win with distinct slices, three get NO_CAPACITY; and the
// database refuses a second active booking of a slice outright.
func TestConcurrentSliceBookingsNeverDoubleBook(t *testing.T) {
	t.Parallel()
	e := migSetup(t)
	e.setNode(t, "node_00", miglayouts.Layout{Name: "g0", Selector: miglayouts.Selector{Indices: []int{0}}, Profiles: sevenG1})
	e.converge(t)
	e.reportSlices(t, "node_00")

	var wg sync.WaitGroup
	errs := make([]error, 10)
	for i := range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = reconcile.InTx(t.Context(), e.db, nil, func(tx pgx.Tx, _ *reconcile.Queue) error {
				r := capstore.Reservation{ID: fmt.Sprintf("rsv_%d", i), TenantID: "root", PoolID: "pool_p", GPUCount: 1, MigProfile: "1g.18gb"}
				if err := capstore.Insert(t.Context(), tx, r); err != nil {
					return err
				}
				_, err := capstore.Place(t.Context(), tx, &r, capstore.PlaceOptions{})
				return err
			})
		}()
	}
	wg.Wait()
	won := 0
	for _, err := range errs {
		switch {
		case err == nil:
			won++
		case fault.CodeOf(err) != fault.NoCapacity:
			t.Fatalf("unexpected: %v", err)
		}
	}
	if won != 7 {
		t.Fatalf("%d creates won, want 7", won)
	}
	if n := e.count(t, `SELECT count(DISTINCT device_id) FROM bookings WHERE active AND mig_profile = '1g.18gb'`); n != 7 {
		t.Fatalf("%d distinct slices booked, want 7", n)
	}
	fixture.Reservation(t, e.db, fixture.ReservationOpts{ID: "rsv_x", Pool: "pool_p"})
	_, err := e.db.Exec(t.Context(), `INSERT INTO bookings (reservation_id, node_id, device_id, tenant_id, pool_id, mig_profile)
		SELECT 'rsv_x', node_id, device_id, 'root', 'pool_p', mig_profile FROM bookings WHERE active LIMIT 1`)
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.ConstraintName != "bookings_active_atom" {
		t.Fatalf("a second active booking of a slice: %v", err)
	}
}

// TestSliceQuotaByProfile: a quota on one profile bounds that profile's
// slices only.
func TestSliceQuotaByProfile(t *testing.T) {
	t.Parallel()
	e := migSetup(t)
	e.setPool(t, miglayouts.Layout{Name: "mixed", Selector: h200, Profiles: mixed})
	e.converge(t)
	e.reportSlices(t, "node_00")
	e.reportSlices(t, "node_01")
	if _, _, err := capstore.SetQuota(t.Context(), e.db, capstore.Quota{PoolID: "pool_p", TenantID: "root", MigProfile: "1g.18gb", GPULimit: 2}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.book(t, "rsv_1", "1g.18gb", 2); err != nil {
		t.Fatal(err)
	}
	_, err := e.book(t, "rsv_2", "1g.18gb", 1)
	if fault.CodeOf(err) != fault.QuotaExceeded || fieldOf(err) != "count" {
		t.Fatalf("a third 1g.18gb over a quota of 2: %v", err)
	}
	if _, err := e.book(t, "rsv_3", "3g.71gb", 4); err != nil {
		t.Fatalf("3g.71gb is not under the 1g.18gb quota: %v", err)
	}
	if q, err := capstore.ListQuotas(t.Context(), e.db, "pool_p"); err != nil || len(q) != 1 || q[0].MigProfile != "1g.18gb" {
		t.Fatalf("quotas %+v %v", q, err)
	}
}

// TestSliceGPUHoursWeighted: a slice's GPU-hours are its hours times its
// compute slices over 7.
func TestSliceGPUHoursWeighted(t *testing.T) {
	t.Parallel()
	e := migSetup(t)
	e.setNode(t, "node_00", miglayouts.Layout{Name: "mixed", Selector: h200, Profiles: mixed}) // node_01 stays whole
	e.converge(t)
	e.reportSlices(t, "node_00")
	for _, c := range []struct{ id, profile string }{{"rsv_1", "1g.18gb"}, {"rsv_3", "3g.71gb"}, {"rsv_w", ""}} {
		if _, err := e.book(t, c.id, c.profile, 1); err != nil {
			t.Fatalf("%s: %v", c.profile, err)
		}
	}
	// Bound two hours ago.
	if _, err := e.db.Exec(t.Context(), `UPDATE reservations SET bound_at = now() - interval '2 hours', state = 'bound'`); err != nil {
		t.Fatal(err)
	}
	if _, err := e.db.Exec(t.Context(), `UPDATE bookings SET created_at = now() - interval '2 hours'`); err != nil {
		t.Fatal(err)
	}
	if err := capstore.Usage(t.Context(), e.db, time.Hour); err != nil {
		t.Fatal(err)
	}
	for id, want := range map[string]float64{"rsv_1": 2.0 / 7, "rsv_3": 6.0 / 7, "rsv_w": 2} {
		r, err := capstore.Get(t.Context(), e.db, "root", id)
		if err != nil {
			t.Fatal(err)
		}
		if math.Abs(r.GPUHours-want) > 0.01 {
			t.Fatalf("%s: %.4f GPU-hours, want %.4f", id, r.GPUHours, want)
		}
	}
}

// TestMigCountsByProfile: capacity.get's counts of slices per profile.
func TestMigCountsByProfile(t *testing.T) {
	t.Parallel()
	e := sliceEnv(t)
	if _, err := e.book(t, "rsv_1", "1g.18gb", 3); err != nil {
		t.Fatal(err)
	}
	if _, err := e.db.Exec(t.Context(), `UPDATE devices SET quarantined_at = now() WHERE id = $1`, gpu("node_01", 7)); err != nil {
		t.Fatal(err)
	}
	if _, err := e.db.Exec(t.Context(), `UPDATE devices SET healthy = false WHERE id = $1`, gpu("node_01", 6)); err != nil {
		t.Fatal(err)
	}
	c, err := capstore.MigCounts(t.Context(), e.db, "pool_p", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	want := capstore.SliceCounts{Profile: "1g.18gb", Free: 112 - 3 - 14, Booked: 3, Unavailable: 7, Quarantined: 7}
	if len(c) != 1 || c[0] != want {
		t.Fatalf("counts %+v, want %+v", c, want)
	}
}

// TestMigChangeWaitsOnlyForRemovedBookedSlice: a layout change that keeps
// a booked slice (same profile and start) applies at once; one that
// removes it waits for the booking (reservation.device_draining), while the
// other GPUs change, and applies after the release.
func TestMigChangeWaitsOnlyForRemovedBookedSlice(t *testing.T) {
	t.Parallel()
	e := sliceEnv(t)
	b, err := e.book(t, "rsv_1", "1g.18gb", 1)
	if err != nil {
		t.Fatal(err)
	}
	g := b[0].ParentID
	e.converge(t)
	// Seven 1g to mixed keeps the 1g.18gb at 0 and 1 (the booked one is
	// at 0): it proceeds.
	e.setPool(t, miglayouts.Layout{Name: "mixed", Selector: h200, Profiles: mixed})
	e.converge(t)
	m, _ := e.mig(t, b[0].NodeID)
	if !slices.Equal(m[g].GetProfiles(), mixed) || !slices.Contains(placements(m[g]), "1g.18gb@0") {
		t.Fatalf("a change keeping the booked slice waited: %v", placements(m[g]))
	}
	e.reportSlices(t, b[0].NodeID)

	// One 7g removes it: that GPU waits, the others change.
	e.setPool(t, miglayouts.Layout{Name: "big", Selector: h200, Profiles: []string{"7g.141gb"}})
	e.converge(t)
	m, _ = e.mig(t, b[0].NodeID)
	if !slices.Equal(m[g].GetProfiles(), mixed) {
		t.Fatalf("the GPU with the booked slice changed: %v", placements(m[g]))
	}
	for i := range 8 {
		if gg := gpu(b[0].NodeID, i); gg != g && !slices.Equal(m[gg].GetProfiles(), []string{"7g.141gb"}) {
			t.Fatalf("free GPU %d did not change: %v", i, placements(m[gg]))
		}
	}
	drains := `SELECT count(*) FROM outbox WHERE type = 'reservation.device_draining' AND resource_id = 'rsv_1' AND payload->>'gpuUuid' = $1`
	if n := e.count(t, drains, g); n != 1 {
		t.Fatalf("%d reservation.device_draining events, want 1", n)
	}
	// The booked slice is still in the devices section meanwhile.
	if sec := devicesSection(t, e, b[0].NodeID); !slices.Equal(sec["rsv_1"], []string{b[0].DeviceID}) {
		t.Fatalf("devices section %v", sec)
	}
	e.release(t, "rsv_1")
	e.converge(t)
	m, _ = e.mig(t, b[0].NodeID)
	if !slices.Equal(m[g].GetProfiles(), []string{"7g.141gb"}) {
		t.Fatalf("after the release: %v", placements(m[g]))
	}
}

func fieldOf(err error) string {
	if fe, ok := fault.As(err); ok {
		return fe.Field
	}
	return ""
}

// TestSliceBookingConvergesWithBusStopped: with NATS stopped, a slice
// booking reaches its node's devices section, and a layout change that
// removes a booked slice applies after the release, all through the work
// queue in the database.
func TestSliceBookingConvergesWithBusStopped(t *testing.T) {
	t.Parallel()
	e := migSetup(t) // its own runtime is never ticked: rt below owns every shard
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

	e.setPool(t, miglayouts.Layout{Name: "small", Selector: h200, Profiles: sevenG1})
	poll.UntilNil(t, 30*time.Second, "every GPU laid out with the bus down", func() error {
		for _, node := range []string{"node_00", "node_01"} {
			m, _ := readMig(t, e.db, node)
			for i := range 8 {
				if len(m[gpu(node, i)].GetInstances()) != 7 {
					return fmt.Errorf("%s GPU %d: %v", node, i, m[gpu(node, i)])
				}
			}
		}
		return nil
	})
	e.reportSlices(t, "node_00")
	e.reportSlices(t, "node_01")
	b, err := e.book(t, "rsv_1", "1g.18gb", 1)
	if err != nil {
		t.Fatal(err)
	}
	node, g := b[0].NodeID, b[0].ParentID
	poll.UntilNil(t, 30*time.Second, "the slice in the devices section with the bus down", func() error {
		if sec := devicesSection(t, e, node); !slices.Equal(sec["rsv_1"], []string{b[0].DeviceID}) {
			return fmt.Errorf("devices section %v", sec)
		}
		return nil
	})
	e.setPool(t, miglayouts.Layout{Name: "big", Selector: h200, Profiles: []string{"7g.141gb"}})
	poll.UntilNil(t, 30*time.Second, "the free GPUs re-laid with the bus down", func() error {
		m, _ := readMig(t, e.db, node)
		for i := range 8 {
			gg := gpu(node, i)
			want := []string{"7g.141gb"}
			if gg == g {
				want = sevenG1
			}
			if !slices.Equal(m[gg].GetProfiles(), want) {
				return fmt.Errorf("GPU %d: %v", i, m[gg].GetProfiles())
			}
		}
		return nil
	})
	e.release(t, "rsv_1")
	poll.UntilNil(t, 30*time.Second, "the released GPU re-laid with the bus down", func() error {
		m, _ := readMig(t, e.db, node)
		if !slices.Equal(m[g].GetProfiles(), []string{"7g.141gb"}) {
			return fmt.Errorf("GPU %s: %v", g, m[g].GetProfiles())
		}
		if sec := devicesSection(t, e, node); len(sec) != 0 {
			return fmt.Errorf("devices section %v", sec)
		}
		return nil
	})
}
