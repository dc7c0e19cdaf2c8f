package reconcile

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/lease"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
)

// Dispatch: the dispatch loop claims due keys under the held, non-draining
// leases, runs them (one by one, or in batches) and settles them; pokes and
// the poll ticker wake it.

func (rt *Runtime) onPoke(s int, kind string) {
	rec, ok := rt.byName[kind]
	if !ok {
		return
	}
	rt.met.pokes.Inc()
	rt.leaseMu.Lock()
	m := rt.member(rec.Role)
	var mine bool
	if rec.ShardBy == ShardByNone {
		_, mine = m.held[lease.Singleton(kind)]
	} else {
		_, mine = m.held[lease.Shard(m.role, s)]
	}
	rt.leaseMu.Unlock()
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
	rt.passMu.Lock()
	defer rt.passMu.Unlock()
	var tr TickResult
	rt.leaseMu.Lock()
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
	rt.leaseMu.Unlock()

	for _, m := range rt.members {
		leases := byWorker[m.workerID]
		if len(leases) == 0 {
			continue
		}
		if m.orphans {
			// A claim or settle failed (a terminated connection, a lost
			// commit): its rows may still be claimed by this worker, and
			// would wait out ClaimTTL unrun. Nothing of this worker runs
			// now, so every row it holds is such an orphan: release them
			// (their keys run again; runs are idempotent).
			var n int
			if err := bookkeeping(ctx, rt.pool, func(tx pgx.Tx) (err error) {
				n, err = workqueue.ReleaseClaims(ctx, tx, m.workerID)
				return err
			}); err != nil {
				return tr, err
			}
			m.orphans = false
			if n > 0 {
				rt.log.InfoContext(ctx, "released claims left by a failed pass", "role", m.role, "n", n)
			}
		}
		var claimed []workqueue.Claimed
		err := bookkeeping(ctx, rt.pool, func(tx pgx.Tx) (err error) {
			claimed, err = workqueue.Claim(ctx, tx, m.workerID, rt.cfg.ClaimTTL, leases, rt.cfg.Batch)
			return err
		})
		if err != nil {
			m.orphans = true // the claim may have committed
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
			m.orphans = true // the claims stand until the next pass releases them
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
	rt.leaseMu.Lock()
	defer rt.leaseMu.Unlock()
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
