// Package startstop is the one lifecycle of Better Compute's long-running
// parts (the app, the reconciler runtime, the gateway, the outbox relay, a
// lease's leader): started at most once, stopped at most once, in any order
// and from any goroutine. Each has Start(ctx) error and Stop() (the app's
// Stop takes a context, which its graceful shutdown ends by).
//
//   - Stop before Start stops what there is (perhaps nothing) and makes a
//     later Start fail with [ErrStopped].
//   - A second Stop does nothing; a second Start fails with [ErrStarted].
//   - Stop concurrent with Start waits for Start to finish, then stops what
//     it started.
//
// A service embeds a [Once] and writes its Start and Stop as closures run
// under it:
//
//	func (s *Service) Start(ctx context.Context) error {
//		return s.life.Start(func() error { … })
//	}
//
//	func (s *Service) Stop() {
//		s.life.Stop(func(started bool) { … })
//	}
//
// What such a part runs between Start and Stop is a [Loop]: a pass of its
// work on a timer, or at once when woken.
package startstop

import (
	"errors"
	"sync"
)

// Errors of a Start that does not run.
var (
	ErrStarted = errors.New("started already")
	ErrStopped = errors.New("stopped already")
)

// Once is a lifecycle. Its zero value is ready: neither started nor stopped.
type Once struct {
	mu      sync.Mutex
	started bool
	stopped bool
}

// Start runs start unless Start or Stop ran before ([ErrStarted],
// [ErrStopped]). A concurrent Stop waits while start runs. A start that
// fails must undo what it did: the lifecycle then counts as stopped, and a
// later Stop does nothing.
func (o *Once) Start(start func() error) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	switch {
	case o.stopped:
		return ErrStopped
	case o.started:
		return ErrStarted
	}
	o.started = true
	if err := start(); err != nil {
		o.stopped = true
		return err
	}
	return nil
}

// Stop runs stop the first time it is called, after a Start in progress has
// finished; started says whether a Start succeeded. Later calls do nothing.
func (o *Once) Stop(stop func(started bool)) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.stopped {
		return
	}
	o.stopped = true
	stop(o.started)
}

// BeforeStart runs f unless Start ran before ([ErrStarted]); Start waits
// while f runs. It guards setup that must be done before Start, such as
// registering work.
func (o *Once) BeforeStart(f func() error) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.started {
		return ErrStarted
	}
	return f()
}
