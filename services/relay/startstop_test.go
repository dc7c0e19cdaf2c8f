package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/events"
	"github.com/bettercompute/bettercompute/pkg/poll"

	"github.com/bettercompute/bettercompute/services/relay"
)

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
