package api_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/services/api"
)

// restH is rest that also returns the response's headers.
func (h *harness) restH(t testing.TB, path, body string) (int, http.Header, map[string]any) {
	t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, h.base+"/api/compute/"+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+h.root)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	var out map[string]any
	if err := json.Unmarshal(raw, &out); err != nil {
		t.Fatalf("POST %s: not JSON (%d): %s", path, resp.StatusCode, raw)
	}
	return resp.StatusCode, resp.Header, out
}

// metric reads one sample of the server's /metrics ("" when absent).
func (h *harness) metric(t testing.TB, sample string) string {
	t.Helper()
	resp, err := http.Get(h.admin + "/metrics") //nolint:noctx // a test's one scrape
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	raw, _ := io.ReadAll(resp.Body)
	for l := range bytes.Lines(raw) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(string(l)), sample+" "); ok {
			return v
		}
	}
	return ""
}

// TestRenamedRequestFields: every request field renamed from a bare id to
// <resource>_id answers to its new name over REST and gRPC, still answers
// to "id" over REST (with Deprecation: true, counted) until
// api.RenamedUntil, and refuses both names naming different resources,
// before the handler runs.
func TestRenamedRequestFields(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	// For each renamed method: its REST path, the new JSON name and what
	// else a body needs to get past the method's own checks to the lookup.
	// The resource does not exist, so the handler's lookup answers
	// NOT_FOUND naming the field: proof that the value reached the field the
	// handler reads.
	methods := []struct {
		path, field, extra string
	}{
		{"apiKeys/revoke", "apiKeyId", ``},
		{"identities/revoke", "identityId", ``},
		{"joinTokens/revoke", "joinTokenId", ``},
		{"nodes/get", "nodeId", ``},
		{"nodes/getSpec", "nodeId", ``},
		{"nodes/revoke", "nodeId", ``},
		{"nodes/update", "nodeId", `,"labels":{"a":"b"},"updateMask":"labels"`},
		{"pools/get", "poolId", ``},
		{"pools/update", "poolId", `,"description":"d","updateMask":"description"`},
		{"reservations/get", "reservationId", ``},
		{"reservations/release", "reservationId", ``},
		{"webhooks/get", "webhookId", ``},
		{"webhooks/update", "webhookId", `,"description":"d"`},
		{"webhooks/delete", "webhookId", ``},
		{"webhooks/rotateSecret", "webhookId", ``},
		{"webhooks/test", "webhookId", ``},
	}
	if len(methods)+1 != len(api.Renamed) { // +1: tenants.create, below
		t.Fatalf("%d methods here, %d renamed fields in api.Renamed: test each", len(methods)+1, len(api.Renamed))
	}
	for _, m := range methods {
		t.Run(m.path, func(t *testing.T) {
			t.Run("the new name", func(t *testing.T) {
				code, hdr, body := h.restH(t, m.path, `{"tenantId":"root","`+m.field+`":"x_nope"`+m.extra+`}`)
				wantREST(t, code, body, fault.NotFound, m.field)
				if hdr.Get("Deprecation") != "" {
					t.Fatalf("Deprecation %q on a request without deprecated names", hdr.Get("Deprecation"))
				}
			})
			t.Run("the old name, deprecated", func(t *testing.T) {
				code, hdr, body := h.restH(t, m.path, `{"tenantId":"root","id":"x_nope"`+m.extra+`}`)
				wantREST(t, code, body, fault.NotFound, m.field)
				if hdr.Get("Deprecation") != "true" {
					t.Fatalf("Deprecation %q, want true", hdr.Get("Deprecation"))
				}
			})
			t.Run("both names, the same value", func(t *testing.T) {
				code, _, body := h.restH(t, m.path, `{"tenantId":"root","id":"x_nope","`+m.field+`":"x_nope"`+m.extra+`}`)
				wantREST(t, code, body, fault.NotFound, m.field)
			})
			t.Run("both names, different values", func(t *testing.T) {
				code, _, body := h.restH(t, m.path, `{"tenantId":"root","id":"x_a","`+m.field+`":"x_b"`+m.extra+`}`)
				wantREST(t, code, body, fault.InvalidInput, m.field)
			})
			t.Run("neither", func(t *testing.T) {
				code, _, body := h.restH(t, m.path, `{"tenantId":"root"`+m.extra+`}`)
				if c, f := restErr(body); code/100 == 2 || f != m.field || (c != fault.InvalidInput && c != fault.NotFound) {
					t.Fatalf("got %d %v, want an error on %s", code, body, m.field)
				}
			})
		})
	}
	if got := h.metric(t, `bc_api_deprecated_fields_total{field="id",method="/bettercompute.compute.v1.NodesService/Get"}`); got != "2" {
		t.Fatalf("bc_api_deprecated_fields_total for nodes.get: %q, want 2 (old name alone, both names)", got)
	}

	t.Run("unknown fields are still unknown", func(t *testing.T) {
		code, _, body := h.restH(t, "nodes/get", `{"tenantId":"root","nodeID":"x"}`)
		wantREST(t, code, body, fault.InvalidInput, "nodeID")
		if !strings.Contains(body["message"].(string), "unknown field") {
			t.Fatalf("message %q", body["message"])
		}
	})
}

