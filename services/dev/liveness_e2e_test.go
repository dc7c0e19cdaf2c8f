package dev_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/dev"
)

// livenessEnv is chaosEnv with short liveness settings: Unknown after 2 s
// without a heartbeat, Lost after 4 s, the job every 100 ms.
func livenessEnv(t *testing.T, db, natsURL string) *dev.Env {
	t.Helper()
	port, none := 0, 0
	cfg := &config.Config{
		Database: config.Database{URL: db},
		NATS:     config.NATS{URL: natsURL},
		Server:   config.Server{Host: "127.0.0.1", Port: &port},
		Dev:      config.Dev{DataDir: t.TempDir(), SimNodes: &none},
		Gateway: config.Gateway{Listen: freePort(t), HeartbeatInterval: config.Duration(100 * time.Millisecond),
			LivenessInterval: config.Duration(100 * time.Millisecond)},
		Runtime: config.Runtime{PollBusDown: config.Duration(50 * time.Millisecond)},
		Nodes: config.Nodes{NotReadyAfter: config.Duration(2 * time.Second), LostAfter: config.Duration(4 * time.Second),
			LivenessEvery: config.Duration(100 * time.Millisecond)},
	}
	cfg.Defaults()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	env, err := dev.Start(t.Context(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { env.Stop(context.Background()) })
	return env
}

type readyCond struct {
	Type   string
	Status bool
	Value  string
	Reason string
	Since  time.Time
}

// readyOf reads node id's Ready condition through nodes.get.
func readyOf(t *testing.T, env *dev.Env, id string) readyCond {
	t.Helper()
	var out struct {
		Node struct{ Conditions []readyCond }
	}
	call(t, env, "nodes/get", map[string]any{"tenantId": "root", "nodeId": id}, &out)
	for _, c := range out.Node.Conditions {
		if c.Type == "Ready" {
			return c
		}
	}
	t.Fatalf("node %s has no Ready condition: %+v", id, out.Node.Conditions)
	return readyCond{}
}

func readyEvents(t *testing.T, db *pgxpool.Pool, id string) []string {
	t.Helper()
	rows, err := db.Query(t.Context(), `SELECT type FROM outbox WHERE resource_id = $1
		AND type IN ('node.ready', 'node.not_ready', 'node.lost') ORDER BY id`, id)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestLivenessEndToEnd runs simulated nodes (the real agent) against dev: a
// node whose daemon stops goes Unknown, then Lost, and Ready again when it
// comes back — with the bus up, and again with NATS stopped.
func TestLivenessEndToEnd(t *testing.T) {
	t.Parallel()
	const n = 3
	dbURL := pgtest.NewDB(t)
	db, err := pgxpool.New(t.Context(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ns := natstest.New(t)
	env := livenessEnv(t, dbURL, ns.URL())
	f, _ := fleet(t, env, n, t.TempDir())
	defer f.Stop()
	waitSessions(t, db, n, 1, time.Now().Add(-time.Minute), "the fleet joining")
	ids := f.Nodes()

	cycle := func(t *testing.T, i int, want []string) {
		t.Helper()
		id := ids[i]
		if c := readyOf(t, env, id); !c.Status || c.Value != "True" {
			t.Fatalf("%s before: %+v", id, c)
		}
		f.Halt(i)
		// While it waits, every 5 s it logs what liveness decides from (the
		// node's row by database time, the liveness job's queue entry), so
		// a timeout says where it stalled.
		last := time.Now()
		// Unknown lasts nodes.lostAfter − nodes.notReadyAfter (2 s here): a
		// loaded machine may poll only once it is Lost already, so either
		// passes here and the events below prove the node went through
		// Unknown (node.not_ready) first.
		poll.Until(t, time.Minute, id+" to go Unknown", func() bool {
			if time.Since(last) > 5*time.Second {
				last = time.Now()
				var ready, gw string
				var seen, now time.Time
				var epoch int64
				_ = db.QueryRow(t.Context(), `SELECT ready, coalesce(gateway_id,''), last_seen_at, now(), session_epoch FROM nodes WHERE id = $1`, id).Scan(&ready, &gw, &seen, &now, &epoch)
				var wq string
				_ = db.QueryRow(t.Context(), `SELECT coalesce(string_agg(kind||'/'||key||' '||to_char(run_after,'HH24:MI:SS.MS')||' a='||attempts||' e='||coalesce(last_error,''), '; '),'') FROM work_queue WHERE kind = 'liveness'`).Scan(&wq)
				t.Logf("waiting: %s ready=%s gw=%s seen=%s now=%s epoch=%d wq=[%s]", id, ready, gw, seen.Format("15:04:05.000"), now.Format("15:04:05.000"), epoch, wq)
			}
			v := readyOf(t, env, id).Value
			return v == "Unknown" || v == "Lost"
		})
		if c := readyOf(t, env, id); c.Status || c.Reason == "" || c.Since.IsZero() {
			t.Fatalf("%s not ready: %+v", id, c)
		}
		poll.Until(t, time.Minute, id+" to go Lost", func() bool { return readyOf(t, env, id).Value == "Lost" })
		f.Resume(i)
		poll.Until(t, time.Minute, id+" to be Ready again", func() bool { return readyOf(t, env, id).Value == "True" })
		if got := readyEvents(t, db, id); !equal(got, want) {
			t.Fatalf("%s events %v, want %v", id, got, want)
		}
	}
	t.Run("a stopped daemon goes NotReady, Lost, then Ready", func(t *testing.T) {
		cycle(t, 0, []string{"node.not_ready", "node.lost", "node.ready"})
	})
	t.Run("and with the bus stopped", func(t *testing.T) {
		ns.Stop()
		cycle(t, 1, []string{"node.not_ready", "node.lost", "node.ready"})
		ns.Restart()
	})
	// The node that kept talking never changed.
	if got := readyEvents(t, db, ids[2]); len(got) != 0 {
		t.Fatalf("a live node's Ready changed: %v", got)
	}
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
