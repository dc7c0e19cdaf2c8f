// Package workqueue is the level-triggered work queue in PostgreSQL: one
// row per (kind, key) in `work_queue`.
//
// [Enqueue] runs in the caller's transaction, so a state change and the work
// it implies commit together. Enqueueing a key that is already queued bumps
// its generation instead of adding a row (and makes it due now); a run deletes
// the row only if the generation did not move, so a key dirtied during its run
// is run again. Claims take due rows FOR UPDATE SKIP LOCKED, in batches, in
// the shards whose leases the claimer holds, and every claim and settle checks
// the lease's fence in the same statement.
package workqueue

import (
	"context"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/pkg/shard"
)

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Item names one unit of work.
type Item struct {
	Kind string
	Key  string
}

// Shard is the item's shard.
func (i Item) Shard() int { return shard.Of(i.Key) }

// Enqueue queues (kind, key) in tx. See the package comment.
func Enqueue(ctx context.Context, tx Querier, kind, key string) error {
	return EnqueueMany(ctx, tx, []Item{{Kind: kind, Key: key}})
}

// EnqueueMany queues every item in one statement. Duplicates in items count
// once.
func EnqueueMany(ctx context.Context, tx Querier, items []Item) error {
	if len(items) == 0 {
		return nil
	}
	kinds := make([]string, 0, len(items))
	keys := make([]string, 0, len(items))
	shards := make([]int32, 0, len(items))
	seen := make(map[Item]bool, len(items))
	for _, it := range items {
		if it.Kind == "" || it.Key == "" {
			return fmt.Errorf("enqueue: empty kind or key (%q, %q)", it.Kind, it.Key)
		}
		if seen[it] {
			continue
		}
		seen[it] = true
		kinds = append(kinds, it.Kind)
		keys = append(keys, it.Key)
		shards = append(shards, int32(it.Shard()))
	}
	_, err := tx.Exec(ctx, `
		INSERT INTO work_queue AS w (kind, key, shard)
		SELECT * FROM unnest($1::text[], $2::text[], $3::smallint[])
		ON CONFLICT (kind, key) DO UPDATE
		   SET generation = w.generation + 1, run_after = least(w.run_after, now())`,
		kinds, keys, shards)
	if err != nil {
		return fmt.Errorf("enqueue %d item(s): %w", len(kinds), err)
	}
	return nil
}

// customPlan makes pgx send a statement unnamed, so PostgreSQL plans it for
// the actual arrays every time. A cached generic plan knows nothing of the
// arrays' sizes and, for claims, scans the whole queue per lease: 50x slower.
const customPlan = pgx.QueryExecModeExec

// Lease is a lease a claimer holds, and the shards it covers: a shard lease
// covers its shard; a singleton lease covers every shard of its kinds.
type Lease struct {
	Name  string
	Fence int64
	// Shard is the shard a shard lease covers; -1 for a singleton lease.
	Shard int
	// Kinds are the kinds this lease lets the claimer run.
	Kinds []string
}

// Claimed is a claimed item: run it, then settle it.
type Claimed struct {
	Item
	Generation int64
	Attempts   int
	// Lease and Fence are the lease the claim was made under.
	Lease string
	Fence int64
}

