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
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/events"
	"github.com/bettercompute/bettercompute/pkg/lease"
	"github.com/bettercompute/bettercompute/pkg/outbound"
	"github.com/bettercompute/bettercompute/pkg/startstop"
	"github.com/bettercompute/bettercompute/pkg/wake"
)

// LeaseName is the relay's lease: its holder sequences, publishes, fans out
// and prunes.
const LeaseName = "singleton:outbox-relay"

// DeliverSubject is poked after a transaction makes deliveries due (a
// fan-out in another process, webhooks.test, webhooks.redeliver), so every
// relay's deliverer looks at once.
const DeliverSubject = wake.WebhooksDue

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
	// Client sends deliveries; nil builds one from Webhooks' outbound
	// rules (pkg/outbound).
	Client *outbound.Client
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
	client *outbound.Client
	m      *metrics
	// authz decides, for webhooks with includeDescendants, each
	// descendant's events with its policies.
	authz *authz.Authorizer

	// leader holds the relay's lease: sequencing, publishing, the fan-out,
	// the subscribers and pruning run under it.
	leader   *lease.Leader
	streamOK atomic.Bool

	// The loops: sequencer, publisher, fanout (with the subscribers) and
	// pruner run while this process leads, deliverer in every process.
	sequencer, publisher, fanout, deliverer, pruner *startstop.Loop

	life   startstop.Once
	cancel context.CancelFunc
	wg     sync.WaitGroup
	sub    *nats.Subscription

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
	cfg.Holder = cmp.Or(cfg.Holder, "outbox-relay/"+uuid.NewString())
	s := &Service{
		cfg:     cfg,
		db:      cfg.DB,
		nc:      cfg.NATS,
		log:     cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler)),
		client:  cfg.Client,
		authz:   authz.New(cfg.DB),
		busy:    map[string]int{},
		slots:   make(chan struct{}, cfg.Webhooks.Concurrency),
		results: make(chan attemptResult, cfg.Webhooks.Concurrency),
	}
	s.sequencer = startstop.NewLoop(cfg.Events.Poll.Std(), s.sequencePass)
	s.publisher = startstop.NewLoop(time.Second, s.publishPass)
	s.fanout = startstop.NewLoop(time.Second, s.fanoutPass)
	s.deliverer = startstop.NewLoop(cfg.Webhooks.Poll.Std(), s.deliverPass)
	s.pruner = startstop.NewLoop(cfg.Events.PruneEvery.Std(), s.prunePass)
	if s.client == nil {
		s.client = outbound.NewClient(cfg.Webhooks.Outbound())
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
	if s.leader, err = lease.NewLeader(cfg.DB, lease.LeaderConfig{
		Name: LeaseName, Holder: cfg.Holder,
		Heartbeat: cfg.Heartbeat, TTL: cfg.LeaseTTL, Logger: s.log, OnChange: s.leading,
	}); err != nil {
		return nil, fmt.Errorf("relay: %w", err)
	}
	return s, nil
}

// Holder is this process's name in the lease.
func (s *Service) Holder() string { return s.cfg.Holder }

// Leading reports whether this process holds the relay's lease.
func (s *Service) Leading() bool { return s.leader.Leading() }

// leading is told when this process takes or stops holding the lease.
func (s *Service) leading(h lease.Held, leading bool) {
	if !leading {
		s.m.leading.Set(0)
		return
	}
	s.m.leading.Set(1)
	s.streamOK.Store(false) // make sure of the stream before publishing
	s.log.Info("leading the outbox relay", "fence", h.Fence)
	s.sequencer.Wake()
	s.fanout.Wake()
	s.publisher.Wake()
}

