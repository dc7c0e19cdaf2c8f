package commands

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// SweeperName is the command-sweeper's reconciler name (and work-queue kind).
const SweeperName = "command-sweeper"

// sweepBatch bounds one pass; a full batch runs again at once.
const sweepBatch = 500

// Sweeper returns the command-sweeper reconciler: a singleton (shardBy none)
// whose periodic key "all" runs every interval (5 s when 0). See
// [Registry.Sweep].
func (r *Registry) Sweeper(interval time.Duration) reconcile.Reconciler {
	if interval <= 0 {
		interval = 5 * time.Second
	}
	return reconcile.Reconciler{
		Name:     SweeperName,
		ShardBy:  reconcile.ShardByNone,
		Role:     reconcile.RoleCommandSweeper,
		Periodic: []reconcile.Periodic{{Key: "all", Every: interval}},
		Run: func(ctx context.Context, rc *reconcile.RunContext, _ string) (reconcile.Result, error) {
			var n int
			err := rc.InTx(ctx, func(tx pgx.Tx, q *reconcile.Queue) error {
				var err error
				n, err = r.Sweep(ctx, tx, q)
				return err
			})
			if err != nil {
				return reconcile.Done, err
			}
			if n >= sweepBatch {
				return reconcile.SyncAgain, nil
			}
			return reconcile.Done, nil
		},
	}
}

// Sweep runs one pass in tx: pending commands past not_after expire (reason
// "EXPIRED"); in-flight ones past not_after plus their kind's timeout fail
// (reason "timeout"). Both go through the finish path, so each writes its
// event and wakes its owner. It returns how many it settled (at most a
// batch of each).
func (r *Registry) Sweep(ctx context.Context, tx pgx.Tx, w Waker) (int, error) {
	expired, err := collect(tx.Query(ctx, `
		SELECT `+Columns+` FROM commands WHERE state = 'pending' AND not_after < now()
		 ORDER BY not_after LIMIT $1 FOR UPDATE SKIP LOCKED`, sweepBatch))
	if err != nil {
		return 0, fmt.Errorf("sweep: %w", err)
	}
	for _, c := range expired {
		if _, err := finish(ctx, tx, w, c, Expired, ReasonExpired, nil); err != nil {
			return 0, err
		}
	}
	var kinds []string
	var secs []float64
	for _, k := range r.Kinds() {
		kinds = append(kinds, k.Name)
		secs = append(secs, k.Timeout.Seconds())
	}
	late, err := collect(tx.Query(ctx, `
		SELECT `+qualified("c")+` FROM commands c LEFT JOIN unnest($1::text[], $2::float8[]) AS k(kind, secs) ON k.kind = c.kind
		 WHERE c.state = 'in_flight' AND c.not_after < now()
		   AND c.not_after + make_interval(secs => coalesce(k.secs, $3)) < now()
		 ORDER BY c.not_after LIMIT $4 FOR UPDATE OF c SKIP LOCKED`, kinds, secs, DefaultTimeout.Seconds(), sweepBatch))
	if err != nil {
		return 0, fmt.Errorf("sweep: %w", err)
	}
	for _, c := range late {
		if _, err := finish(ctx, tx, w, c, Failed, ReasonTimeout, nil); err != nil {
			return 0, err
		}
	}
	return len(expired) + len(late), nil
}
