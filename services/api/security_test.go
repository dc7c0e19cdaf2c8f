package api_test

import (
	"strings"
	"testing"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/services/api"
)

// Tests for the findings of the security review (issue 13); docs/security.md
// states the rules they hold.

// keyID returns the id of an API key token bck_<id>.<secret>.
func keyID(tok string) string { return strings.TrimPrefix(strings.Split(tok, ".")[0], "bck_") }

func TestAPIKeyCannotBeMintedForAnotherIdentity(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	keys := computev1.NewApiKeysServiceClient(h.conn)
	admin, _ := h.member(t, "acme", "admin")
	ci, ciTok := h.member(t, "acme", "ci")
	h.policy(t, "acme", "self-keys", `permit (principal in Tenant::"acme", action == Action::"compute:api-keys:create", resource in Tenant::"acme")
when { context.self };`)

	own, err := keys.Create(as(ciTok), &computev1.ApiKeysServiceCreateRequest{TenantId: "acme", IdentityId: ci, Name: "mine"})
	if err != nil || own.GetApiKey().GetIdentityId() != ci || own.GetSecret() == "" {
		t.Fatalf("a key for oneself: %v %v", own, err)
	}
	before := h.count(t, `SELECT count(*) FROM api_keys WHERE identity_id = $1`, admin)

	// The attack: mint a key for the tenant's admin, then act as it.
	_, err = keys.Create(as(ciTok), &computev1.ApiKeysServiceCreateRequest{TenantId: "acme", IdentityId: admin, Name: "stolen"})
	wantCode(t, err, fault.AccessDenied, "")
	code, body := h.rest(t, ciTok, "apiKeys/create", `{"tenantId":"acme","identityId":"`+admin+`","name":"stolen"}`)
	wantREST(t, code, body, fault.AccessDenied, "")
	if n := h.count(t, `SELECT count(*) FROM api_keys WHERE identity_id = $1`, admin); n != before {
		t.Fatalf("the denied calls minted %d keys for the admin", n-before)
	}
	if n := h.count(t, `SELECT count(*) FROM audit WHERE action IN ('compute:api-keys:create', 'compute:identities:impersonate') AND decision = 'deny' AND actor = $1`, ci); n != 2 {
		t.Fatalf("deny audit rows = %d, want 2", n)
	}
}

func TestIdentityRevokeIsDecidedOnTheTarget(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	idents := computev1.NewIdentitiesServiceClient(h.conn)
	admin, _ := h.member(t, "acme", "admin")
	ci, ciTok := h.member(t, "acme", "ci")
	h.policy(t, "acme", "self-revoke", `permit (principal in Tenant::"acme", action == Action::"compute:identities:revoke", resource in Tenant::"acme")
when { context.self };`)

	_, err := idents.Revoke(as(ciTok), &computev1.IdentitiesServiceRevokeRequest{TenantId: "acme", IdentityId: admin})
	wantCode(t, err, fault.AccessDenied, "")
	if n := h.count(t, `SELECT count(*) FROM identities WHERE id = $1 AND revoked_at IS NULL`, admin); n != 1 {
		t.Fatal("the denied call revoked the admin")
	}
	got, err := idents.Revoke(as(ciTok), &computev1.IdentitiesServiceRevokeRequest{TenantId: "acme", IdentityId: ci})
	if err != nil || got.GetIdentity().GetRevokeTime() == nil {
		t.Fatalf("revoking oneself: %v %v", got, err)
	}
}

func TestAPIKeyRevokeIsDecidedOnTheKeysOwner(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	keys := computev1.NewApiKeysServiceClient(h.conn)
	admin, adminTok := h.member(t, "acme", "admin")
	_, ciTok := h.member(t, "acme", "ci")
	h.policy(t, "acme", "admin", `permit (principal == Identity::"`+admin+`", action, resource in Tenant::"acme");`)
	// Nobody but the admin acts on the admin's keys: a forbid on the owner.
	h.policy(t, "acme", "keys", `permit (principal in Tenant::"acme", action == Action::"compute:api-keys:revoke", resource in Tenant::"acme");
forbid (principal, action == Action::"compute:api-keys:revoke", resource)
when { context.targetIdentity == Identity::"`+admin+`" } unless { context.self };`)

	_, err := keys.Revoke(as(ciTok), &computev1.ApiKeysServiceRevokeRequest{TenantId: "acme", ApiKeyId: keyID(adminTok)})
	wantCode(t, err, fault.AccessDenied, "")
	if _, err := computev1.NewSystemServiceClient(h.conn).WhoAmI(as(adminTok), &computev1.WhoAmIRequest{}); err != nil {
		t.Fatalf("the admin's key still works: %v", err)
	}
	if _, err := keys.Revoke(as(ciTok), &computev1.ApiKeysServiceRevokeRequest{TenantId: "acme", ApiKeyId: keyID(ciTok)}); err != nil {
		t.Fatalf("revoking one's own key: %v", err)
	}
	if _, err := keys.Revoke(as(adminTok), &computev1.ApiKeysServiceRevokeRequest{TenantId: "acme", ApiKeyId: keyID(adminTok)}); err != nil {
		t.Fatalf("the admin revokes its own key: %v", err)
	}
}

