package relay

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/events"
	"github.com/bettercompute/bettercompute/pkg/gateways"
	"github.com/bettercompute/bettercompute/pkg/lease"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/sites"
	"github.com/bettercompute/bettercompute/pkg/sitetasks"
	"github.com/bettercompute/bettercompute/pkg/tunnels"
)

// pruneBatch bounds one prune statement, so no transaction holds many row
// locks for long.
const pruneBatch = 5000

// prunePass runs events.prune while this process leads; the pruner runs
// it every events.pruneEvery.
func (s *Service) prunePass(ctx context.Context) (more bool) {
	if !s.Leading() {
		return false
	}
	if _, err := s.PruneOnce(ctx); err != nil && ctx.Err() == nil && !errors.Is(err, lease.ErrNotLeading) {
		s.log.Warn("prune events", "err", err)
	}
	return false
}

// Pruned counts what one prune removed.
type Pruned struct {
	Events, Idempotency, Certificates int64
	// SiteTasks counts finished site tasks deleted after
	// sitetasks.Retention, and ones expired here (their deadline passed
	// with no gateway holding the site's lease holder to expire them).
	SiteTasks, SiteTasksExpired int64
	// SiteTokens counts site tokens deleted sites.TokenRetention after
	// they expired or were revoked.
	SiteTokens int64
	// Tunnels counts tunnels deleted tunnels.Retention after they closed.
	Tunnels int64
}

// PruneOnce deletes events older than events.retention that the fan-out
// has passed (with their deliveries), expired idempotency records and node
// certificates expired longer than events.certificateGrace ago, finished
// site tasks and ended site tokens past their retention, in batches,
// then vacuums the tables it deleted from and those the relay updates, so
// their scans stay short with autovacuum off.
func (s *Service) PruneOnce(ctx context.Context) (Pruned, error) {
	var p Pruned
	before := time.Now().Add(-s.cfg.Events.Retention.Std())
	certBefore := time.Now().Add(-s.cfg.Events.CertificateGrace.Std())
	for {
		var ev, idem, certs, tasks, toks, tuns int64
		err := s.leader.InTx(ctx, func(tx pgx.Tx) error {
			var err error
			if ev, err = events.Prune(ctx, tx, before, pruneBatch); err != nil {
				return err
			}
			if idem, err = admission.PruneIdempotency(ctx, tx, pruneBatch); err != nil {
				return err
			}
			if certs, err = nodeca.PruneExpired(ctx, tx, certBefore, pruneBatch); err != nil {
				return err
			}
			if tasks, err = sitetasks.Prune(ctx, tx, time.Now().Add(-sitetasks.Retention), pruneBatch); err != nil {
				return err
			}
			if toks, err = sites.PruneTokens(ctx, tx, pruneBatch); err != nil {
				return err
			}
			if tuns, err = tunnels.Prune(ctx, tx, time.Now().Add(-tunnels.Retention), pruneBatch); err != nil {
				return err
			}
			_, err = gateways.Prune(ctx, tx, time.Now().Add(-gateways.Retention))
			return err
		})
		if err != nil {
			return p, err
		}
		p.Events += ev
		p.Idempotency += idem
		p.Certificates += certs
		p.SiteTasks += tasks
		p.SiteTokens += toks
		p.Tunnels += tuns
		if ev < pruneBatch && idem < pruneBatch && certs < pruneBatch && tasks < pruneBatch && toks < pruneBatch && tuns < pruneBatch {
			break
		}
	}
	// Overdue site tasks of sites no gateway serves (the holder's gateway
	// expires its own on every resync); their machines' jobs are woken.
	err := reconcile.InTx(ctx, s.db, nil, func(tx pgx.Tx, q *reconcile.Queue) error {
		n, err := sitetasks.Expire(ctx, tx, q, "", pruneBatch)
		p.SiteTasksExpired = int64(n)
		return err
	})
	if err != nil {
		s.log.Warn("expire site tasks", "err", err)
	}
	s.m.pruned.Add(float64(p.Events))
	// VACUUM cannot run in a transaction; each is one statement, so it also
	// works behind PgBouncer in transaction mode.
	for _, table := range []string{"outbox", "webhook_deliveries", "event_cursors", "idempotency"} {
		if _, err := s.db.Exec(ctx, "VACUUM (ANALYZE) "+table); err != nil {
			s.log.Warn("vacuum", "table", table, "err", err)
		}
	}
	return p, nil
}
