// Package relay is the outbox-relay deployable (the spec's sinks role): it
// moves committed events out of the database and to everyone who listens.
//
//   - outbox-dispatch: one relay at a time, under the fenced lease
//     singleton:outbox-relay, gives committed outbox rows their seq (their
//     place in commit order), then publishes them in order to the JetStream
//     stream BC_EVENTS (subject bc.events.<tenant>.<type>, Nats-Msg-Id = the
//     event id, so a republish inside the duplicate window is dropped) with
//     asynchronous publish acks, and marks them sent. It creates or updates
//     the stream at start and re-creates it when it is gone.
//   - events.fanout: the same lease holder turns every sequenced event into
//     one delivery row per matching webhook, behind a cursor kept in
//     PostgreSQL, so nothing depends on JetStream having kept a message.
//   - events.deliver: every relay process sends due deliveries, signed as
//     Standard Webhooks, retrying on a fixed schedule, at most
//     webhooks.perEndpoint at a time to one endpoint.
//   - events.prune: the lease holder deletes events past events.retention
//     with their deliveries, expired idempotency records and long-expired
//     node certificates, and vacuums what it deleted from.
//
// With the bus down, sequencing, fan-out and delivery go on from the
// database; publishing resumes, in seq order, when the bus is back.
package relay

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/events"
	"github.com/bettercompute/bettercompute/pkg/lease"
	"github.com/bettercompute/bettercompute/pkg/webhooks"
)

// LeaseName is the relay's lease: its holder sequences, publishes, fans out
// and prunes.
const LeaseName = "singleton:outbox-relay"

// DeliverSubject is poked after a transaction makes deliveries due (a
// fan-out in another process, webhooks.test, webhooks.redeliver), so every
// relay's deliverer looks at once.
const DeliverSubject = "bc.webhooks.due"

// Config configures a [Service].
type Config struct {
	// DB is the pool. Required.
	DB *pgxpool.Pool
	// NATS is the bus; nil runs without it (no publishing, polling only).
	NATS *nats.Conn
	// Events and Webhooks are the configuration sections; their defaults
	// must be filled.
	Events   config.Events
	Webhooks config.Webhooks
	// Heartbeat is how often the lease is renewed or taken; default 2s.
	// LeaseTTL is how long it lives unrenewed; default 10s.
	Heartbeat, LeaseTTL time.Duration
	// Logger is the process logger; nil discards.
	Logger *slog.Logger
	// Registerer receives the relay's metrics; nil registers none.
	Registerer prometheus.Registerer
	// Client sends deliveries; nil builds one from Webhooks
	// (webhooks.NewClient).
	Client *http.Client
	// Holder names this process in the lease; default outbox-relay/<uuid>.
	Holder string
	// Subscribers are the in-process subscribers the lease holder runs.
	Subscribers []Subscriber
}

// Service is one relay process.
type Service struct {
	cfg    Config
	db     *pgxpool.Pool
	nc     *nats.Conn
	js     jetstream.JetStream
	log    *slog.Logger
	client *http.Client
	holder string
	m      *metrics

	held     atomic.Pointer[lease.Held]
	streamOK atomic.Bool

	wakeRelay, wakeFanout, wakeDeliver, wakePublish chan struct{}

	mu      sync.Mutex
	started bool
	stopped bool
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	sub     *nats.Subscription

	inflight sync.WaitGroup
	results  chan attemptResult
	recorded sync.WaitGroup
	busyMu   sync.Mutex
	busy     map[string]int
	slots    chan struct{}
}

