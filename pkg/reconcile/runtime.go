package reconcile

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime/debug"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"

	"github.com/bettercompute/bettercompute/pkg/lease"
	"github.com/bettercompute/bettercompute/pkg/reconcile/internal/testhook"
	"github.com/bettercompute/bettercompute/pkg/startstop"
	"github.com/bettercompute/bettercompute/pkg/wake"
)

// The runtime's code is in four files: this one (configuration and the
// lifecycle), membership.go (worker rows, shard and singleton leases,
// periodic keys and resync), dispatch.go (claiming, running and settling
// keys) and tx.go (the transaction API: InTx and Queue).

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Config tunes a Runtime. Zero values take the defaults given.
type Config struct {
	// Roles are the memberships this process takes part in
	// ("controllers", "scheduler"). Required.
	Roles []string
	// Heartbeat is how often the worker renews its membership and leases and
	// rebalances shards; default 2s. Shards move within one heartbeat of a
	// membership change (a dead worker's, once its rows expire).
	Heartbeat time.Duration
	// LeaseTTL is how long a lease and a worker row live without renewal;
	// default 5 heartbeats.
	LeaseTTL time.Duration
	// ClaimTTL bounds a run: a claim older than this is reclaimable, and a
	// run's context is cancelled a little before; default 5m.
	ClaimTTL time.Duration
	// ResyncEvery and ResyncJitter: each worker re-enqueues the keys it owns
	// every ResyncEvery plus up to ResyncJitter; defaults 5m and 5m (a
	// negative jitter means none).
	ResyncEvery, ResyncJitter time.Duration
	// Poll is how often the queue is polled while the bus is up (pokes do
	// the waking); default 2s. PollBusDown is used while it is not; default
	// 250ms.
	Poll, PollBusDown time.Duration
	// Concurrency bounds runs in flight; default 8. Batch bounds a claim;
	// default 256.
	Concurrency, Batch int
	// Logger; nil discards.
	Logger *slog.Logger
	// Registerer receives the runtime's metrics; nil keeps them private.
	Registerer prometheus.Registerer
	// Hostname and Version are recorded in the workers table.
	Hostname, Version string
	// Waker sends the wakes of the runtime's transactions after commit;
	// nil: work wakes over the runtime's connection only.
	Waker *wake.Waker
}

func (c *Config) defaults() {
	c.Heartbeat = cmp.Or(c.Heartbeat, 2*time.Second)
	c.LeaseTTL = cmp.Or(c.LeaseTTL, 5*c.Heartbeat)
	c.ClaimTTL = cmp.Or(c.ClaimTTL, 5*time.Minute)
	c.ResyncEvery = cmp.Or(c.ResyncEvery, 5*time.Minute)
	switch {
	case c.ResyncJitter == 0:
		c.ResyncJitter = 5 * time.Minute
	case c.ResyncJitter < 0:
		c.ResyncJitter = 0
	}
	c.Poll = cmp.Or(c.Poll, 2*time.Second)
	c.PollBusDown = cmp.Or(c.PollBusDown, 250*time.Millisecond)
	c.Concurrency = cmp.Or(c.Concurrency, 8)
	c.Batch = cmp.Or(c.Batch, 256)
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Hostname == "" {
		c.Hostname, _ = os.Hostname()
	}
	if c.Version == "" {
		if bi, ok := debug.ReadBuildInfo(); ok {
			c.Version = bi.Main.Version
		}
	}
}

// Runtime runs registered reconcilers for the memberships it hosts.
//
// Two locks: life (the lifecycle, and the registrations made before Start)
// and leaseMu (each member's lease state: what membership passes change
// and dispatch reads). Neither is held while taking the other, except that
// Stop takes leaseMu under life.
type Runtime struct {
	pool   *pgxpool.Pool
	nc     *nats.Conn
	waker  *wake.Waker
	cfg    Config
	id     string
	log    *slog.Logger
	tracer trace.Tracer
	met    *metrics

	// Set by Register, before Start; read-only after.
	recs    []*Reconciler
	byName  map[string]*Reconciler
	jobs    map[string]*Job
	members []*member

	// leaseMu guards every member's held, live, periodic and nextResync,
	// and each held lease's draining and inflight.
	leaseMu sync.Mutex
	joined  atomic.Bool // a membership pass has run
	wake    chan struct{}

	// passMu serialises dispatch passes (the loop's and Job.Tick's): while
	// no pass runs, no claim of this runtime's workers is in flight, so
	// a claim left by a pass that failed is an orphan.
	passMu sync.Mutex

	life   startstop.Once
	killed atomic.Bool
	// Set by Start, read by Stop, both under life.
	cancel context.CancelFunc
	wg     sync.WaitGroup
	sub    *nats.Subscription
}

