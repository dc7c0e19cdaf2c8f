package authz_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cedar-policy/cedar-go"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/wake"
)

// fakeClock is a clock tests move by hand.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *fakeClock) Add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func connect(t *testing.T, url string) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

func createTenants(t *testing.T, db *pgxpool.Pool, ids ...string) {
	t.Helper()
	for _, id := range ids {
		if _, err := iam.CreateTenant(t.Context(), db, iam.Tenant{ID: id, ParentID: iam.Parent(id), Name: id}); err != nil {
			t.Fatal(err)
		}
	}
}

func putPolicy(t *testing.T, db authz.Querier, tenant, name, body string) {
	t.Helper()
	if _, err := authz.PutPolicy(t.Context(), db, authz.Policy{TenantID: tenant, Name: name, Body: body}); err != nil {
		t.Fatal(err)
	}
}

func allowedBy(t *testing.T, az *authz.Authorizer, q authz.Querier, p iam.Principal, a authz.Action, r authz.Resource) bool {
	t.Helper()
	d, err := az.Decide(t.Context(), q, p, a, r)
	if err != nil {
		t.Fatal(err)
	}
	return d.Allowed
}

// TestPolicyChangeReachesOtherAuthorizers: an authorizer of another process
// (its own cache and bus connection, the same database) sees a change by the
// bus message; without one (lost) after Recheck; with the bus down at once.
func TestPolicyChangeReachesOtherAuthorizers(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ns := natstest.New(t)
	createTenants(t, db, "acme")
	writer, reader := connect(t, ns.URL()), connect(t, ns.URL())
	clock := &fakeClock{t: time.Unix(1e9, 0)}
	const recheck = time.Minute
	az := authz.NewWithOptions(db, authz.Options{Recheck: recheck, Now: clock.Now})
	if err := az.Listen(reader); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(az.Close)
	alice := iam.Principal{IdentityID: "idn_alice", TenantID: "acme", Kind: "user", Name: "alice"}
	pool := authz.Resource{Type: authz.TypePool, ID: "pool_1", TenantID: "acme"}
	allowed := func() bool { t.Helper(); return allowedBy(t, az, nil, alice, authz.PoolsGet, pool) }
	eventually := func(want bool, why string) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); allowed() != want; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal(why)
			}
		}
	}
	if allowed() {
		t.Fatal("no policy denies")
	}

	// A change whose message is lost: the cache is trusted until Recheck.
	putPolicy(t, db, "acme", "members", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)
	if allowed() {
		t.Fatal("without a message, the cached (empty) policies are trusted within Recheck")
	}
	clock.Add(recheck)
	if !allowed() {
		t.Fatal("after Recheck the version check sees the change")
	}

	// With the message, at once (as soon as it arrives), within Recheck.
	putPolicy(t, db, "acme", "no-pools", `forbid (principal, action == Action::"compute:pools:get", resource);`)
	wake.New(writer, nil, nil).Wake(wake.Set{Policies: []string{"acme"}})
	eventually(false, "the bus message makes the change visible")

	// With the bus down, every decision reads the versions.
	ns.Stop()
	for deadline := time.Now().Add(10 * time.Second); reader.IsConnected(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the client did not notice the bus going away")
		}
	}
	if _, err := db.Exec(t.Context(), `SELECT 1`); err != nil {
		t.Fatal(err)
	}
	if err := authz.DeletePolicy(t.Context(), db, "acme", "no-pools"); err != nil {
		t.Fatal(err)
	}
	if !allowed() {
		t.Fatal("with the bus down the change is seen at the next decision")
	}
}