// TestNodesGetByNodeID is the example, `nodes.get nodeId=…`, with
// a real node: by nodeId over REST and gRPC, and by the deprecated id.
func TestNodesGetByNodeID(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	ctx := context.Background()
	p, err := computev1.NewPoolsServiceClient(h.conn).Create(as(h.root), &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "a", Class: "gpu"})
	if err != nil {
		t.Fatal(err)
	}
	pool := p.GetPool().GetId()
	fixture.Node(t, h.db, fixture.NodeOpts{ID: "node_x", Pool: pool, State: nodes.StateAdopted})
	if err := authz.Put(ctx, h.db, authz.Resource{Type: authz.TypeNode, ID: "node_x", TenantID: "root", PoolID: pool}); err != nil {
		t.Fatal(err)
	}
	nodeOf := func(t *testing.T, body map[string]any) string {
		t.Helper()
		n, _ := body["node"].(map[string]any)
		id, _ := n["id"].(string)
		return id
	}

	t.Run("REST, nodeId", func(t *testing.T) {
		code, hdr, body := h.restH(t, "nodes/get", `{"tenantId":"root","nodeId":"node_x"}`)
		if code != http.StatusOK || nodeOf(t, body) != "node_x" || hdr.Get("Deprecation") != "" {
			t.Fatalf("got %d %v %v", code, hdr, body)
		}
	})
	t.Run("REST, the proto name node_id", func(t *testing.T) {
		code, _, body := h.restH(t, "nodes/get", `{"tenantId":"root","node_id":"node_x"}`)
		if code != http.StatusOK || nodeOf(t, body) != "node_x" {
			t.Fatalf("got %d %v", code, body)
		}
	})
	t.Run("REST, the deprecated id", func(t *testing.T) {
		code, hdr, body := h.restH(t, "nodes/get", `{"tenantId":"root","id":"node_x"}`)
		if code != http.StatusOK || nodeOf(t, body) != "node_x" || hdr.Get("Deprecation") != "true" {
			t.Fatalf("got %d %v %v", code, hdr, body)
		}
	})
	t.Run("gRPC, node_id", func(t *testing.T) {
		var md metadata.MD
		got, err := computev1.NewNodesServiceClient(h.conn).Get(as(h.root), &computev1.NodesServiceGetRequest{TenantId: "root", NodeId: "node_x"}, grpc.Header(&md))
		if err != nil || got.GetNode().GetId() != "node_x" || len(md.Get(api.DeprecationHeader)) != 0 {
			t.Fatalf("got %v %v %v", got, err, md)
		}
	})
	t.Run("gRPC, the deprecated field still works and says so", func(t *testing.T) {
		var md metadata.MD
		got, err := computev1.NewNodesServiceClient(h.conn).Get(as(h.root), &computev1.NodesServiceGetRequest{TenantId: "root", Id: "node_x"}, grpc.Header(&md)) //nolint:staticcheck // the deprecated field, on purpose
		if err != nil || got.GetNode().GetId() != "node_x" || md.Get(api.DeprecationHeader)[0] != "true" {
			t.Fatalf("got %v %v %v", got, err, md)
		}
	})
	t.Run("gRPC, both, different", func(t *testing.T) {
		_, err := computev1.NewNodesServiceClient(h.conn).Get(as(h.root), &computev1.NodesServiceGetRequest{TenantId: "root", NodeId: "node_x", Id: "node_y"}) //nolint:staticcheck // the deprecated field, on purpose
		wantCode(t, err, fault.InvalidInput, "nodeId")
	})
	t.Run("pools.get by poolId and by id", func(t *testing.T) {
		for _, f := range []string{"poolId", "id"} {
			code, _, body := h.restH(t, "pools/get", `{"tenantId":"root","`+f+`":"`+pool+`"}`)
			if got, _ := body["pool"].(map[string]any); code != http.StatusOK || got["id"] != pool {
				t.Fatalf("%s: %d %v", f, code, body)
			}
		}
		got, err := computev1.NewPoolsServiceClient(h.conn).Get(as(h.root), &computev1.PoolsServiceGetRequest{TenantId: "root", PoolId: pool})
		if err != nil || got.GetPool().GetId() != pool {
			t.Fatalf("gRPC: %v %v", got, err)
		}
	})
}

