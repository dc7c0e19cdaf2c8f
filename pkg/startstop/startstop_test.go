package startstop_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"go.uber.org/goleak"

	"github.com/bettercompute/bettercompute/pkg/startstop"
	"github.com/bettercompute/bettercompute/pkg/startstop/startstoptest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// loop is a service written with Once: one goroutine until Stop.
type loop struct {
	life startstop.Once
	quit chan struct{}
	done chan struct{}
}

func newLoop() *loop { return &loop{quit: make(chan struct{}), done: make(chan struct{})} }

func (l *loop) Start(context.Context) error {
	return l.life.Start(func() error {
		go func() {
			defer close(l.done)
			<-l.quit
		}()
		return nil
	})
}

func (l *loop) Stop() {
	l.life.Stop(func(started bool) {
		close(l.quit)
		if started {
			<-l.done
		}
	})
}

func TestOnce(t *testing.T) {
	t.Parallel()
	t.Run("starts once", func(t *testing.T) {
		t.Parallel()
		var o startstop.Once
		runs := 0
		start := func() error { runs++; return nil }
		if err := o.Start(start); err != nil {
			t.Fatal(err)
		}
		if err := o.Start(start); !errors.Is(err, startstop.ErrStarted) {
			t.Fatalf("second Start = %v, want ErrStarted", err)
		}
		if runs != 1 {
			t.Fatalf("start ran %d times", runs)
		}
	})
	t.Run("stops once and says whether it started", func(t *testing.T) {
		t.Parallel()
		var o startstop.Once
		var calls []bool
		stop := func(started bool) { calls = append(calls, started) }
		o.Stop(stop)
		o.Stop(stop)
		if err := o.Start(func() error { t.Error("start ran after Stop"); return nil }); !errors.Is(err, startstop.ErrStopped) {
			t.Fatalf("Start after Stop = %v, want ErrStopped", err)
		}
		if len(calls) != 1 || calls[0] {
			t.Fatalf("stop calls %v, want one with started false", calls)
		}
	})
	t.Run("a failed start counts as stopped", func(t *testing.T) {
		t.Parallel()
		var o startstop.Once
		boom := errors.New("boom")
		if err := o.Start(func() error { return boom }); !errors.Is(err, boom) {
			t.Fatalf("Start = %v", err)
		}
		o.Stop(func(bool) { t.Error("stop ran after a failed Start") })
		if err := o.Start(func() error { return nil }); !errors.Is(err, startstop.ErrStopped) {
			t.Fatalf("Start after a failed Start = %v, want ErrStopped", err)
		}
	})
	t.Run("before start", func(t *testing.T) {
		t.Parallel()
		var o startstop.Once
		if err := o.BeforeStart(func() error { return nil }); err != nil {
			t.Fatal(err)
		}
		_ = o.Start(func() error { return nil })
		if err := o.BeforeStart(func() error { t.Error("ran after Start"); return nil }); !errors.Is(err, startstop.ErrStarted) {
			t.Fatalf("BeforeStart after Start = %v, want ErrStarted", err)
		}
	})
	t.Run("stop waits for a start in progress", func(t *testing.T) {
		t.Parallel()
		var o startstop.Once
		entered, release := make(chan struct{}), make(chan struct{})
		var wg sync.WaitGroup
		wg.Go(func() {
			_ = o.Start(func() error { close(entered); <-release; return nil })
		})
		<-entered
		stopped := make(chan bool, 1)
		wg.Go(func() { o.Stop(func(started bool) { stopped <- started }) })
		select {
		case <-stopped:
			t.Fatal("Stop ran while Start was running")
		default:
		}
		close(release)
		wg.Wait()
		if !<-stopped {
			t.Fatal("Stop after Start was told it had not started")
		}
	})
}

func TestStress(t *testing.T) {
	startstoptest.Stress(t, func(*testing.T) startstoptest.Service {
		l := newLoop()
		return startstoptest.Service{Start: l.Start, Stop: l.Stop}
	}, startstoptest.Options{StartAfterStopFails: true})
}
