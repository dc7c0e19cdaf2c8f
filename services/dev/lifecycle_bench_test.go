package dev_test

import (
	"context"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/sim"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/services/dev"
)

// lifecycleBenchNodes is the fleet size of BenchmarkLifecycle:
// BC_BENCH_NODES, default 200 (the figure is for 1,000).
func lifecycleBenchNodes() int {
	if v, err := strconv.Atoi(os.Getenv("BC_BENCH_NODES")); err == nil && v > 0 {
		return v
	}
	return 200
}

// lifecycleBenchEnv is a dev control plane with the production intervals
// (heartbeat 10 s, gateway liveness writes every 5 s, the liveness job every
// 5 s) but nodes.notReadyAfter shortened to notReady, so a run takes seconds
// rather than the default 40 s; what is measured beyond notReady is the
// detection lag those intervals make.
func lifecycleBenchEnv(b *testing.B, dbURL, natsURL string, notReady time.Duration) *dev.Env {
	b.Helper()
	port, none := 0, 0
	cfg := &config.Config{
		Database: config.Database{URL: dbURL, MaxConns: maxConnsForBench()},
		NATS:     config.NATS{URL: natsURL},
		Server:   config.Server{Host: "127.0.0.1", Port: &port},
		Dev:      config.Dev{DataDir: b.TempDir(), SimNodes: &none},
		Gateway:  config.Gateway{Listen: "127.0.0.1:0"},
		Nodes:    config.Nodes{NotReadyAfter: config.Duration(notReady), LostAfter: config.Duration(10 * notReady)},
	}
	cfg.Defaults()
	env, err := dev.Start(context.Background(), cfg, nil)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { env.Stop(context.Background()) })
	return env
}

// BenchmarkLifecycle measures, with real simulated daemons (mock NVML) over
// the real gateway:
//
//   - heartbeat-to-notready: every daemon stops at once; per node, the time
//     from its last heartbeat the database recorded (last_seen_at) to its
//     Ready condition turning Unknown (ready_since), p50 and p99, and the
//     lag beyond nodes.notReadyAfter.
//   - fault-to-quarantine: a fault (XID 79) is injected into GPU 0 of every
//     daemon's mock NVML at once; per node, the time from the injection to
//     the health job's quarantine of that GPU (its gpu.quarantined event),
//     p50 and p99, with the daemons' health checks every 5 s (the
//     section's check_interval; 30 s by default).
func BenchmarkLifecycle(b *testing.B) {
	n := lifecycleBenchNodes()
	const notReady = 5 * time.Second
	b.Run("heartbeat-to-notready", func(b *testing.B) {
		ns := natstest.New(b)
		dbURL := pgtest.NewDB(b)
		env := lifecycleBenchEnv(b, dbURL, ns.URL(), notReady)
		db, err := pgxpool.New(context.Background(), dbURL)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(db.Close)
		f := simFleet(b, env, db, "lifecycle", n, nil)
		for range b.N {
			since := time.Now()
			for i := range n {
				f.Halt(i)
			}
			waitFor(b, time.Minute+notReady, "every halted node Unknown", func() bool {
				var k int
				_ = db.QueryRow(context.Background(), `SELECT count(*) FROM nodes WHERE id = ANY($1) AND ready <> 'True'`, f.Nodes()).Scan(&k)
				return k == n
			})
			b.ReportMetric(time.Since(since).Seconds(), "fleet-notready-s")
			rows, err := db.Query(context.Background(), `SELECT extract(epoch FROM ready_since - last_seen_at)::float8 FROM nodes WHERE id = ANY($1)`, f.Nodes())
			if err != nil {
				b.Fatal(err)
			}
			lags, err := pgx.CollectRows(rows, pgx.RowTo[float64])
			if err != nil {
				b.Fatal(err)
			}
			slices.Sort(lags)
			b.ReportMetric(lags[len(lags)/2], "heartbeat-to-notready-p50-s")
			b.ReportMetric(lags[len(lags)*99/100], "heartbeat-to-notready-p99-s")
			b.ReportMetric(lags[len(lags)*99/100]-notReady.Seconds(), "lag-beyond-threshold-p99-s")
			b.StopTimer()
			for i := range n {
				f.Resume(i)
			}
			waitFor(b, 2*time.Minute, "every node Ready again", func() bool {
				var k int
				_ = db.QueryRow(context.Background(), `SELECT count(*) FROM nodes WHERE id = ANY($1) AND ready = 'True'`, f.Nodes()).Scan(&k)
				return k == n
			})
			b.StartTimer()
		}
		b.ReportMetric(float64(n), "nodes")
	})
	b.Run("fault-to-quarantine", func(b *testing.B) {
		const every = 5 * time.Second
		ns := natstest.New(b)
		dbURL := pgtest.NewDB(b)
		env := lifecycleBenchEnv(b, dbURL, ns.URL(), 40*time.Second)
		db, err := pgxpool.New(context.Background(), dbURL)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(db.Close)
		f := simFleet(b, env, db, "faults", n, func(c *sim.Config) { c.HealthCheckInterval = every })
		// The remediation ladder resets a GPU and lifts its quarantine
		// within a second (fleet-wide one ladder per 10 s by the rate), so
		// the quarantine is timed by its gpu.quarantined event, which stays.
		quarantined := func(since time.Time) []float64 {
			rows, err := db.Query(context.Background(), `SELECT extract(epoch FROM min(created_at) - $1::timestamptz)::float8
				FROM outbox WHERE type = 'gpu.quarantined' AND created_at >= $1 AND payload->>'deviceId' IN (SELECT id FROM devices WHERE index = 0)
				GROUP BY resource_id`, since)
			if err != nil {
				b.Fatal(err)
			}
			lags, err := pgx.CollectRows(rows, pgx.RowTo[float64])
			if err != nil {
				b.Fatal(err)
			}
			return lags
		}
		for range b.N {
			start := time.Now()
			for i := range n {
				if err := f.Faults(i).Inject(0, inventory.Fault{XIDs: []uint32{79}}); err != nil {
					b.Fatal(err)
				}
			}
			var lags []float64
			waitFor(b, 2*time.Minute+every, "GPU 0 of every node quarantined", func() bool {
				lags = quarantined(start)
				return len(lags) == n
			})
			b.ReportMetric(time.Since(start).Seconds(), "fleet-quarantined-s")
			slices.Sort(lags)
			b.ReportMetric(lags[len(lags)/2], "fault-to-quarantine-p50-s")
			b.ReportMetric(lags[len(lags)*99/100], "fault-to-quarantine-p99-s")
			b.StopTimer()
			for i := range n {
				if err := f.Faults(i).ClearAll(); err != nil {
					b.Fatal(err)
				}
			}
			waitFor(b, 5*time.Minute, "every GPU healthy again", func() bool {
				var k int
				_ = db.QueryRow(context.Background(), `SELECT count(*) FROM devices WHERE healthy AND quarantined_at IS NULL`).Scan(&k)
				return k == 8*n
			})
			b.StartTimer()
		}
		b.ReportMetric(float64(n), "nodes")
	})
}
