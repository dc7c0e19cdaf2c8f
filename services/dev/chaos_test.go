package dev_test

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/agent/sim"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/dev"
)

// freePort returns a port nothing listens on now.
func freePort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ln.Close() }()
	return ln.Addr().String()
}

// chaosEnv starts a dev control plane on db, dataDir and the gateway address
// gw, with no fleet of its own and the bus at natsURL. It stops when t ends
// unless stopped before.
func chaosEnv(t *testing.T, db, dataDir, gw, natsURL string) *dev.Env {
	t.Helper()
	port, none := 0, 0
	cfg := &config.Config{
		Database: config.Database{URL: db},
		NATS:     config.NATS{URL: natsURL},
		Server:   config.Server{Host: "127.0.0.1", Port: &port},
		Dev:      config.Dev{DataDir: dataDir, SimNodes: &none},
		Gateway:  config.Gateway{Listen: gw, HeartbeatInterval: config.Duration(100 * time.Millisecond), LivenessInterval: config.Duration(100 * time.Millisecond)},
		Runtime:  config.Runtime{PollBusDown: config.Duration(50 * time.Millisecond)},
	}
	cfg.Defaults()
	env, err := dev.Start(t.Context(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { env.Stop(context.Background()) })
	return env
}

// fleet joins n simulated nodes to env through its gateway.
func fleet(t *testing.T, env *dev.Env, n int, root string) (*sim.Fleet, string) {
	t.Helper()
	var pool struct{ Pool struct{ ID string } }
	call(t, env, "pools/create", map[string]any{"tenantId": "root", "name": "chaos", "class": "gpu", "idempotencyKey": "chaos-pool"}, &pool)
	var tok struct{ Token string }
	call(t, env, "joinTokens/create", map[string]any{"tenantId": "root", "poolId": pool.Pool.ID, "uses": n, "idempotencyKey": "chaos-token"}, &tok)
	pub, keyID, roots := joinMaterial(t, env)
	f, err := sim.Start(t.Context(), sim.Config{
		Gateway: env.App.GatewayAddr(), RootCAs: roots, Token: tok.Token,
		JoinserviceKey: pub, JoinserviceKeyID: keyID, Root: root, Prefix: "chaos",
	}, n)
	if err != nil {
		t.Fatal(err)
	}
	return f, pool.Pool.ID
}

// setSite changes the pool's site settings through the API.
func setSite(t *testing.T, env *dev.Env, poolID, level string) {
	t.Helper()
	var out struct{}
	call(t, env, "pools/update", map[string]any{"tenantId": "root", "poolId": poolID, "site": map[string]any{"logLevel": level}, "updateMask": "site"}, &out)
}

// waitConverged waits until every node applied a generation of at least gen
// whose site log level is level ("" for any).
func waitConverged(t *testing.T, db *pgxpool.Pool, n int, gen int64, level, what string) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		var done int
		err := db.QueryRow(t.Context(), `SELECT count(*) FROM nodes WHERE generation >= $1 AND observed_generation = generation
			AND ($2 = '' OR spec->'site'->>'logLevel' = $2)`, gen, level).Scan(&done)
		if err != nil {
			t.Fatal(err)
		}
		if done == n {
			return
		}
		if time.Now().After(deadline) {
			rows, _ := db.Query(t.Context(), `SELECT id, generation, observed_generation, session_epoch, coalesce(spec->'site'->>'logLevel', '') FROM nodes`)
			for rows.Next() {
				var id, lvl string
				var g, obs, epoch int64
				_ = rows.Scan(&id, &g, &obs, &epoch, &lvl)
				t.Logf("node %s generation %d observed %d epoch %d log level %q", id, g, obs, epoch, lvl)
			}
			rows.Close()
			t.Fatalf("%s: %d of %d nodes converged on generation %d", what, done, n, gen)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitSessions waits until every node holds a session of at least epoch and
// was seen after since.
func waitSessions(t *testing.T, db *pgxpool.Pool, n int, epoch int64, since time.Time, what string) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		var live int
		err := db.QueryRow(t.Context(), `SELECT count(*) FROM nodes WHERE session_epoch >= $1 AND last_seen_at > $2`, epoch, since).Scan(&live)
		if err != nil {
			t.Fatal(err)
		}
		if live == n {
			return
		}
		if time.Now().After(deadline) {
			rows, _ := db.Query(t.Context(), `SELECT id, session_epoch, gateway_id, last_seen_at FROM nodes`)
			for rows.Next() {
				var id, gw string
				var epoch int64
				var seen *time.Time
				_ = rows.Scan(&id, &epoch, &gw, &seen)
				t.Logf("node %s epoch %d gateway %s last seen %v (since %v)", id, epoch, gw, seen, since)
			}
			rows.Close()
			t.Fatalf("%s: %d of %d nodes live", what, live, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestChaosGatewayRestartAndLostBus(t *testing.T) {
	t.Parallel()
	const n = 5
	dbURL := pgtest.NewDB(t)
	db, err := pgxpool.New(t.Context(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ns := natstest.New(t)
	dataDir, gw := t.TempDir(), freePort(t)

	first := chaosEnv(t, dbURL, dataDir, gw, ns.URL())
	fleetRoot := t.TempDir()
	f, poolID := fleet(t, first, n, fleetRoot)
	defer func() { f.Stop() }() // f is replaced below
	waitSessions(t, db, n, 1, time.Now().Add(-time.Minute), "the fleet joining")
	waitConverged(t, db, n, 1, "", "the fleet applying generation 1")

	t.Run("with the bus stopped nodes stay connected and live", func(t *testing.T) {
		ns.Stop()
		since := time.Now()
		waitSessions(t, db, n, 1, since, "liveness without the bus")
		var epochs int64
		_ = db.QueryRow(t.Context(), `SELECT max(session_epoch) FROM nodes`).Scan(&epochs)
		if epochs != 1 {
			t.Fatalf("sessions were reopened (epoch %d): losing the bus must not drop nodes", epochs)
		}
		// A desired-state change still reaches every node without the bus.
		setSite(t, first, poolID, "debug")
		waitConverged(t, db, n, 2, "debug", "a change without the bus")
		// The runtime section too: each node's engine configuration
		// follows without the bus.
		var out struct{}
		call(t, first, "pools/update", map[string]any{"tenantId": "root", "poolId": poolID,
			"runtime": map[string]any{"engines": []any{"podman"}, "cdiSpecDirs": []any{"/etc/cdi"}}, "updateMask": "runtime"}, &out)
		waitConverged(t, db, n, 3, "debug", "a runtime change without the bus")
		dropIns, err := filepath.Glob(filepath.Join(fleetRoot, "*", "etc", "containers", "containers.conf.d", "*.conf"))
		if err != nil || len(dropIns) != n {
			t.Fatalf("podman drop-ins %v (%v), want one per node (%d)", dropIns, err, n)
		}
		for _, p := range dropIns {
			if b, err := os.ReadFile(p); err != nil || !strings.Contains(string(b), `"/etc/cdi"`) {
				t.Fatalf("%s: %q %v, want it to name /etc/cdi", p, b, err)
			}
		}
		ns.RestartEmpty()
		// And after the bus comes back empty.
		setSite(t, first, poolID, "warn")
		waitConverged(t, db, n, 4, "warn", "a change after the bus restarted empty")
	})

	t.Run("nodes offline during three changes converge on the latest when they return", func(t *testing.T) {
		f.Stop()
		for _, level := range []string{"info", "debug", "error"} {
			setSite(t, first, poolID, level)
		}
		// The controller computes the latest spec while every node is away
		// (three quick changes may coalesce into fewer generations).
		poll.Until(t, 30*time.Second, "the changes to be computed", func() bool {
			var done int
			_ = db.QueryRow(t.Context(), `SELECT count(*) FROM nodes WHERE spec->'site'->>'logLevel' = 'error' AND generation >= 4`).Scan(&done)
			return done == n
		})
		f, _ = fleet(t, first, n, fleetRoot) // the same nodes, back again (stopped by the test's end)
		waitConverged(t, db, n, 4, "error", "returning nodes converging on the latest spec")
	})

	t.Run("restart the gateway and every node reconnects", func(t *testing.T) {
		// A change in flight when the gateway goes down still converges.
		setSite(t, first, poolID, "info")
		first.Stop(context.Background())
		second := chaosEnv(t, dbURL, dataDir, gw, ns.URL())
		defer second.Stop(context.Background())
		since := time.Now()
		waitSessions(t, db, n, 2, since, "every node reconnecting to the restarted gateway")
		waitConverged(t, db, n, 5, "info", "every node converging on the change made as the gateway went down")
		var gateways int
		_ = db.QueryRow(t.Context(), `SELECT count(DISTINCT gateway_id) FROM nodes`).Scan(&gateways)
		if gateways != 1 || len(f.Nodes()) != n {
			t.Fatalf("gateways %d, nodes %v", gateways, f.Nodes())
		}
	})
}
