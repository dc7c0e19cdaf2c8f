package reconcile

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/lease"
	"github.com/bettercompute/bettercompute/pkg/wake"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
)

// The transaction API: a change and the work it implies commit together
// (InTx, Queue), fenced by the run's leases inside a run.

// InTx runs fn in one transaction fenced by every lease the batch's keys
// were claimed under: it first locks those lease rows (FOR SHARE, in name
// order) if each still has this worker and its fence and has not expired,
// so none changes hands until the transaction ends. A lost lease returns
// [ErrFenced] and writes nothing (the runtime then runs each key on its own,
// and those under a lost lease are fenced there). Keys fn enqueues through
// q wake their loops after commit.
func (bc *BatchContext) InTx(ctx context.Context, fn func(tx pgx.Tx, q *Queue) error) error {
	names := make([]string, len(bc.leases))
	fences := make([]int64, len(bc.leases))
	for i, h := range bc.leases {
		names[i], fences[i] = h.Name, h.Fence
	}
	q := &Queue{}
	err := db.InTx(ctx, bc.rt.pool, db.TxOptions{}, func(tx pgx.Tx) error {
		q.wakes = wake.Set{}
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
		q.Committed(bc.rt.waker)
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
		q.wakes = wake.Set{}
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
		q.Committed(rc.rt.waker)
	}
	return err
}

// InTx runs fn in a transaction and sends the wakes it collected in q
// after commit: the way to change state and enqueue the work it implies
// outside a run.
func (rt *Runtime) InTx(ctx context.Context, fn func(tx pgx.Tx, q *Queue) error) error {
	return InTx(ctx, rt.pool, rt.waker, fn)
}

// InTx is [Runtime.InTx] for processes that enqueue without running a
// runtime (the API): waker may be nil.
func InTx(ctx context.Context, pool *pgxpool.Pool, waker *wake.Waker, fn func(tx pgx.Tx, q *Queue) error) error {
	q := &Queue{}
	err := db.InTx(ctx, pool, db.TxOptions{}, func(tx pgx.Tx) error {
		q.wakes = wake.Set{}
		q.tx = tx
		return fn(tx, q)
	})
	if err == nil {
		q.Committed(waker)
	}
	return err
}

// Queue enqueues within one transaction and collects the wakes its changes
// imply, sent after the commit by [Queue.Committed]: the keys it enqueued
// wake the workers owning them, and the typed wakes (WakeCommands,
// WakeSiteTasks, WakeDeliveries, WakePolicies) wake the loop each names,
// where it runs (package wake). It is the one way a change and its wake-ups
// commit together and are announced after; every woken loop also resyncs
// from the database, so a lost wake only delays it.
type Queue struct {
	tx    pgx.Tx
	wakes wake.Set
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
	for _, it := range items {
		q.wakes.Work = append(q.wakes.Work, wake.Work{Shard: it.Shard(), Kind: it.Kind})
	}
	return nil
}

// WakeCommands wakes, after commit, the gateways holding nodes: the
// transaction queued or cancelled their commands.
func (q *Queue) WakeCommands(nodeIDs ...string) {
	q.wakes.Nodes = append(q.wakes.Nodes, nodeIDs...)
}

// WakeNodeSpec wakes, after commit, the gateway holding the node's
// session (gatewayID when the transaction read it; empty: none): the
// transaction moved the node's desired state to a new generation.
func (q *Queue) WakeNodeSpec(nodeID, gatewayID string) {
	q.wakes.Specs = append(q.wakes.Specs, wake.Spec{NodeID: nodeID, GatewayID: gatewayID})
}

// WakeSiteTasks wakes, after commit, the gateways holding the agents of
// sites: the transaction queued or resealed their tasks.
func (q *Queue) WakeSiteTasks(siteIDs ...string) {
	q.wakes.Sites = append(q.wakes.Sites, siteIDs...)
}

// WakeDeliveries wakes, after commit, the relays' webhook deliverers: the
// transaction made deliveries due.
func (q *Queue) WakeDeliveries() { q.wakes.Deliveries = true }

// WakePolicies invalidates, after commit, every policy cache's copy of
// tenant's policies: the transaction changed them.
func (q *Queue) WakePolicies(tenant string) {
	if !slices.Contains(q.wakes.Policies, tenant) {
		q.wakes.Policies = append(q.wakes.Policies, tenant)
	}
}

// Committed sends the collected wakes through waker (which may be nil).
// Call it once the transaction has committed.
func (q *Queue) Committed(waker *wake.Waker) { waker.Wake(q.wakes) }
