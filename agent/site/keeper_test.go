package site

import (
	"log/slog"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// calls is a BootServer recording its calls.
type calls struct {
	mu  sync.Mutex
	log []int64 // an epoch per Serve, -1 per Stop
}

func (c *calls) Serve(epoch int64) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.log = append(c.log, epoch)
	return nil
}

func (c *calls) Stop() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.log = append(c.log, -1)
}

func (c *calls) get() []int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]int64(nil), c.log...)
}

func grant(holder string, epoch int64, ttl time.Duration, held bool) *agentv1.LeaseState {
	return &agentv1.LeaseState{HolderAgentId: holder, Epoch: epoch, Held: held, TtlMs: ttl.Milliseconds(), ExpireTime: timestamppb.New(time.Now().Add(ttl))}
}

func equal(a, b []int64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func newKeeper(c *calls) *keeper { return &keeper{boot: c, log: slog.New(slog.DiscardHandler)} }

func TestKeeperServesWhileHeldAndStopsWhenLost(t *testing.T) {
	t.Parallel()
	c := &calls{}
	k := newKeeper(c)
	defer k.stop("test over")
	k.answer(time.Now(), grant("sag_a", 3, time.Hour, true), time.Minute)
	k.answer(time.Now(), grant("sag_a", 3, time.Hour, true), time.Minute) // a renewal: nothing to do
	if got := c.get(); !equal(got, []int64{3}) {
		t.Fatalf("after two grants at epoch 3: %v, want one Serve(3)", got)
	}
	k.answer(time.Now(), grant("sag_a", 5, time.Hour, true), time.Minute)
	if got := c.get(); !equal(got, []int64{3, -1, 5}) {
		t.Fatalf("after a grant at a new epoch: %v, want Stop then Serve(5)", got)
	}
	k.answer(time.Now(), grant("sag_b", 6, time.Hour, false), time.Minute)
	if got := c.get(); !equal(got, []int64{3, -1, 5, -1}) {
		t.Fatalf("after the lease went to sag_b: %v, want a Stop", got)
	}
	k.answer(time.Now(), grant("sag_b", 6, time.Hour, false), time.Minute)
	if got := c.get(); len(got) != 4 {
		t.Fatalf("a second refusal while stopped: %v, want nothing more", got)
	}
}

// TestKeeperStopsAtItsDeadline: without a renewal the boot server stops at
// sentAt + ttl − margin, measured from when the request was sent.
func TestKeeperStopsAtItsDeadline(t *testing.T) {
	t.Parallel()
	c := &calls{}
	k := newKeeper(c)
	defer k.stop("test over")
	sent := time.Now()
	ttl, margin := 600*time.Millisecond, 100*time.Millisecond
	k.answer(sent, grant("sag_a", 1, ttl, true), margin)
	deadline := time.Now().Add(30 * time.Second)
	for len(c.get()) < 2 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	stoppedBy := time.Now()
	if got := c.get(); !equal(got, []int64{1, -1}) {
		t.Fatalf("%v, want Serve(1) then Stop", got)
	}
	if since := stoppedBy.Sub(sent); since < ttl-margin {
		t.Fatalf("stopped %s after the request, before its deadline %s", since, ttl-margin)
	}
}

// TestKeeperDoesNotCountOnALateAnswer: a grant whose deadline has already
// passed when it arrives starts nothing.
func TestKeeperDoesNotCountOnALateAnswer(t *testing.T) {
	t.Parallel()
	c := &calls{}
	k := newKeeper(c)
	k.answer(time.Now().Add(-time.Second), grant("sag_a", 1, time.Second, true), 100*time.Millisecond)
	if got := c.get(); len(got) != 0 {
		t.Fatalf("%v, want nothing", got)
	}
}

func TestRunRefusesABadConfiguration(t *testing.T) {
	t.Parallel()
	for _, cfg := range []Config{
		{},
		{Gateway: "x:1"},
	} {
		if err := Run(t.Context(), cfg); err == nil {
			t.Errorf("%+v: want an error", cfg)
		}
	}
}
