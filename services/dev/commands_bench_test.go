package dev_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	nodestore "github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/wake"
)

// BenchmarkCommands measures command delivery through the whole system:
// pkg/commands.Enqueue committed (as a module in another process would),
// a poke over the bus, the gateway's dispatch over real mutual TLS, the
// real agent's checks, journal and diag.nvml on the mock NVML, and the
// settle. It reports, from the commands rows (database clock):
//
//   - delivered-p50-ms, delivered-p99-ms: accepted_at − created_at (the
//     daemon received, journaled and accepted it), one command at a time
//     spread round-robin over the nodes, each queued after a random pause
//     of up to one resync interval;
//   - serial-cmds/s: one over their mean result latency (one command in
//     flight at a time);
//   - result-p50-ms, result-p99-ms: finished_at − created_at, likewise;
//   - burst-result-p50-ms, burst-result-p99-ms and burst-cmds/s (with more
//     than one node): one command for every node queued in one transaction
//     and poked, three rounds; commands per second from the first created
//     to the last finished.
//
// For one node and for BC_BENCH_NODES simulated nodes (default 200), with
// the bus up and down (down: NATS stopped, so only the gateway's resync
// delivers, every gateway.livenessInterval: BC_BENCH_RESYNC, default
// 250ms). BC_BENCH_CMDS is the number of serial commands (default 50).
// Run once per case:
//
//	cd services && BC_BENCH_NODES=500 go test ./dev -run '^$' -bench Commands -benchtime 1x -timeout 30m
func BenchmarkCommands(b *testing.B) {
	many := envInt(b, "BC_BENCH_NODES", 200)
	samples := envInt(b, "BC_BENCH_CMDS", 50)
	resync := 250 * time.Millisecond
	if v := getenvDuration(b, "BC_BENCH_RESYNC"); v > 0 {
		resync = v
	}
	for _, n := range []int{1, many} {
		for _, up := range []bool{true, false} {
			bus := "down"
			if up {
				bus = "up"
			}
			b.Run(fmt.Sprintf("nodes=%d/bus=%s", n, bus), func(b *testing.B) {
				benchCommands(b, n, up, samples, resync)
			})
		}
	}
}

func getenvDuration(b *testing.B, name string) time.Duration {
	v := os.Getenv(name)
	if v == "" {
		return 0
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		b.Fatalf("%s: %v", name, err)
	}
	return d
}

func benchCommands(b *testing.B, n int, up bool, samples int, resync time.Duration) {
	ns := natstest.New(b)
	dbURL := pgtest.NewDB(b)
	env := commandEnvOn(b, dbURL, b.TempDir(), "127.0.0.1:0", ns.URL(), resync, 5*time.Second)
	defer env.Stop(context.Background())
	db, err := pgxpool.New(context.Background(), dbURL)
	if err != nil {
		b.Fatal(err)
	}
	defer db.Close()
	joinStart := time.Now()
	f := simFleet(b, env, db, "bench", n, nil)
	b.Logf("%d nodes joined and converged in %s", n, time.Since(joinStart).Round(time.Millisecond))
	nc, err := nats.Connect(ns.URL())
	if err != nil {
		b.Fatal(err)
	}
	defer nc.Close()
	poker := wake.New(nc, func(ctx context.Context, ids []string) (map[string]string, error) {
		return nodestore.Gateways(ctx, db, ids)
	}, nil)
	if !up {
		ns.Stop()
		waitFor(b, 10*time.Second, "the bus down", func() bool { return !nc.IsConnected() })
	}
	nodes := f.Nodes()
	ctx := context.Background()

	// finished waits until every one of ids is final and returns their rows.
	finished := func(ids []string) []commands.Command {
		deadline := time.Now().Add(5 * time.Minute)
		for {
			var done int
			if err := db.QueryRow(ctx, `SELECT count(*) FROM commands WHERE id = ANY($1) AND state NOT IN ('pending', 'in_flight')`, ids).Scan(&done); err != nil {
				b.Fatal(err)
			}
			if done == len(ids) {
				break
			}
			if time.Now().After(deadline) {
				b.Fatalf("%d of %d commands finished", done, len(ids))
			}
			time.Sleep(2 * time.Millisecond)
		}
		rows, err := db.Query(ctx, `SELECT `+commands.Columns+` FROM commands WHERE id = ANY($1)`, ids)
		if err != nil {
			b.Fatal(err)
		}
		cs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (commands.Command, error) { return commands.Scan(r) })
		if err != nil {
			b.Fatal(err)
		}
		for _, c := range cs {
			if c.State != commands.Succeeded || c.AcceptedAt == nil || c.FinishedAt == nil {
				b.Fatalf("command %s on %s: %s %q", c.ID, c.NodeID, c.State, c.Reason)
			}
		}
		return cs
	}
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	pct := func(ds []time.Duration, p int) float64 {
		slices.Sort(ds)
		return ms(ds[min(len(ds)*p/100, len(ds)-1)])
	}

	var delivered, result []time.Duration
	b.ResetTimer()
	for i := range samples {
		node := nodes[i%len(nodes)]
		// A random pause so queueing is not in phase with the resync
		// ticker (the latencies come from the rows, not this clock).
		time.Sleep(rand.N(resync))
		c := enqueue(b, db, commands.Request{NodeID: node, Kind: "diag.nvml", NotAfter: time.Now().Add(time.Minute)})
		poker.Wake(wake.Set{Nodes: []string{node}})
		got := finished([]string{c.ID})[0]
		delivered = append(delivered, got.AcceptedAt.Sub(got.CreatedAt))
		result = append(result, got.FinishedAt.Sub(got.CreatedAt))
	}
	b.StopTimer()
	b.ReportMetric(pct(delivered, 50), "delivered-p50-ms")
	b.ReportMetric(pct(delivered, 99), "delivered-p99-ms")
	b.ReportMetric(pct(result, 50), "result-p50-ms")
	b.ReportMetric(pct(result, 99), "result-p99-ms")
	var busy time.Duration
	for _, d := range result {
		busy += d
	}
	b.ReportMetric(float64(samples)/busy.Seconds(), "serial-cmds/s")
	b.ReportMetric(float64(n), "nodes")
	b.ReportMetric(ms(resync), "resync-ms")
	if n == 1 {
		return
	}

	var burst []time.Duration
	var total int
	var elapsed time.Duration
	for round := range 3 {
		ids := make([]string, 0, n)
		err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			for _, node := range nodes {
				c, _, err := testKinds().Enqueue(ctx, tx, commands.Request{NodeID: node, Kind: "diag.nvml",
					IdempotencyKey: "burst-" + strconv.Itoa(round), NotAfter: time.Now().Add(5 * time.Minute)})
				if err != nil {
					return err
				}
				ids = append(ids, c.ID)
			}
			return nil
		})
		if err != nil {
			b.Fatal(err)
		}
		poker.Wake(wake.Set{Nodes: nodes})
		cs := finished(ids)
		first, last := cs[0].CreatedAt, cs[0].FinishedAt
		for _, c := range cs {
			burst = append(burst, c.FinishedAt.Sub(c.CreatedAt))
			if c.CreatedAt.Before(first) {
				first = c.CreatedAt
			}
			if c.FinishedAt.After(*last) {
				last = c.FinishedAt
			}
		}
		total += len(cs)
		elapsed += last.Sub(first)
	}
	b.ReportMetric(pct(burst, 50), "burst-result-p50-ms")
	b.ReportMetric(pct(burst, 99), "burst-result-p99-ms")
	b.ReportMetric(float64(total)/elapsed.Seconds(), "burst-cmds/s")
}
