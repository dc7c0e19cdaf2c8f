package cli

import (
	"encoding/json"
	"github.com/bettercompute/bettercompute/services/cli/serve"
	"strings"
	"testing"
)

// TestAPIRenamedFields: the api command sends what it is given; the renamed
// request fields answer to their new names (tenants.create childTenantId,
// nodes.get nodeId) and, for one release, to the old "id", with a warning
// on stderr naming the field and its replacement.
func TestAPIRenamedFields(t *testing.T) {
	t.Parallel()
	base, token, _, _ := startAuditServer(t)
	cfgFile := emptyClientConfig(t)
	call := func(t *testing.T, args ...string) (int, string, string) {
		t.Helper()
		return execCLI(t, "", append(append([]string{"api"}, args...), "--url", base, "--token", token, "--client-config", cfgFile)...)
	}

	t.Run("the new name, no warning", func(t *testing.T) {
		t.Parallel()
		code, out, stderr := call(t, "tenants.create", "tenantId=root", "childTenantId=acme")
		var got struct{ Tenant struct{ ID, ParentID string } }
		if code != serve.ExitOK || json.Unmarshal([]byte(out), &got) != nil || got.Tenant.ID != "acme" || got.Tenant.ParentID != "root" || stderr != "" {
			t.Fatalf("exit %d\n%s%s", code, out, stderr)
		}
	})
	t.Run("the old name works and warns", func(t *testing.T) {
		t.Parallel()
		code, out, stderr := call(t, "tenants.create", "tenantId=root", "id=beta")
		if code != serve.ExitOK || !strings.Contains(out, `"id": "beta"`) {
			t.Fatalf("exit %d\n%s%s", code, out, stderr)
		}
		if !strings.Contains(stderr, "warning: tenants.create: field id is deprecated") || !strings.Contains(stderr, "child_tenant_id") {
			t.Fatalf("stderr %q", stderr)
		}
	})
	t.Run("nodes.get nodeId= is a known field", func(t *testing.T) {
		t.Parallel()
		code, _, stderr := call(t, "nodes.get", "tenantId=root", "nodeId=node_nope")
		env, _ := splitEnvelope(t, stderr)
		if code != serve.ExitError || env.Code != "NOT_FOUND" || env.Field != "nodeId" || strings.Contains(stderr, "warning") {
			t.Fatalf("exit %d: %+v\n%s", code, env, stderr)
		}
	})
	t.Run("nodes.get id= is refused by lookup, with the warning", func(t *testing.T) {
		t.Parallel()
		code, _, stderr := call(t, "nodes.get", "tenantId=root", "id=node_nope")
		env, _ := splitEnvelope(t, stderr)
		if code != serve.ExitError || env.Code != "NOT_FOUND" || env.Field != "nodeId" || !strings.Contains(stderr, "warning: nodes.get: field id is deprecated") {
			t.Fatalf("exit %d: %+v\n%s", code, env, stderr)
		}
	})
}
