package gateway_test

import (
	"context"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/pgtest"
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
		return startstoptest.Service{
			Start: func(context.Context) error { gw.Start(); return nil },
			Stop:  gw.Stop,
		}
	}, startstoptest.Options{Run: 20 * time.Millisecond})
}