func TestChildTenantCannotForbidItsAncestorsBreakGlass(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	rootCtx := as(h.root)
	pols := computev1.NewPoliciesServiceClient(h.conn)
	pools := computev1.NewPoolsServiceClient(h.conn)
	ci, ciTok := h.member(t, "acme", "ci")
	h.policy(t, "acme", "members", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)
	h.policy(t, "acme", "lockout", `forbid (principal, action, resource);`)

	// The forbid works otherwise: root's pools.create in acme is denied, and
	// so is acme's own member's break-glass action in its own tenant.
	_, err := pools.Create(rootCtx, &computev1.PoolsServiceCreateRequest{TenantId: "acme", Name: "p", Class: "gpu"})
	wantCode(t, err, fault.AccessDenied, "")
	_, err = pols.Delete(as(ciTok), &computev1.PoliciesServiceDeleteRequest{TenantId: "acme", Name: "lockout"})
	wantCode(t, err, fault.AccessDenied, "")

	// Root still sees into acme and disarms it.
	if _, err := computev1.NewTenantsServiceClient(h.conn).Get(rootCtx, &computev1.TenantsServiceGetRequest{TenantId: "acme"}); err != nil {
		t.Fatalf("tenants.get: %v", err)
	}
	if _, err := pols.List(rootCtx, &computev1.PoliciesServiceListRequest{TenantId: "acme"}); err != nil {
		t.Fatalf("policies.list: %v", err)
	}
	if _, err := pols.Get(rootCtx, &computev1.PoliciesServiceGetRequest{TenantId: "acme", Name: "lockout"}); err != nil {
		t.Fatalf("policies.get: %v", err)
	}
	if _, err := computev1.NewIdentitiesServiceClient(h.conn).List(rootCtx, &computev1.IdentitiesServiceListRequest{TenantId: "acme"}); err != nil {
		t.Fatalf("identities.list: %v", err)
	}
	if _, err := computev1.NewApiKeysServiceClient(h.conn).Revoke(rootCtx, &computev1.ApiKeysServiceRevokeRequest{TenantId: "acme", ApiKeyId: keyID(ciTok)}); err != nil {
		t.Fatalf("apiKeys.revoke: %v", err)
	}
	if _, err := computev1.NewIdentitiesServiceClient(h.conn).Revoke(rootCtx, &computev1.IdentitiesServiceRevokeRequest{TenantId: "acme", IdentityId: ci}); err != nil {
		t.Fatalf("identities.revoke: %v", err)
	}
	if _, err := pols.Delete(rootCtx, &computev1.PoliciesServiceDeleteRequest{TenantId: "acme", Name: "lockout"}); err != nil {
		t.Fatalf("policies.delete: %v", err)
	}
	if _, err := pools.Create(rootCtx, &computev1.PoolsServiceCreateRequest{TenantId: "acme", Name: "p", Class: "gpu"}); err != nil {
		t.Fatalf("with the forbid gone, root creates again: %v", err)
	}
}

func TestIdempotentReplayIsAuthorizedAgain(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	pools := computev1.NewPoolsServiceClient(h.conn)
	dev, tok := h.member(t, "acme", "dev")
	const permit = `permit (principal in Tenant::"acme", action == Action::"compute:pools:create", resource in Tenant::"acme");`
	h.policy(t, "acme", "pools", permit)
	req := &computev1.PoolsServiceCreateRequest{TenantId: "acme", Name: "gpus", Class: "gpu", IdempotencyKey: "k1"}
	first, err := pools.Create(as(tok), req)
	if err != nil {
		t.Fatal(err)
	}

	// The permission is revoked; a replay under the key gets the denial, not
	// the stored result.
	if _, err := computev1.NewPoliciesServiceClient(h.conn).Delete(as(h.root), &computev1.PoliciesServiceDeleteRequest{TenantId: "acme", Name: "pools"}); err != nil {
		t.Fatal(err)
	}
	again, err := pools.Create(as(tok), req)
	wantCode(t, err, fault.AccessDenied, "")
	if again.GetPool() != nil {
		t.Fatalf("a denied replay returned %v", again)
	}
	if n := h.count(t, `SELECT count(*) FROM audit WHERE action = 'compute:pools:create' AND decision = 'deny' AND actor = $1`, dev); n != 1 {
		t.Fatalf("deny audit rows = %d, want 1", n)
	}

	// Permitted again, the key replays the one stored result.
	h.policy(t, "acme", "pools", permit)
	again, err = pools.Create(as(tok), req)
	if err != nil || again.GetPool().GetId() != first.GetPool().GetId() {
		t.Fatalf("replay %v %v, first %v", again, err, first)
	}
	if n := h.count(t, `SELECT count(*) FROM pools`); n != 1 {
		t.Fatalf("pools = %d, want 1", n)
	}
}
