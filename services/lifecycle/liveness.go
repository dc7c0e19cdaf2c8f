// Package lifecycle holds the node lifecycle's reconcilers. Today that is
// the liveness job: a node's Ready condition follows how long ago a gateway
// last heard from it.
package lifecycle

import (
	"cmp"
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// LivenessKind is the liveness job's kind in the work queue.
const LivenessKind = "liveness"

// Defaults of [Config].
const (
	DefaultNotReadyAfter = 40 * time.Second
	DefaultLostAfter     = 2 * time.Minute
	DefaultEvery         = 5 * time.Second
	// DefaultLimit bounds the nodes one transaction changes; a pass that
	// hits it runs again a second later (SyncAgain), not a period later.
	DefaultLimit = 1000
)

// Config configures the liveness job (config nodes.*).
type Config struct {
	// NotReadyAfter: a node unseen this long is Unknown; 0 means 40s.
	NotReadyAfter time.Duration
	// LostAfter: a node unseen this long is Lost; 0 means 2m.
	LostAfter time.Duration
	// Every is the period of its key "all"; 0 means 5s.
	Every time.Duration
	// Limit bounds the nodes changed per transaction; 0 means 1,000.
	Limit int
}

// Liveness is the liveness job: a ShardByNone reconciler of the controllers
// role (lease singleton:liveness) with the one periodic key "all". Each
// run changes, in one transaction, every node whose Ready condition no
// longer matches its last heartbeat ([nodes.UpdateReadiness], one
// statement) and writes their node.not_ready, node.lost and node.ready
// events (one statement). It reads only the database, so it converges with
// the bus down: the runtime polls the queue and enqueues the periodic key
// on its own timer.
func Liveness(cfg Config) reconcile.Reconciler {
	cfg.NotReadyAfter = cmp.Or(cfg.NotReadyAfter, DefaultNotReadyAfter)
	cfg.LostAfter = cmp.Or(cfg.LostAfter, DefaultLostAfter)
	cfg.Every = cmp.Or(cfg.Every, DefaultEvery)
	cfg.Limit = cmp.Or(cfg.Limit, DefaultLimit)
	l := &liveness{cfg: cfg}
	return reconcile.Reconciler{
		Name:     LivenessKind,
		ShardBy:  reconcile.ShardByNone,
		Role:     reconcile.RoleControllers,
		Run:      l.run,
		Periodic: []reconcile.Periodic{{Key: "all", Every: cfg.Every}},
	}
}

type liveness struct{ cfg Config }

func (l *liveness) run(ctx context.Context, rc *reconcile.RunContext, _ string) (reconcile.Result, error) {
	var n int
	err := rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
		changes, err := nodes.UpdateReadiness(ctx, tx, nodes.Readiness{
			NotReadyAfter: l.cfg.NotReadyAfter, LostAfter: l.cfg.LostAfter, Limit: l.cfg.Limit,
		})
		if err != nil {
			return err
		}
		n = len(changes)
		es := make([]outbox.Event, 0, len(changes))
		for _, c := range changes {
			var event string
			switch c.To {
			case nodes.ReadyTrue:
				event = "node.ready"
			case nodes.ReadyUnknown:
				event = "node.not_ready"
			default:
				event = "node.lost"
			}
			payload := map[string]any{"nodeId": c.NodeID, "poolId": c.PoolID, "from": c.From, "to": c.To, "reason": c.Reason}
			if c.LastSeenAt != nil {
				payload["lastSeenAt"] = c.LastSeenAt.UTC().Format(time.RFC3339Nano)
			}
			es = append(es, outbox.Event{TenantID: c.TenantID, Type: event, Resource: c.NodeID, Payload: payload})
		}
		return outbox.WriteMany(ctx, tx, es)
	})
	if err != nil {
		return reconcile.Done, err
	}
	if n >= l.cfg.Limit {
		return reconcile.SyncAgain, nil // more to do: back in a second
	}
	return reconcile.Done, nil
}
