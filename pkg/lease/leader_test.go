package lease_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/lease"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/startstop/startstoptest"
)

// changes records what a leader's OnChange is told.
type changes struct {
	mu  sync.Mutex
	got []string
}

func (c *changes) on(h lease.Held, leading bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if leading {
		c.got = append(c.got, "took "+h.Name)
	} else {
		c.got = append(c.got, "dropped "+h.Name)
	}
}

func (c *changes) list() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.got...)
}

// newLeader returns a leader of singleton:thing that looks every 20ms; ttl
// is long enough that a loaded machine's late renewal does not lose the
// lease, unless a test wants it to expire.
func newLeader(t *testing.T, pool *pgxpool.Pool, holder string, ttl time.Duration, c *changes) *lease.Leader {
	t.Helper()
	l, err := lease.NewLeader(pool, lease.LeaderConfig{
		Name: lease.Singleton("thing"), Holder: holder,
		Heartbeat: 20 * time.Millisecond, TTL: ttl, OnChange: c.on,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Stop)
	return l
}

// write bumps t.v under l's lease.
func write(ctx context.Context, l *lease.Leader) error {
	return l.InTx(ctx, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `UPDATE t SET v = v + 1`)
		return err
	})
}

// TestLeaderHandsOverAtStop: one of two leaders leads, takes the lease at
// Start, and writes under it; the other writes nothing; when the first
// stops it releases the lease and the second takes it with the next fence.
func TestLeaderHandsOverAtStop(t *testing.T) {
	t.Parallel()
	pool := pgtest.New(t)
	ctx := t.Context()
	if _, err := pool.Exec(ctx, `CREATE TABLE t (v int); INSERT INTO t VALUES (0)`); err != nil {
		t.Fatal(err)
	}
	var ca, cb changes
	a, b := newLeader(t, pool, "a", time.Minute, &ca), newLeader(t, pool, "b", time.Minute, &cb)
	if err := a.Start(ctx); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 10*time.Second, "a leading", a.Leading)
	if err := b.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if err := write(ctx, a); err != nil {
		t.Fatal(err)
	}
	if err := write(ctx, b); !errors.Is(err, lease.ErrNotLeading) {
		t.Fatalf("b wrote without the lease: %v", err)
	}
	first, _ := a.Held()
	a.Stop()
	if a.Leading() {
		t.Fatal("a stopped leader still leads")
	}
	poll.Until(t, 10*time.Second, "b leading", b.Leading)
	if h, _ := b.Held(); h.Fence != first.Fence+1 {
		t.Fatalf("b took fence %d after %d", h.Fence, first.Fence)
	}
	if err := write(ctx, b); err != nil {
		t.Fatal(err)
	}
	var v int
	if err := pool.QueryRow(ctx, `SELECT v FROM t`).Scan(&v); err != nil || v != 2 {
		t.Fatalf("v = %d (%v), want the two leaders' writes", v, err)
	}
	want := []string{"took singleton:thing", "dropped singleton:thing"}
	if got := ca.list(); len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("a was told %v, want %v", got, want)
	}
}

// TestLeaderFencedOnceLost: a leader whose lease another took writes
// nothing, stops leading at once, and is told so.
func TestLeaderFencedOnceLost(t *testing.T) {
	t.Parallel()
	pool := pgtest.New(t)
	ctx := t.Context()
	if _, err := pool.Exec(ctx, `CREATE TABLE t (v int); INSERT INTO t VALUES (0)`); err != nil {
		t.Fatal(err)
	}
	var c changes
	l, err := lease.NewLeader(pool, lease.LeaderConfig{Name: lease.Singleton("thing"), Holder: "a", Heartbeat: time.Hour, OnChange: c.on})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Stop)
	if err := l.Start(ctx); err != nil || !l.Leading() {
		t.Fatalf("not leading after Start: %v", err)
	}
	// Expired by database time and taken by another: the next heartbeat is
	// an hour away, so only the fence can tell.
	if _, err := pool.Exec(ctx, `UPDATE leases SET expires_at = now() - interval '1 ms'`); err != nil {
		t.Fatal(err)
	}
	if got, err := lease.Acquire(ctx, pool, "b", time.Minute, []string{lease.Singleton("thing")}); err != nil || len(got) != 1 {
		t.Fatalf("b: %v %v", got, err)
	}
	if err := write(ctx, l); !errors.Is(err, lease.ErrLost) {
		t.Fatalf("a fenced write returned %v", err)
	}
	if l.Leading() {
		t.Fatal("a fenced leader still leads")
	}
	var v int
	if err := pool.QueryRow(ctx, `SELECT v FROM t`).Scan(&v); err != nil || v != 0 {
		t.Fatalf("v = %d (%v): the fenced write landed", v, err)
	}
	if got := c.list(); len(got) != 2 || got[1] != "dropped singleton:thing" {
		t.Fatalf("told %v", got)
	}
}

// TestLeaderStopReleasesAbandonDoesNot: a stopped leader's lease is free at
// once; an abandoned one stays held until it expires, then a standby takes
// it.
func TestLeaderStopReleasesAbandonDoesNot(t *testing.T) {
	t.Parallel()
	pool := pgtest.New(t)
	ctx := t.Context()
	holder := func() string {
		t.Helper()
		var h *string
		if err := pool.QueryRow(ctx, `SELECT holder FROM leases`).Scan(&h); err != nil {
			t.Fatal(err)
		}
		if h == nil {
			return ""
		}
		return *h
	}
	stopped := newLeader(t, pool, "stopped", time.Minute, &changes{})
	if err := stopped.Start(ctx); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 10*time.Second, "leading", stopped.Leading)
	stopped.Stop()
	if h := holder(); h != "" {
		t.Fatalf("held by %q after Stop", h)
	}

	a := newLeader(t, pool, "a", time.Second, &changes{})
	if err := a.Start(ctx); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 10*time.Second, "a leading", a.Leading)
	a.Abandon()
	if a.Leading() {
		t.Fatal("an abandoned leader still leads")
	}
	if h := holder(); h != "a" {
		t.Fatalf("held by %q after Abandon, want a", h)
	}
	b := newLeader(t, pool, "b", time.Second, &changes{})
	if err := b.Start(ctx); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 10*time.Second, "b leading once a's lease expired", b.Leading)
}

// TestLeaderStartStop stress-tests the leader's lifecycle. Not parallel: it
// checks for leaked goroutines.
func TestLeaderStartStop(t *testing.T) {
	pool := pgtest.New(t)
	startstoptest.Stress(t, func(t *testing.T) startstoptest.Service {
		l := newLeader(t, pool, "stress", time.Minute, &changes{})
		return startstoptest.Service{Start: l.Start, Stop: l.Stop}
	}, startstoptest.Options{Run: 30 * time.Millisecond, StartAfterStopFails: true})
}
