// Package startstoptest stress-tests a Start/Stop lifecycle (see package
// startstop): stop before start, double stop, start and stop repeated, and
// Stop concurrent with Start. A case fails on a panic in Start or Stop, on a
// hang (the process panics with every goroutine's stack once the stress
// overruns its deadline), and on goroutines left running once it is done.
package startstoptest

import (
	"cmp"
	"context"
	"fmt"
	"runtime"
	"runtime/debug"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// Service is one instance under test.
type Service struct {
	// Start starts it. A Start after Stop, or one racing a Stop and losing,
	// may fail or do nothing; any other must succeed.
	Start func(ctx context.Context) error
	// Stop stops it, waiting for what it started.
	Stop func()
}

// Options tune [Stress]. Zero values take the defaults given.
type Options struct {
	// Repeat is how many instances the repeated cases start and stop;
	// default 20.
	Repeat int
	// Timeout bounds the whole stress; default 2 minutes.
	Timeout time.Duration
	// Run is how long a started instance runs before Stop in the double
	// stop and repeated cases, so its loops do some work; default none.
	Run time.Duration
	// StartAfterStopFails says a Start after Stop must return an error
	// (else it must only leave nothing running).
	StartAfterStopFails bool
	// IgnoreLeaks are goleak options for goroutines that outlive a Stop by
	// design.
	IgnoreLeaks []goleak.Option
}

// Stress runs the cases on fresh instances from newService, which is called
// on t's goroutine. Goroutines running when Stress begins are not counted as
// leaks, so create what the instances share (a database, a bus) first, and
// do not make t parallel: the leak check counts the whole process's
// goroutines.
func Stress(t *testing.T, newService func(t *testing.T) Service, opts Options) {
	t.Helper()
	opts.Repeat = cmp.Or(opts.Repeat, 20)
	opts.Timeout = cmp.Or(opts.Timeout, 2*time.Minute)
	ignore := append([]goleak.Option{goleak.IgnoreCurrent()}, opts.IgnoreLeaks...)
	watchdog := time.AfterFunc(opts.Timeout, func() {
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		panic(fmt.Sprintf("startstoptest: %s still running after %s: a Start or Stop hangs\n\n%s", t.Name(), opts.Timeout, buf))
	})
	defer watchdog.Stop()

	cases := []struct {
		name string
		run  func(t *testing.T)
	}{
		{"stop before start", func(t *testing.T) {
			s := newService(t)
			stop(t, s)
			err := start(t, s)
			if opts.StartAfterStopFails && err == nil {
				t.Error("Start after Stop succeeded")
			}
			stop(t, s)
		}},
		{"double stop", func(t *testing.T) {
			s := newService(t)
			if err := start(t, s); err != nil {
				t.Fatalf("Start: %v", err)
			}
			time.Sleep(opts.Run)
			stop(t, s)
			stop(t, s)
		}},
		{"start stop repeated", func(t *testing.T) {
			for i := range opts.Repeat {
				s := newService(t)
				if err := start(t, s); err != nil {
					t.Fatalf("Start %d: %v", i, err)
				}
				time.Sleep(opts.Run)
				stop(t, s)
			}
		}},
		{"stop concurrent with start", func(t *testing.T) {
			for range opts.Repeat {
				s := newService(t)
				var wg sync.WaitGroup
				wg.Go(func() { _ = start(t, s) }) // fails if Stop came first
				wg.Go(func() { stop(t, s) })
				wg.Wait()
				stop(t, s)
			}
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			c.run(t)
			goleak.VerifyNone(t, ignore...)
		})
	}
}

// start calls s.Start, turning a panic into t's error.
func start(t *testing.T, s Service) (err error) {
	defer func() {
		if p := recover(); p != nil {
			t.Errorf("Start panicked: %v\n%s", p, debug.Stack())
			err = fmt.Errorf("panic: %v", p)
		}
	}()
	return s.Start(t.Context())
}

// stop calls s.Stop, turning a panic into t's error.
func stop(t *testing.T, s Service) {
	defer func() {
		if p := recover(); p != nil {
			t.Errorf("Stop panicked: %v\n%s", p, debug.Stack())
		}
	}()
	s.Stop()
}
