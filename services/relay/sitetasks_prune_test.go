package relay_test

import (
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/poll"
)

// The prune job deletes site tasks finished more than sitetasks.Retention
// ago, keeps younger ones, and expires overdue ones no gateway expired;
// and site tokens 30 days after they ended.
func TestPruneRemovesOldSiteTasksAndExpiresOverdueOnes(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := t.Context()
	fixture.Site(t, e.pool, fixture.SiteOpts{ID: "site_a", Tenant: "acme"})
	for _, q := range []string{
		`INSERT INTO site_tasks (id, tenant_id, site_id, machine_id, kind, state, not_after, finished_at) VALUES
		   ('stk_old', 'acme', 'site_a', 'mach_1', 'pxe.disarm', 'succeeded', now(), now() - interval '8 days'),
		   ('stk_young', 'acme', 'site_a', 'mach_1', 'pxe.disarm', 'failed', now(), now() - interval '6 days'),
		   ('stk_overdue', 'acme', 'site_a', 'mach_2', 'pxe.disarm', 'pending', now() - interval '1 second', NULL)`,
		// Site tokens: one revoked 31 days ago (pruned), one expired 29
		// days ago and one live (kept).
		`INSERT INTO site_tokens (id, tenant_id, site_id, secret_hash, uses, uses_left, expires_at, revoked_at) VALUES
		   ('tok_revoked', 'acme', 'site_a', '\x00', 1, 1, now() + interval '1 day', now() - interval '31 days'),
		   ('tok_expired', 'acme', 'site_a', '\x00', 1, 1, now() - interval '29 days', NULL),
		   ('tok_live', 'acme', 'site_a', '\x00', 1, 1, now() + interval '1 day', NULL)`,
	} {
		if _, err := e.pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	cfg := e.cfg
	cfg.Events.PruneEvery = 1 << 62
	r := e.start(cfg)
	poll.Until(t, 20*time.Second, "leading", r.Leading)
	p, err := r.PruneOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if p.SiteTasks != 1 || p.SiteTasksExpired != 1 || p.SiteTokens != 1 {
		t.Fatalf("pruned %+v, want 1 site task deleted and 1 expired, 1 site token deleted", p)
	}
	var toks string
	if err := e.pool.QueryRow(ctx, `SELECT string_agg(id, ',' ORDER BY id) FROM site_tokens`).Scan(&toks); err != nil || toks != "tok_expired,tok_live" {
		t.Fatalf("site tokens left: %s (%v), want tok_expired,tok_live", toks, err)
	}
	var states string
	if err := e.pool.QueryRow(ctx, `SELECT string_agg(id || '=' || state, ',' ORDER BY id) FROM site_tasks`).Scan(&states); err != nil {
		t.Fatal(err)
	}
	if states != "stk_overdue=expired,stk_young=failed" {
		t.Fatalf("left %s", states)
	}
	var woken int
	if err := e.pool.QueryRow(ctx, `SELECT count(*) FROM work_queue WHERE kind = 'metal' AND key = 'mach_2'`).Scan(&woken); err != nil || woken != 1 {
		t.Fatalf("metal job of the expired task's machine: %d (%v)", woken, err)
	}
}
