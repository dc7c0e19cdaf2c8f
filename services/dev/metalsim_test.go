package dev_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/dev"
)

// TestDevSimulatedSite: dev's simulated site (dev.simMachines) — a site
// agent in process serving PXE over HTTP on loopback and three machines
// behind fake BMCs — takes every machine to ready through the real flow and
// deploys the first, whose installed system joins as its reserved node;
// the banner names the site and how to list the machines. A restart on the
// same data dir keeps the machines and does not enroll them again.
func TestDevSimulatedSite(t *testing.T) {
	t.Parallel()
	port, none, three := 0, 0, 3
	url := pgtest.NewDB(t)
	dir := t.TempDir()
	startDev := func() *dev.Env {
		t.Helper()
		cfg := &config.Config{
			Database: config.Database{URL: url},
			Server:   config.Server{Host: "127.0.0.1", Port: &port},
			Dev:      config.Dev{DataDir: dir, SimNodes: &none, SimMachines: &three},
			Gateway:  config.Gateway{Listen: "127.0.0.1:0", HeartbeatInterval: config.Duration(200 * time.Millisecond), LivenessInterval: config.Duration(200 * time.Millisecond)},
			Runtime:  config.Runtime{PollBusDown: config.Duration(50 * time.Millisecond), Poll: config.Duration(200 * time.Millisecond)},
			Metal:    config.Metal{Resync: config.Duration(300 * time.Millisecond)},
		}
		cfg.Defaults()
		env, err := dev.Start(t.Context(), cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		return env
	}
	began := time.Now()
	env := startDev()
	db, err := pgxpool.New(t.Context(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if len(env.MetalMachines) != 3 || env.Metal == nil {
		t.Fatalf("%d simulated machines", len(env.MetalMachines))
	}
	banner := env.Banner()
	for _, want := range []string{`site "sim"`, env.MetalSiteID, "3 simulated machines", "better-compute api metal.list tenantId=root"} {
		if !strings.Contains(banner, want) {
			t.Errorf("banner lacks %q:\n%s", want, banner)
		}
	}
	settled := func() bool {
		var ready, joined int
		err := db.QueryRow(t.Context(), `SELECT count(*) FILTER (WHERE m.state = 'ready'),
			count(*) FILTER (WHERE m.state = 'joined' AND m.name = 'sim-1' AND n.state IN ('adopting', 'adopted'))
			FROM machines m LEFT JOIN nodes n ON n.id = m.node_id WHERE m.site_id = $1`, env.MetalSiteID).Scan(&ready, &joined)
		if err != nil {
			t.Fatal(err)
		}
		var failed string
		_ = db.QueryRow(t.Context(), `SELECT coalesce(string_agg(name || ': ' || failed_reason, '; '), '') FROM machines WHERE state = 'failed'`).Scan(&failed)
		if failed != "" {
			t.Fatalf("a simulated machine failed: %s", failed)
		}
		return ready == 2 && joined == 1
	}
	poll.Until(t, 4*time.Minute, "two simulated machines ready and sim-1 joined", settled)
	t.Logf("dev start to two machines ready and one joined: %s", time.Since(began).Round(10*time.Millisecond))

	env.Stop(context.Background())
	again := startDev()
	defer again.Stop(context.Background())
	var machines int
	if err := db.QueryRow(t.Context(), `SELECT count(*) FROM machines`).Scan(&machines); err != nil {
		t.Fatal(err)
	}
	if machines != 3 || again.MetalSiteID != env.MetalSiteID {
		t.Fatalf("after a restart: %d machines, site %s (was %s)", machines, again.MetalSiteID, env.MetalSiteID)
	}
	// The joined machine's installed system comes back with dev.
	restarted := time.Now()
	poll.Until(t, 2*time.Minute, "sim-1's node back after the restart", func() bool {
		var seen *time.Time
		_ = db.QueryRow(t.Context(), `SELECT n.last_seen_at FROM machines m JOIN nodes n ON n.id = m.node_id WHERE m.name = 'sim-1'`).Scan(&seen)
		return seen != nil && seen.After(restarted)
	})
	if !settled() {
		t.Fatal("the simulated machines moved after the restart")
	}
}
