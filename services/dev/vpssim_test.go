package dev_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/dev"
)

// TestDevVPSPools: dev.simInstances (on by default with simulated nodes)
// starts a hosted pool of two simulated VPS hosts and a provider pool on a
// fake provider on loopback; an instance created in each runs, the hosted
// one as a process on one of the pool's hosts, the provider one as a
// machine at the fake provider.
func TestDevVPSPools(t *testing.T) {
	t.Parallel()
	port, one, noMachines := 0, 1, 0
	cfg := &config.Config{
		Database: config.Database{URL: pgtest.NewDB(t)},
		Server:   config.Server{Host: "127.0.0.1", Port: &port},
		Dev:      config.Dev{DataDir: t.TempDir(), SimNodes: &one, SimMachines: &noMachines},
		Gateway:  config.Gateway{Listen: "127.0.0.1:0"},
	}
	cfg.Defaults()
	env, err := dev.Start(t.Context(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		env.Stop(context.Background())
		if err := env.VPSFleet.DeleteInstances(context.Background()); err != nil {
			t.Errorf("ending the instances' processes: %v", err)
		}
	})
	if env.VPSFleet == nil || len(env.VPSFleet.Nodes()) != dev.SimVPSHosts || env.Provider == nil ||
		!strings.HasPrefix(env.ProviderURL, "http://127.0.0.1:") {
		t.Fatalf("dev started no VPS pools: fleet %v, provider %q", env.VPSFleet, env.ProviderURL)
	}

	db, err := pgxpool.New(t.Context(), cfg.Database.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	poll.Until(t, 2*time.Minute, "the VPS hosts to be adopted and schedulable", func() bool {
		var n int
		err := db.QueryRow(t.Context(), `SELECT count(*) FROM nodes WHERE pool_id = $1 AND state = 'adopted' AND observed_generation >= 1`,
			env.VPSPoolID).Scan(&n)
		return err == nil && n == dev.SimVPSHosts
	})

	var hosted struct{ Instance instanceJSON }
	call(t, env, "instances/create", map[string]any{"tenantId": "root", "poolId": env.VPSPoolID, "vcpus": 2, "memoryMiB": 4096, "diskGiB": 40,
		"image": "ubuntu-24.04", "idempotencyKey": "dev-vm-1"}, &hosted)
	in := waitInstance(t, env, hosted.Instance.ID, "running")
	host := slices.Index(env.VPSFleet.Nodes(), in.NodeID)
	if host < 0 {
		t.Fatalf("instance on %q, not on a VPS host %v", in.NodeID, env.VPSFleet.Nodes())
	}
	if pidOf(t, env.VPSFleet, host, in.ID) == 0 {
		t.Fatal("no process runs the hosted instance")
	}

	var prov struct{ Instance instanceJSON }
	call(t, env, "instances/create", map[string]any{"tenantId": "root", "poolId": env.ProviderPoolID, "vcpus": 2, "memoryMiB": 4096, "diskGiB": 40,
		"image": "ubuntu-24.04", "idempotencyKey": "dev-vm-2"}, &prov)
	waitInstance(t, env, prov.Instance.ID, "running")
	if ms := env.Provider.MachinesFor(prov.Instance.ID); len(ms) != 1 {
		t.Fatalf("the fake provider has %d machines for %s, want 1", len(ms), prov.Instance.ID)
	}
}