// Start takes the lease when it is free and runs the loops until Stop. A
// second Start, or one after Stop, is an error.
func (s *Service) Start(ctx context.Context) error {
	err := s.life.Start(func() error {
		ctx, s.cancel = context.WithCancel(context.WithoutCancel(ctx))
		if s.nc != nil {
			sub, err := s.nc.Subscribe(DeliverSubject, func(*nats.Msg) { s.deliverer.Wake() })
			if err != nil {
				s.cancel()
				return fmt.Errorf("relay: subscribe %s: %w", DeliverSubject, err)
			}
			s.sub = sub
		}
		if err := s.leader.Start(ctx); err != nil {
			s.halt()
			return fmt.Errorf("relay: %w", err)
		}
		s.recorded.Go(s.recorder)
		s.wg.Go(func() { s.sequencer.Run(ctx) })
		s.wg.Go(func() { s.publisher.Run(ctx) })
		s.wg.Go(func() { s.fanout.Run(ctx) })
		s.wg.Go(func() { s.deliverer.Run(ctx) })
		s.wg.Go(func() { s.pruner.RunAfter(ctx, s.cfg.Events.PruneEvery.Std()) })
		return nil
	})
	if errors.Is(err, startstop.ErrStarted) || errors.Is(err, startstop.ErrStopped) {
		return errors.New("relay: Start called twice or after Stop")
	}
	return err
}

// Stop ends the loops, waits for attempts in flight and releases the lease,
// so a standby relay takes over at once. It tolerates stop-before-start,
// double stop, and Stop concurrent with Start (it waits for Start).
func (s *Service) Stop() { s.stop(s.leader.Stop) }

// stop ends the loops, records the attempts in flight, then ends the leader
// with end (Stop, or Abandon as a crash would).
func (s *Service) stop(end func()) {
	s.life.Stop(func(started bool) {
		if started {
			s.halt()
			s.inflight.Wait()
			close(s.results) // the recorder records what the attempts sent, then ends
			s.recorded.Wait()
			if s.js != nil {
				s.js.CleanupPublisher() // its ack subscription and goroutine
			}
			if s.cfg.Client == nil {
				s.client.CloseIdleConnections() // the client is the relay's own
			}
		}
		end()
		s.m.leading.Set(0)
	})
}

// halt ends the subscription and the loops Start started.
func (s *Service) halt() {
	if s.sub != nil {
		_ = s.sub.Unsubscribe()
	}
	s.cancel()
	s.wg.Wait()
}

// sequencePass sequences committed events while this process leads, and
// wakes the fan-out and the publisher. It never waits for the bus.
func (s *Service) sequencePass(ctx context.Context) (more bool) {
	if !s.Leading() {
		return false
	}
	more, err := s.SequenceOnce(ctx)
	if err != nil && ctx.Err() == nil && !errors.Is(err, lease.ErrNotLeading) {
		s.log.Warn("sequence events", "err", err)
	}
	return more
}

// publishPass publishes sequenced events while this process leads and the
// bus is up: woken by the sequencer, and every second for a backlog left
// by a bus that was down.
func (s *Service) publishPass(ctx context.Context) (more bool) {
	if !s.Leading() || s.js == nil || !s.nc.IsConnected() {
		return false
	}
	n, err := s.publish(ctx, s.cfg.Events.Batch)
	if err != nil && ctx.Err() == nil {
		s.log.Warn("publish events", "err", err)
	}
	return err == nil && n == s.cfg.Events.Batch
}

// SequenceOnce gives one batch of committed events their seqs and reports
// whether the batch was full (run again at once). It needs the lease.
func (s *Service) SequenceOnce(ctx context.Context) (bool, error) {
	batch := s.cfg.Events.Batch
	var seqd []events.Event
	err := s.leader.InTx(ctx, func(tx pgx.Tx) error {
		var err error
		seqd, err = events.Sequence(ctx, tx, batch)
		return err
	})
	if err != nil {
		return false, err
	}
	if len(seqd) > 0 {
		s.m.sequenced.Add(float64(len(seqd)))
		s.fanout.Wake()
		s.publisher.Wake()
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
		Subjects:    []string{wake.Events},
		Storage:     jetstream.FileStorage,
		MaxAge:      e.StreamMaxAge.Std(),
		MaxBytes:    e.StreamMaxBytes,
		Replicas:    e.StreamReplicas,
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