// TestTenantsCreateChildTenantID: tenants.create names the new tenant
// childTenantId (tenantId is the parent, as in every request); id is
// accepted for one release.
func TestTenantsCreateChildTenantID(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	code, hdr, body := h.restH(t, "tenants/create", `{"tenantId":"root","childTenantId":"acme"}`)
	if got, _ := body["tenant"].(map[string]any); code != http.StatusOK || got["id"] != "acme" || got["parentId"] != "root" || hdr.Get("Deprecation") != "" {
		t.Fatalf("childTenantId: %d %v %v", code, hdr, body)
	}
	code, hdr, body = h.restH(t, "tenants/create", `{"tenantId":"acme","id":"acme.ml"}`)
	if got, _ := body["tenant"].(map[string]any); code != http.StatusOK || got["id"] != "acme.ml" || hdr.Get("Deprecation") != "true" {
		t.Fatalf("id: %d %v %v", code, hdr, body)
	}
	got, err := computev1.NewTenantsServiceClient(h.conn).Create(as(h.root), &computev1.TenantsServiceCreateRequest{TenantId: "acme", ChildTenantId: "acme.ops"})
	if err != nil || got.GetTenant().GetId() != "acme.ops" {
		t.Fatalf("gRPC: %v %v", got, err)
	}
	// A conflict or a bad id names the new field, whichever name was sent.
	code, _, body = h.restH(t, "tenants/create", `{"tenantId":"root","id":"acme"}`)
	wantREST(t, code, body, fault.Conflict, "childTenantId")
	code, _, body = h.restH(t, "tenants/create", `{"tenantId":"root","childTenantId":"a.b"}`)
	wantREST(t, code, body, fault.InvalidInput, "childTenantId")
	code, _, body = h.restH(t, "tenants/create", `{"tenantId":"root","id":"zed","childTenantId":"zee"}`)
	wantREST(t, code, body, fault.InvalidInput, "childTenantId")
	if n := h.count(t, `SELECT count(*) FROM tenants WHERE id IN ('zed', 'zee')`); n != 0 {
		t.Fatalf("a refused create made %d tenants", n)
	}
}
