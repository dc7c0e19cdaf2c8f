package retry_test

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/bettercompute/bettercompute/agent/internal/retry"
)

func TestBackoff_DoublesWithJitterCappedAndResets(t *testing.T) {
	t.Parallel()
	b := retry.Backoff{Min: 500 * time.Millisecond, Max: 30 * time.Second}
	step := b.Min
	for i := range 12 {
		d := b.Next()
		if lo, hi := step/2, min(step*3/2, b.Max); d < lo || d > hi {
			t.Errorf("attempt %d: %s outside [%s, %s]", i, d, lo, hi)
		}
		step = min(step*2, b.Max)
	}
	b.Reset()
	if d := b.Next(); d > 750*time.Millisecond {
		t.Errorf("after reset: %s", d)
	}
	b.Longest()
	if d := b.Next(); d < b.Max/2 {
		t.Errorf("after Longest: %s, want at least %s", d, b.Max/2)
	}
}

func TestSleep(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		begin := time.Now()
		if !retry.Sleep(t.Context(), time.Minute) || time.Since(begin) != time.Minute {
			t.Fatalf("Sleep(1m) returned after %s", time.Since(begin))
		}
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		begin = time.Now()
		if retry.Sleep(ctx, time.Hour) || time.Since(begin) != time.Second {
			t.Fatalf("Sleep with a context ending in 1s returned %s later", time.Since(begin))
		}
	})
}

func TestHostOf(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{"gw.example:7443": "gw.example", "[::1]:7443": "::1", "gw.example": "gw.example"} {
		if got := retry.HostOf(in); got != want {
			t.Errorf("HostOf(%q) = %q, want %q", in, got, want)
		}
	}
}