// Claim claims up to limit due items under the given leases for worker, for
// claimTTL (after which another claimer may take them if this one vanished).
// A row claimed under an older fence of the same lease is reclaimable at
// once: its claimer lost the lease.
func Claim(ctx context.Context, q Querier, worker string, claimTTL time.Duration, leases []Lease, limit int) ([]Claimed, error) {
	var lkinds, lnames []string
	var lfences []int64
	var lshards []int32
	grant := func(l Lease, k string, s int) {
		lkinds = append(lkinds, k)
		lnames = append(lnames, l.Name)
		lfences = append(lfences, l.Fence)
		lshards = append(lshards, int32(s))
	}
	for _, l := range leases {
		for _, k := range l.Kinds {
			if l.Shard >= 0 {
				grant(l, k, l.Shard)
				continue
			}
			// A singleton lease covers every shard; one grant row per shard
			// keeps the join an equality the planner can hash.
			for s := range shard.Count {
				grant(l, k, s)
			}
		}
	}
	if len(lkinds) == 0 || limit <= 0 {
		return nil, nil
	}
	rows, err := q.Query(ctx, `
		WITH grant_ AS (
			SELECT g.kind, g.lease, g.fence, g.shard
			  FROM unnest($1::text[], $2::text[], $3::bigint[], $4::int[]) AS g(kind, lease, fence, shard)
			  JOIN leases l ON l.name = g.lease AND l.fence = g.fence AND l.holder = $5 AND l.expires_at > now()
		), due AS (
			SELECT w.kind, w.key, g.lease, g.fence
			  FROM work_queue w
			  JOIN grant_ g ON g.kind = w.kind AND g.shard = w.shard
			 WHERE w.run_after <= now()
			   AND (w.claimed_until IS NULL OR w.claimed_until <= now() OR w.claim_fence IS DISTINCT FROM g.fence)
			 ORDER BY w.run_after
			 LIMIT $6
			   FOR UPDATE OF w SKIP LOCKED
		)
		UPDATE work_queue w
		   SET claimed_by = $5, claim_fence = due.fence,
		       claimed_until = now() + $7 * interval '1 microsecond', last_run_at = now()
		  FROM due
		 WHERE w.kind = due.kind AND w.key = due.key
		RETURNING w.kind, w.key, w.generation, w.attempts, due.lease, due.fence`,
		customPlan, lkinds, lnames, lfences, lshards, worker, limit, claimTTL.Microseconds())
	if err != nil {
		return nil, fmt.Errorf("claim: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Claimed, error) {
		var c Claimed
		err := r.Scan(&c.Kind, &c.Key, &c.Generation, &c.Attempts, &c.Lease, &c.Fence)
		return c, err
	})
}

// Outcome is how a run ended.
type Outcome int

// Outcomes.
const (
	// Done removes the item, unless it was enqueued again during the run.
	Done Outcome = iota
	// SyncAgain brings the item back after [SyncAgainDelay].
	SyncAgain
	// Failed backs the item off (see [Backoff]) and records the error.
	Failed
)

// SyncAgainDelay is how long a SYNC_AGAIN item waits.
const SyncAgainDelay = time.Second

// Result settles one claimed item.
type Result struct {
	Claimed
	Outcome Outcome
	// Err is the failure, for Failed.
	Err error
}

// Settled counts what [Settle] did.
type Settled struct {
	// Deleted items are done.
	Deleted int
	// Requeued items run again: dirtied during their run, SYNC_AGAIN, or
	// failed and backing off.
	Requeued int
	// Fenced items were not touched: their lease was lost.
	Fenced int
}

