package api_test

import (
	"fmt"
	"strings"
	"testing"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/services/api"
)

// TestPolicyLimits: policies.put refuses a body over authz.MaxPolicyBytes
// (INVALID_INPUT on body) and a new policy beyond authz.MaxPoliciesPerTenant
// (QUOTA_EXCEEDED on name), and a put or delete decides the next request at
// once (security review, issue 13, finding #7).
func TestPolicyLimits(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	_, key := h.member(t, "acme", "ci")
	pols := computev1.NewPoliciesServiceClient(h.conn)
	pools := computev1.NewPoolsServiceClient(h.conn)
	put := func(name, body string) error {
		_, err := pols.Put(as(h.root), &computev1.PoliciesServicePutRequest{TenantId: "acme", Name: name, Body: body})
		return err
	}

	big := `permit (principal, action, resource) when { principal.name == "` + strings.Repeat("x", authz.MaxPolicyBytes) + `" };`
	wantCode(t, put("big", big), fault.InvalidInput, "body")

	listPools := func() error {
		_, err := pools.List(as(key), &computev1.PoolsServiceListRequest{TenantId: "acme"})
		return err
	}
	wantCode(t, listPools(), fault.AccessDenied, "")
	if err := put("p000", `permit (principal in Tenant::"acme", action == Action::"compute:pools:list", resource in Tenant::"acme");`); err != nil {
		t.Fatal(err)
	}
	if err := listPools(); err != nil {
		t.Fatalf("the new policy decides the next request: %v", err)
	}
	for i := 1; i < authz.MaxPoliciesPerTenant; i++ {
		if err := put(fmt.Sprintf("p%03d", i), fmt.Sprintf(`permit (principal, action == Action::"compute:pools:get", resource) when { principal.name == "p%d" };`, i)); err != nil {
			t.Fatal(err)
		}
	}
	wantCode(t, put("one-more", `permit (principal, action == Action::"compute:pools:get", resource);`), fault.QuotaExceeded, "name")
	if err := put("p001", `forbid (principal, action == Action::"compute:pools:list", resource);`); err != nil {
		t.Fatalf("replacing a policy at the cap: %v", err)
	}
	wantCode(t, listPools(), fault.AccessDenied, "")
	if _, err := pols.Delete(as(h.root), &computev1.PoliciesServiceDeleteRequest{TenantId: "acme", Name: "p001"}); err != nil {
		t.Fatal(err)
	}
	if err := listPools(); err != nil {
		t.Fatalf("the delete decides the next request: %v", err)
	}
}
