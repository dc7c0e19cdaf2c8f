package reconcile

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	mrand "math/rand/v2"
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
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/lease"
	"github.com/bettercompute/bettercompute/pkg/shard"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
)

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
type Runtime struct {
	pool   *pgxpool.Pool
	nc     *nats.Conn
	poker  *workqueue.Poker
	cfg    Config
	id     string
	log    *slog.Logger
	tracer trace.Tracer
	met    *metrics

	recs    []*Reconciler
	byName  map[string]*Reconciler
	jobs    map[string]*Job
	members []*member

	mu      sync.Mutex // guards members' lease state and the lifecycle
	started bool
	stopped bool
	killed  atomic.Bool
	joined  atomic.Bool // a membership pass has run
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	wake    chan struct{}
	sub     *nats.Subscription
}

// member is this process's worker in one membership.
type member struct {
	role       string
	workerID   string
	sharded    []string          // kinds spread over shards
	singletons map[string]string // lease name → kind
	held       map[string]*heldLease
	live       []string
	periodic   map[string]time.Time // kind/key → next due
	nextResync time.Time
}

type heldLease struct {
	lease.Held
	shard    int // -1 for a singleton
	kinds    []string
	draining bool
	inflight int
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
	var b [8]byte
	_, _ = rand.Read(b[:])
	rt := &Runtime{
		pool: pool, nc: nc, poker: &workqueue.Poker{NC: nc}, cfg: cfg,
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
	rt.mu.Lock()
	defer rt.mu.Unlock()
	if rt.started {
		return errors.New("reconcile: Register after Start")
	}
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

func (rt *Runtime) member(role string) *member {
	for _, m := range rt.members {
		if m.role == role {
			return m
		}
	}
	return nil
}

// Jobs returns the registered reconcilers' deterministic handles by name.
func (rt *Runtime) Jobs() map[string]*Job { return rt.jobs }

// Start joins the memberships and runs the loops until Stop.
func (rt *Runtime) Start(ctx context.Context) error {
	rt.mu.Lock()
	if rt.started || rt.stopped {
		rt.mu.Unlock()
		return errors.New("reconcile: Start twice or after Stop")
	}
	rt.started = true
	ctx, rt.cancel = context.WithCancel(context.WithoutCancel(ctx))
	rt.mu.Unlock()

	if err := rt.Heartbeat(ctx); err != nil {
		rt.log.WarnContext(ctx, "first heartbeat failed; retrying", "err", err)
	}
	if rt.nc != nil {
		sub, err := rt.nc.Subscribe(workqueue.PokeSubjectPrefix+"*", rt.onPoke)
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
}

// Stop ends the loops, waits for runs in flight, releases every lease and
// leaves the memberships, so other workers take over at once. It tolerates
// Stop before Start and a second Stop.
func (rt *Runtime) Stop() {
	rt.mu.Lock()
	if rt.stopped {
		rt.mu.Unlock()
		return
	}
	rt.stopped = true
	cancel := rt.cancel
	rt.mu.Unlock()
	if rt.sub != nil {
		_ = rt.sub.Unsubscribe()
	}
	if cancel != nil {
		cancel()
	}
	rt.wg.Wait()
	// Heartbeat may have joined without Start: leave either way.
	ctx, done := context.WithTimeout(context.Background(), 5*time.Second)
	defer done()
	for _, m := range rt.members {
		rt.mu.Lock()
		held := make([]lease.Held, 0, len(m.held))
		for _, h := range m.held {
			held = append(held, h.Held)
		}
		m.held = map[string]*heldLease{}
		rt.mu.Unlock()
		if err := lease.Release(ctx, rt.pool, m.workerID, held); err != nil {
			rt.log.Warn("release leases at stop", "err", err)
		}
		rt.met.leaseChanges.WithLabelValues(m.role, "released").Add(float64(len(held)))
		if _, err := rt.pool.Exec(ctx, `DELETE FROM workers WHERE id = $1`, m.workerID); err != nil {
			rt.log.Warn("leave membership", "err", err)
		}
	}
}

// Kill stops the loops without releasing anything, as a crash would: the
// worker's rows and leases stay until they expire. For chaos tests.
func (rt *Runtime) Kill() {
	rt.killed.Store(true)
	rt.mu.Lock()
	rt.stopped = true
	cancel := rt.cancel
	rt.mu.Unlock()
	if rt.sub != nil {
		_ = rt.sub.Unsubscribe()
	}
	if cancel != nil {
		cancel()
	}
	rt.wg.Wait()
}

// Owned returns the shards whose leases role's worker holds, sorted.
func (rt *Runtime) Owned(role string) []int {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	m := rt.member(role)
	if m == nil {
		return nil
	}
	var out []int
	for _, h := range m.held {
		if h.shard >= 0 && !h.draining {
			out = append(out, h.shard)
		}
	}
	slices.Sort(out)
	return out
}

// HeldLeases returns the leases role's worker holds, by name.
func (rt *Runtime) HeldLeases(role string) map[string]int64 {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	out := map[string]int64{}
	if m := rt.member(role); m != nil {
		for n, h := range m.held {
			out[n] = h.Fence
		}
	}
	return out
}

func (rt *Runtime) heartbeatLoop(ctx context.Context) {
	defer rt.wg.Done()
	t := time.NewTicker(rt.cfg.Heartbeat)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if err := rt.Heartbeat(ctx); err != nil && ctx.Err() == nil {
				rt.log.WarnContext(ctx, "heartbeat failed", "err", err)
			}
		}
	}
}

// Heartbeat runs one membership pass for every role: renew the worker row,
// read the live members, release shards this worker no longer wins (once
// their runs finish), renew the rest and take the ones it now wins; then
// enqueue due periodic keys and, when due, resync. The loops call it every
// Config.Heartbeat; tests call it directly.
func (rt *Runtime) Heartbeat(ctx context.Context) error {
	rt.joined.Store(true)
	var errs []error
	for _, m := range rt.members {
		if err := rt.heartbeat(ctx, m); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", m.role, err))
		}
	}
	return errors.Join(errs...)
}