// TestPolicyCacheDoesNotReparse: nothing changed, nothing is parsed again;
// a change parses only the policy that changed; with the bus up and the
// versions checked within Recheck, a decision reads nothing.
func TestPolicyCacheDoesNotReparse(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	createTenants(t, db, "acme", "acme.ml")
	putPolicy(t, db, "root", "admins", `permit (principal, action, resource) when { principal.tenant == Tenant::"root" };`)
	putPolicy(t, db, "acme", "members", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)
	putPolicy(t, db, "acme.ml", "no-exec", `forbid (principal, action == Action::"compute:nodes:exec", resource);`)
	alice := iam.Principal{IdentityID: "idn_alice", TenantID: "acme", Kind: "user", Name: "alice"}
	p1 := authz.Resource{Type: authz.TypePool, ID: "pool_1", TenantID: "acme.ml"}
	p2 := authz.Resource{Type: authz.TypePool, ID: "pool_2", TenantID: "acme"}

	t.Run("without a bus", func(t *testing.T) {
		az := authz.New(db)
		for range 10 {
			if !allowedBy(t, az, nil, alice, authz.PoolsGet, p1) || allowedBy(t, az, nil, alice, authz.NodesExec, p1) || !allowedBy(t, az, nil, alice, authz.PoolsGet, p2) {
				t.Fatal("wrong decision")
			}
		}
		if s := az.Stats(); s.Parses != 3 || s.Reads != 30 || s.Tenants != 3 || s.Chains != 2 {
			t.Fatalf("after 30 decisions: %+v; want 3 parses, one read a decision, 3 tenants, 2 chains", s)
		}
		putPolicy(t, db, "acme", "readers", `permit (principal, action == Action::"compute:pools:list", resource in Tenant::"acme");`)
		if !allowedBy(t, az, nil, alice, authz.PoolsGet, p1) || !allowedBy(t, az, nil, alice, authz.PoolsList, p2) {
			t.Fatal("the new policy decides")
		}
		if s := az.Stats(); s.Parses != 4 {
			t.Fatalf("a new policy is the only one parsed again: %+v", s)
		}
	})

	t.Run("with a bus", func(t *testing.T) {
		ns := natstest.New(t)
		clock := &fakeClock{t: time.Unix(1e9, 0)}
		az := authz.NewWithOptions(db, authz.Options{Now: clock.Now})
		if err := az.Listen(connect(t, ns.URL())); err != nil {
			t.Fatal(err)
		}
		defer az.Close()
		for range 10 {
			if !allowedBy(t, az, nil, alice, authz.PoolsGet, p1) || !allowedBy(t, az, nil, alice, authz.PoolsGet, p2) {
				t.Fatal("wrong decision")
			}
		}
		if s := az.Stats(); s.Parses != 4 || s.Reads != 1 {
			t.Fatalf("after 20 decisions within Recheck: %+v; want 4 parses and 1 read", s)
		}
		clock.Add(authz.DefaultRecheck)
		allowedBy(t, az, nil, alice, authz.PoolsGet, p1)
		if s := az.Stats(); s.Parses != 4 || s.Reads != 2 {
			t.Fatalf("after Recheck, one read of the versions and no parse: %+v", s)
		}
	})
}

// TestDecideInATransaction: a decision through a transaction sees its
// uncommitted policies, and caches none of them.
func TestDecideInATransaction(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	createTenants(t, db, "acme")
	az := authz.New(db)
	alice := iam.Principal{IdentityID: "idn_alice", TenantID: "acme"}
	pool := authz.Resource{Type: authz.TypePool, ID: "pool_1", TenantID: "acme"}
	if allowedBy(t, az, nil, alice, authz.PoolsGet, pool) {
		t.Fatal("no policy denies")
	}
	err := pgx.BeginFunc(t.Context(), db, func(tx pgx.Tx) error {
		putPolicy(t, tx, "acme", "members", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)
		if !allowedBy(t, az, tx, alice, authz.PoolsGet, pool) {
			t.Fatal("the transaction's decision sees its policy")
		}
		return fmt.Errorf("roll back")
	})
	if err == nil || allowedBy(t, az, nil, alice, authz.PoolsGet, pool) {
		t.Fatalf("a rolled-back policy decides nothing (%v)", err)
	}
}

