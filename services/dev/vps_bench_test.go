package dev_test

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/agent/sim"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/poll"
)

// BenchmarkInstanceCreateToRunning measures, with the bus up and three
// real agents (mock DGX H200s) running the simulated VPS runtime (a real
// process per instance), the time from instances.create being called until
// the instance is running at its current generation, as instances.get
// would answer. b.N instances of 2 vCPUs are created one after another
// without waiting, while a watcher reads every instance's state from the
// database; it reports p50 and p99.
func BenchmarkInstanceCreateToRunning(b *testing.B) {
	const nodes = 3
	if b.N > nodes*224/2 {
		b.Fatalf("b.N %d is more than %d hosts hold", b.N, nodes)
	}
	ns := natstest.New(b)
	env, db := commandEnv(b, ns.URL())
	b.Cleanup(func() { env.Stop(context.Background()) }) // after the fleet's cleanup
	var pool struct{ Pool struct{ ID string } }
	call(b, env, "pools/create", map[string]any{"tenantId": "root", "name": "vps", "class": "vps-host", "idempotencyKey": "pool-vps"}, &pool)
	var tok struct{ Token string }
	call(b, env, "joinTokens/create", map[string]any{"tenantId": "root", "poolId": pool.Pool.ID, "uses": nodes, "idempotencyKey": "token-vps"}, &tok)
	pub, keyID, roots := joinMaterial(b, env)
	f := startFleet(b, db, sim.Config{
		Gateway: env.App.GatewayAddr(), RootCAs: roots, Token: tok.Token,
		JoinserviceKey: pub, JoinserviceKeyID: keyID, Root: filepath.Join(b.TempDir(), "vps"), Prefix: "vps",
		CommandKey: env.CommandKey, VPS: true,
	}, nodes, 1)
	b.Cleanup(func() {
		f.Stop()
		if err := f.DeleteInstances(context.Background()); err != nil {
			b.Errorf("ending the instances' processes: %v", err)
		}
	})
	poll.UntilNil(b, 60*time.Second, "host capacity from inventory", func() error {
		var n int
		err := db.QueryRow(context.Background(), `SELECT count(*) FROM host_capacity WHERE pool_id = $1 AND vcpus_total = 224`, pool.Pool.ID).Scan(&n)
		if err != nil || n != nodes {
			return fmt.Errorf("%d of %d hosts sized (%v)", n, nodes, err)
		}
		return nil
	})

	var mu sync.Mutex
	started := make(map[string]time.Time, b.N)
	lat := make([]time.Duration, 0, b.N)
	done := make(chan error, 1)
	b.ResetTimer()
	go func() { // the watcher
		seen := make(map[string]bool, b.N)
		deadline := time.Now().Add(2*time.Minute + time.Duration(b.N)*time.Second)
		for len(seen) < b.N {
			if time.Now().After(deadline) {
				done <- fmt.Errorf("%d of %d instances running", len(seen), b.N)
				return
			}
			rows, err := db.Query(context.Background(), `SELECT id FROM instances WHERE pool_id = $1 AND state = 'running' AND observed_generation = generation`, pool.Pool.ID)
			if err != nil {
				done <- err
				return
			}
			now := time.Now()
			for rows.Next() {
				var id string
				if err := rows.Scan(&id); err != nil {
					done <- err
					return
				}
				mu.Lock()
				t0, ok := started[id]
				mu.Unlock()
				if ok && !seen[id] {
					seen[id] = true
					lat = append(lat, now.Sub(t0))
				}
			}
			rows.Close()
			time.Sleep(2 * time.Millisecond)
		}
		done <- nil
	}()
	for i := range b.N {
		t0 := time.Now()
		var out struct{ Instance instanceJSON }
		call(b, env, "instances/create", map[string]any{"tenantId": "root", "poolId": pool.Pool.ID, "vcpus": 2, "memoryMiB": 2048, "diskGiB": 20,
			"image": "ubuntu-24.04", "idempotencyKey": fmt.Sprintf("ctr-%d", i)}, &out)
		mu.Lock()
		started[out.Instance.ID] = t0
		mu.Unlock()
	}
	if err := <-done; err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99-ms")
}
