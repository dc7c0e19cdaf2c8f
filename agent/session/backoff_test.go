package session

import (
	"testing"
	"time"
)

func TestBackoff_DoublesWithJitterCappedAndResets(t *testing.T) {
	t.Parallel()
	b := backoff{min: 500 * time.Millisecond, max: 30 * time.Second}
	step := b.min
	for i := range 12 {
		d := b.next()
		if lo, hi := step/2, min(step*3/2, b.max); d < lo || d > hi {
			t.Errorf("attempt %d: %s outside [%s, %s]", i, d, lo, hi)
		}
		step = min(step*2, b.max)
	}
	b.reset()
	if d := b.next(); d > 750*time.Millisecond {
		t.Errorf("after reset: %s", d)
	}
}
