package reconcile_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/bus"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/startstop/startstoptest"
)

// TestStartStop stress-tests the runtime's lifecycle on a real database and
// bus, with keys to run. Not parallel: it checks for leaked goroutines.
func TestStartStop(t *testing.T) {
	pool := newPool(t)
	ns := natstest.New(t)
	nc, err := bus.Connect(ns.URL(), "startstop", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	for _, k := range []string{"a", "b", "c"} {
		enqueue(t, pool, "thing", k)
	}
	startstoptest.Stress(t, func(t *testing.T) startstoptest.Service {
		rt, err := reconcile.New(pool, nc, reconcile.Config{
			Roles:     []string{reconcile.RoleControllers, reconcile.RoleScheduler},
			Heartbeat: 20 * time.Millisecond, Poll: 10 * time.Millisecond, PollBusDown: 10 * time.Millisecond,
		})
		if err != nil {
			t.Fatal(err)
		}
		c := &counter{}
		c.hook = func(context.Context, *reconcile.RunContext, string, int) (reconcile.Result, error) {
			return reconcile.SyncAgain, nil // keep the keys coming
		}
		if err := rt.Register(c.reconciler("thing")); err != nil {
			t.Fatal(err)
		}
		return startstoptest.Service{Start: rt.Start, Stop: rt.Stop}
	}, startstoptest.Options{Run: 20 * time.Millisecond, StartAfterStopFails: true})
}
