// Package iam is the iam role: IAM's jobs, each a singleton of the
// reconciler runtime (one process runs it at a time, under the lease
// singleton:<name>), level-triggered and periodic, so they converge from
// the database with the bus down.
//
//   - iam.keys: deletes API keys revoked or expired longer ago than
//     iam.keyRetention (their console sessions with them) and writes
//     apiKey.expiring once for each live key that expires within
//     iam.keyExpiryWarning.
//   - iam.projection: re-verifies the authorization projection against its
//     sources (authz.VerifyProjection): deletes drafts of admissions that
//     never finished, rewrites Node and Pool rows that differ from the
//     nodes and pools tables, counts rows and resources without each
//     other; a gauge and a log line say what it found.
//
// The policy cache needs no job of its own: each api process re-reads a
// changed policy from the event log its tailer follows (from the database
// too, so without the bus), see docs/security.md.
package iam

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/config"
	iamstore "github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// Kinds of the iam role's jobs.
const (
	KindKeys       = "iam.keys"
	KindProjection = "iam.projection"
)

// batch bounds the keys one run deletes or warns of; a full batch runs
// again at once.
const batch = 1000

// draftAge is how old a draft projection row must be to be an admission
// that never finished (admission writes the live row seconds later).
const draftAge = time.Hour

// Config is the jobs' settings.
type Config struct {
	// IAM is the configuration's iam section (defaults filled).
	IAM config.IAM
	// Now is the clock; nil means time.Now.
	Now func() time.Time
	// Logger receives what the jobs find; nil discards.
	Logger *slog.Logger
	// Registerer receives the gauge bc_authz_projection_discrepancies;
	// nil registers nothing.
	Registerer prometheus.Registerer
}

// Reconcilers returns the iam role's jobs.
func Reconcilers(cfg Config) ([]reconcile.Reconciler, error) {
	j := &jobs{cfg: cfg, now: cfg.Now, log: cfg.Logger}
	if j.now == nil {
		j.now = time.Now
	}
	if j.log == nil {
		j.log = slog.New(slog.DiscardHandler)
	}
	j.found = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "bc_authz_projection_discrepancies",
		Help: "What the last iam.projection pass found, by resource type and kind (stale_draft, repaired, missing, orphan).",
	}, []string{"type", "kind"})
	if cfg.Registerer != nil {
		if err := cfg.Registerer.Register(j.found); err != nil {
			return nil, err
		}
	}
	role := string(config.RoleIAM)
	return []reconcile.Reconciler{
		{Name: KindKeys, ShardBy: reconcile.ShardByNone, Role: role, Run: j.keys,
			Periodic: []reconcile.Periodic{{Key: "all", Every: cfg.IAM.KeysEvery.Std()}}},
		{Name: KindProjection, ShardBy: reconcile.ShardByNone, Role: role, Run: j.projection,
			Periodic: []reconcile.Periodic{{Key: "all", Every: cfg.IAM.VerifyEvery.Std()}}},
	}, nil
}

type jobs struct {
	cfg   Config
	now   func() time.Time
	log   *slog.Logger
	found *prometheus.GaugeVec
}

func (j *jobs) keys(ctx context.Context, rc *reconcile.RunContext, _ string) (reconcile.Result, error) {
	var pruned, warned int
	err := rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
		now := j.now()
		var err error
		if pruned, err = iamstore.PruneKeys(ctx, tx, now.Add(-j.cfg.IAM.KeyRetention.Std()), batch); err != nil {
			return err
		}
		ks, err := iamstore.WarnExpiringKeys(ctx, tx, now, j.cfg.IAM.KeyExpiryWarning.Std(), batch)
		if err != nil {
			return err
		}
		warned = len(ks)
		for _, k := range ks {
			if _, err := outbox.Write(ctx, tx, outbox.Event{TenantID: k.TenantID, Type: "apiKey.expiring", Resource: k.ID,
				Payload: map[string]any{"id": k.ID, "identityId": k.IdentityID, "name": k.Name, "expiresAt": k.ExpiresAt.UTC().Format(time.RFC3339)}}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return reconcile.Done, err
	}
	if pruned > 0 || warned > 0 {
		j.log.InfoContext(ctx, "iam.keys", "pruned", pruned, "expiring", warned)
	}
	if pruned >= batch || warned >= batch {
		return reconcile.SyncAgain, nil
	}
	return reconcile.Done, nil
}

func (j *jobs) projection(ctx context.Context, rc *reconcile.RunContext, _ string) (reconcile.Result, error) {
	var rep authz.ProjectionReport
	err := rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
		var err error
		rep, err = authz.VerifyProjection(ctx, tx, j.now().Add(-draftAge))
		return err
	})
	if err != nil {
		return reconcile.Done, err
	}
	j.found.WithLabelValues("", "stale_draft").Set(float64(rep.StaleDrafts))
	for kind, m := range map[string]map[string]int{"repaired": rep.Repaired, "missing": rep.Missing, "orphan": rep.Orphans} {
		for typ, n := range m {
			j.found.WithLabelValues(typ, kind).Set(float64(n))
		}
	}
	if rep.Total() > 0 {
		j.log.WarnContext(ctx, "iam.projection: the authorization projection differed from its sources",
			"stale_drafts", rep.StaleDrafts, "repaired", rep.Repaired, "missing", rep.Missing, "orphans", rep.Orphans)
	}
	return reconcile.Done, nil
}