// Settle records results in at most three statements, each checking the
// claim's lease and fence. A Done item whose generation moved during the run
// is released to run again at once.
func Settle(ctx context.Context, q Querier, worker string, results []Result) (Settled, error) {
	var st Settled
	if len(results) == 0 {
		return st, nil
	}
	var done, again []Result
	for _, r := range results {
		if r.Outcome == Done {
			done = append(done, r)
		} else {
			again = append(again, r)
		}
	}
	if len(done) > 0 {
		kinds, keys, gens, leases, fences := columns(done)
		// Two statements, not one: each takes its own snapshot. A key
		// enqueued again while the DELETE waits for its row lock fails the
		// DELETE's re-check (its generation moved); the UPDATE's fresher
		// snapshot then sees the new generation and releases the claim. In
		// one statement both would judge by the old snapshot and the row
		// would stay claimed, unrun, until its claim expired.
		tag, err := q.Exec(ctx, `
			DELETE FROM work_queue w
			 USING unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::bigint[]) AS s(kind, key, gen, lease, fence),
			       leases l
			 WHERE w.kind = s.kind AND w.key = s.key AND w.generation = s.gen AND w.claimed_by = $6
			   AND l.name = s.lease AND l.fence = s.fence AND l.holder = $6 AND l.expires_at > now()`,
			customPlan, kinds, keys, gens, leases, fences, worker)
		if err != nil {
			return st, fmt.Errorf("settle done: %w", err)
		}
		deleted := int(tag.RowsAffected())
		requeued := 0
		if deleted < len(done) {
			// Dirtied during the run: release the claim so it runs again now.
			tag, err = q.Exec(ctx, `
				UPDATE work_queue w SET claimed_by = NULL, claim_fence = NULL, claimed_until = NULL,
				       attempts = 0, last_error = NULL, run_after = least(w.run_after, now())
				  FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::bigint[]) AS s(kind, key, gen, lease, fence),
				       leases l
				 WHERE w.kind = s.kind AND w.key = s.key AND w.generation <> s.gen AND w.claimed_by = $6
				   AND l.name = s.lease AND l.fence = s.fence AND l.holder = $6 AND l.expires_at > now()`,
				customPlan, kinds, keys, gens, leases, fences, worker)
			if err != nil {
				return st, fmt.Errorf("settle done: %w", err)
			}
			requeued = int(tag.RowsAffected())
		}
		st.Deleted += deleted
		st.Requeued += requeued
		st.Fenced += len(done) - deleted - requeued
	}
	if len(again) > 0 {
		kinds, keys, gens, leases, fences := columns(again)
		delays := make([]int64, len(again))
		errs := make([]*string, len(again))
		for i, r := range again {
			switch r.Outcome {
			case SyncAgain:
				delays[i] = SyncAgainDelay.Microseconds()
			default:
				delays[i] = Backoff(r.Attempts+1, rand.Float64()).Microseconds()
				msg := "error"
				if r.Err != nil {
					msg = r.Err.Error()
				}
				errs[i] = &msg
			}
		}
		tag, err := q.Exec(ctx, `
			UPDATE work_queue w
			   SET claimed_by = NULL, claim_fence = NULL, claimed_until = NULL,
			       -- A key enqueued again during a SYNC_AGAIN run is due now.
			       run_after = CASE WHEN w.generation <> s.gen AND s.err IS NULL THEN now()
			                        ELSE now() + s.delay * interval '1 microsecond' END,
			       attempts = CASE WHEN s.err IS NULL THEN 0 ELSE w.attempts + 1 END,
			       last_error = s.err
			  FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::bigint[], $7::bigint[], $8::text[])
			       AS s(kind, key, gen, lease, fence, delay, err),
			       leases l
			 WHERE w.kind = s.kind AND w.key = s.key AND w.claimed_by = $6
			   AND l.name = s.lease AND l.fence = s.fence AND l.holder = $6 AND l.expires_at > now()`,
			customPlan, kinds, keys, gens, leases, fences, worker, delays, errs)
		if err != nil {
			return st, fmt.Errorf("settle requeue: %w", err)
		}
		n := int(tag.RowsAffected())
		st.Requeued += n
		st.Fenced += len(again) - n
	}
	return st, nil
}

// ReleaseClaims releases every row claimed by worker, making each due
// again at once, and returns how many it released. Call it only while none
// of the worker's claims is running: it is for claims a failed claim or
// settle left behind (their outcome unknown), which would otherwise stay
// claimed, unrun, until their claim expired.
func ReleaseClaims(ctx context.Context, q Querier, worker string) (int, error) {
	tag, err := q.Exec(ctx, `
		UPDATE work_queue SET claimed_by = NULL, claim_fence = NULL, claimed_until = NULL,
		       run_after = least(run_after, now())
		 WHERE claimed_by = $1`, worker)
	if err != nil {
		return 0, fmt.Errorf("release claims of %s: %w", worker, err)
	}
	return int(tag.RowsAffected()), nil
}

func columns(rs []Result) (kinds, keys []string, gens []int64, leases []string, fences []int64) {
	for _, r := range rs {
		kinds = append(kinds, r.Kind)
		keys = append(keys, r.Key)
		gens = append(gens, r.Generation)
		leases = append(leases, r.Lease)
		fences = append(fences, r.Fence)
	}
	return
}

// Backoff bounds.
const (
	BackoffBase = time.Second
	BackoffMax  = 5 * time.Minute
)

// Backoff returns the delay before attempt n (1 = the first retry): 1 s
// doubling up to 5 min, scaled by a jitter factor in [0.8, 1.2) from u in
// [0, 1), and never above the cap.
func Backoff(n int, u float64) time.Duration {
	d := BackoffBase
	for i := 1; i < n && d < BackoffMax; i++ {
		d *= 2
	}
	d = min(d, BackoffMax)
	return min(time.Duration(float64(d)*(0.8+0.4*u)), BackoffMax)
}