func (rt *Runtime) heartbeat(ctx context.Context, m *member) error {
	ttl := rt.cfg.LeaseTTL
	if _, err := rt.pool.Exec(ctx, `
		INSERT INTO workers (id, membership, hostname, version, roles, expires_at)
		VALUES ($1, $2, $3, $4, $5, now() + $6 * interval '1 microsecond')
		ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), expires_at = EXCLUDED.expires_at`,
		m.workerID, m.role, rt.cfg.Hostname, rt.cfg.Version, rt.cfg.Roles, ttl.Microseconds()); err != nil {
		return fmt.Errorf("heartbeat: %w", err)
	}
	rows, err := rt.pool.Query(ctx, `SELECT id FROM workers WHERE membership = $1 AND expires_at > now() ORDER BY id`, m.role)
	if err != nil {
		return fmt.Errorf("list workers: %w", err)
	}
	live, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("list workers: %w", err)
	}

	desired := map[string]int{} // lease name → shard (-1 singleton)
	if len(m.sharded) > 0 {
		for _, s := range shard.Assign(m.workerID, live, func(s int) string { return lease.Shard(m.role, s) }) {
			desired[lease.Shard(m.role, s)] = s
		}
	}
	for name := range m.singletons {
		if shard.Owner(name, live) == m.workerID {
			desired[name] = -1
		}
	}

	rt.mu.Lock()
	m.live = live
	var release, renew []lease.Held
	var acquire []string
	for name, h := range m.held {
		if _, want := desired[name]; want {
			h.draining = false
		} else {
			h.draining = true
			if h.inflight == 0 {
				release = append(release, h.Held)
				continue
			}
		}
		renew = append(renew, h.Held)
	}
	for name := range desired {
		if _, ok := m.held[name]; !ok {
			acquire = append(acquire, name)
		}
	}
	rt.mu.Unlock()
	slices.Sort(acquire)

	if err := lease.Release(ctx, rt.pool, m.workerID, release); err != nil {
		return err
	}
	renewed, err := lease.Renew(ctx, rt.pool, m.workerID, ttl, renew)
	if err != nil {
		return err
	}
	acquired, err := lease.Acquire(ctx, rt.pool, m.workerID, ttl, acquire)
	if err != nil {
		return err
	}

	rt.mu.Lock()
	for _, h := range release {
		delete(m.held, h.Name)
	}
	kept := map[string]bool{}
	for _, h := range renewed {
		kept[h.Name] = true
	}
	lost := 0
	for _, h := range renew {
		if !kept[h.Name] {
			delete(m.held, h.Name)
			lost++
		}
	}
	for _, a := range acquired {
		s := desired[a.Name]
		kinds := m.sharded
		if s < 0 {
			kinds = []string{m.singletons[a.Name]}
		}
		m.held[a.Name] = &heldLease{Held: a, shard: s, kinds: kinds}
	}
	owned := 0
	for _, h := range m.held {
		if h.shard >= 0 && !h.draining {
			owned++
		}
	}
	rt.mu.Unlock()

	rt.met.leaseChanges.WithLabelValues(m.role, "released").Add(float64(len(release)))
	rt.met.leaseChanges.WithLabelValues(m.role, "lost").Add(float64(lost))
	rt.met.leaseChanges.WithLabelValues(m.role, "acquired").Add(float64(len(acquired)))
	rt.met.ownedShards.WithLabelValues(m.role).Set(float64(owned))
	if lost > 0 {
		rt.log.WarnContext(ctx, "leases lost", "role", m.role, "n", lost)
	}
	if len(acquired) > 0 {
		rt.poke() // new shards may hold due work
	}
	return rt.schedule(ctx, m)
}