// TestPolicyCacheIsBounded: the cache keeps at most its bounds.
func TestPolicyCacheIsBounded(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	var ids []string
	for i := range 6 {
		ids = append(ids, fmt.Sprintf("t%d", i))
	}
	createTenants(t, db, ids...)
	body := `permit (principal, action == Action::"compute:pools:get", resource) when { principal.name == "` + strings.Repeat("x", 4000) + `" };`
	for _, id := range ids {
		putPolicy(t, db, id, "big", body)
	}
	az := authz.NewWithOptions(db, authz.Options{MaxTenants: 4, MaxChains: 2, MaxBytes: 3 * 5000})
	for round := range 3 {
		for _, id := range ids {
			allowedBy(t, az, nil, iam.Principal{IdentityID: "idn_x", TenantID: id}, authz.PoolsGet, authz.TenantResource(id))
			if s := az.Stats(); s.Tenants > 4 || s.Chains > 2 || s.Bytes > 3*5000 {
				t.Fatalf("round %d, %s: %+v is over the bounds", round, id, s)
			}
		}
	}
}

func TestPolicyCaps(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := t.Context()
	createTenants(t, db, "acme")
	small := func(i int) string {
		return fmt.Sprintf(`permit (principal, action == Action::"compute:pools:get", resource) when { principal.name == "p%d" };`, i)
	}
	big := `permit (principal, action, resource) when { principal.name == "` + strings.Repeat("x", authz.MaxPolicyBytes) + `" };`
	_, err := authz.PutPolicy(ctx, db, authz.Policy{TenantID: "acme", Name: "big", Body: big})
	if fe, ok := fault.As(err); !ok || fe.Code != fault.InvalidInput || fe.Field != "body" {
		t.Fatalf("put of %d bytes = %v; want INVALID_INPUT on body", len(big), err)
	}
	for i := range authz.MaxPoliciesPerTenant {
		putPolicy(t, db, "acme", fmt.Sprintf("p%03d", i), small(i))
	}
	_, err = authz.PutPolicy(ctx, db, authz.Policy{TenantID: "acme", Name: "one-more", Body: small(0)})
	if fe, ok := fault.As(err); !ok || fe.Code != fault.QuotaExceeded || fe.Field != "name" {
		t.Fatalf("put of policy %d = %v; want QUOTA_EXCEEDED on name", authz.MaxPoliciesPerTenant+1, err)
	}
	putPolicy(t, db, "acme", "p000", small(1)) // replacing one is not adding one
	if err := authz.DeletePolicy(ctx, db, "acme", "p001"); err != nil {
		t.Fatal(err)
	}
	putPolicy(t, db, "acme", "one-more", small(0))
	putPolicy(t, db, "root", "elsewhere", small(0)) // the cap is per tenant
}

// bigPolicy is a policy of about size bytes that does not match nodes.list.
func bigPolicy(i, size int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "forbid (principal, action == Action::\"compute:nodes:exec\", resource) when {\n  principal.name == \"p%d\"", i)
	for j := 0; b.Len() < size-160; j++ {
		fmt.Fprintf(&b, " ||\n  resource.labels has \"k%04d\" && resource.labels[\"k%04d\"] == \"v%d\"", j, j, i)
	}
	b.WriteString("\n};")
	return b.String()
}

// BenchmarkDecideWithManyPolicies: a nodes.list decision in a tenant with
// MaxPoliciesPerTenant policies of about MaxPolicyBytes. "before" is the
// old decision path (read every body, reuse parses by version, compose the
// set); the others are the cache without a bus (one version read a
// decision) and with one (no read within Recheck).
func BenchmarkDecideWithManyPolicies(b *testing.B) {
	db := pgtest.New(b)
	ctx := context.Background()
	if _, err := iam.CreateTenant(ctx, db, iam.Tenant{ID: "acme", ParentID: "root", Name: "acme"}); err != nil {
		b.Fatal(err)
	}
	if _, err := authz.PutPolicy(ctx, db, authz.Policy{TenantID: "root", Name: "admins", Body: `permit (principal, action, resource) when { principal.tenant == Tenant::"root" };`}); err != nil {
		b.Fatal(err)
	}
	if _, err := authz.PutPolicy(ctx, db, authz.Policy{TenantID: "acme", Name: "members", Body: `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`}); err != nil {
		b.Fatal(err)
	}
	for i := 1; i < authz.MaxPoliciesPerTenant; i++ {
		if _, err := authz.PutPolicy(ctx, db, authz.Policy{TenantID: "acme", Name: fmt.Sprintf("big-%03d", i), Body: bigPolicy(i, authz.MaxPolicyBytes)}); err != nil {
			b.Fatal(err)
		}
	}
	alice := iam.Principal{IdentityID: "idn_alice", TenantID: "acme", Kind: "user", Name: "alice"}
	res := authz.TenantResource("acme")
	run := func(b *testing.B, decide func() bool) {
		if !decide() {
			b.Fatal("denied")
		}
		b.ResetTimer()
		for range b.N {
			if !decide() {
				b.Fatal("denied")
			}
		}
	}
	b.Run("before", func(b *testing.B) {
		old := &oldAuthorizer{db: db, parsed: map[string]oldParsed{}}
		run(b, func() bool { return old.decide(b, alice, res) })
	})
	b.Run("cache-no-bus", func(b *testing.B) {
		az := authz.New(db)
		run(b, func() bool {
			d, err := az.Decide(ctx, nil, alice, authz.NodesList, res)
			return err == nil && d.Allowed
		})
	})
	b.Run("cache-bus", func(b *testing.B) {
		ns := natstest.New(b)
		nc, err := nats.Connect(ns.URL())
		if err != nil {
			b.Fatal(err)
		}
		defer nc.Close()
		az := authz.New(db)
		if err := az.Listen(nc); err != nil {
			b.Fatal(err)
		}
		defer az.Close()
		run(b, func() bool {
			d, err := az.Decide(ctx, nil, alice, authz.NodesList, res)
			return err == nil && d.Allowed
		})
	})
}

