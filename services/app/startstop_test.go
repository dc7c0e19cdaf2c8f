package app_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/startstop/startstoptest"
	"github.com/bettercompute/bettercompute/services/app"
)

// TestStartStop stress-tests the app's lifecycle with every built role, the
// gateway and the bus included. Not parallel: it checks for leaked
// goroutines.
func TestStartStop(t *testing.T) {
	url := pgtest.NewDB(t)
	ns := natstest.New(t)
	keys := t.TempDir()
	newApp := func(t *testing.T) *app.App {
		t.Helper()
		cfg := testConfig(url)
		cfg.Gateway.Listen = "127.0.0.1:0"
		cfg.JoinService.KeyDir = keys
		cfg.NATS.URL = ns.URL()
		cfg.Runtime.Heartbeat = config.Duration(50 * time.Millisecond)
		cfg.Runtime.LeaseTTL = config.Duration(time.Second)
		a, err := app.New(cfg, app.Options{})
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
	// The first start creates the relay's stream, and with it the bus
	// server's goroutines for it: before the stress, so that they are not
	// counted as the app's.
	// The relay creates it once it leads, a moment after Start: wait for
	// it, or a slow machine counts the stream's goroutines as a leak.
	first := newApp(t)
	if err := first.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(ns.URL())
	if err != nil {
		t.Fatal(err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 30*time.Second, "the relay's stream", func() bool {
		_, err := js.Stream(t.Context(), testConfig(url).Events.Stream)
		return err == nil
	})
	nc.Close()
	first.Stop(context.Background())

	startstoptest.Stress(t, func(t *testing.T) startstoptest.Service {
		a := newApp(t)
		return startstoptest.Service{Start: a.Start, Stop: func() { a.Stop(context.Background()) }}
	}, startstoptest.Options{Run: 20 * time.Millisecond, StartAfterStopFails: true})
}
