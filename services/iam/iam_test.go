package iam_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	iamstore "github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
	"github.com/bettercompute/bettercompute/services/iam"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type env struct {
	pool *pgxpool.Pool
	rt   *reconcile.Runtime
	reg  *prometheus.Registry
	now  time.Time
}

func newEnv(t *testing.T, cfg config.IAM, start bool) *env {
	t.Helper()
	pool, err := db.Open(t.Context(), db.Config{URL: pgtest.NewDB(t), MaxConns: 8})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	e := &env{pool: pool, reg: prometheus.NewRegistry(), now: time.Now()}
	c := &config.Config{IAM: cfg}
	c.Defaults()
	// No NATS: every job runs from the work queue's periodic keys alone.
	rt, err := reconcile.New(pool, nil, reconcile.Config{Roles: []string{string(config.RoleIAM)}, Heartbeat: 200 * time.Millisecond,
		Poll: 50 * time.Millisecond, PollBusDown: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	rs, err := iam.Reconcilers(iam.Config{IAM: c.IAM, Now: func() time.Time { return e.now }, Registerer: e.reg})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rs {
		if err := rt.Register(r); err != nil {
			t.Fatal(err)
		}
	}
	if start {
		if err := rt.Start(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(rt.Stop)
	e.rt = rt
	return e
}

func (e *env) tick(t *testing.T, kind string) {
	t.Helper()
	if err := workqueue.Enqueue(t.Context(), e.pool, kind, "all"); err != nil {
		t.Fatal(err)
	}
	if tr, err := e.rt.Jobs()[kind].Tick(t.Context()); err != nil || tr.Failed > 0 {
		t.Fatalf("tick %s: %+v %v", kind, tr, err)
	}
}

// key makes an API key of a new identity in root, expiring at exp (nil:
// never) and revoked at revoked (nil: live).
func (e *env) key(t *testing.T, id string, exp, revoked *time.Time) {
	t.Helper()
	ctx := t.Context()
	if _, err := iamstore.CreateIdentity(ctx, e.pool, iamstore.Identity{ID: "idt_" + id, TenantID: fixture.DefaultTenant, Kind: iamstore.KindService, Name: id}); err != nil {
		t.Fatal(err)
	}
	if _, err := iamstore.CreateKey(ctx, e.pool, iamstore.APIKey{ID: id, IdentityID: "idt_" + id, TenantID: fixture.DefaultTenant, Name: "key " + id, ExpiresAt: exp}, []byte("h")); err != nil {
		t.Fatal(err)
	}
	if revoked != nil {
		if _, err := e.pool.Exec(ctx, `UPDATE api_keys SET revoked_at = $2 WHERE id = $1`, id, *revoked); err != nil {
			t.Fatal(err)
		}
	}
}

func (e *env) keys(t *testing.T) map[string]bool {
	t.Helper()
	rows, err := e.pool.Query(t.Context(), `SELECT id FROM api_keys WHERE id LIKE 'key_%'`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]bool{}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		out[id] = true
	}
	return out
}

func (e *env) expiringEvents(t *testing.T) []string {
	t.Helper()
	rows, err := e.pool.Query(t.Context(), `SELECT payload->>'id' FROM outbox WHERE type = 'apiKey.expiring' ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		out = append(out, id)
	}
	return out
}

func at(t time.Time) *time.Time { return &t }

// TestKeysPrunedAndWarnedOnce: keys ended longer ago than the retention
// go (revoked or expired), younger ones and live ones stay; a key expiring
// within the warning gets one apiKey.expiring however often the job runs,
// one expiring later gets none until it is within the window.
func TestKeysPrunedAndWarnedOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, config.IAM{}, false) // defaults: 30 days, 7 days
	day := 24 * time.Hour
	e.key(t, "key_revoked_old", nil, at(e.now.Add(-40*day)))
	e.key(t, "key_expired_old", at(e.now.Add(-31*day)), nil)
	e.key(t, "key_revoked_recent", nil, at(e.now.Add(-10*day)))
	e.key(t, "key_expired_recent", at(e.now.Add(-2*day)), nil)
	e.key(t, "key_expiring", at(e.now.Add(3*day)), nil)
	e.key(t, "key_later", at(e.now.Add(20*day)), nil)
	e.key(t, "key_revoked_expiring", at(e.now.Add(2*day)), at(e.now.Add(-time.Hour)))
	e.key(t, "key_forever", nil, nil)

	e.tick(t, iam.KindKeys)
	e.tick(t, iam.KindKeys)
	got := e.keys(t)
	for _, id := range []string{"key_revoked_old", "key_expired_old"} {
		if got[id] {
			t.Errorf("%s kept past the retention", id)
		}
	}
	for _, id := range []string{"key_revoked_recent", "key_expired_recent", "key_expiring", "key_later", "key_revoked_expiring", "key_forever"} {
		if !got[id] {
			t.Errorf("%s pruned", id)
		}
	}
	if ev := e.expiringEvents(t); len(ev) != 1 || ev[0] != "key_expiring" {
		t.Fatalf("apiKey.expiring for %v, want once for key_expiring", ev)
	}
	// 14 days on: key_later is within its week; the rest expired or went.
	e.now = e.now.Add(14 * day)
	e.tick(t, iam.KindKeys)
	if ev := e.expiringEvents(t); len(ev) != 2 || ev[1] != "key_later" {
		t.Fatalf("apiKey.expiring for %v, want key_expiring then key_later", ev)
	}
}

// TestProjectionVerified: a Node row whose labels and a Pool row whose
// tenant differ from their tables are rewritten, a stale draft is deleted
// and a fresh one kept, and a node without a row is counted, not invented.
func TestProjectionVerified(t *testing.T) {
	t.Parallel()
	e := newEnv(t, config.IAM{}, false)
	ctx := t.Context()
	fixture.Tenant(t, e.pool, fixture.TenantOpts{ID: "ten_other"})
	fixture.Pool(t, e.pool, fixture.PoolOpts{ID: "pool_a"})
	fixture.Node(t, e.pool, fixture.NodeOpts{ID: "node_a", Pool: "pool_a", Labels: map[string]string{"rack": "r1"}})
	fixture.Node(t, e.pool, fixture.NodeOpts{ID: "node_b", Pool: "pool_a"})
	for _, res := range []authz.Resource{
		{Type: authz.TypeNode, ID: "node_a", TenantID: fixture.DefaultTenant, PoolID: "pool_a", Labels: map[string]string{"rack": "r9"}},
		{Type: authz.TypePool, ID: "pool_a", TenantID: "ten_other", PoolID: "pool_a"},
	} {
		if err := authz.Put(ctx, e.pool, res); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := e.pool.Exec(ctx, `DELETE FROM authz_projection WHERE type = 'Node' AND id = 'node_b'`); err != nil {
		t.Fatal(err)
	}
	for _, d := range []struct {
		id  string
		age time.Duration
	}{{"pool_stale", 2 * time.Hour}, {"pool_fresh", time.Minute}} {
		if err := authz.PutDraft(ctx, e.pool, authz.Resource{Type: authz.TypePool, ID: d.id, TenantID: fixture.DefaultTenant}); err != nil {
			t.Fatal(err)
		}
		if _, err := e.pool.Exec(ctx, `UPDATE authz_projection SET updated_at = now() - $2::interval WHERE id = $1`, d.id, d.age.String()); err != nil {
			t.Fatal(err)
		}
	}

	e.tick(t, iam.KindProjection)
	n, err := authz.Get(ctx, e.pool, fixture.DefaultTenant, authz.TypeNode, "node_a", "nodeId")
	if err != nil || n.Labels["rack"] != "r1" || n.PoolID != "pool_a" {
		t.Errorf("node_a's row %+v %v, want the nodes table's labels", n, err)
	}
	if p, err := authz.Get(ctx, e.pool, fixture.DefaultTenant, authz.TypePool, "pool_a", "poolId"); err != nil || p.TenantID != fixture.DefaultTenant {
		t.Errorf("pool_a's row %+v %v, want tenant root", p, err)
	}
	var drafts []string
	rows, err := e.pool.Query(ctx, `SELECT id FROM authz_projection WHERE draft ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		drafts = append(drafts, id)
	}
	rows.Close()
	if len(drafts) != 1 || drafts[0] != "pool_fresh" {
		t.Errorf("drafts left %v, want pool_fresh", drafts)
	}
	for _, c := range []struct {
		typ, kind string
		want      float64
	}{
		{"", "stale_draft", 1}, {authz.TypeNode, "repaired", 1}, {authz.TypePool, "repaired", 1},
		{authz.TypeNode, "missing", 1}, {authz.TypePool, "missing", 0}, {authz.TypeNode, "orphan", 0},
	} {
		if got := gauge(t, e.reg, c.typ, c.kind); got != c.want {
			t.Errorf("discrepancies{type=%q,kind=%q} = %v, want %v", c.typ, c.kind, got, c.want)
		}
	}
	// A second pass finds what was not repaired, and only that.
	e.tick(t, iam.KindProjection)
	if got := gauge(t, e.reg, authz.TypeNode, "repaired"); got != 0 {
		t.Errorf("second pass repaired %v Node rows", got)
	}
	if got := gauge(t, e.reg, authz.TypeNode, "missing"); got != 1 {
		t.Errorf("second pass: %v nodes missing, want 1", got)
	}
}

func gauge(t *testing.T, reg *prometheus.Registry, typ, kind string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var gotType, gotKind string
			for _, l := range m.GetLabel() {
				switch l.GetName() {
				case "type":
					gotType = l.GetValue()
				case "kind":
					gotKind = l.GetValue()
				}
			}
			if gotType == typ && gotKind == kind {
				return m.GetGauge().GetValue()
			}
		}
	}
	return -1
}

// TestJobsRunWithoutTheBus: a runtime with no NATS at all prunes an old
// key on the job's period alone, under the iam membership's singleton
// lease.
func TestJobsRunWithoutTheBus(t *testing.T) {
	t.Parallel()
	e := newEnv(t, config.IAM{KeysEvery: config.Duration(100 * time.Millisecond)}, true)
	e.key(t, "key_old", nil, at(e.now.Add(-60*24*time.Hour)))
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	for e.keys(t)["key_old"] {
		select {
		case <-ctx.Done():
			t.Fatal("the old key was never pruned without the bus")
		case <-time.After(50 * time.Millisecond):
		}
	}
	var holder string
	if err := e.pool.QueryRow(ctx, `SELECT holder FROM leases WHERE name = 'singleton:iam.keys'`).Scan(&holder); err != nil || holder == "" {
		t.Errorf("singleton lease of iam.keys: %q %v", holder, err)
	}
}