// schedule enqueues due periodic keys this worker owns and, when due, the
// resync of every key it owns.
func (rt *Runtime) schedule(ctx context.Context, m *member) error {
	now := time.Now()
	var items []workqueue.Item
	rt.mu.Lock()
	for _, r := range rt.recs {
		if r.Role != m.role {
			continue
		}
		for _, p := range r.Periodic {
			if !rt.ownsLocked(m, r, p.Key) {
				continue
			}
			id := r.Name + "/" + p.Key
			if next, ok := m.periodic[id]; ok && now.Before(next) {
				continue
			}
			m.periodic[id] = now.Add(p.Every)
			items = append(items, workqueue.Item{Kind: r.Name, Key: p.Key})
		}
	}
	resync := !m.nextResync.IsZero() && !now.Before(m.nextResync)
	if m.nextResync.IsZero() || resync {
		m.nextResync = now.Add(rt.cfg.ResyncEvery + time.Duration(mrand.Int64N(int64(rt.cfg.ResyncJitter)+1)))
	}
	rt.mu.Unlock()
	if len(items) > 0 {
		if err := workqueue.EnqueueMany(ctx, rt.pool, items); err != nil {
			return err
		}
		rt.poke()
	}
	if resync {
		return rt.resync(ctx, m)
	}
	return nil
}

// Resync re-enqueues every key this process owns now, as the timer does.
func (rt *Runtime) Resync(ctx context.Context) error {
	var errs []error
	for _, m := range rt.members {
		errs = append(errs, rt.resync(ctx, m))
	}
	return errors.Join(errs...)
}

func (rt *Runtime) resync(ctx context.Context, m *member) error {
	total := 0
	for _, r := range rt.recs {
		if r.Role != m.role {
			continue
		}
		var items []workqueue.Item
		for _, p := range r.Periodic {
			if rt.owns(m, r, p.Key) {
				items = append(items, workqueue.Item{Kind: r.Name, Key: p.Key})
			}
		}
		if r.Keys != nil {
			shards := rt.ownedShards(m, r)
			if len(shards) > 0 {
				keys, err := r.Keys(ctx, rt.pool, shards)
				if err != nil {
					return fmt.Errorf("resync %s: %w", r.Name, err)
				}
				for _, k := range keys {
					items = append(items, workqueue.Item{Kind: r.Name, Key: k})
				}
			}
		}
		for chunk := range slices.Chunk(items, 1000) {
			if err := workqueue.EnqueueMany(ctx, rt.pool, chunk); err != nil {
				return fmt.Errorf("resync %s: %w", r.Name, err)
			}
		}
		total += len(items)
	}
	rt.met.resynced.WithLabelValues(m.role).Add(float64(total))
	if total > 0 {
		rt.poke()
	}
	return nil
}

