package reconcile

import (
	"context"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/lease"
	"github.com/bettercompute/bettercompute/pkg/shard"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
)

// Membership: each member renews its worker row, divides the shards with the
// live workers of its membership by rendezvous hashing, and holds the shard
// and singleton leases it wins. Its lease state is guarded by rt.leaseMu.

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
	// orphans says a claim or settle of this worker failed, so rows may
	// be left claimed by it with no run behind them; the next pass
	// releases them first. Guarded by Runtime.passMu.
	orphans bool
}

type heldLease struct {
	lease.Held
	shard    int // -1 for a singleton
	kinds    []string
	draining bool
	inflight int
}

func (rt *Runtime) member(role string) *member {
	for _, m := range rt.members {
		if m.role == role {
			return m
		}
	}
	return nil
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

	rt.leaseMu.Lock()
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
	rt.leaseMu.Unlock()
	slices.Sort(acquire)

	released, err := lease.Release(ctx, rt.pool, m.workerID, release)
	if err != nil {
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

	rt.leaseMu.Lock()
	for _, h := range release {
		delete(m.held, h.Name)
	}
	kept := map[string]bool{}
	for _, h := range renewed {
		kept[h.Name] = true
	}
	// Leases given up that were no longer this worker's (another took
	// them while it was stopped or cut off) were lost, not released.
	lost := len(release) - released
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
	rt.leaseMu.Unlock()

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
	rt.leaseMu.Lock()
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
	rt.leaseMu.Unlock()
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
	rt.leaseMu.Lock()
	defer rt.leaseMu.Unlock()
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
	rt.leaseMu.Lock()
	defer rt.leaseMu.Unlock()
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
	return heldShardsLocked(m)
}

// heldShardsLocked returns the shards whose leases m holds and is not
// draining, sorted. rt.leaseMu is held.
func heldShardsLocked(m *member) []int {
	var out []int
	for _, h := range m.held {
		if h.shard >= 0 && !h.draining {
			out = append(out, h.shard)
		}
	}
	slices.Sort(out)
	return out
}

// leave releases every lease and deletes the worker rows, so other workers
// take over at once. Stop calls it after the loops have ended.
func (rt *Runtime) leave(ctx context.Context) {
	for _, m := range rt.members {
		rt.leaseMu.Lock()
		held := make([]lease.Held, 0, len(m.held))
		for _, h := range m.held {
			held = append(held, h.Held)
		}
		m.held = map[string]*heldLease{}
		rt.leaseMu.Unlock()
		if _, err := lease.Release(ctx, rt.pool, m.workerID, held); err != nil {
			rt.log.Warn("release leases at stop", "err", err)
		}
		rt.met.leaseChanges.WithLabelValues(m.role, "released").Add(float64(len(held)))
		if _, err := rt.pool.Exec(ctx, `DELETE FROM workers WHERE id = $1`, m.workerID); err != nil {
			rt.log.Warn("leave membership", "err", err)
		}
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
