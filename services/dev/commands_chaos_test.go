package dev_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/wake"
)

// TestCommandsChaosBusAndGateway delivers commands queued by "another
// process" (pkg/commands.Enqueue, then a poke over the bus: the API's own
// pokes reach the in-process gateway without the bus) with the bus up,
// stopped and restarted empty, and across a gateway restart while a command
// runs.
func TestCommandsChaosBusAndGateway(t *testing.T) {
	t.Parallel()
	dbURL := pgtest.NewDB(t)
	db, err := pgxpool.New(context.Background(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ns := natstest.New(t)
	dataDir, gw := t.TempDir(), freePort(t)
	env := commandEnvOn(t, dbURL, dataDir, gw, ns.URL(), 100*time.Millisecond, 100*time.Millisecond)
	defer func() { env.Stop(context.Background()) }() // env is replaced below
	h := newHooks()
	f := simFleet(t, env, db, "chaos-cmd", 1, h.install)
	node := f.Nodes()[0]

	nc, err := nats.Connect(ns.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	poker := wake.New(nc, func(ctx context.Context, ids []string) (map[string]string, error) {
		return nodes.Gateways(ctx, db, ids)
	}, nil)

	// queue enqueues a diag.nvml with level and pokes its node over the
	// bus (a no-op while the bus is down).
	queue := func(t *testing.T, level string, within time.Duration) commands.Command {
		t.Helper()
		c := enqueue(t, db, commands.Request{NodeID: node, Kind: "diag.nvml", Payload: diagLevel(level), NotAfter: time.Now().Add(within)})
		poker.Wake(wake.Set{Nodes: []string{node}})
		return c
	}
	// delivered waits until c succeeded, accepted by the daemon before its
	// deadline, having run once.
	delivered := func(t *testing.T, c commands.Command, level string) {
		t.Helper()
		wantFinal(t, env, node, c.ID, "succeeded", "")
		got := dbCmd(t, db, node, c.ID)
		if got.AcceptedAt == nil || !got.AcceptedAt.Before(got.NotAfter) || h.count(level) != 1 {
			t.Fatalf("accepted %v, not after %v, runs %d", got.AcceptedAt, got.NotAfter, h.count(level))
		}
	}

	t.Run("bus up: a poke from another process delivers", func(t *testing.T) {
		delivered(t, queue(t, "bus-up", 20*time.Second), "bus-up")
	})

	t.Run("bus stopped: the gateway's resync delivers before the deadline", func(t *testing.T) {
		ns.Stop()
		poll.Until(t, 10*time.Second, "the client to see the bus down", func() bool { return !nc.IsConnected() })
		delivered(t, queue(t, "bus-down", 20*time.Second), "bus-down")
	})

	t.Run("bus restarted empty: commands still go", func(t *testing.T) {
		ns.RestartEmpty()
		poll.Until(t, 30*time.Second, "the client to reconnect", nc.IsConnected)
		delivered(t, queue(t, "bus-back", 20*time.Second), "bus-back")
	})

	t.Run("gateway restarted while a command runs: the outcome arrives once, the re-sent seq never runs again", func(t *testing.T) {
		c := queue(t, "gate:restart", 30*time.Second)
		poll.Until(t, 30*time.Second, "the diag running", func() bool { return h.count("gate:restart") == 1 })
		var epoch int64
		_ = db.QueryRow(context.Background(), `SELECT session_epoch FROM nodes WHERE id = $1`, node).Scan(&epoch)
		env.Stop(context.Background())
		// The command finishes while the node has no session: its outcome
		// waits in the daemon's outbox and journal.
		h.open("gate:restart")
		env = commandEnvOn(t, dbURL, dataDir, gw, ns.URL(), 100*time.Millisecond, 100*time.Millisecond)
		poll.Until(t, 30*time.Second, "the node reconnecting", func() bool {
			var now int64
			_ = db.QueryRow(context.Background(), `SELECT session_epoch FROM nodes WHERE id = $1`, node).Scan(&now)
			return now > epoch
		})
		got := wantFinal(t, env, node, c.ID, "succeeded", "")
		if got.Attempts != 1 || h.count("gate:restart") != 1 || got.Result["driverVersion"] != "gate:restart" {
			t.Fatalf("attempts %d, runs %d, result %v", got.Attempts, h.count("gate:restart"), got.Result)
		}
		// And the restarted gateway delivers new work.
		delivered(t, queue(t, "after-restart", 20*time.Second), "after-restart")
	})
}