// New validates cfg and returns a stopped Service.
func New(cfg Config) (*Service, error) {
	if cfg.DB == nil {
		return nil, errors.New("relay: no database")
	}
	for _, sub := range cfg.Subscribers {
		if err := sub.validate(); err != nil {
			return nil, fmt.Errorf("relay: %w", err)
		}
	}
	cfg.Heartbeat = cmp.Or(cfg.Heartbeat, 2*time.Second)
	cfg.LeaseTTL = cmp.Or(cfg.LeaseTTL, 5*cfg.Heartbeat)
	s := &Service{
		cfg:         cfg,
		db:          cfg.DB,
		nc:          cfg.NATS,
		log:         cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler)),
		client:      cfg.Client,
		holder:      cmp.Or(cfg.Holder, "outbox-relay/"+uuid.NewString()),
		wakeRelay:   make(chan struct{}, 1),
		wakeFanout:  make(chan struct{}, 1),
		wakeDeliver: make(chan struct{}, 1),
		wakePublish: make(chan struct{}, 1),
		busy:        map[string]int{},
		slots:       make(chan struct{}, cfg.Webhooks.Concurrency),
		results:     make(chan attemptResult, cfg.Webhooks.Concurrency),
	}
	if s.client == nil {
		s.client = webhooks.NewClient(webhooks.Options{
			AllowPrivateNetworks: cfg.Webhooks.AllowPrivateNetworks,
			AllowInsecure:        cfg.Webhooks.AllowInsecure,
			Timeout:              cfg.Webhooks.Timeout.Std(),
		})
	}
	if s.nc != nil {
		js, err := jetstream.New(s.nc, jetstream.WithPublishAsyncMaxPending(4096))
		if err != nil {
			return nil, fmt.Errorf("relay: jetstream: %w", err)
		}
		s.js = js
	}
	var err error
	if s.m, err = newMetrics(cfg.Registerer, cfg.DB); err != nil {
		return nil, err
	}
	return s, nil
}

// Holder is this process's name in the lease.
func (s *Service) Holder() string { return s.holder }

// Leading reports whether this process holds the relay's lease.
func (s *Service) Leading() bool { return s.held.Load() != nil }

// Start takes the lease when it is free and runs the loops until Stop.
func (s *Service) Start(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.started || s.stopped {
		return errors.New("relay: Start called twice or after Stop")
	}
	s.started = true
	ctx, s.cancel = context.WithCancel(context.WithoutCancel(ctx))
	if s.nc != nil {
		sub, err := s.nc.Subscribe(DeliverSubject, func(*nats.Msg) { poke(s.wakeDeliver) })
		if err != nil {
			return fmt.Errorf("relay: subscribe %s: %w", DeliverSubject, err)
		}
		s.sub = sub
	}
	s.takeLease(ctx)
	s.recorded.Add(1)
	go func() {
		defer s.recorded.Done()
		s.recorder()
	}()
	for _, loop := range []func(context.Context){s.leaseLoop, s.relayLoop, s.publishLoop, s.fanoutLoop, s.deliverLoop, s.pruneLoop} {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			loop(ctx)
		}()
	}
	return nil
}

// Stop ends the loops, waits for attempts in flight and releases the lease,
// so a standby relay takes over at once. It tolerates stop-before-start and
// double stop.
func (s *Service) Stop() { s.stop(true) }

func (s *Service) stop(release bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped {
		return
	}
	s.stopped = true
	if !s.started {
		return
	}
	if s.sub != nil {
		_ = s.sub.Unsubscribe()
	}
	s.cancel()
	s.wg.Wait()
	s.inflight.Wait()
	close(s.results) // the recorder records what the attempts sent, then ends
	s.recorded.Wait()
	if h := s.held.Swap(nil); h != nil && release {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := lease.Release(ctx, s.db, s.holder, []lease.Held{*h}); err != nil {
			s.log.Warn("release the relay lease", "err", err)
		}
	}
	s.m.leading.Set(0)
}

func poke(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// leaseLoop renews the lease, or takes it when it is free.
func (s *Service) leaseLoop(ctx context.Context) {
	t := time.NewTicker(s.cfg.Heartbeat)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if h := s.held.Load(); h != nil {
			rctx, cancel := context.WithTimeout(ctx, s.cfg.Heartbeat)
			got, err := lease.Renew(rctx, s.db, s.holder, s.cfg.LeaseTTL, []lease.Held{*h})
			cancel()
			switch {
			case err != nil:
				s.log.Warn("renew the relay lease", "err", err)
			case len(got) == 0:
				s.log.Warn("lost the relay lease")
				s.held.Store(nil)
				s.m.leading.Set(0)
			}
			continue
		}
		s.takeLease(ctx)
	}
}

