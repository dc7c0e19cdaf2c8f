package relay_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/events"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/webhooks"
	"github.com/bettercompute/bettercompute/services/relay"
)

func TestRelayKilledMidBatchLosesNothing(t *testing.T) {
	t.Parallel()
	e := setup(t)
	_, key := e.hook("acme", "", []string{"*"}, false)
	rcv := newReceiver(t, key)
	setURL(t, e, rcv)
	cfg := e.cfg
	cfg.Events.Batch = 50 // many batches, so the kill lands inside the run
	r1 := e.start(cfg)
	poll.Until(t, 20*time.Second, "r1 leading", r1.Leading)
	var ids []int64
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		ids = e.write("acme", "node.updated", 300)
	}()
	poll.Until(t, 20*time.Second, "some deliveries", func() bool { _, n := rcv.ids(); return n >= 20 })
	r1.Kill()
	r2 := e.start(cfg)
	wg.Wait()
	poll.Until(t, 20*time.Second, "r2 leading", r2.Leading)
	waitReceived(t, rcv, ids)
	got, n := rcv.ids()
	if len(got) != len(ids) {
		t.Fatalf("%d distinct events for %d", len(got), len(ids))
	}
	t.Logf("%d deliveries of %d events (duplicates share their webhook-id)", n, len(ids))
	stream := e.streamIDs()
	seen := map[string]bool{}
	for _, id := range stream {
		if seen[id] {
			t.Fatalf("%s twice in the stream", id)
		}
		seen[id] = true
	}
	poll.Until(t, 20*time.Second, "all published", func() bool { return len(e.streamIDs()) == len(ids) })
}

func TestFailingForDisableAfterDisablesTheWebhook(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w, key := e.hook("acme", "", []string{"*"}, false)
	rcv := newReceiver(t, key)
	rcv.status = func(string, int) int { return http.StatusServiceUnavailable }
	setURL(t, e, rcv)
	// Failing for 6 days already: the next failure disables it.
	if _, err := e.pool.Exec(t.Context(), `UPDATE webhooks SET failing_since = now() - interval '6 days'`); err != nil {
		t.Fatal(err)
	}
	e.start(e.cfg)
	e.write("acme", "node.updated", 1)
	poll.Until(t, 20*time.Second, "disabled as failing", func() bool {
		var reason string
		_ = e.pool.QueryRow(t.Context(), `SELECT disabled_reason FROM webhooks WHERE id = $1 AND NOT enabled`, w.ID).Scan(&reason)
		return reason == webhooks.ReasonFailing
	})
	// A success after re-enabling clears the failing streak.
	rcv.mu.Lock()
	rcv.status = nil
	rcv.mu.Unlock()
	w, err := webhooks.Get(t.Context(), e.pool, "acme", w.ID)
	if err != nil {
		t.Fatal(err)
	}
	w.Enabled, w.DisabledReason = true, ""
	if _, err := webhooks.Save(t.Context(), e.pool, w); err != nil {
		t.Fatal(err)
	}
	ids := e.write("acme", "node.updated", 1)
	waitReceived(t, rcv, ids)
	poll.Until(t, 20*time.Second, "the streak cleared", func() bool {
		var failing bool
		_ = e.pool.QueryRow(t.Context(), `SELECT failing_since IS NOT NULL FROM webhooks WHERE id = $1`, w.ID).Scan(&failing)
		return !failing
	})
}

func TestOutboxAndDeliveriesReachASteadySize(t *testing.T) {
	t.Parallel()
	e := setup(t)
	_, key := e.hook("acme", "", []string{"*"}, false)
	rcv := newReceiver(t, key)
	setURL(t, e, rcv)
	cfg := e.cfg
	cfg.Events.Retention = 1 // 1 ns: everything the fan-out passed goes
	cfg.Events.PruneEvery = 1 << 62
	r := e.start(cfg)
	poll.Until(t, 20*time.Second, "leading", r.Leading)
	const perRound = 40
	var sizes []int
	for round := range 15 {
		ids := e.write("acme", "node.updated", perRound)
		waitReceived(t, rcv, ids)
		if _, err := e.pool.Exec(t.Context(), `INSERT INTO idempotency (tenant_id, identity_id, method, key, request_hash, expires_at)
			VALUES ('acme', 'idn_x', 'm', $1, '\x00', now() - interval '1 second')`, fmt.Sprint(round)); err != nil {
			t.Fatal(err)
		}
		if _, err := r.PruneOnce(t.Context()); err != nil {
			t.Fatal(err)
		}
		var n int
		if err := e.pool.QueryRow(t.Context(), `SELECT (SELECT count(*) FROM outbox) + (SELECT count(*) FROM webhook_deliveries) + (SELECT count(*) FROM idempotency)`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		sizes = append(sizes, n)
	}
	// What is left after a prune is at most what arrived since the fan-out
	// last moved: never more than a round's events and deliveries,
	// however many rounds ran.
	for i, n := range sizes {
		if n > 2*perRound {
			t.Fatalf("after round %d the tables hold %d rows (sizes %v): want at most %d", i, n, sizes, 2*perRound)
		}
	}
}

func TestInProcessSubscribersSeeEachEventOnceInOrder(t *testing.T) {
	t.Parallel()
	e := setup(t)
	// Events sequenced before the subscriber existed are not replayed.
	e.write("acme", "node.updated", 3)
	first := e.start(e.cfg)
	poll.Until(t, 20*time.Second, "the first events sequenced", func() bool {
		st, err := events.ReadStats(t.Context(), e.pool)
		return err == nil && st.Unsequenced == 0
	})
	first.Stop()
	var mu sync.Mutex
	var seen []int64
	fail := true
	cfg := e.cfg
	cfg.Subscribers = []relay.Subscriber{{
		Name: "test-sub", Types: []string{"node.*"},
		Handle: func(ctx context.Context, tx pgx.Tx, ev events.Event) error {
			mu.Lock()
			defer mu.Unlock()
			if fail && ev.Resource == "node_x" && len(seen) == 2 {
				fail = false
				return errors.New("first try fails")
			}
			// Its writes commit with the cursor.
			if _, err := tx.Exec(ctx, `INSERT INTO event_cursors (name, seq) VALUES ($1, $2)`, fmt.Sprint("seen:", ev.ID), ev.Seq); err != nil {
				return err
			}
			seen = append(seen, ev.Seq)
			return nil
		},
	}}
	r := e.start(cfg)
	poll.Until(t, 20*time.Second, "leading", r.Leading)
	// Let the subscriber take its place at the head before writing.
	poll.Until(t, 20*time.Second, "the subscriber's cursor", func() bool {
		var n int
		_ = e.pool.QueryRow(t.Context(), `SELECT count(*) FROM event_cursors WHERE name = 'sub:test-sub'`).Scan(&n)
		return n == 1
	})
	e.write("acme", "pool.created", 2) // filtered out
	ids := e.write("acme", "node.updated", 5)
	e.passed("sub:test-sub", ids)
	var committed []int64
	rows, err := e.pool.Query(t.Context(), `SELECT seq FROM event_cursors WHERE name LIKE 'seen:%' ORDER BY seq`)
	if err != nil {
		t.Fatal(err)
	}
	committed, err = pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil || len(committed) != 5 {
		t.Fatalf("committed %v, %v", committed, err)
	}
	for i := 1; i < len(committed); i++ {
		if committed[i] <= committed[i-1] {
			t.Fatalf("out of order: %v", committed)
		}
	}
}
