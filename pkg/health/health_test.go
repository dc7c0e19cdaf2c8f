package health_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/health"
)

// TestCachedProbesAtMostOncePerInterval: a hundred concurrent callers of a
// cached check cost one probe, and get its result; after the interval the
// next caller probes again.
func TestCachedProbesAtMostOncePerInterval(t *testing.T) {
	var probes atomic.Int64
	c := health.Cached(health.Check{Name: "database", Required: true, Run: func(context.Context) error {
		probes.Add(1)
		return errors.New("down")
	}}, 200*time.Millisecond)
	var wg sync.WaitGroup
	for range 100 {
		wg.Go(func() {
			if rep := health.Run(t.Context(), []health.Check{c}); rep.Ready || rep.Checks[0].Message != "down" {
				t.Errorf("report %+v", rep)
			}
		})
	}
	wg.Wait()
	if n := probes.Load(); n != 1 {
		t.Fatalf("%d probes for 100 callers within the interval, want 1", n)
	}
	// Past the 200 ms interval: the time passing is what is under test.
	time.Sleep(250 * time.Millisecond)
	health.Run(t.Context(), []health.Check{c})
	if n := probes.Load(); n != 2 {
		t.Fatalf("%d probes after the interval, want 2", n)
	}
}
