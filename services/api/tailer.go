package api

import (
	"cmp"
	"context"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/bettercompute/bettercompute/pkg/events"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/wake"
)

// WatchLimits bound the events.watch streams of one API process
// (events.maxStreamLifetime, events.maxWatchesPerIdentity,
// events.maxWatches). Zero values are the defaults.
type WatchLimits struct {
	// MaxLifetime ends a stream this long after it opened; 0 means 1h.
	MaxLifetime time.Duration
	// PerIdentity bounds one identity's open streams; 0 means 16.
	PerIdentity int
	// Total bounds the process's open streams; 0 means 2048.
	Total int
}

func (l WatchLimits) withDefaults() WatchLimits {
	l.MaxLifetime = cmp.Or(l.MaxLifetime, time.Hour)
	l.PerIdentity = cmp.Or(l.PerIdentity, 16)
	l.Total = cmp.Or(l.Total, 2048)
	return l
}

// Bounds of the tailer and of one watch.
const (
	// tailBatch is how many events the tailer reads at once.
	tailBatch = 1000
	// tailPoll is the tailer's resync with a connected bus (the event
	// stream wakes it sooner); tailPollNoBus without one.
	tailPoll      = 2 * time.Second
	tailPollNoBus = 250 * time.Millisecond
	// watchBuffer is how many events a watch may fall behind the tailer
	// before it is cut loose to catch up from the database.
	watchBuffer = 1024
	// replayWindow is how many seqs one replay statement scans.
	replayWindow = 10_000
)

// tailer is the one reader of new events in an API process: it reads
// each event once (woken by the event stream, and on a timer — every
// tailPoll, or tailPollNoBus while the bus is down — so it converges from
// the database alone) and hands it, in memory, to the watches whose tenant
// and filter select it. A watch reads the database only to replay what
// came before it joined, in bounded chunks.
type tailer struct {
	s      *Server
	limits WatchLimits

	mu sync.Mutex
	// head is the last seq read; valid once started. stale says the tail
	// was not read for want of watches, so head may be behind.
	head           int64
	started, stale bool
	// watches are the admitted watches (for caps and rechecks); live those
	// following the tail, by the tenant of their filter.
	watches     map[*watch]struct{}
	live        map[string]map[*watch]struct{}
	perIdentity map[string]int

	kick chan struct{}
	sub  *nats.Subscription
	done chan struct{}
}

// watch is one open events.watch stream.
type watch struct {
	p iam.Principal
	f events.Filter
	// ch receives the events f selects after the seq join returned;
	// lagged is closed (and lagAt set) when ch was full, and the watch must
	// catch up from the database after lagAt.
	ch      chan events.Event
	lagged  chan struct{}
	lagAt   int64
	recheck chan struct{}
}

func newTailer(s *Server, l WatchLimits) *tailer {
	return &tailer{
		s: s, limits: l.withDefaults(),
		watches: map[*watch]struct{}{}, live: map[string]map[*watch]struct{}{}, perIdentity: map[string]int{},
		kick: make(chan struct{}, 1), done: make(chan struct{}),
	}
}

// admit registers a watch by p with filter f, or refuses it RATE_LIMITED
// when p or the process holds as many as the limits allow.
func (t *tailer) admit(p iam.Principal, f events.Filter) (*watch, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.watches) >= t.limits.Total {
		return nil, fault.New(fault.RateLimited, "", "this server holds %d event watches, its limit (events.maxWatches); retry later or on another server", len(t.watches))
	}
	if t.perIdentity[p.IdentityID] >= t.limits.PerIdentity {
		return nil, fault.New(fault.RateLimited, "", "identity %s holds %d event watches on this server, its limit (events.maxWatchesPerIdentity); close one first", p.IdentityID, t.perIdentity[p.IdentityID])
	}
	w := &watch{p: p, f: f, recheck: make(chan struct{}, 1)}
	t.watches[w] = struct{}{}
	t.perIdentity[p.IdentityID]++
	return w, nil
}

// release forgets w.
func (t *tailer) release(w *watch) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.unlink(w)
	delete(t.watches, w)
	if t.perIdentity[w.p.IdentityID]--; t.perIdentity[w.p.IdentityID] <= 0 {
		delete(t.perIdentity, w.p.IdentityID)
	}
}

func (t *tailer) unlink(w *watch) {
	if ws := t.live[w.f.TenantID]; ws != nil {
		delete(ws, w)
		if len(ws) == 0 {
			delete(t.live, w.f.TenantID)
		}
	}
}

