package leaktest_test

import (
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/bettercompute/bettercompute/agent/internal/leaktest"
)

func TestMain(m *testing.M) { leaktest.Main(m) }

// plantedLeak blocks until stop is closed: a goroutine a test forgot.
func plantedLeak(stop <-chan struct{}, started chan<- struct{}) {
	close(started)
	<-stop
}

// TestFindReportsALeakedGoroutine plants a goroutine that outlives its
// "test" and checks that Find reports it, naming its function, and that
// Find is content once it has stopped.
func TestFindReportsALeakedGoroutine(t *testing.T) {
	before := goleak.IgnoreCurrent()
	stop, started := make(chan struct{}), make(chan struct{})
	go plantedLeak(stop, started)
	<-started

	err := leaktest.Find(100*time.Millisecond, before)
	if err == nil || !strings.Contains(err.Error(), "leaktest_test.plantedLeak") {
		close(stop)
		t.Fatalf("Find with a goroutine left running: got %v, want a report naming plantedLeak", err)
	}

	close(stop)
	if err := leaktest.Find(leaktest.Grace, before); err != nil {
		t.Fatalf("Find after the goroutine stopped: %v", err)
	}
}
