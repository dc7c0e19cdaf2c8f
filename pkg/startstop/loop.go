package startstop

import (
	"context"
	"time"
)

// Loop runs passes of some work, one at a time, on a timer or when woken:
// the loop a long-running part runs in a goroutine between its Start and
// its Stop. A pass that reports more work waiting is followed at once by
// another; otherwise the next pass runs Every later, or as soon as
// [Loop.Wake] is called. Wakes coalesce: any number of them while a pass
// runs make one more pass.
type Loop struct {
	every time.Duration
	pass  func(ctx context.Context) (more bool)
	wake  chan struct{}
}

// NewLoop returns a loop of pass with every as its period.
func NewLoop(every time.Duration, pass func(ctx context.Context) (more bool)) *Loop {
	return &Loop{every: every, pass: pass, wake: make(chan struct{}, 1)}
}

// Wake makes the loop run a pass as soon as the one running, if any, ends.
// It never blocks, and may be called before Run or after it returned.
func (l *Loop) Wake() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// Run runs a pass at once, then passes as the loop's doc says, until ctx is
// done.
func (l *Loop) Run(ctx context.Context) { l.RunAfter(ctx, 0) }

// RunAfter is [Loop.Run] whose first pass waits first (or a wake).
func (l *Loop) RunAfter(ctx context.Context, first time.Duration) {
	t := time.NewTimer(first)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-l.wake:
		}
		if l.pass(ctx) {
			t.Reset(0)
		} else {
			t.Reset(l.every)
		}
	}
}
