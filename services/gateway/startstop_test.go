package gateway_test

import (
	"errors"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/startstop"
	"github.com/bettercompute/bettercompute/pkg/startstop/startstoptest"
	"github.com/bettercompute/bettercompute/services/gateway"
)

// TestStartStop stress-tests the gateway's lifecycle, its liveness and
// report writers busy. Not parallel: it checks for leaked goroutines.
func TestStartStop(t *testing.T) {
	db := pgtest.New(t)
	startstoptest.Stress(t, func(t *testing.T) startstoptest.Service {
		gw, err := gateway.New(gateway.Config{
			ID: "gw-stress", DB: db, Joiner: &joiner{}, TrustDomain: trustDomain,
			LivenessInterval: 5 * time.Millisecond,
		})
		if err != nil {
			t.Fatal(err)
		}
		return startstoptest.Service{Start: gw.Start, Stop: gw.Stop}
	}, startstoptest.Options{Run: 20 * time.Millisecond, StartAfterStopFails: true})
}

// TestStartTwiceFails: a second Start is refused, and the gateway started
// once stops cleanly.
func TestStartTwiceFails(t *testing.T) {
	gw, err := gateway.New(gateway.Config{ID: "gw-twice", DB: pgtest.New(t), Joiner: &joiner{}, TrustDomain: trustDomain})
	if err != nil {
		t.Fatal(err)
	}
	if err := gw.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := gw.Start(t.Context()); !errors.Is(err, startstop.ErrStarted) {
		t.Fatalf("a second Start returned %v", err)
	}
	gw.Stop()
}
