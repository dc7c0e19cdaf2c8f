package audit

import (
	"cmp"
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// Reconciler names (and work-queue kinds).
const (
	ChainName      = "audit.chain"
	CheckpointName = "audit.checkpoint"
)

// chainBatch bounds the rows one transaction chains; chainBatches bounds the
// transactions of one run, after which a backlog runs again at once.
const (
	chainBatch   = 1000
	chainBatches = 16
)

// Config configures the audit reconcilers. Zero values are documented per
// field.
type Config struct {
	// ChainEvery is how often new rows are chained; 0 means 1s.
	ChainEvery time.Duration
	// CheckpointEvery is how often the chain head is checkpointed; 0 means
	// 1h.
	CheckpointEvery time.Duration
	// Signer signs checkpoints; nil writes them unsigned.
	Signer *Signer
	// Retention is how long chained rows are kept: audit.checkpoint prunes
	// older ones below a checkpoint ([Prune]) after each checkpoint. 0
	// keeps them forever.
	Retention time.Duration
	// Now is the clock of the prune cutoff; nil is time.Now.
	Now func() time.Time
}

// Reconcilers returns the audit chain's reconcilers, both singletons
// (shardBy none) of the controllers membership with a periodic key "all":
// audit.chain chains committed rows ([Chain]) every ChainEvery (and writes
// the very first checkpoint, [FirstCheckpoint]), and
// audit.checkpoint chains, then records the head ([Checkpoint]) every
// CheckpointEvery, then prunes rows older than Retention ([Prune]). Every
// write is fenced by the run's lease.
func Reconcilers(cfg Config) []reconcile.Reconciler {
	chainEvery := cmp.Or(cfg.ChainEvery, time.Second)
	checkpointEvery := cmp.Or(cfg.CheckpointEvery, time.Hour)
	return []reconcile.Reconciler{
		{
			Name:     ChainName,
			ShardBy:  reconcile.ShardByNone,
			Role:     reconcile.RoleControllers,
			Periodic: []reconcile.Periodic{{Key: "all", Every: chainEvery}},
			Run: func(ctx context.Context, rc *reconcile.RunContext, _ string) (reconcile.Result, error) {
				full, err := chainAll(ctx, rc)
				if err != nil {
					return reconcile.Done, err
				}
				// The first checkpoint comes with the first chained rows.
				err = rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
					_, err := FirstCheckpoint(ctx, tx, cfg.Signer)
					return err
				})
				if err != nil || !full {
					return reconcile.Done, err
				}
				return reconcile.SyncAgain, nil
			},
		},
		{
			Name:     CheckpointName,
			ShardBy:  reconcile.ShardByNone,
			Role:     reconcile.RoleControllers,
			Periodic: []reconcile.Periodic{{Key: "all", Every: checkpointEvery}},
			Run: func(ctx context.Context, rc *reconcile.RunContext, _ string) (reconcile.Result, error) {
				if _, err := chainAll(ctx, rc); err != nil {
					return reconcile.Done, err
				}
				var wrote bool
				err := rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
					if _, err := Chain(ctx, tx, chainBatch); err != nil {
						return err
					}
					var err error
					wrote, err = Checkpoint(ctx, tx, cfg.Signer)
					return err
				})
				if err != nil {
					return reconcile.Done, err
				}
				if wrote {
					rc.Logger.InfoContext(ctx, "audit checkpoint written", "signed", cfg.Signer != nil)
				}
				if cfg.Retention <= 0 {
					return reconcile.Done, nil
				}
				now := time.Now
				if cfg.Now != nil {
					now = cfg.Now
				}
				cutoff := now().Add(-cfg.Retention)
				pruned := 0
				for range chainBatches {
					var n int
					err := rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
						var err error
						n, err = Prune(ctx, tx, cutoff)
						return err
					})
					if err != nil {
						return reconcile.Done, err
					}
					if pruned += n; n < pruneBatch {
						break
					}
				}
				if pruned > 0 {
					rc.Logger.InfoContext(ctx, "audit records pruned", "records", pruned, "before", cutoff)
				}
				if pruned == chainBatches*pruneBatch {
					return reconcile.SyncAgain, nil
				}
				return reconcile.Done, nil
			},
		},
	}
}

// chainAll chains up to chainBatches full batches, each in its own fenced
// transaction, and reports whether the last was full (more may wait).
func chainAll(ctx context.Context, rc *reconcile.RunContext) (bool, error) {
	for range chainBatches {
		var n int
		err := rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
			var err error
			n, err = Chain(ctx, tx, chainBatch)
			return err
		})
		if err != nil || n < chainBatch {
			return false, err
		}
	}
	return true, nil
}
