package capacity_test

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/proto/migcatalog"

	capstore "github.com/bettercompute/bettercompute/pkg/capacity"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/miglayouts"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	desired "github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/services/capacity"
)

// placer is a scheduler runtime on e's database running the capacity
// reconcilers under the lost-node policy, driven by Tick.
func (e *migEnv) placer(t *testing.T, policy string) *reconcile.Runtime {
	t.Helper()
	rt, err := reconcile.New(e.db, nil, reconcile.Config{Roles: []string{reconcile.RoleScheduler}, Heartbeat: time.Hour, LeaseTTL: 3 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	recs, err := capacity.Reconcilers(capacity.Config{LostNode: policy})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range recs {
		if err := rt.Register(r); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(rt.Stop)
	return rt
}

// gpuIndex is the index of a test GPU UUID (gpu(node, i)).
func gpuIndex(t *testing.T, uuid string) int {
	t.Helper()
	var i int
	if _, err := fmt.Sscanf(uuid[strings.LastIndex(uuid, "-")+1:], "%d", &i); err != nil {
		t.Fatal(err)
	}
	return i
}

// reservation reads reservation id.
func (e *migEnv) reservation(t *testing.T, id string) capstore.Reservation {
	t.Helper()
	r, err := capstore.Get(t.Context(), e.db, "root", id)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// entries is node's stored mig entries as wire JSON, by GPU UUID.
func (e *migEnv) entries(t *testing.T, node string) map[string]string {
	t.Helper()
	m, _ := e.mig(t, node)
	out := map[string]string{}
	for u, g := range m {
		out[u] = entryJSON(t, g)
	}
	return out
}

// TestMigDrainPolicies: a node's new layout for one GPU removes a slice
// booked by rsv_1 (a node override on that GPU's index: seven 1g.18gb to
// one 7g.141gb). Under capacity.lostNode wait the GPU waits and the
// booking stays; under replace the placer books another free 1g.18gb
// slice, not on that GPU, and the change applies; under fail rsv_1 fails
// naming the layout change and the change applies. No other GPU's entry
// moves in any case.
func TestMigDrainPolicies(t *testing.T) {
	t.Parallel()
	for _, policy := range capstore.LostNodePolicies {
		t.Run(policy, func(t *testing.T) {
			t.Parallel()
			e := sliceEnv(t)
			b, err := e.book(t, "rsv_1", "1g.18gb", 1)
			if err != nil {
				t.Fatal(err)
			}
			e.converge(t)
			node, g, slice := b[0].NodeID, b[0].ParentID, b[0].DeviceID
			before := e.entries(t, node)
			e.setNode(t, node, miglayouts.Layout{Name: "big", Selector: miglayouts.Selector{Indices: []int{gpuIndex(t, g)}},
				Profiles: []string{"7g.141gb"}})
			e.converge(t)
			if got := e.entries(t, node); !maps(got, before) {
				t.Fatalf("the GPU with the booked slice changed before its booking was handled")
			}
			marked := e.count(t, `SELECT count(*) FROM mig_layouts_draining WHERE node_id = $1 AND gpu_uuid = $2 AND devices = ARRAY[$3]`, node, g, slice)
			if marked != 1 {
				t.Fatalf("draining marks naming the booked slice: %d, want 1", marked)
			}

			rt := e.placer(t, policy)
			tick(t, rt, capstore.KindTick, capstore.KindReservations)
			e.converge(t)
			after := e.entries(t, node)
			for u, j := range before {
				if u != g && after[u] != j {
					t.Fatalf("GPU %s moved:\n%s\n%s", u, j, after[u])
				}
			}
			r := e.reservation(t, "rsv_1")
			drained := `SELECT count(*) FROM outbox WHERE type = 'reservation.device_drained' AND resource_id = 'rsv_1'
				AND payload->>'gpuUuid' = $1 AND payload->>'deviceId' = $2 AND payload->>'action' = $3`
			switch policy {
			case capstore.LostNodeWait:
				if after[g] != before[g] || len(r.Bookings) != 1 || r.Bookings[0].DeviceID != slice {
					t.Fatalf("wait: entry %s, bookings %+v", after[g], r.Bookings)
				}
				if n := e.count(t, `SELECT count(*) FROM outbox WHERE type = 'reservation.device_drained'`); n != 0 {
					t.Fatalf("wait: %d reservation.device_drained events", n)
				}
				return
			case capstore.LostNodeReplace:
				if !capstore.Live(r.State) || len(r.Bookings) != 1 {
					t.Fatalf("replace: %s %+v", r.State, r.Bookings)
				}
				nb := r.Bookings[0]
				if nb.DeviceID == slice || nb.ParentID == g || nb.MigProfile != "1g.18gb" {
					t.Fatalf("replace booked %+v (the drained GPU is %s)", nb, g)
				}
				if n := e.count(t, drained, g, slice, "replaced"); n != 1 {
					t.Fatalf("%d reservation.device_drained replaced events", n)
				}
			case capstore.LostNodeFail:
				if r.State != capstore.StateFailed || !strings.Contains(r.Reason, "MIG layout change of GPU "+g) {
					t.Fatalf("fail: %s %q", r.State, r.Reason)
				}
				if n := e.count(t, drained, g, slice, "failed"); n != 1 {
					t.Fatalf("%d reservation.device_drained failed events", n)
				}
			}
			m, _ := e.mig(t, node)
			if !slices.Equal(placements(m[g]), []string{"7g.141gb@0"}) {
				t.Fatalf("%s: the change did not apply after the booking was handled: %v", policy, placements(m[g]))
			}
			if n := e.count(t, `SELECT count(*) FROM mig_layouts_draining`); n != 0 {
				t.Fatalf("%d draining marks left", n)
			}
		})
	}
}

func maps(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// TestMigDrainReplacesWholeGPU: a whole-GPU booking on a GPU that a node
// override puts in MIG mode moves, under replace, to another whole GPU (never
// the one being re-laid), and the GPU takes its layout.
func TestMigDrainReplacesWholeGPU(t *testing.T) {
	t.Parallel()
	e := migSetup(t)
	e.converge(t)
	b, err := e.book(t, "rsv_w", "", 1)
	if err != nil {
		t.Fatal(err)
	}
	e.converge(t)
	node, g := b[0].NodeID, b[0].DeviceID
	e.setNode(t, node, miglayouts.Layout{Name: "small", Selector: miglayouts.Selector{Indices: []int{gpuIndex(t, g)}}, Profiles: sevenG1})
	e.converge(t)
	if m, _ := e.mig(t, node); m[g] != nil {
		t.Fatalf("the booked GPU got an entry before its booking moved: %v", placements(m[g]))
	}
	rt := e.placer(t, capstore.LostNodeReplace)
	tick(t, rt, capstore.KindTick, capstore.KindReservations)
	e.converge(t)
	r := e.reservation(t, "rsv_w")
	if !capstore.Live(r.State) || len(r.Bookings) != 1 || r.Bookings[0].DeviceID == g || r.Bookings[0].MigProfile != "" {
		t.Fatalf("replace: %s %+v (re-laid GPU %s)", r.State, r.Bookings, g)
	}
	m, _ := e.mig(t, node)
	if !slices.Equal(m[g].GetProfiles(), sevenG1) || len(m) != 1 {
		t.Fatalf("after the move: %d entries, GPU %s %v", len(m), g, placements(m[g]))
	}
}

// TestMigPlacesFromReportedSlices: capacity.mig keeps what a GPU reports
// it has, not only its last entry. GPU 0 of node_00 was re-laid by hand (it
// reports 2g.35gb at 0, 1g.18gb at 2 and 3, 3g.71gb at 4; its entry says
// seven 1g.18gb): the same layout keeps its entry (the node lays it out
// again), and the new layout (3g, 2g, 1g, 1g) keeps all four where they
// are, where GPU 1, which reports its entry, keeps its 1g.18gb at 0 and 1.
func TestMigPlacesFromReportedSlices(t *testing.T) {
	t.Parallel()
	e := sliceEnv(t)
	h, _ := migcatalog.ByName("H200 141GB")
	slice := func(i int, profile string, start int) nodes.ReportedSlice {
		p, _ := h.Profile(profile)
		return nodes.ReportedSlice{ID: sliceID("node_00", i, profile, start), Parent: gpu("node_00", i), Profile: profile,
			Start: int32(start), MemoryBytes: int64(p.MemoryMiB) << 20, ComputeSlices: int32(p.ComputeSlices), GPUInstanceID: int32(start) + 1}
	}
	out := []nodes.ReportedSlice{slice(0, "2g.35gb", 0), slice(0, "1g.18gb", 2), slice(0, "1g.18gb", 3), slice(0, "3g.71gb", 4)}
	for i := 1; i < 8; i++ {
		for s := range 7 {
			out = append(out, slice(i, "1g.18gb", s))
		}
	}
	if err := nodes.StoreMigSlices(t.Context(), e.db, "node_00", out); err != nil {
		t.Fatal(err)
	}
	// Unchanged layout: the entry stays (the node lays the GPU out again).
	_, gen := e.mig(t, "node_00")
	e.inTx(t, func(_ pgx.Tx, q *reconcile.Queue) error { return desired.Invalidate(t.Context(), q, "node_00") })
	e.converge(t)
	m, gen2 := e.mig(t, "node_00")
	if gen2 != gen || len(placements(m[gpu("node_00", 0)])) != 7 {
		t.Fatalf("recomputing the same layout moved the node: generation %d → %d, GPU 0 %v", gen, gen2, placements(m[gpu("node_00", 0)]))
	}

	e.setPool(t, miglayouts.Layout{Name: "mixed", Selector: h200, Profiles: mixed})
	e.converge(t)
	m, _ = e.mig(t, "node_00")
	if got, want := placements(m[gpu("node_00", 0)]), []string{"3g.71gb@4", "2g.35gb@0", "1g.18gb@2", "1g.18gb@3"}; !slices.Equal(got, want) {
		t.Fatalf("GPU 0 (reports %v): %v", want, got)
	}
	if got, want := placements(m[gpu("node_00", 1)]), []string{"3g.71gb@4", "2g.35gb@2", "1g.18gb@0", "1g.18gb@1"}; !slices.Equal(got, want) {
		t.Fatalf("GPU 1 (reports seven 1g): %v, want %v", got, want)
	}
}

// TestMigSliceAboutToGoIsNotBooked: once node_00's GPU 0 has a new layout
// in its stored mig section (seven 1g.18gb to 3g, 2g, 1g, 1g: the 1g.18gb
// at 2 to 6 go), the five slices it removes are not booked although the
// node still reports them, not counted free, and every other slice is.
func TestMigSliceAboutToGoIsNotBooked(t *testing.T) {
	t.Parallel()
	e := sliceEnv(t)
	e.setNode(t, "node_00", miglayouts.Layout{Name: "mixed", Selector: miglayouts.Selector{Indices: []int{0}}, Profiles: mixed})
	e.converge(t)
	m, _ := e.mig(t, "node_00")
	if got := placements(m[gpu("node_00", 0)]); !slices.Contains(got, "1g.18gb@0") || !slices.Contains(got, "1g.18gb@1") {
		t.Fatalf("GPU 0's new entry %v", got)
	}
	counts, err := capstore.MigCounts(t.Context(), e.db, "pool_p", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if len(counts) != 1 || counts[0].Free != 107 || counts[0].Unavailable != 5 {
		t.Fatalf("counts %+v, want 107 free and 5 unavailable 1g.18gb", counts)
	}
	if n := e.count(t, `SELECT coalesce(sum(free), 0) FROM node_slices_free WHERE node_id = 'node_00' AND profile = '1g.18gb'`); n != 51 {
		t.Fatalf("node_00 counts %d free 1g.18gb, want 51", n)
	}
	b, err := e.book(t, "rsv_all", "1g.18gb", 107)
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range b {
		if x.ParentID == gpu("node_00", 0) && x.DeviceID != sliceID("node_00", 0, "1g.18gb", 0) && x.DeviceID != sliceID("node_00", 0, "1g.18gb", 1) {
			t.Fatalf("booked %s, which GPU 0's pending layout removes", x.DeviceID)
		}
	}
	_, err = e.book(t, "rsv_more", "1g.18gb", 1)
	if f := (*fault.Error)(nil); !errors.As(err, &f) || f.Code != fault.NoCapacity {
		t.Fatalf("one more: %v, want NO_CAPACITY", err)
	}
}
