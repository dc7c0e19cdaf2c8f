package api_test

import (
	"testing"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/services/api"
)

// TestApiKeysCreateForAnotherIdentityNeedsImpersonate: a helper whose
// only right is compute:api-keys:create on resource in Tenant::"acme" (no
// `when { context.self }`) used to mint a key for the tenant's admin and
// act as it. Now compute:api-keys:create is a key for oneself: a key for
// anybody else also needs compute:identities:impersonate on that identity
// (PERMISSION_DENIED otherwise, over gRPC and REST, with a deny audit row,
// no key minted). Granting impersonate on one service account lets the
// helper mint that account's keys, not the admin's; the admin, whose
// policy permits every action, still mints keys for anyone in the tenant.
func TestApiKeysCreateForAnotherIdentityNeedsImpersonate(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	keys := computev1.NewApiKeysServiceClient(h.conn)
	admin, adminTok := h.member(t, "acme", "admin")
	helper, helperTok := h.member(t, "acme", "helper")
	svc, _ := h.member(t, "acme", "ci-bot")
	h.policy(t, "acme", "admin", `permit (principal == Identity::"`+admin+`", action, resource in Tenant::"acme");`)
	h.policy(t, "acme", "helper", `permit (principal == Identity::"`+helper+`", action == Action::"compute:api-keys:create", resource in Tenant::"acme");`)

	own, err := keys.Create(as(helperTok), &computev1.ApiKeysServiceCreateRequest{TenantId: "acme", IdentityId: helper, Name: "mine"})
	if err != nil || own.GetApiKey().GetIdentityId() != helper || own.GetSecret() == "" {
		t.Fatalf("a key for oneself: %v %v", own, err)
	}
	before := h.count(t, `SELECT count(*) FROM api_keys WHERE identity_id = $1`, admin)
	_, err = keys.Create(as(helperTok), &computev1.ApiKeysServiceCreateRequest{TenantId: "acme", IdentityId: admin, Name: "stolen"})
	wantCode(t, err, fault.AccessDenied, "")
	code, body := h.rest(t, helperTok, "apiKeys/create", `{"tenantId":"acme","identityId":"`+admin+`","name":"stolen"}`)
	wantREST(t, code, body, fault.AccessDenied, "")
	if n := h.count(t, `SELECT count(*) FROM api_keys WHERE identity_id = $1`, admin); n != before {
		t.Fatalf("the denied calls minted %d keys for the admin", n-before)
	}
	if n := h.count(t, `SELECT count(*) FROM audit WHERE action = 'compute:identities:impersonate' AND decision = 'deny' AND actor = $1 AND resource = $2`,
		helper, `Identity::"`+admin+`"`); n != 2 {
		t.Fatalf("deny audit rows = %d, want 2", n)
	}
	// Nor for the service account, until a policy lets it act as that one.
	_, err = keys.Create(as(helperTok), &computev1.ApiKeysServiceCreateRequest{TenantId: "acme", IdentityId: svc, Name: "ci"})
	wantCode(t, err, fault.AccessDenied, "")
	h.policy(t, "acme", "helper-owns-ci", `permit (principal == Identity::"`+helper+`", action == Action::"compute:identities:impersonate", resource == Identity::"`+svc+`");`)
	if k, err := keys.Create(as(helperTok), &computev1.ApiKeysServiceCreateRequest{TenantId: "acme", IdentityId: svc, Name: "ci"}); err != nil || k.GetApiKey().GetIdentityId() != svc {
		t.Fatalf("the service account's owner: %v %v", k, err)
	}
	_, err = keys.Create(as(helperTok), &computev1.ApiKeysServiceCreateRequest{TenantId: "acme", IdentityId: admin, Name: "stolen"})
	wantCode(t, err, fault.AccessDenied, "")
	// The admin's policy permits every action, impersonate included.
	if k, err := keys.Create(as(adminTok), &computev1.ApiKeysServiceCreateRequest{TenantId: "acme", IdentityId: svc, Name: "by-admin"}); err != nil || k.GetSecret() == "" {
		t.Fatalf("the admin for the service account: %v %v", k, err)
	}
}
