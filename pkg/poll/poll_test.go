package poll_test

import (
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/poll"
)

func TestUntil(t *testing.T) {
	t.Parallel()
	var n atomic.Int32
	go func() {
		for range 3 {
			time.Sleep(time.Millisecond)
			n.Add(1)
		}
	}()
	calls := 0
	poll.Until(t, 10*time.Second, "three increments", func() bool { calls++; return n.Load() == 3 })
	if calls == 0 {
		t.Fatal("the condition was never checked")
	}
}

// fatal records a Fatalf instead of ending the test.
type fatal struct {
	testing.TB
	msg string
}

func (f *fatal) Helper() {}

func (f *fatal) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	panic(f)
}

func TestUntilTimesOut(t *testing.T) {
	t.Parallel()
	f := &fatal{TB: t}
	start := time.Now()
	func() {
		defer func() {
			if p := recover(); p != f {
				t.Fatalf("Until did not fail: %v", p)
			}
		}()
		poll.Until(f, 30*time.Millisecond, "never", func() bool { return false })
	}()
	if d := time.Since(start); d < 30*time.Millisecond {
		t.Errorf("gave up after %s, before the deadline", d)
	}
	if f.msg == "" {
		t.Error("no failure message")
	}
}

func TestUntilNil(t *testing.T) {
	t.Parallel()
	n := 0
	poll.UntilNil(t, 10*time.Second, "the third call", func() error {
		if n++; n < 3 {
			return fmt.Errorf("call %d", n)
		}
		return nil
	})

	f := &fatal{TB: t}
	func() {
		defer func() { _ = recover() }()
		poll.UntilNil(f, 20*time.Millisecond, "never", func() error { return errors.New("still not") })
	}()
	if !strings.Contains(f.msg, "still not") {
		t.Errorf("failure %q does not give the last error", f.msg)
	}
}