func (s *Service) takeLease(ctx context.Context) {
	actx, cancel := context.WithTimeout(ctx, s.cfg.Heartbeat)
	defer cancel()
	got, err := lease.Acquire(actx, s.db, s.holder, s.cfg.LeaseTTL, []string{LeaseName})
	if err != nil {
		s.log.Warn("take the relay lease", "err", err)
		return
	}
	if len(got) == 1 {
		h := got[0]
		s.held.Store(&h)
		s.m.leading.Set(1)
		s.streamOK.Store(false) // make sure of the stream before publishing
		s.log.Info("leading the outbox relay", "fence", h.Fence)
		poke(s.wakeRelay)
		poke(s.wakeFanout)
		poke(s.wakePublish)
	}
}

// errNotLeading says this process does not hold the lease.
var errNotLeading = errors.New("not the relay lease holder")

// inLease runs fn in a transaction fenced by the relay's lease.
func (s *Service) inLease(ctx context.Context, fn func(tx pgx.Tx) error) error {
	h := s.held.Load()
	if h == nil {
		return errNotLeading
	}
	err := db.InTx(ctx, s.db, db.TxOptions{}, func(tx pgx.Tx) error {
		if err := lease.Hold(ctx, tx, s.holder, *h); err != nil {
			return err
		}
		return fn(tx)
	})
	if errors.Is(err, lease.ErrLost) {
		s.held.CompareAndSwap(h, nil)
		s.m.leading.Set(0)
	}
	return err
}

// relayLoop sequences committed events while this process leads, and wakes
// the fan-out and the publisher. It never waits for the bus.
func (s *Service) relayLoop(ctx context.Context) {
	poll := s.cfg.Events.Poll.Std()
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-s.wakeRelay:
		}
		more := false
		if s.Leading() {
			var err error
			if more, err = s.SequenceOnce(ctx); err != nil && ctx.Err() == nil && !errors.Is(err, errNotLeading) {
				s.log.Warn("sequence events", "err", err)
			}
		}
		if more {
			t.Reset(0)
		} else {
			t.Reset(poll)
		}
	}
}

// publishLoop publishes sequenced events while this process leads and the
// bus is up: woken by the sequencer, and every second for a backlog left
// by a bus that was down.
func (s *Service) publishLoop(ctx context.Context) {
	t := time.NewTimer(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-s.wakePublish:
		}
		more := false
		if s.Leading() && s.js != nil && s.nc.IsConnected() {
			n, err := s.publish(ctx, s.cfg.Events.Batch)
			if err != nil && ctx.Err() == nil {
				s.log.Warn("publish events", "err", err)
			}
			more = err == nil && n == s.cfg.Events.Batch
		}
		if more {
			t.Reset(0)
		} else {
			t.Reset(time.Second)
		}
	}
}

// SequenceOnce gives one batch of committed events their seqs and reports
// whether the batch was full (run again at once). It needs the lease.
func (s *Service) SequenceOnce(ctx context.Context) (bool, error) {
	batch := s.cfg.Events.Batch
	var seqd []events.Event
	err := s.inLease(ctx, func(tx pgx.Tx) error {
		var err error
		seqd, err = events.Sequence(ctx, tx, batch)
		return err
	})
	if err != nil {
		return false, err
	}
	if len(seqd) > 0 {
		s.m.sequenced.Add(float64(len(seqd)))
		poke(s.wakeFanout)
		poke(s.wakePublish)
	}
	return len(seqd) == batch, nil
}

