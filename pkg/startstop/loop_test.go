package startstop_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/startstop"
)

// passes runs a loop whose passes report on a channel and return what more
// says, until the test ends.
func passes(t *testing.T, every, first time.Duration, more func(n int) bool) (*startstop.Loop, <-chan int) {
	t.Helper()
	ran := make(chan int, 100)
	n := 0
	l := startstop.NewLoop(every, func(context.Context) bool {
		n++
		ran <- n
		return more(n)
	})
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	wg.Go(func() { l.RunAfter(ctx, first) })
	t.Cleanup(func() { cancel(); wg.Wait() })
	return l, ran
}

func next(t *testing.T, ran <-chan int, want int) {
	t.Helper()
	select {
	case n := <-ran:
		if n != want {
			t.Fatalf("pass %d, want %d", n, want)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("no pass %d", want)
	}
}

func none(t *testing.T, ran <-chan int) {
	t.Helper()
	select {
	case n := <-ran:
		t.Fatalf("unexpected pass %d", n)
	case <-time.After(50 * time.Millisecond):
	}
}

// TestLoopRunsAtOnceThenWhenWoken: the first pass runs at once; the next
// only when woken (the period is an hour).
func TestLoopRunsAtOnceThenWhenWoken(t *testing.T) {
	l, ran := passes(t, time.Hour, 0, func(int) bool { return false })
	next(t, ran, 1)
	none(t, ran)
	l.Wake()
	next(t, ran, 2)
	none(t, ran)
}

// TestLoopWakesCoalesce: wakes made while a pass runs make one more pass.
func TestLoopWakesCoalesce(t *testing.T) {
	gate := make(chan struct{})
	l, ran := passes(t, time.Hour, 0, func(n int) bool {
		if n == 1 {
			<-gate
		}
		return false
	})
	next(t, ran, 1) // pass 1 is running, held at the gate
	for range 3 {
		l.Wake()
	}
	close(gate)
	next(t, ran, 2)
	none(t, ran)
}

// TestLoopRunsAgainWhileMore: a pass that reports more is followed at once
// by another, without a wake, until one reports none.
func TestLoopRunsAgainWhileMore(t *testing.T) {
	_, ran := passes(t, time.Hour, 0, func(n int) bool { return n < 3 })
	next(t, ran, 1)
	next(t, ran, 2)
	next(t, ran, 3)
	none(t, ran)
}

// TestLoopRunsEveryPeriod: without wakes, passes come every period.
func TestLoopRunsEveryPeriod(t *testing.T) {
	_, ran := passes(t, time.Millisecond, 0, func(int) bool { return false })
	for i := 1; i <= 5; i++ {
		next(t, ran, i)
	}
}

// TestLoopRunAfterWaitsOrWakes: RunAfter's first pass waits its delay, or a
// wake made even before the loop runs.
func TestLoopRunAfterWaitsOrWakes(t *testing.T) {
	_, ran := passes(t, time.Hour, time.Hour, func(int) bool { return false })
	none(t, ran)

	ran2 := make(chan struct{}, 1)
	l := startstop.NewLoop(time.Hour, func(context.Context) bool { ran2 <- struct{}{}; return false })
	l.Wake()
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	wg.Go(func() { l.RunAfter(ctx, time.Hour) })
	defer func() { cancel(); wg.Wait() }()
	select {
	case <-ran2:
	case <-time.After(10 * time.Second):
		t.Fatal("a wake before RunAfter did not run a pass")
	}
}

// TestLoopEndsWithItsContext: Run returns once ctx is done, even while
// passes keep reporting more.
func TestLoopEndsWithItsContext(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	l := startstop.NewLoop(time.Hour, func(context.Context) bool { return true })
	done := make(chan struct{})
	go func() { defer close(done); l.Run(ctx) }()
	cancel()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after its context was done")
	}
}
