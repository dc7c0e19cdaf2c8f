package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/events"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/startstop/startstoptest"

	"github.com/bettercompute/bettercompute/services/relay"
)

// TestStartStop stress-tests the relay's lifecycle with its loops busy:
// events to sequence, publish and fan out, deliveries to attempt. Not
// parallel: it checks for leaked goroutines (a relay's JetStream publisher
// and its HTTP client's connections included).
func TestStartStop(t *testing.T) {
	e := setup(t)
	_, key := e.hook("acme", "", []string{"*"}, false)
	rcv := newReceiver(t, key)
	setURL(t, e, rcv)
	cfg := e.cfg
	cfg.Events.Batch = 5 // many passes, so each relay does some of the work
	// The first relay to lead creates the stream, and with it the bus
	// server's goroutines for it: before the stress, so that they are not
	// counted as the relays'.
	first, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 20*time.Second, "the stream", func() bool { return first.EnsureStream(t.Context()) == nil })
	first.Stop()
	e.write("acme", "node.updated", 400)
	startstoptest.Stress(t, func(t *testing.T) startstoptest.Service {
		r, err := relay.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		return startstoptest.Service{Start: r.Start, Stop: r.Stop}
	}, startstoptest.Options{Run: 50 * time.Millisecond, StartAfterStopFails: true})
	var seqd, dels int
	if err := e.pool.QueryRow(t.Context(), `SELECT count(seq), (SELECT count(*) FROM webhook_deliveries) FROM outbox`).Scan(&seqd, &dels); err != nil {
		t.Fatal(err)
	}
	if seqd == 0 {
		t.Error("the relays sequenced nothing: the stress did not exercise their loops")
	}
	_, n := rcv.ids()
	t.Logf("the relays sequenced %d events of 400, made %d deliveries and delivered %d", seqd, dels, n)
}

// TestStartStopToleratesEveryOrder: stop before start, a double stop, and
// start after stop (refused) leave nothing running and hold no lease.
func TestStartStopToleratesEveryOrder(t *testing.T) {
	t.Parallel()
	e := setup(t)
	never, err := relay.New(e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	never.Stop()
	never.Stop()
	if err := never.Start(t.Context()); err == nil {
		t.Fatal("Start after Stop was accepted")
	}

	r, err := relay.New(e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := r.Start(t.Context()); err == nil {
		t.Fatal("a second Start was accepted")
	}
	poll.Until(t, 20*time.Second, "leading", r.Leading)
	r.Stop()
	r.Stop()
	if r.Leading() {
		t.Fatal("a stopped relay still leads")
	}
	var holder *string
	if err := e.pool.QueryRow(t.Context(), `SELECT holder FROM leases WHERE name = $1`, relay.LeaseName).Scan(&holder); err != nil {
		t.Fatal(err)
	}
	if holder != nil {
		t.Fatalf("the lease is still held by %s after Stop", *holder)
	}
}

// TestNewRefusesABadSubscriber names what is wrong.
func TestNewRefusesABadSubscriber(t *testing.T) {
	t.Parallel()
	e := setup(t)
	for _, sub := range []relay.Subscriber{
		{Name: "Bad Name", Handle: nil},
		{Name: "ok", Handle: nil},
		{Name: "ok", Types: []string{"Nope!"}, Handle: func(context.Context, pgx.Tx, events.Event) error { return nil }},
	} {
		cfg := e.cfg
		cfg.Subscribers = []relay.Subscriber{sub}
		if _, err := relay.New(cfg); err == nil {
			t.Errorf("subscriber %+v accepted", sub.Name)
		}
	}
}