// join makes w follow the tail and returns the seq it follows from: every
// event f selects after it reaches w.ch (or w.lagged closes).
func (t *tailer) join(ctx context.Context, w *watch) (int64, error) {
	if err := t.start(ctx); err != nil {
		return 0, err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.stale && len(t.live) == 0 {
		// Nothing followed the tail for a while, so the head is old: a
		// watch from now must not get what came meanwhile.
		t.mu.Unlock()
		head, err := events.Head(ctx, t.s.db)
		t.mu.Lock()
		if err != nil {
			return 0, err
		}
		if len(t.live) == 0 {
			t.head = max(t.head, head)
		}
		t.stale = false
	}
	w.ch = make(chan events.Event, watchBuffer)
	w.lagged = make(chan struct{})
	ws := t.live[w.f.TenantID]
	if ws == nil {
		ws = map[*watch]struct{}{}
		t.live[w.f.TenantID] = ws
	}
	ws[w] = struct{}{}
	return t.head, nil
}

// start reads the head and starts the tail loop, once.
func (t *tailer) start(ctx context.Context) error {
	t.mu.Lock()
	started := t.started
	t.mu.Unlock()
	if started {
		return nil
	}
	head, err := events.Head(ctx, t.s.db)
	if err != nil {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.started {
		return nil
	}
	t.head, t.started = head, true
	if t.s.nc != nil {
		sub, err := wake.SubscribeEvents(t.s.nc, t.wake)
		if err != nil {
			t.s.logger.Warn("subscribe to the event stream; event watches poll the database", "err", err)
		} else {
			t.sub = sub
		}
	}
	go t.run()
	return nil
}

func (t *tailer) wake() {
	select {
	case t.kick <- struct{}{}:
	default:
	}
}

// run reads new events until the server closes its streams.
func (t *tailer) run() {
	defer close(t.done)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		<-t.s.closing
		cancel()
	}()
	for {
		for t.tailOnce(ctx) {
		}
		poll := tailPoll
		if t.s.nc == nil || !t.s.nc.IsConnected() {
			poll = tailPollNoBus
		}
		timer := time.NewTimer(poll)
		select {
		case <-ctx.Done():
			timer.Stop()
			return
		case <-t.kick:
		case <-timer.C:
		}
		timer.Stop()
	}
}

// tailOnce reads the next batch of events after the head, when anything
// watches, and hands each to the watches it concerns; it reports whether
// a full batch was read.
func (t *tailer) tailOnce(ctx context.Context) bool {
	t.mu.Lock()
	head, idle := t.head, len(t.watches) == 0
	if idle {
		t.stale = true
	}
	t.mu.Unlock()
	if idle {
		return false
	}
	evs, err := events.After(ctx, t.s.db, head, tailBatch)
	if err != nil {
		if ctx.Err() == nil {
			t.s.logger.Warn("event watches: read new events", "err", err)
		}
		return false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, e := range evs {
		t.deliver(e)
		t.head = e.Seq
	}
	return len(evs) == tailBatch
}

// deliver hands e to the live watches that select it: those of its tenant
// and, with Descendants, of its ancestors. A watch whose buffer is full is
// cut loose (it catches up from the database). An event that revokes a key
// or identity, or changes policies, makes the watches it may concern
// re-authorize. t.mu is held.
func (t *tailer) deliver(e events.Event) {
	for _, anc := range iam.Ancestors(e.TenantID) {
		for w := range t.live[anc] {
			if !w.f.Matches(e) {
				continue
			}
			select {
			case w.ch <- e:
			default:
				w.lagAt = e.Seq - 1
				close(w.lagged)
				t.unlink(w)
			}
		}
	}
	switch e.Type {
	case "apiKey.revoked", "identity.revoked":
		for w := range t.watches {
			if w.p.KeyID == e.Resource || w.p.IdentityID == e.Resource {
				signal(w.recheck)
			}
		}
	case "policy.put", "policy.deleted":
		// This process may not have heard the policy wake yet: the event
		// in the database is the resync.
		t.s.authz.Invalidate(e.TenantID)
		t.recheckAll()
	}
}

// recheckAll makes every watch re-authorize. t.mu is held.
func (t *tailer) recheckAll() {
	for w := range t.watches {
		signal(w.recheck)
	}
}

// policiesChanged is the waker's policy hook: every watch re-decides.
func (t *tailer) policiesChanged(string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.recheckAll()
}

func signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// stop ends the subscription (the loop ends with the server's streams).
func (t *tailer) stop() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.sub != nil {
		_ = t.sub.Unsubscribe()
		t.sub = nil
	}
}
