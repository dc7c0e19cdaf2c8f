package authz_test

import (
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestDecide(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := t.Context()
	for _, id := range []string{"acme", "acme.ml"} {
		if _, err := iam.CreateTenant(ctx, db, iam.Tenant{ID: id, ParentID: iam.Parent(id), Name: id}); err != nil {
			t.Fatal(err)
		}
	}
	put := func(tenant, name, body string) {
		t.Helper()
		if _, err := authz.PutPolicy(ctx, db, authz.Policy{TenantID: tenant, Name: name, Body: body}); err != nil {
			t.Fatal(err)
		}
	}
	az := authz.New(db)
	alice := iam.Principal{IdentityID: "idn_alice", TenantID: "acme", Kind: "user", Name: "alice"}
	rootP := iam.Principal{IdentityID: "idn_root", TenantID: "root", Kind: "user", Name: "root-admin"}
	pool := authz.Resource{Type: authz.TypePool, ID: "pool_1", TenantID: "acme.ml", Labels: map[string]string{"env": "prod"}}
	allowed := func(p iam.Principal, a authz.Action, r authz.Resource) bool {
		t.Helper()
		d, err := az.Decide(ctx, nil, p, a, r)
		if err != nil {
			t.Fatal(err)
		}
		return d.Allowed
	}

	if allowed(alice, authz.PoolsGet, pool) || allowed(rootP, authz.PoolsGet, pool) {
		t.Fatal("no policy must deny")
	}
	put("root", "admins", `permit (principal, action, resource) when { principal.tenant == Tenant::"root" };`)
	if !allowed(rootP, authz.PoolsGet, pool) || allowed(alice, authz.PoolsGet, pool) {
		t.Fatal("root's policy is for root's own identities")
	}
	put("acme", "members", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)
	if !allowed(alice, authz.PoolsGet, pool) {
		t.Fatal("acme's policy covers acme.ml's resources")
	}
	put("acme.ml", "no-prod-exec", `forbid (principal, action == Action::"compute:nodes:exec", resource) when { resource.labels.env == "prod" };`)
	if allowed(alice, authz.NodesExec, pool) || allowed(rootP, authz.NodesExec, pool) || !allowed(alice, authz.PoolsGet, pool) {
		t.Fatal("the forbid denies exec only")
	}
	err := az.Authorize(ctx, nil, alice, authz.NodesExec, pool)
	if fe, ok := fault.As(err); !ok || fe.Code != fault.AccessDenied || !strings.Contains(fe.Message, `Pool::"pool_1"`) {
		t.Fatalf("Authorize = %v", err)
	}
	other := authz.Resource{Type: authz.TypePool, ID: "pool_2", TenantID: "root"}
	if allowed(alice, authz.PoolsGet, other) {
		t.Fatal("acme's policy does not reach root's resources")
	}
}

func TestParse(t *testing.T) {
	t.Parallel()
	_, err := authz.Parse("p", "permit (principal, action, resource);\npermit (principal action, resource);")
	fe, ok := fault.As(err)
	if !ok || fe.Code != fault.InvalidInput || fe.Field != "body" || !strings.Contains(fe.Message, "line 2, column") {
		t.Fatalf("Parse = %v", err)
	}
	if _, err := authz.Parse("p", "  "); fault.CodeOf(err) != fault.InvalidInput {
		t.Fatalf("empty: %v", err)
	}
	// Actions in a policy's scope must be in the catalog: a typo would make
	// a policy that silently never matches.
	for _, body := range []string{
		`permit (principal, action, resource);`,
		`permit (principal, action == Action::"compute:nodes:exec", resource);`,
		`permit (principal, action in [Action::"compute:nodes:get", Action::"compute:reservations:create"], resource);`,
	} {
		if _, err := authz.Parse("p", body); err != nil {
			t.Errorf("%s: %v", body, err)
		}
	}
	for _, body := range []string{
		`permit (principal, action == Action::"compute:nodes:exce", resource);`,
		`forbid (principal, action in [Action::"compute:nodes:get", Action::"compute:nodes:reboot"], resource);`,
		`permit (principal, action in Action::"compute:nodes", resource);`,
		`permit (principal, action == Tenant::"compute:nodes:exec", resource);`,
	} {
		_, err := authz.Parse("p", body)
		if fe, ok := fault.As(err); !ok || fe.Code != fault.InvalidInput || fe.Field != "body" || !strings.Contains(fe.Message, "not an action in the catalog") {
			t.Errorf("%s: %v; want INVALID_INPUT on body naming the unknown action", body, err)
		}
	}
	if err := authz.CheckKnown(authz.PoolsCreate, "compute:bogus"); err == nil || !strings.Contains(err.Error(), "compute:bogus") {
		t.Fatalf("CheckKnown = %v", err)
	}
}

func TestDecideOnTheTargetIdentity(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := t.Context()
	if _, err := iam.CreateTenant(ctx, db, iam.Tenant{ID: "acme", ParentID: "root", Name: "acme"}); err != nil {
		t.Fatal(err)
	}
	if _, err := authz.PutPolicy(ctx, db, authz.Policy{TenantID: "acme", Name: "self", Body: `
permit (principal in Tenant::"acme", action in [Action::"compute:api-keys:create", Action::"compute:api-keys:revoke", Action::"compute:identities:revoke"], resource in Tenant::"acme")
when { context.self && context.targetIdentity == principal };
permit (principal in Tenant::"acme", action == Action::"compute:api-keys:list", resource)
when { resource.identity.tenant == Tenant::"acme" };`}); err != nil {
		t.Fatal(err)
	}
	az := authz.New(db)
	ci := iam.Principal{IdentityID: "idn_ci", TenantID: "acme", Kind: "service", Name: "ci"}
	allowed := func(a authz.Action, r authz.Resource) bool {
		t.Helper()
		d, err := az.Decide(ctx, nil, ci, a, r)
		if err != nil {
			t.Fatal(err)
		}
		return d.Allowed
	}
	key := func(owner string) authz.Resource {
		return authz.Resource{Type: authz.TypeAPIKey, ID: "key_1", TenantID: "acme", Identity: owner}
	}
	ident := func(id string) authz.Resource {
		return authz.Resource{Type: authz.TypeIdentity, ID: id, TenantID: "acme"}
	}
	if !allowed(authz.APIKeysCreate, key("idn_ci")) || !allowed(authz.APIKeysRevoke, key("idn_ci")) || !allowed(authz.IdentitiesRevoke, ident("idn_ci")) {
		t.Fatal("a self-only policy allows acting on oneself")
	}
	if allowed(authz.APIKeysCreate, key("idn_admin")) || allowed(authz.APIKeysRevoke, key("idn_admin")) || allowed(authz.IdentitiesRevoke, ident("idn_admin")) {
		t.Fatal("a self-only policy denies acting on another identity")
	}
	if allowed(authz.APIKeysCreate, key("")) {
		t.Fatal("without a target, context.self is absent and the permit does not match")
	}
	if !allowed(authz.APIKeysList, key("idn_admin")) {
		t.Fatal("the key's resource carries its owner as attribute identity, in its tenant")
	}
}

func TestBreakGlass(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := t.Context()
	for _, id := range []string{"acme", "acme.ml"} {
		if _, err := iam.CreateTenant(ctx, db, iam.Tenant{ID: id, ParentID: iam.Parent(id), Name: id}); err != nil {
			t.Fatal(err)
		}
	}
	put := func(tenant, name, body string) {
		t.Helper()
		if _, err := authz.PutPolicy(ctx, db, authz.Policy{TenantID: tenant, Name: name, Body: body}); err != nil {
			t.Fatal(err)
		}
	}
	put("root", "admins", `permit (principal, action, resource) when { principal.tenant == Tenant::"root" };`)
	put("acme", "members", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)
	put("acme.ml", "lockout", `forbid (principal, action, resource);`)
	az := authz.New(db)
	rootP := iam.Principal{IdentityID: "idn_root", TenantID: "root"}
	alice := iam.Principal{IdentityID: "idn_alice", TenantID: "acme"}
	bob := iam.Principal{IdentityID: "idn_bob", TenantID: "acme.ml"}
	pol := authz.Resource{Type: authz.TypePolicy, ID: "acme.ml/lockout", TenantID: "acme.ml"}
	pool := authz.Resource{Type: authz.TypePool, ID: "pool_1", TenantID: "acme.ml"}
	allowed := func(p iam.Principal, a authz.Action, r authz.Resource) bool {
		t.Helper()
		d, err := az.Decide(ctx, nil, p, a, r)
		if err != nil {
			t.Fatal(err)
		}
		return d.Allowed
	}
	for _, p := range []iam.Principal{rootP, alice} {
		for _, a := range authz.BreakGlassActions() {
			if !allowed(p, a, pol) {
				t.Errorf("%s: %s on %s is break-glass", p.IdentityID, a, pol.UID())
			}
		}
		if allowed(p, authz.PoolsGet, pool) || allowed(p, authz.PoliciesPut, pol) {
			t.Errorf("%s: the child's forbid still denies what is not break-glass", p.IdentityID)
		}
	}
	if allowed(bob, authz.PoliciesDelete, pol) {
		t.Error("a member of the tenant itself is no ancestor: its own forbid applies")
	}
	// The caller's own tenant and its ancestors still decide: acme's forbid
	// binds acme's member.
	put("acme", "no-delete", `forbid (principal, action == Action::"compute:policies:delete", resource);`)
	if allowed(alice, authz.PoliciesDelete, pol) || !allowed(rootP, authz.PoliciesDelete, pol) {
		t.Error("an ancestor's own policies (and its ancestors') decide break-glass")
	}
	for _, a := range authz.BreakGlassActions() {
		if !authz.Known(a) {
			t.Errorf("break-glass %s is not in the catalog", a)
		}
	}
}