// oldAuthorizer is the decision path before the cache, kept to measure it.
type oldAuthorizer struct {
	db     *pgxpool.Pool
	parsed map[string]oldParsed
}

type oldParsed struct {
	version int64
	list    cedar.PolicyList
}

func (a *oldAuthorizer) decide(b *testing.B, p iam.Principal, res authz.Resource) bool {
	rows, err := a.db.Query(context.Background(), `SELECT tenant_id, name, version, body FROM policies WHERE tenant_id = ANY($1)`, iam.Ancestors(res.TenantID))
	if err != nil {
		b.Fatal(err)
	}
	ps := cedar.NewPolicySet()
	for rows.Next() {
		var tenant, name, body string
		var version int64
		if err := rows.Scan(&tenant, &name, &version, &body); err != nil {
			b.Fatal(err)
		}
		key := tenant + "/" + name
		pp, ok := a.parsed[key]
		if !ok || pp.version != version {
			list, err := authz.Parse(key, body)
			if err != nil {
				b.Fatal(err)
			}
			pp = oldParsed{version, list}
			a.parsed[key] = pp
		}
		for i, pol := range pp.list {
			ps.Add(cedar.PolicyID(fmt.Sprintf("%s#%d", key, i)), pol)
		}
	}
	if rows.Err() != nil {
		b.Fatal(rows.Err())
	}
	req := cedar.Request{
		Principal: cedar.NewEntityUID(authz.TypeIdentity, cedar.String(p.IdentityID)),
		Action:    cedar.NewEntityUID("Action", cedar.String(authz.NodesList)),
		Resource:  cedar.NewEntityUID(authz.TypeTenant, cedar.String(res.ID)),
		Context:   cedar.NewRecord(nil),
	}
	em := cedar.EntityMap{}
	for _, t := range []string{"root", "acme"} {
		uid := cedar.NewEntityUID(authz.TypeTenant, cedar.String(t))
		var parents []cedar.EntityUID
		if par := iam.Parent(t); par != "" {
			parents = append(parents, cedar.NewEntityUID(authz.TypeTenant, cedar.String(par)))
		}
		em[uid] = cedar.Entity{UID: uid, Parents: cedar.NewEntityUIDSet(parents...), Attributes: cedar.NewRecord(nil)}
	}
	pu := req.Principal
	em[pu] = cedar.Entity{UID: pu, Parents: cedar.NewEntityUIDSet(cedar.NewEntityUID(authz.TypeTenant, "acme")),
		Attributes: cedar.NewRecord(cedar.RecordMap{"tenant": cedar.NewEntityUID(authz.TypeTenant, "acme"), "kind": cedar.String(p.Kind), "name": cedar.String(p.Name)})}
	ok, _ := cedar.Authorize(ps, em, req)
	return ok == cedar.Allow
}
