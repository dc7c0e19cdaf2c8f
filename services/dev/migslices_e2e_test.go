package dev_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/agent/converge"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/dev"
)

// TestMigSliceBookingReachesTheNode: the first simulated node lays out its
// GPU 0 (make run's layout); once an inventory report carries the slices,
// reservations.create {migProfile, count: 1} books one, nodes.get shows it
// booked, and the node's CDI spec (under its state root) has a device
// named by exactly that MIG UUID, and the reservation's device.
func TestMigSliceBookingReachesTheNode(t *testing.T) {
	t.Parallel()
	port := 0
	cfg := &config.Config{
		Database: config.Database{URL: pgtest.NewDB(t)},
		Server:   config.Server{Host: "127.0.0.1", Port: &port},
		Dev:      config.Dev{DataDir: t.TempDir()},
		Gateway:  config.Gateway{Listen: "127.0.0.1:0"},
	}
	cfg.Defaults()
	env, err := dev.StartRun(t.Context(), cfg, nil, dev.RunOptions{SimMig: true}) // node 0 carries make run's layout
	if err != nil {
		t.Fatal(err)
	}
	defer env.Stop(context.Background())
	node := env.Fleet.Nodes()[0]

	type gpu struct {
		ID        string
		MigLayout []string
		MigSlices []struct{ ID, Profile, ReservationID string }
	}
	var got struct {
		Node struct {
			PoolID  string
			Devices []gpu
		}
	}
	// The node lays GPU 0 out and reports its slices by itself (an
	// inventory report once the mig section changed), no refresh asked.
	poll.UntilNil(t, 60*time.Second, "GPU 0's slices in nodes.get", func() error {
		call(t, env, "nodes/get", map[string]any{"tenantId": "root", "nodeId": node}, &got)
		if len(got.Node.Devices) > 0 && len(got.Node.Devices[0].MigSlices) == 4 {
			return nil
		}
		if len(got.Node.Devices) == 0 {
			return fmt.Errorf("no devices yet")
		}
		return fmt.Errorf("GPU 0 %+v", got.Node.Devices)
	})
	g0 := got.Node.Devices[0]
	if len(g0.MigLayout) != 4 {
		t.Fatalf("GPU 0's layout %v", g0.MigLayout)
	}

	var created struct{ Reservation reservation }
	call(t, env, "reservations/create", map[string]any{"tenantId": "root", "poolId": got.Node.PoolID, "migProfile": "2g.35gb", "count": 1,
		"idempotencyKey": "slice-1"}, &created)
	r := waitState(t, env, created.Reservation.ID, "bound")
	if len(r.Bookings) != 1 || r.Bookings[0].NodeID != node || !strings.HasPrefix(r.Bookings[0].DeviceID, "MIG-") {
		t.Fatalf("bookings %+v", r.Bookings)
	}
	slice := r.Bookings[0].DeviceID
	if !slices.ContainsFunc(g0.MigSlices, func(s struct{ ID, Profile, ReservationID string }) bool {
		return s.ID == slice && s.Profile == "2g.35gb"
	}) {
		t.Fatalf("booked %s, not GPU 0's 2g.35gb slice: %+v", slice, g0.MigSlices)
	}
	call(t, env, "nodes/get", map[string]any{"tenantId": "root", "nodeId": node}, &got)
	for _, s := range got.Node.Devices[0].MigSlices {
		if (s.ID == slice) != (s.ReservationID == r.ID) {
			t.Fatalf("nodes.get slice %+v (booked %s by %s)", s, slice, r.ID)
		}
	}

	// Bound: the node's CDI spec (in the pool's runtime CDI dir,
	// /var/run/cdi under the simulated node's root) has the slice's device
	// and the reservation's.
	var b []byte
	poll.UntilNil(t, 30*time.Second, "the node's CDI spec", func() error {
		var err error
		b, err = os.ReadFile(filepath.Join(env.Fleet.Root(0), "var/run/cdi", filepath.Base(converge.CDISpecFile)))
		if err == nil && !strings.Contains(string(b), slice) {
			err = fmt.Errorf("no %s yet", slice)
		}
		return err
	})
	var spec struct {
		Devices []struct{ Name string } `json:"devices"`
	}
	if err := json.Unmarshal(b, &spec); err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, d := range spec.Devices {
		names = append(names, d.Name)
	}
	if !slices.Contains(names, slice) || !slices.Contains(names, r.ID) {
		t.Fatalf("CDI devices %v, want %s and %s", names, slice, r.ID)
	}
	for _, n := range names {
		if strings.HasPrefix(n, "MIG-") && n != slice {
			t.Fatalf("CDI spec exposes slice %s, not booked", n)
		}
	}
}
