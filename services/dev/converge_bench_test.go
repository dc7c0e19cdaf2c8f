package dev_test

import (
	"context"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/services/dev"
)

// BenchmarkConvergence measures the time from an API change to
// observedGeneration == generation: for one node (nodes.update, p50/p99) and
// for a change that touches every node (pools.update of the site settings),
// with the bus up and down. The fleet is dev's simulated nodes (real agent,
// mock NVML) over the real gateway; BC_BENCH_NODES sets its size (default
// 20), BC_BENCH_MAXCONNS the pool (database.maxConns) and
// BC_BENCH_CONCURRENCY the runtime's runs in flight (runtime.concurrency).
// fleet-specs-stored-s is when every node's new spec was stored (the
// nodespec controller's share of fleet-change-s).
func BenchmarkConvergence(b *testing.B) {
	n, noMachines := 20, 0
	if v, err := strconv.Atoi(os.Getenv("BC_BENCH_NODES")); err == nil && v > 0 {
		n = v
	}
	for _, up := range []bool{true, false} {
		name := "bus-down"
		if up {
			name = "bus-up"
		}
		b.Run(name, func(b *testing.B) {
			ns := natstest.New(b)
			dbURL := pgtest.NewDB(b)
			port := 0
			cfg := &config.Config{
				Database: config.Database{URL: dbURL, MaxConns: maxConnsForBench()},
				NATS:     config.NATS{URL: ns.URL()},
				Server:   config.Server{Host: "127.0.0.1", Port: &port},
				Dev:      config.Dev{DataDir: b.TempDir(), SimNodes: &n, SimMachines: &noMachines}, // it counts every node
				Gateway:  config.Gateway{Listen: "127.0.0.1:0"},
				Runtime:  config.Runtime{Concurrency: concurrencyForBench()},
			}
			cfg.Defaults()
			env, err := dev.Start(b.Context(), cfg, nil)
			if err != nil {
				b.Fatal(err)
			}
			defer env.Stop(context.Background())
			db, err := pgxpool.New(b.Context(), dbURL)
			if err != nil {
				b.Fatal(err)
			}
			defer db.Close()
			converged := func(gen int64, node string) bool {
				var done int
				_ = db.QueryRow(b.Context(), `SELECT count(*) FROM nodes WHERE generation >= $1 AND observed_generation = generation
					AND ($2 = '' OR id = $2)`, gen, node).Scan(&done)
				if node != "" {
					return done == 1
				}
				return done == n
			}
			wait := func(gen int64, node string) time.Duration {
				start := time.Now()
				for !converged(gen, node) {
					if time.Since(start) > 2*time.Minute {
						b.Fatalf("no convergence on generation %d (%q)", gen, node)
					}
					time.Sleep(2 * time.Millisecond)
				}
				return time.Since(start)
			}
			wait(1, "")
			if !up {
				ns.Stop()
			}
			nodes := env.Fleet.Nodes()
			gen := func(node string) int64 {
				var g int64
				_ = db.QueryRow(b.Context(), `SELECT generation FROM nodes WHERE id = $1`, node).Scan(&g)
				return g
			}
			var one []time.Duration
			b.ResetTimer()
			for i := range b.N {
				node := nodes[i%len(nodes)]
				next := gen(node) + 1
				start := time.Now()
				var out struct{}
				call(b, env, "nodes/update", map[string]any{"tenantId": "root", "nodeId": node, "labels": map[string]string{"i": strconv.Itoa(i)}, "updateMask": "labels"}, &out)
				wait(next, node)
				one = append(one, time.Since(start))
			}
			b.StopTimer()
			slices.Sort(one)
			b.ReportMetric(float64(one[len(one)/2].Microseconds())/1000, "one-node-p50-ms")
			b.ReportMetric(float64(one[len(one)*99/100].Microseconds())/1000, "one-node-p99-ms")

			// A change to every node: the pool's site settings.
			var pools struct{ Pools []struct{ ID, Name string } }
			call(b, env, "pools/list", map[string]any{"tenantId": "root"}, &pools)
			var pool string
			for _, p := range pools.Pools {
				if p.Name == "sim" {
					pool = p.ID
				}
			}
			start := time.Now()
			var out struct{}
			call(b, env, "pools/update", map[string]any{"tenantId": "root", "poolId": pool, "site": map[string]any{"logLevel": "debug"}, "updateMask": "site"}, &out)
			var specced time.Duration
			for {
				var done, computed int
				_ = db.QueryRow(b.Context(), `SELECT count(*) FILTER (WHERE observed_generation = generation AND spec->'site'->>'logLevel' = 'debug'),
					count(*) FILTER (WHERE spec->'site'->>'logLevel' = 'debug') FROM nodes`).Scan(&done, &computed)
				if computed == n && specced == 0 {
					specced = time.Since(start)
				}
				if done == n {
					break
				}
				if time.Since(start) > 5*time.Minute {
					b.Fatalf("the fleet did not converge: %d of %d", done, n)
				}
				time.Sleep(5 * time.Millisecond)
			}
			b.ReportMetric(time.Since(start).Seconds(), "fleet-change-s")
			b.ReportMetric(specced.Seconds(), "fleet-specs-stored-s")
			b.ReportMetric(float64(n), "nodes")
		})
	}
}

func maxConnsForBench() int {
	n, _ := strconv.Atoi(os.Getenv("BC_BENCH_MAXCONNS"))
	return n
}

func concurrencyForBench() int {
	n, _ := strconv.Atoi(os.Getenv("BC_BENCH_CONCURRENCY"))
	return n
}