// New returns a runtime over pool. nc may be nil: the runtime then polls.
func New(pool *pgxpool.Pool, nc *nats.Conn, cfg Config) (*Runtime, error) {
	cfg.defaults()
	if len(cfg.Roles) == 0 {
		return nil, errors.New("reconcile: no roles to host")
	}
	for _, r := range cfg.Roles {
		if !slices.Contains(Roles, r) {
			return nil, fmt.Errorf("reconcile: role %q: want one of %v", r, Roles)
		}
	}
	if cfg.LeaseTTL < 2*cfg.Heartbeat {
		return nil, fmt.Errorf("reconcile: lease TTL %s must be at least two heartbeats (%s)", cfg.LeaseTTL, cfg.Heartbeat)
	}
	if cfg.Waker == nil {
		cfg.Waker = wake.New(nc, nil, cfg.Logger)
	}
	var b [8]byte
	_, _ = rand.Read(b[:])
	rt := &Runtime{
		pool: pool, nc: nc, waker: cfg.Waker, cfg: cfg,
		id:     hex.EncodeToString(b[:]),
		log:    cfg.Logger,
		tracer: otel.Tracer("github.com/bettercompute/bettercompute/pkg/reconcile"),
		byName: map[string]*Reconciler{},
		jobs:   map[string]*Job{},
		wake:   make(chan struct{}, 1),
	}
	rt.met = newMetrics(cfg.Registerer, pool)
	for _, role := range slices.Compact(slices.Sorted(slices.Values(cfg.Roles))) {
		rt.members = append(rt.members, &member{
			role:       role,
			workerID:   role + "/" + rt.id,
			singletons: map[string]string{},
			held:       map[string]*heldLease{},
			periodic:   map[string]time.Time{},
		})
	}
	if slices.Contains(cfg.Roles, RoleControllers) {
		if err := rt.Register(janitor()); err != nil {
			return nil, err
		}
	}
	return rt, nil
}

// WorkerID returns this process's worker id in role ("controllers/<id>").
func (rt *Runtime) WorkerID(role string) string { return role + "/" + rt.id }

// Register adds a reconciler. Call it before Start.
func (rt *Runtime) Register(r Reconciler) error {
	err := rt.life.BeforeStart(func() error { return rt.register(r) })
	if errors.Is(err, startstop.ErrStarted) {
		return errors.New("reconcile: Register after Start")
	}
	return err
}

func (rt *Runtime) register(r Reconciler) error {
	if err := r.validate(); err != nil {
		return err
	}
	if _, dup := rt.byName[r.Name]; dup {
		return fmt.Errorf("reconcile: %s registered twice", r.Name)
	}
	m := rt.member(r.Role)
	if m == nil {
		return fmt.Errorf("reconcile: %s needs role %s, which this process does not host", r.Name, r.Role)
	}
	rec := &r
	rt.recs = append(rt.recs, rec)
	rt.byName[r.Name] = rec
	rt.jobs[r.Name] = &Job{rt: rt, rec: rec}
	if r.ShardBy == ShardByNone {
		m.singletons[lease.Singleton(r.Name)] = r.Name
	} else {
		m.sharded = append(m.sharded, r.Name)
	}
	return nil
}

// Jobs returns the registered reconcilers' deterministic handles by name.
func (rt *Runtime) Jobs() map[string]*Job { return rt.jobs }

// Start joins the memberships and runs the loops until Stop. A second
// Start, or one after Stop, is an error.
func (rt *Runtime) Start(ctx context.Context) error {
	err := rt.life.Start(func() error {
		ctx, rt.cancel = context.WithCancel(context.WithoutCancel(ctx))
		if err := rt.Heartbeat(ctx); err != nil {
			rt.log.WarnContext(ctx, "first heartbeat failed; retrying", "err", err)
		}
		if rt.nc != nil {
			sub, err := wake.SubscribeWork(rt.nc, rt.onPoke)
			if err != nil {
				rt.log.WarnContext(ctx, "cannot subscribe to pokes; polling only", "err", err)
			}
			rt.sub = sub
		}
		rt.wg.Add(2)
		go rt.heartbeatLoop(ctx)
		go rt.dispatchLoop(ctx)
		rt.log.InfoContext(ctx, "reconciler runtime started", "roles", rt.cfg.Roles, "reconcilers", len(rt.recs))
		return nil
	})
	if err != nil {
		return errors.New("reconcile: Start twice or after Stop")
	}
	return nil
}

// Stop ends the loops, waits for runs in flight, releases every lease and
// leaves the memberships, so other workers take over at once. It tolerates
// Stop before Start (it still leaves the memberships a Heartbeat joined), a
// second Stop, and Stop concurrent with Start (it waits for Start).
func (rt *Runtime) Stop() {
	rt.life.Stop(func(bool) {
		rt.stopLoops()
		ctx, done := context.WithTimeout(context.Background(), 5*time.Second)
		defer done()
		rt.leave(ctx)
	})
}

// kill stops the loops without releasing anything, as a crash would: the
// worker's rows and leases stay until they expire. Chaos tests reach it
// through reconciletest.Kill.
func (rt *Runtime) kill() {
	rt.life.Stop(func(bool) {
		rt.killed.Store(true)
		rt.stopLoops()
	})
}

func init() { testhook.Kill = func(rt any) { rt.(*Runtime).kill() } }

// stopLoops ends the loops Start started, if it did, and waits for them and
// the runs in flight. Call it under life.
func (rt *Runtime) stopLoops() {
	if rt.sub != nil {
		_ = rt.sub.Unsubscribe()
	}
	if rt.cancel != nil {
		rt.cancel()
	}
	rt.wg.Wait()
}