func (rt *Runtime) owns(m *member, r *Reconciler, key string) bool {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	return rt.ownsLocked(m, r, key)
}

func (rt *Runtime) ownsLocked(m *member, r *Reconciler, key string) bool {
	if r.ShardBy == ShardByNone {
		h, ok := m.held[lease.Singleton(r.Name)]
		return ok && !h.draining
	}
	h, ok := m.held[lease.Shard(m.role, shard.Of(key))]
	return ok && !h.draining
}

// ownedShards returns the shards whose keys of r this worker owns.
func (rt *Runtime) ownedShards(m *member, r *Reconciler) []int {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	if r.ShardBy == ShardByNone {
		if h, ok := m.held[lease.Singleton(r.Name)]; ok && !h.draining {
			out := make([]int, shard.Count)
			for i := range out {
				out[i] = i
			}
			return out
		}
		return nil
	}
	var out []int
	for _, h := range m.held {
		if h.shard >= 0 && !h.draining {
			out = append(out, h.shard)
		}
	}
	slices.Sort(out)
	return out
}

func (rt *Runtime) onPoke(msg *nats.Msg) {
	s, kind, ok := workqueue.ParsePoke(msg.Subject, msg.Data)
	if !ok {
		return
	}
	rec, ok := rt.byName[kind]
	if !ok {
		return
	}
	rt.met.pokes.Inc()
	rt.mu.Lock()
	m := rt.member(rec.Role)
	var mine bool
	if rec.ShardBy == ShardByNone {
		_, mine = m.held[lease.Singleton(kind)]
	} else {
		_, mine = m.held[lease.Shard(m.role, s)]
	}
	rt.mu.Unlock()
	if mine {
		rt.poke()
	}
}

// poke wakes the dispatch loop.
func (rt *Runtime) poke() {
	select {
	case rt.wake <- struct{}{}:
	default:
	}
}

func (rt *Runtime) busUp() bool { return rt.nc != nil && rt.nc.IsConnected() }

func (rt *Runtime) dispatchLoop(ctx context.Context) {
	defer rt.wg.Done()
	// The loop ticks at the bus-down rate so that it notices a lost bus
	// within PollBusDown, but only queries the queue that often while the
	// bus is down; while it is up it queries every Poll, or when poked.
	tick := time.NewTicker(rt.cfg.PollBusDown)
	defer tick.Stop()
	var last time.Time
	for {
		n, err := rt.dispatch(ctx, nil)
		last = time.Now()
		if err != nil && ctx.Err() == nil {
			rt.log.WarnContext(ctx, "dispatch failed", "err", err)
		}
		if n >= rt.cfg.Batch && err == nil {
			continue // more is due
		}
	wait:
		for {
			select {
			case <-ctx.Done():
				return
			case <-rt.wake:
				break wait
			case <-tick.C:
				if !rt.busUp() || time.Since(last) >= rt.cfg.Poll {
					break wait
				}
			}
		}
	}
}

// TickResult counts what one pass did.
type TickResult struct {
	Claimed, Done, SyncAgain, Failed, Fenced int
}

// dispatch claims one batch under the held, non-draining leases (for the
// given kinds, or all), runs it, settles it, and returns how many it claimed.
func (rt *Runtime) dispatch(ctx context.Context, kinds []string) (int, error) {
	res, err := rt.pass(ctx, kinds)
	return res.Claimed, err
}

