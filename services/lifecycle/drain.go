package lifecycle

import (
	"cmp"
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/audit"
	"github.com/bettercompute/bettercompute/pkg/authz"
	capstore "github.com/bettercompute/bettercompute/pkg/capacity"
	"github.com/bettercompute/bettercompute/pkg/lifecycle"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// DrainDueKey is the drain job's periodic key: its run enqueues every node
// whose drain has something to do ([nodes.DueDrains]).
const DrainDueKey = "due"

// DefaultDrainEvery is the period of the due key when [DrainConfig.Every]
// is 0: a drain completes at most this long after its deadline even with
// the bus down.
const DefaultDrainEvery = 5 * time.Second

// DrainConfig configures the drain job.
type DrainConfig struct {
	// Every is the period of the due key; 0 means 5s.
	Every time.Duration
	// LostNode is capacity.lostNode (wait, replace or fail; "" is wait):
	// under wait a retiring node's bookings stay where they are, so it is
	// retired as soon as it is drained; otherwise once the placer has
	// handled them.
	LostNode string
}

// Drain is the drain job: a ShardByNode reconciler of the controllers role
// whose keys are nodes being drained, plus the periodic key "due". A node's
// run moves it from draining to drained once it holds no active booking or
// its deadline passed (node.drained), and enqueues its pool's placer, which
// applies capacity.lostNode to the bookings it still holds (drained nodes
// count as lost: replace re-places them elsewhere, fail ends them, wait
// keeps them). A retiring node, once drained and its bookings gone (or at
// once under wait), is retired: its certificates are revoked (the gateway
// closes its session at its next liveness tick and refuses it after),
// node.retired and an audit row are written. The due key's run enqueues
// every node whose drain has something to do, in one statement: a drain
// completes at its deadline with the bus down, and a node whose last
// booking ended is drained within a period.
func Drain(cfg DrainConfig) reconcile.Reconciler {
	cfg.Every = cmp.Or(cfg.Every, DefaultDrainEvery)
	cfg.LostNode = cmp.Or(cfg.LostNode, capstore.LostNodeWait)
	d := &drain{cfg: cfg}
	return reconcile.Reconciler{
		Name:    lifecycle.KindDrain,
		ShardBy: reconcile.ShardByNode,
		Role:    reconcile.RoleControllers,
		Run:     d.run,
		Keys: func(ctx context.Context, q reconcile.Querier, shards []int) ([]string, error) {
			return nodes.DrainKeys(ctx, q, shards)
		},
		Periodic: []reconcile.Periodic{{Key: DrainDueKey, Every: cfg.Every}},
	}
}

type drain struct{ cfg DrainConfig }

func (d *drain) run(ctx context.Context, rc *reconcile.RunContext, key string) (reconcile.Result, error) {
	if key == DrainDueKey {
		return reconcile.Done, rc.InTx(ctx, func(tx pgx.Tx, q *reconcile.Queue) error {
			ids, err := nodes.DueDrains(ctx, tx, 0)
			if err != nil {
				return err
			}
			for _, id := range ids {
				if err := q.Enqueue(ctx, lifecycle.KindDrain, id); err != nil {
					return err
				}
			}
			return nil
		})
	}
	return reconcile.Done, rc.InTx(ctx, func(tx pgx.Tx, q *reconcile.Queue) error {
		return d.step(ctx, tx, q, key)
	})
}

// step moves node id as far along its drain as it can go now.
func (d *drain) step(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, id string) error {
	n, drained, err := nodes.MarkDrained(ctx, tx, id)
	if err != nil {
		return err
	}
	if drained {
		reason := "no_bookings"
		if n.DrainDeadline != nil && !n.DrainDeadline.After(n.UpdatedAt) {
			reason = "deadline"
		}
		if _, err := outbox.Write(ctx, tx, outbox.Event{TenantID: n.TenantID, Type: "node.drained", Resource: n.ID, Payload: map[string]any{
			"nodeId": n.ID, "poolId": n.PoolID, "reason": reason,
		}}); err != nil {
			return err
		}
		// The placer applies the lost-node policy to what it still holds.
		if err := q.Enqueue(ctx, capstore.KindReservations, n.PoolID); err != nil {
			return err
		}
	}
	n, retired, err := nodes.MarkRetired(ctx, tx, id, d.cfg.LostNode == capstore.LostNodeWait)
	if err != nil || !retired {
		return err
	}
	revoked, err := nodeca.RevokeNode(ctx, tx, n.ID)
	if err != nil {
		return err
	}
	if _, err := outbox.Write(ctx, tx, outbox.Event{TenantID: n.TenantID, Type: "node.retired", Resource: n.ID, Payload: map[string]any{
		"nodeId": n.ID, "poolId": n.PoolID, "revokedCertificates": revoked,
	}}); err != nil {
		return err
	}
	res := authz.Resource{Type: authz.TypeNode, ID: n.ID, TenantID: n.TenantID, PoolID: n.PoolID, Labels: n.Labels}
	if err := audit.Write(ctx, tx, audit.Record{
		TenantID: n.TenantID, Actor: "drain", ActorTenantID: n.TenantID, Action: string(authz.NodesRetire),
		Resource: res.UID(), Decision: audit.Allow, Method: "job:" + lifecycle.KindDrain,
		Detail: map[string]any{"revokedCertificates": revoked, "reason": n.DrainReason, "by": n.DrainBy},
	}); err != nil {
		return fmt.Errorf("audit retirement of %s: %w", n.ID, err)
	}
	return nil
}
