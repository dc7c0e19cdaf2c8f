package mcpserver_test

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/services/dev"
	"github.com/bettercompute/bettercompute/services/mcpserver"
)

type mcpSlice struct {
	ID, Profile, ReservationID string
	Start                      int32
	ComputeSlices              int32
}

type mcpGPU struct {
	ID         string
	MigEnabled bool
	MigLayout  []string
	MigSlices  []mcpSlice
}

type mcpCounts struct {
	Free, Booked, Unavailable, Quarantined int32
}

type mcpCapacity struct {
	Total       mcpCounts
	MigProfiles []struct {
		Profile string
		mcpCounts
	}
}

// profile is the counts of one profile in capacity_get's answer.
func (c mcpCapacity) profile(p string) (mcpCounts, bool) {
	for _, m := range c.MigProfiles {
		if m.Profile == p {
			return m.mcpCounts, true
		}
	}
	return mcpCounts{}, false
}

// TestMCPMig: make run's MIG layout on node 0's GPU 0. nodes_get shows the
// GPU's layout and slices, nodes_list and capacity_get count them,
// reservations_create books a slice by migProfile and count (its dry run
// says how many are free of the profile and books nothing), and nodes_get
// then names the reservation on exactly the booked slice.
func TestMCPMig(t *testing.T) {
	env, db := startEnvRun(t, dev.RunOptions{SimMig: true})
	root := connect(t, env.BaseURL()+mcpserver.Path, env.Credential)
	node := env.Fleet.Nodes()[0]

	type nodeOut struct {
		Node struct {
			ID, PoolID                 string
			MigSlices, BookedMigSlices int
		}
		GPUs []mcpGPU
	}
	var n nodeOut
	eventually(t, 2*time.Minute, "GPU 0's four slices in nodes_get", func() bool {
		n = call[nodeOut](t, root, "nodes_get", map[string]any{"nodeId": node})
		return len(n.GPUs) == 8 && len(n.GPUs[0].MigSlices) == 4
	})
	pool, g0 := n.Node.PoolID, n.GPUs[0]
	if want := []string{"3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb"}; !slices.Equal(g0.MigLayout, want) || !g0.MigEnabled {
		t.Fatalf("GPU 0: layout %v, migEnabled %v", g0.MigLayout, g0.MigEnabled)
	}
	var profiles []string
	for i, s := range g0.MigSlices {
		profiles = append(profiles, s.Profile)
		if !strings.HasPrefix(s.ID, "MIG-") || s.ReservationID != "" || s.ComputeSlices < 1 || (i > 0 && s.Start <= g0.MigSlices[i-1].Start) {
			t.Fatalf("slice %d: %+v", i, s)
		}
	}
	slices.Sort(profiles)
	if want := slices.Sorted(slices.Values(g0.MigLayout)); !slices.Equal(profiles, want) {
		t.Fatalf("slices' profiles %v, want the layout's %v", profiles, want)
	}
	for _, g := range n.GPUs[1:] {
		if len(g.MigSlices) != 0 || len(g.MigLayout) != 0 {
			t.Fatalf("GPU %s has MIG: %+v", g.ID, g)
		}
	}
	if n.Node.MigSlices != 4 || n.Node.BookedMigSlices != 0 {
		t.Fatalf("node summary counts %d slices, %d booked", n.Node.MigSlices, n.Node.BookedMigSlices)
	}

	t.Run("capacity_get counts slices by profile", func(t *testing.T) {
		c := call[mcpCapacity](t, root, "capacity_get", map[string]any{"poolId": pool})
		for p, free := range map[string]int32{"3g.71gb": 1, "2g.35gb": 1, "1g.18gb": 2} {
			got, ok := c.profile(p)
			if !ok || got.Free != free || got.Booked != 0 {
				t.Fatalf("%s: %+v (listed %v), want %d free", p, got, ok, free)
			}
		}
	})

	t.Run("bad slice asks name the field", func(t *testing.T) {
		for _, tc := range []struct {
			args  map[string]any
			field string
		}{
			{map[string]any{"poolId": pool, "migProfile": "1g.18gb", "count": 1, "gpuCount": 1}, "gpuCount"},
			{map[string]any{"poolId": pool, "count": 1}, "count"},
			{map[string]any{"poolId": pool, "migProfile": "1g.18gb"}, "count"},
			{map[string]any{"poolId": pool, "migProfile": "1g.18gb", "count": 5000}, "count"},
			{map[string]any{"poolId": pool, "migProfile": strings.Repeat("g", 100), "count": 1}, "migProfile"},
			{map[string]any{"poolId": pool, "migProfile": "9g.999gb", "count": 1}, "migProfile"},
			{map[string]any{"poolId": pool}, "gpuCount"},
		} {
			if msg := refused(t, root, "reservations_create", tc.args); !strings.Contains(msg, tc.field) {
				t.Errorf("reservations_create(%v): %q does not name %s", tc.args, msg, tc.field)
			}
		}
	})

	t.Run("a slice is booked through reservations_create", func(t *testing.T) {
		before := count(t, db, `SELECT count(*) FROM reservations`)
		type dryOut struct {
			DryRun          bool
			Requested, Free int32
			MigProfile      string
			Fits            bool
			Message         string
			Reservation     *reservation
		}
		dry := call[dryOut](t, root, "reservations_create", map[string]any{"poolId": pool, "migProfile": "1g.18gb", "count": 2, "dryRun": true})
		if !dry.DryRun || dry.Requested != 2 || dry.Free != 2 || !dry.Fits || dry.MigProfile != "1g.18gb" || dry.Reservation != nil ||
			!strings.Contains(dry.Message, "1g.18gb") {
			t.Fatalf("dry run %+v", dry)
		}
		if over := call[dryOut](t, root, "reservations_create", map[string]any{"poolId": pool, "migProfile": "1g.18gb", "count": 3, "dryRun": true}); over.Fits || over.Free != 2 {
			t.Fatalf("3 × 1g.18gb of 2: %+v", over)
		}
		if got := count(t, db, `SELECT count(*) FROM reservations`); got != before {
			t.Fatalf("dry runs made %d reservations", got-before)
		}

		type sliceRes struct {
			ID, State, MigProfile string
			GPUCount              int32
			Bookings              []struct{ NodeID, DeviceID, MigProfile, ParentDeviceID string }
		}
		made := call[struct {
			Reservation *sliceRes
			Message     string
		}](t, root, "reservations_create", map[string]any{"poolId": pool, "migProfile": "1g.18gb", "count": 1, "idempotencyKey": "mcp-slice"})
		r := made.Reservation
		if r == nil || r.MigProfile != "1g.18gb" || r.GPUCount != 1 || len(r.Bookings) != 1 || !strings.Contains(made.Message, "MIG 1g.18gb slices") {
			t.Fatalf("create %+v %q", r, made.Message)
		}
		b := r.Bookings[0]
		if b.NodeID != node || b.MigProfile != "1g.18gb" || b.ParentDeviceID != g0.ID || !strings.HasPrefix(b.DeviceID, "MIG-") {
			t.Fatalf("booking %+v", b)
		}
		got := call[struct{ Reservation sliceRes }](t, root, "reservations_get", map[string]any{"reservationId": r.ID})
		if got.Reservation.MigProfile != "1g.18gb" || len(got.Reservation.Bookings) != 1 || got.Reservation.Bookings[0].DeviceID != b.DeviceID {
			t.Fatalf("reservations_get %+v", got.Reservation)
		}

		n := call[nodeOut](t, root, "nodes_get", map[string]any{"nodeId": node})
		booked := 0
		for _, s := range n.GPUs[0].MigSlices {
			if (s.ID == b.DeviceID) != (s.ReservationID == r.ID) {
				t.Fatalf("slice %+v (booked %s by %s)", s, b.DeviceID, r.ID)
			}
			if s.ReservationID != "" {
				booked++
			}
		}
		if booked != 1 || n.Node.BookedMigSlices != 1 {
			t.Fatalf("nodes_get: %d slices booked, the summary says %d", booked, n.Node.BookedMigSlices)
		}
		c := call[mcpCapacity](t, root, "capacity_get", map[string]any{"poolId": pool})
		if got, _ := c.profile("1g.18gb"); got.Free != 1 || got.Booked != 1 {
			t.Fatalf("1g.18gb after the booking: %+v", got)
		}
	})
}