func (rt *Runtime) pass(ctx context.Context, kinds []string) (TickResult, error) {
	var tr TickResult
	rt.mu.Lock()
	byWorker := map[string][]workqueue.Lease{}
	for _, m := range rt.members {
		for name, h := range m.held {
			if h.draining {
				continue
			}
			ks := h.kinds
			if kinds != nil {
				ks = slices.DeleteFunc(slices.Clone(ks), func(k string) bool { return !slices.Contains(kinds, k) })
			}
			if len(ks) > 0 {
				byWorker[m.workerID] = append(byWorker[m.workerID], workqueue.Lease{Name: name, Fence: h.Fence, Shard: h.shard, Kinds: ks})
			}
		}
	}
	rt.mu.Unlock()

	for _, m := range rt.members {
		leases := byWorker[m.workerID]
		if len(leases) == 0 {
			continue
		}
		var claimed []workqueue.Claimed
		err := bookkeeping(ctx, rt.pool, func(tx pgx.Tx) (err error) {
			claimed, err = workqueue.Claim(ctx, tx, m.workerID, rt.cfg.ClaimTTL, leases, rt.cfg.Batch)
			return err
		})
		if err != nil {
			return tr, err
		}
		tr.Claimed += len(claimed)
		if len(claimed) == 0 {
			continue
		}
		rt.track(m, claimed, +1)
		results := rt.runAll(ctx, claimed)
		if rt.killed.Load() {
			return tr, errors.New("reconcile: killed") // a crash settles nothing
		}
		var st workqueue.Settled
		err = bookkeeping(context.WithoutCancel(ctx), rt.pool, func(tx pgx.Tx) (err error) {
			st, err = workqueue.Settle(context.WithoutCancel(ctx), tx, m.workerID, results)
			return err
		})
		rt.track(m, claimed, -1)
		if err != nil {
			return tr, err
		}
		for _, r := range results {
			switch r.Outcome {
			case workqueue.Done:
				tr.Done++
			case workqueue.SyncAgain:
				tr.SyncAgain++
			default:
				tr.Failed++
			}
		}
		tr.Fenced += st.Fenced
		if st.Fenced > 0 {
			rt.met.runs.WithLabelValues("", "fenced").Add(float64(st.Fenced))
		}
	}
	return tr, nil
}

