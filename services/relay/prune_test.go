package relay_test

import (
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/poll"
)

// Security review 13 #17: certificates renewed over a node's life and the
// idempotency records of its callers must not grow without end. The prune
// job removes node certificates expired longer than certificateGrace ago and
// expired idempotency records, and keeps the rest.
func TestPruneRemovesExpiredCertificatesAndIdempotencyRecords(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := t.Context()
	fixture.Node(t, e.pool, fixture.NodeOpts{ID: "node_a", Tenant: "acme"})
	for _, q := range []string{
		`INSERT INTO node_certificates (serial, node_id, not_before, not_after) VALUES
		   ('old', 'node_a', now() - interval '40 days', now() - interval '31 days'),
		   ('grace', 'node_a', now() - interval '3 days', now() - interval '2 days'),
		   ('live', 'node_a', now(), now() + interval '1 day')`,
		`INSERT INTO idempotency (tenant_id, identity_id, method, key, request_hash, expires_at) VALUES
		   ('acme', 'idn_x', 'm', 'expired', '\x00', now() - interval '1 second'),
		   ('acme', 'idn_x', 'm', 'live', '\x00', now() + interval '1 hour')`,
	} {
		if _, err := e.pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	cfg := e.cfg
	cfg.Events.CertificateGrace = config.Duration(30 * 24 * time.Hour)
	cfg.Events.PruneEvery = 1 << 62
	r := e.start(cfg)
	poll.Until(t, 20*time.Second, "leading", r.Leading)
	p, err := r.PruneOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if p.Certificates != 1 || p.Idempotency != 1 {
		t.Fatalf("pruned %+v, want 1 certificate and 1 idempotency record", p)
	}
	rows, err := e.pool.Query(ctx, `SELECT serial FROM node_certificates UNION ALL SELECT key FROM idempotency ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	var left []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		left = append(left, s)
	}
	if rows.Err() != nil || len(left) != 3 || left[0] != "grace" || left[1] != "live" || left[2] != "live" {
		t.Fatalf("left %v (%v), want grace, live, live", left, rows.Err())
	}
}
