package dev_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/services/dev"
)

// BenchmarkReservationCreateToBound measures, with the bus up and real
// agents (mock DGX H200s) connected, the time from reservations.create
// being called until the reservation is bound (every booked node has
// observed a spec exposing it), one reservation of one GPU at a time, each
// released after. It reports p50 and p99.
func BenchmarkReservationCreateToBound(b *testing.B) {
	const n = 4
	dbURL := pgtest.NewDB(b)
	db, err := pgxpool.New(context.Background(), dbURL)
	if err != nil {
		b.Fatal(err)
	}
	defer db.Close()
	ns := natstest.New(b)
	env := benchEnv(b, dbURL, ns.URL())
	defer env.Stop(context.Background())
	poolID, _ := joinAgents(b, env, n)
	deadline := time.Now().Add(60 * time.Second)
	for {
		var ready int
		_ = db.QueryRow(context.Background(), `SELECT count(*) FROM nodes WHERE generation >= 1 AND observed_generation = generation`).Scan(&ready)
		if ready == n {
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("%d of %d agents converged", ready, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := range b.N {
		t0 := time.Now()
		var out struct{ Reservation reservation }
		call(b, env, "reservations/create", map[string]any{"tenantId": "root", "poolId": poolID, "gpuCount": 1, "idempotencyKey": fmt.Sprintf("ctb-%d", i)}, &out)
		for {
			var state string
			if err := db.QueryRow(context.Background(), `SELECT state FROM reservations WHERE id = $1`, out.Reservation.ID).Scan(&state); err != nil {
				b.Fatal(err)
			}
			if state == "bound" {
				break
			}
			if time.Since(t0) > 30*time.Second {
				rows, _ := db.Query(context.Background(), `SELECT id, generation, observed_generation, spec::text FROM nodes`)
				for rows.Next() {
					var id, spec string
					var g, o int64
					_ = rows.Scan(&id, &g, &o, &spec)
					b.Log(id, g, o, spec)
				}
				rows.Close()
				rows, _ = db.Query(context.Background(), `SELECT kind, key, attempts, run_after, coalesce(claimed_by, ''), claimed_until, now(), coalesce(last_error, '') FROM work_queue`)
				for rows.Next() {
					var k, key, by, lastErr string
					var a int
					var ra, now time.Time
					var cu *time.Time
					_ = rows.Scan(&k, &key, &a, &ra, &by, &cu, &now, &lastErr)
					b.Log(k, key, a, ra, by, cu, now, lastErr)
				}
				rows.Close()
				b.Fatalf("reservation %s never bound (%s)", out.Reservation.ID, state)
			}
			time.Sleep(time.Millisecond)
		}
		lat = append(lat, time.Since(t0))
		var rel struct{ Reservation reservation }
		call(b, env, "reservations/release", map[string]any{"tenantId": "root", "reservationId": out.Reservation.ID}, &rel)
	}
	b.StopTimer()
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99-ms")
}

// benchEnv starts a dev control plane on db with the bus at natsURL and no
// fleet of its own.
func benchEnv(tb testing.TB, db, natsURL string) *dev.Env {
	tb.Helper()
	port, none := 0, 0
	cfg := &config.Config{
		Database: config.Database{URL: db, MaxConns: 32},
		NATS:     config.NATS{URL: natsURL},
		Server:   config.Server{Host: "127.0.0.1", Port: &port},
		Dev:      config.Dev{DataDir: tb.TempDir(), SimNodes: &none},
		Gateway:  config.Gateway{Listen: "127.0.0.1:0"},
	}
	cfg.Defaults()
	var logger *slog.Logger
	if path := os.Getenv("BENCH_LOG"); path != "" {
		f, err := os.Create(path)
		if err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(func() { _ = f.Close() })
		logger = slog.New(slog.NewTextHandler(f, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	env, err := dev.Start(context.Background(), cfg, logger)
	if err != nil {
		tb.Fatal(err)
	}
	return env
}