// bookkeeping runs a claim or settle without waiting for its commit to
// reach disk (synchronous_commit off). That is safe here and only here: a
// claim or settle lost in a database crash only runs an idempotent key again.
// It saves a disk flush per batch.
func bookkeeping(ctx context.Context, pool *pgxpool.Pool, fn func(pgx.Tx) error) error {
	return db.InTx(ctx, pool, db.TxOptions{}, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL synchronous_commit = off`); err != nil {
			return err
		}
		return fn(tx)
	})
}

func (rt *Runtime) track(m *member, claimed []workqueue.Claimed, d int) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	for _, c := range claimed {
		if h, ok := m.held[c.Lease]; ok && h.Fence == c.Fence {
			h.inflight += d
		}
	}
}

func (rt *Runtime) runAll(ctx context.Context, claimed []workqueue.Claimed) []workqueue.Result {
	results := make([]workqueue.Result, len(claimed))
	sem := make(chan struct{}, rt.cfg.Concurrency)
	var wg sync.WaitGroup
	batched := map[string][]int{} // kind → indexes into claimed
	var kinds []string
	for i, c := range claimed {
		if rec := rt.byName[c.Kind]; rec != nil && rec.RunBatch != nil {
			if batched[c.Kind] == nil {
				kinds = append(kinds, c.Kind)
			}
			batched[c.Kind] = append(batched[c.Kind], i)
			continue
		}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			results[i] = rt.runOne(ctx, c)
		})
	}
	for _, kind := range kinds {
		rec, idx := rt.byName[kind], batched[kind]
		// Split the claim so every run slot gets a share, up to the
		// reconciler's batch size.
		size := min(cmp.Or(rec.BatchSize, DefaultBatchSize), (len(idx)+rt.cfg.Concurrency-1)/rt.cfg.Concurrency)
		for chunk := range slices.Chunk(idx, max(size, 1)) {
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				rt.runBatch(ctx, rec, claimed, chunk, results)
			})
		}
	}
	wg.Wait()
	return results
}

// runBatch runs the claimed keys at idx with rec.RunBatch, and each on its
// own with Run if the batch fails.
func (rt *Runtime) runBatch(ctx context.Context, rec *Reconciler, claimed []workqueue.Claimed, idx []int, results []workqueue.Result) {
	if len(idx) == 1 {
		results[idx[0]] = rt.runOne(ctx, claimed[idx[0]])
		return
	}
	bctx, cancel := context.WithTimeout(ctx, rt.cfg.ClaimTTL*9/10)
	defer cancel()
	bctx, span := rt.tracer.Start(bctx, "reconcile batch "+rec.Name, trace.WithAttributes(
		attribute.String("reconcile.kind", rec.Name), attribute.Int("reconcile.keys", len(idx))))
	defer span.End()
	bc := &BatchContext{rt: rt, Kind: rec.Name, Worker: rt.WorkerID(rec.Role), Logger: rt.log.With("kind", rec.Name)}
	keys := make([]string, len(idx))
	seen := map[lease.Held]bool{}
	for j, i := range idx {
		c := claimed[i]
		keys[j] = c.Key
		if h := (lease.Held{Name: c.Lease, Fence: c.Fence}); !seen[h] {
			seen[h] = true
			bc.leases = append(bc.leases, h)
		}
	}
	bc.Keys = keys
	start := time.Now()
	err := safeRunBatch(bctx, rec, bc, keys)
	rt.met.runSeconds.WithLabelValues(rec.Name).Observe(time.Since(start).Seconds())
	if err == nil {
		for _, i := range idx {
			results[i] = workqueue.Result{Claimed: claimed[i], Outcome: workqueue.Done}
		}
		rt.met.runs.WithLabelValues(rec.Name, "done").Add(float64(len(idx)))
		return
	}
	span.RecordError(err)
	bc.Logger.WarnContext(ctx, "batch failed; running its keys one by one", "keys", len(keys), "err", err)
	for _, i := range idx {
		results[i] = rt.runOne(ctx, claimed[i])
	}
}

func safeRunBatch(ctx context.Context, rec *Reconciler, bc *BatchContext, keys []string) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("panic: %v", p)
		}
	}()
	return rec.RunBatch(ctx, bc, keys)
}

func (rt *Runtime) runOne(ctx context.Context, c workqueue.Claimed) (res workqueue.Result) {
	res.Claimed = c
	rec := rt.byName[c.Kind]
	if rec == nil {
		res.Outcome, res.Err = workqueue.Failed, fmt.Errorf("no reconciler %q in this process", c.Kind)
		return res
	}
	ctx, cancel := context.WithTimeout(ctx, rt.cfg.ClaimTTL*9/10)
	defer cancel()
	ctx, span := rt.tracer.Start(ctx, "reconcile "+c.Kind, trace.WithAttributes(
		attribute.String("reconcile.kind", c.Kind),
		attribute.String("reconcile.key", c.Key),
		attribute.Int("reconcile.attempt", c.Attempts+1),
	))
	defer span.End()
	rc := &RunContext{rt: rt, Kind: c.Kind, Key: c.Key, Lease: c.Lease, Fence: c.Fence, Attempt: c.Attempts + 1,
		Worker: rt.WorkerID(rec.Role), Logger: rt.log.With("kind", c.Kind, "key", c.Key)}
	start := time.Now()
	out, err := safeRun(ctx, rec, rc, c.Key)
	rt.met.runSeconds.WithLabelValues(c.Kind).Observe(time.Since(start).Seconds())
	switch {
	case err != nil:
		res.Outcome, res.Err = workqueue.Failed, err
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
		rt.met.runs.WithLabelValues(c.Kind, "error").Inc()
		rc.Logger.WarnContext(ctx, "reconcile failed", "attempt", rc.Attempt, "err", err)
	case out == SyncAgain:
		res.Outcome = workqueue.SyncAgain
		rt.met.runs.WithLabelValues(c.Kind, "sync_again").Inc()
	default:
		res.Outcome = workqueue.Done
		rt.met.runs.WithLabelValues(c.Kind, "done").Inc()
	}
	return res
}

func safeRun(ctx context.Context, rec *Reconciler, rc *RunContext, key string) (out Result, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("panic: %v", p)
		}
	}()
	return rec.Run(ctx, rc, key)
}

// Job is one reconciler's deterministic handle.
type Job struct {
	rt  *Runtime
	rec *Reconciler
}

// Tick runs one pass of the job with no timers: it claims every due key of
// the job's kind under the leases held now, runs them and settles them, batch
// after batch, until none is due. A runtime that has not joined its
// memberships yet (no Start, no Heartbeat) joins first; later membership
// passes are the caller's, with [Runtime.Heartbeat].
func (j *Job) Tick(ctx context.Context) (TickResult, error) {
	if !j.rt.joined.Load() {
		if err := j.rt.Heartbeat(ctx); err != nil {
			return TickResult{}, err
		}
	}
	var total TickResult
	for {
		tr, err := j.rt.pass(ctx, []string{j.rec.Name})
		total.Claimed += tr.Claimed
		total.Done += tr.Done
		total.SyncAgain += tr.SyncAgain
		total.Failed += tr.Failed
		total.Fenced += tr.Fenced
		if err != nil || tr.Claimed < j.rt.cfg.Batch {
			return total, err
		}
	}
}

// RunContext is what a run gets besides its key.
type RunContext struct {
	rt *Runtime
	// Kind and Key are what is being reconciled.
	Kind, Key string
	// Lease and Fence are the lease the run holds; Worker holds it.
	Lease  string
	Fence  int64
	Worker string
	// Attempt counts consecutive failures plus one.
	Attempt int
	// Logger carries kind and key.
	Logger *slog.Logger
}

// DB returns the pool, for reads. Write with [RunContext.InTx].
func (rc *RunContext) DB() *pgxpool.Pool { return rc.rt.pool }

// BatchContext is what a [Reconciler.RunBatch] call gets besides its keys.
type BatchContext struct {
	rt     *Runtime
	leases []lease.Held
	// Kind is the reconciler; Keys the keys of the batch.
	Kind string
	Keys []string
	// Worker holds the batch's leases.
	Worker string
	// Logger carries the kind.
	Logger *slog.Logger
}

// DB returns the pool, for reads. Write with [BatchContext.InTx].
func (bc *BatchContext) DB() *pgxpool.Pool { return bc.rt.pool }

// InTx runs fn in one transaction fenced by every lease the batch's keys
// were claimed under: it first locks those lease rows (FOR SHARE, in name
// order) if each still has this worker and its fence and has not expired,
// so none changes hands until the transaction ends. A lost lease returns
// [ErrFenced] and writes nothing (the runtime then runs each key on its own,
// and those under a lost lease are fenced there). Keys fn enqueues through
// q are poked after commit.
func (bc *BatchContext) InTx(ctx context.Context, fn func(tx pgx.Tx, q *Queue) error) error {
	names := make([]string, len(bc.leases))
	fences := make([]int64, len(bc.leases))
	for i, h := range bc.leases {
		names[i], fences[i] = h.Name, h.Fence
	}
	q := &Queue{}
	err := db.InTx(ctx, bc.rt.pool, db.TxOptions{}, func(tx pgx.Tx) error {
		q.items, q.after = q.items[:0], nil
		q.tx = tx
		var held int
		err := tx.QueryRow(ctx, `SELECT count(*) FROM (
			SELECT 1 FROM leases l JOIN unnest($1::text[], $2::bigint[]) AS h(name, fence) ON l.name = h.name AND l.fence = h.fence
			 WHERE l.holder = $3 AND l.expires_at > now() ORDER BY l.name FOR SHARE OF l) x`, names, fences, bc.Worker).Scan(&held)
		if err != nil {
			return fmt.Errorf("check leases: %w", err)
		}
		if held != len(bc.leases) {
			return ErrFenced
		}
		return fn(tx, q)
	})
	if err == nil {
		q.Committed(bc.rt.poker)
	}
	return err
}

// InTx runs fn in a fenced transaction: it first locks the run's lease row,
// and only if it still has this run's holder and fence and has not expired,
// so no new holder can take the lease until the transaction ends. A lost
// lease returns [ErrFenced] and writes nothing. Keys fn enqueues through q
// are poked after commit.
func (rc *RunContext) InTx(ctx context.Context, fn func(tx pgx.Tx, q *Queue) error) error {
	q := &Queue{}
	err := db.InTx(ctx, rc.rt.pool, db.TxOptions{}, func(tx pgx.Tx) error {
		q.items, q.after = q.items[:0], nil
		q.tx = tx
		err := lease.Hold(ctx, tx, rc.Worker, lease.Held{Name: rc.Lease, Fence: rc.Fence})
		if errors.Is(err, lease.ErrLost) {
			return ErrFenced
		}
		if err != nil {
			return err
		}
		return fn(tx, q)
	})
	if err == nil {
		q.Committed(rc.rt.poker)
	}
	return err
}

// InTx runs fn in a transaction and pokes the keys it enqueued through q
// after commit: the way to change state and enqueue the work it implies
// outside a run.
func (rt *Runtime) InTx(ctx context.Context, fn func(tx pgx.Tx, q *Queue) error) error {
	return InTx(ctx, rt.pool, rt.poker, fn)
}

// InTx is [Runtime.InTx] for processes that enqueue without running a
// runtime (the API): poker may be nil.
func InTx(ctx context.Context, pool *pgxpool.Pool, poker *workqueue.Poker, fn func(tx pgx.Tx, q *Queue) error) error {
	q := &Queue{}
	err := db.InTx(ctx, pool, db.TxOptions{}, func(tx pgx.Tx) error {
		q.items, q.after = q.items[:0], nil
		q.tx = tx
		return fn(tx, q)
	})
	if err == nil {
		q.Committed(poker)
	}
	return err
}

// Queue enqueues within one transaction and remembers what to do after its
// commit: poke the workers owning the keys, and run the hooks a change
// registered (a gateway poke). It is the one way a change and its wake-ups
// commit together and are announced after.
type Queue struct {
	tx    pgx.Tx
	items []workqueue.Item
	after []func()
}

// NewQueue returns a queue over tx, for a caller that commits tx itself and
// then calls [Queue.Committed] (admission does). Retry the transaction with
// a new queue.
func NewQueue(tx pgx.Tx) *Queue { return &Queue{tx: tx} }

// Enqueue queues (kind, key) in the transaction.
func (q *Queue) Enqueue(ctx context.Context, kind, key string) error {
	return q.EnqueueMany(ctx, []workqueue.Item{{Kind: kind, Key: key}})
}

// EnqueueMany queues items in the transaction, in statements of at most
// 1,000 items.
func (q *Queue) EnqueueMany(ctx context.Context, items []workqueue.Item) error {
	for chunk := range slices.Chunk(items, 1000) {
		if err := workqueue.EnqueueMany(ctx, q.tx, chunk); err != nil {
			return err
		}
	}
	q.items = append(q.items, items...)
	return nil
}

// AfterCommit runs f after the transaction commits (never if it does not).
func (q *Queue) AfterCommit(f func()) { q.after = append(q.after, f) }

// Committed pokes the owners of the enqueued keys through poker (which may
// be nil) and runs the after-commit hooks. Call it once the transaction has
// committed.
func (q *Queue) Committed(poker *workqueue.Poker) {
	poker.Poke(q.items...)
	for _, f := range q.after {
		f()
	}
}

// janitor removes worker rows that expired more than a minute ago. Leases
// are never deleted: their fences must only grow.
func janitor() Reconciler {
	return Reconciler{
		Name:     "runtime.janitor",
		ShardBy:  ShardByNone,
		Periodic: []Periodic{{Key: "all", Every: time.Minute}},
		Run: func(ctx context.Context, rc *RunContext, _ string) (Result, error) {
			return Done, rc.InTx(ctx, func(tx pgx.Tx, _ *Queue) error {
				_, err := tx.Exec(ctx, `DELETE FROM workers WHERE expires_at < now() - interval '1 minute'`)
				return err
			})
		},
	}
}
