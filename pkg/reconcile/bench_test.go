package reconcile_test

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/bettercompute/bettercompute/pkg/bus"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/shard"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
)

func benchPool(b *testing.B) *pgxpool.Pool {
	b.Helper()
	pool, err := db.Open(b.Context(), db.Config{URL: pgtest.NewDB(b), MaxConns: 16})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	return pool
}

func noop(context.Context, *reconcile.RunContext, string) (reconcile.Result, error) {
	return reconcile.Done, nil
}

// BenchmarkThroughput measures keys per second through enqueue → claim →
// run (no-op) → settle, with Tick driving the runtime.
func BenchmarkThroughput(b *testing.B) {
	for _, mode := range []struct {
		name  string
		batch int // claim batch
		perTx int // keys per enqueue transaction
	}{
		{"single", 1, 1},
		{"batched", 256, 1000},
	} {
		b.Run(mode.name, func(b *testing.B) {
			pool := benchPool(b)
			rt, err := reconcile.New(pool, nil, reconcile.Config{Roles: []string{reconcile.RoleControllers}, Batch: mode.batch, Heartbeat: time.Hour})
			if err != nil {
				b.Fatal(err)
			}
			if err := rt.Register(reconcile.Reconciler{Name: "bench", ShardBy: reconcile.ShardByNode, Run: noop}); err != nil {
				b.Fatal(err)
			}
			b.Cleanup(rt.Stop)
			if err := rt.Heartbeat(b.Context()); err != nil {
				b.Fatal(err)
			}
			job := rt.Jobs()["bench"]
			b.ResetTimer()
			start := time.Now()
			done := 0
			for done < b.N {
				n := min(mode.perTx*10, b.N-done)
				items := make([]workqueue.Item, n)
				for i := range items {
					items[i] = workqueue.Item{Kind: "bench", Key: fmt.Sprintf("k%d", done+i)}
				}
				for chunk := range slices.Chunk(items, mode.perTx) {
					err := db.InTx(b.Context(), pool, db.TxOptions{}, func(tx pgx.Tx) error {
						return workqueue.EnqueueMany(b.Context(), tx, chunk)
					})
					if err != nil {
						b.Fatal(err)
					}
				}
				tr, err := job.Tick(b.Context())
				if err != nil || tr.Done != n {
					b.Fatalf("tick: %+v %v (want %d done)", tr, err, n)
				}
				done += n
			}
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "keys/s")
		})
	}
}

// BenchmarkPokeToRun measures the time from an enqueueing transaction's
// commit to the start of the key's run, with the bus up (a poke wakes the
// owner) and down (the owner polls every PollBusDown, 250ms by default).
func BenchmarkPokeToRun(b *testing.B) {
	for _, up := range []bool{true, false} {
		name := "bus-down"
		if up {
			name = "bus-up"
		}
		b.Run(name, func(b *testing.B) {
			pool := benchPool(b)
			var nc *nats.Conn
			cfg := reconcile.Config{Roles: []string{reconcile.RoleControllers}, Poll: time.Hour}
			var rt *reconcile.Runtime
			var err error
			if up {
				ns := natstest.New(b)
				c, err := bus.Connect(ns.URL(), "bench", slog.New(slog.DiscardHandler))
				if err != nil {
					b.Fatal(err)
				}
				b.Cleanup(c.Close)
				for !c.IsConnected() {
					time.Sleep(time.Millisecond)
				}
				nc = c
			}
			rt, err = reconcile.New(pool, nc, cfg)
			if err != nil {
				b.Fatal(err)
			}
			var mu sync.Mutex
			committed := map[string]time.Time{}
			var lat []time.Duration
			ran := make(chan struct{}, 1)
			err = rt.Register(reconcile.Reconciler{Name: "bench", ShardBy: reconcile.ShardByNode,
				Run: func(_ context.Context, _ *reconcile.RunContext, key string) (reconcile.Result, error) {
					now := time.Now()
					mu.Lock()
					if t0, ok := committed[key]; ok {
						lat = append(lat, now.Sub(t0))
					}
					mu.Unlock()
					ran <- struct{}{}
					return reconcile.Done, nil
				}})
			if err != nil {
				b.Fatal(err)
			}
			if err := rt.Start(b.Context()); err != nil {
				b.Fatal(err)
			}
			b.Cleanup(rt.Stop)
			for len(rt.Owned(reconcile.RoleControllers)) < shard.Count {
				time.Sleep(10 * time.Millisecond)
			}
			drain(ran)
			b.ResetTimer()
			for i := range b.N {
				key := fmt.Sprintf("k%d", i)
				err := rt.InTx(b.Context(), func(_ pgx.Tx, q *reconcile.Queue) error {
					return q.Enqueue(b.Context(), "bench", key)
				})
				if err != nil {
					b.Fatal(err)
				}
				mu.Lock()
				committed[key] = time.Now() // after commit (and the poke)
				mu.Unlock()
				select {
				case <-ran:
				case <-time.After(10 * time.Second):
					b.Fatal("the key did not run")
				}
			}
			b.StopTimer()
			mu.Lock()
			defer mu.Unlock()
			if len(lat) == 0 {
				return
			}
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
			b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99-ms")
		})
	}
}

func drain(c chan struct{}) {
	for {
		select {
		case <-c:
		default:
			return
		}
	}
}