// envelope is an event as published and as the API shows it (proto3 JSON
// of bettercompute.compute.v1.Event).
type envelope struct {
	ID       string          `json:"id"`
	Cursor   string          `json:"cursor"`
	TenantID string          `json:"tenantId"`
	Type     string          `json:"type"`
	Subject  string          `json:"subject,omitempty"`
	Time     string          `json:"time"`
	Data     json.RawMessage `json:"data"`
}

// Envelope renders e as it is published to the stream.
func Envelope(e events.Event) ([]byte, error) {
	return json.Marshal(envelope{
		ID: events.EventID(e.ID), Cursor: events.Cursor(e.Seq), TenantID: e.TenantID, Type: e.Type,
		Subject: e.Resource, Time: e.At.UTC().Format(time.RFC3339Nano), Data: e.Payload,
	})
}

// Headers of a published event.
const (
	HeaderSeq = "Bc-Seq"
)

// publish sends up to batch unpublished events, in seq order, and marks
// the acknowledged ones sent. Events older than the stream keeps are marked
// without being sent: the stream would drop them anyway.
func (s *Service) publish(ctx context.Context, batch int) (int, error) {
	if !s.streamOK.Load() {
		if err := s.EnsureStream(ctx); err != nil {
			return 0, err
		}
	}
	evs, err := events.Unpublished(ctx, s.db, batch)
	if err != nil || len(evs) == 0 {
		return 0, err
	}
	maxAge := s.cfg.Events.StreamMaxAge.Std()
	var stale []int64
	type pending struct {
		id  int64
		ack jetstream.PubAckFuture
	}
	futures := make([]pending, 0, len(evs))
	for _, e := range evs {
		if time.Since(e.At) > maxAge {
			stale = append(stale, e.ID)
			continue
		}
		body, err := Envelope(e)
		if err != nil {
			return 0, err
		}
		msg := nats.NewMsg(e.Subject)
		msg.Data = body
		msg.Header.Set(HeaderSeq, events.Cursor(e.Seq))
		f, err := s.js.PublishMsgAsync(msg, jetstream.WithMsgID(events.EventID(e.ID)))
		if err != nil {
			break // the bus went away: what was sent is acked below
		}
		futures = append(futures, pending{e.ID, f})
	}
	acked := stale
	var pubErr error
	wait := time.NewTimer(5 * time.Second)
	defer wait.Stop()
collect:
	for _, p := range futures {
		select {
		case <-p.ack.Ok():
			acked = append(acked, p.id)
		case err := <-p.ack.Err():
			pubErr = err
			// A later ack cannot make up for a missing earlier one: stop,
			// and republish from here (duplicates are dropped by id).
			break collect
		case <-wait.C:
			pubErr = errors.New("timed out waiting for publish acks")
			break collect
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
	if pubErr != nil {
		s.streamOK.Store(false)
	}
	if err := events.MarkSent(ctx, s.db, acked); err != nil {
		return 0, err
	}
	s.m.published.Add(float64(len(acked) - len(stale)))
	if pubErr != nil {
		return len(acked), fmt.Errorf("publish to %s: %w", s.cfg.Events.Stream, pubErr)
	}
	return len(evs), nil
}

// EnsureStream creates the stream, or updates it to the configuration.
func (s *Service) EnsureStream(ctx context.Context) error {
	if s.js == nil {
		return errors.New("no bus configured")
	}
	e := s.cfg.Events
	sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	_, err := s.js.CreateOrUpdateStream(sctx, jetstream.StreamConfig{
		Name:        e.Stream,
		Description: "Better Compute events (outbox relay)",
		Subjects:    []string{"bc.events.>"},
		Storage:     jetstream.FileStorage,
		MaxAge:      e.StreamMaxAge.Std(),
		MaxBytes:    e.StreamMaxBytes,
		Duplicates:  e.DuplicateWindow.Std(),
		Discard:     jetstream.DiscardOld,
	})
	if err != nil {
		return fmt.Errorf("create or update stream %s: %w", e.Stream, err)
	}
	if !s.streamOK.Swap(true) {
		s.log.Info("event stream ready", "stream", e.Stream)
	}
	return nil
}
