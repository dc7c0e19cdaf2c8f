package session

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"

	"github.com/bettercompute/bettercompute/agent/internal/retry"
)

// TestReconnectBacksOffInVirtualTime runs the session loop's back-off on
// synctest's clock, with sessions that fail at once: each wait is within
// ±50 % of its step, the steps double from MinBackoff to MaxBackoff, the
// waits are jittered, a welcomed session starts the back-off over, and a
// cancel during a wait ends the loop at that instant.
func TestReconnectBacksOffInVirtualTime(t *testing.T) {
	t.Parallel()
	const lo, hi = 500 * time.Millisecond, 30 * time.Second
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		const welcomedAt, sessions = 12, 20 // the 12th session is welcomed
		var starts []time.Time
		var told []time.Duration
		session := func(context.Context) (bool, error) {
			starts = append(starts, time.Now())
			return len(starts) == welcomedAt, errors.New("connection refused")
		}
		ended := func(_ error, d time.Duration) {
			told = append(told, d)
			if len(told) == sessions {
				// Cancel half way through the last wait.
				time.AfterFunc(d/2, cancel)
			}
		}
		begin := time.Now()
		reconnect(ctx, retry.Backoff{Min: lo, Max: hi}, session, ended)
		if len(starts) != sessions {
			t.Fatalf("%d sessions, want %d", len(starts), sessions)
		}

		step := lo
		distinct := map[time.Duration]bool{}
		for i := 1; i < sessions; i++ { // wait i follows session i
			if i == welcomedAt {
				step = lo // a welcomed session starts over
			}
			wait := starts[i].Sub(starts[i-1])
			if wait != told[i-1] {
				t.Errorf("wait %d: slept %s, said %s", i, wait, told[i-1])
			}
			if least, most := step/2, min(step*3/2, hi); wait < least || wait > most {
				t.Errorf("wait %d: %s outside [%s, %s] (step %s)", i, wait, least, most, step)
			}
			distinct[wait] = true
			step = min(step*2, hi)
		}
		if len(distinct) < sessions/2 {
			t.Errorf("only %d distinct waits in %d: not jittered", len(distinct), sessions-1)
		}
		// The waits after the welcomed session start over from MinBackoff.
		if w := starts[welcomedAt].Sub(starts[welcomedAt-1]); w > lo*3/2 {
			t.Errorf("the wait after the welcomed session is %s, want at most %s", w, lo*3/2)
		}
		if got, want := time.Since(begin), starts[sessions-1].Sub(begin)+told[sessions-1]/2; got != want {
			t.Errorf("the loop ended %s after it began, want %s (the cancel, half way through the last wait)", got, want)
		}
	})
}

// TestSleepEndsWithItsContext: sleep waits its delay exactly, or returns
// false at the instant its context ends.
func TestSleepEndsWithItsContext(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		begin := time.Now()
		if !retry.Sleep(t.Context(), time.Minute) || time.Since(begin) != time.Minute {
			t.Fatalf("retry.Sleep(1m) returned after %s", time.Since(begin))
		}
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		begin = time.Now()
		if retry.Sleep(ctx, time.Hour) || time.Since(begin) != time.Second {
			t.Fatalf("sleep under a 1s context returned after %s", time.Since(begin))
		}
	})
}
