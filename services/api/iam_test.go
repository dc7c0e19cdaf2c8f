package api_test

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/timestamppb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/services/api"
)

func TestAuthentication(t *testing.T) {
	t.Parallel()
	// Twelve failed authentications from one address on a stopped clock:
	// more than the default budget (TestBadKeyFromSharedAddressDoesNotLockOutValidKey).
	h := setup(t, api.Tuning{FailedAuthBurst: 100})
	sys := computev1.NewSystemServiceClient(h.conn)

	t.Run("a good key authenticates over REST and gRPC", func(t *testing.T) {
		code, body := h.rest(t, h.root, "system/whoAmI", `{}`)
		if code != http.StatusOK || body["tenantId"] != "root" || body["name"] != "root-admin" {
			t.Fatalf("REST whoAmI %d %v", code, body)
		}
		who, err := sys.WhoAmI(as(h.root), &computev1.WhoAmIRequest{})
		if err != nil || who.GetTenantId() != "root" {
			t.Fatalf("gRPC whoAmI %v %v", who, err)
		}
	})

	t.Run("bad credentials are UNAUTHENTICATED on authorization", func(t *testing.T) {
		wrongSecret := h.root[:len(h.root)-4] + "aaaa"
		if wrongSecret == h.root {
			wrongSecret = h.root[:len(h.root)-4] + "bbbb"
		}
		for name, tok := range map[string]string{
			"malformed":     "hello",
			"wrong prefix":  "bcx_" + h.root[4:],
			"unknown key":   "bck_aaaaaaaaaaaaaaaa." + strings.Repeat("a", 52),
			"wrong secret":  wrongSecret,
			"upper case id": strings.ToUpper(h.root),
		} {
			code, body := h.rest(t, tok, "system/whoAmI", `{}`)
			wantREST(t, code, body, fault.Unauthenticated, "authorization")
			_, err := sys.WhoAmI(as(tok), &computev1.WhoAmIRequest{})
			wantCode(t, err, fault.Unauthenticated, "authorization")
			_ = name
		}
		code, body := h.rest(t, "", "system/whoAmI", `{}`)
		wantREST(t, code, body, fault.Unauthenticated, "authorization")
		_, err := sys.WhoAmI(t.Context(), &computev1.WhoAmIRequest{})
		wantCode(t, err, fault.Unauthenticated, "authorization")
	})

	t.Run("anonymous methods need no credential", func(t *testing.T) {
		if code, body := h.rest(t, "", "system/version", `{}`); code != http.StatusOK {
			t.Fatalf("%d %v", code, body)
		}
	})
}

func TestRevokedKeyStopsWithinTheCacheBound(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	keys := computev1.NewApiKeysServiceClient(h.conn)
	sys := computev1.NewSystemServiceClient(h.conn)
	ident, tok := h.member(t, "acme", "ci")
	_ = ident
	h.policy(t, "acme", "members", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)

	if _, err := sys.WhoAmI(as(tok), &computev1.WhoAmIRequest{}); err != nil {
		t.Fatal(err) // cached now
	}
	id := strings.TrimPrefix(strings.Split(tok, ".")[0], "bck_")
	if _, err := keys.Revoke(as(h.root), &computev1.ApiKeysServiceRevokeRequest{TenantId: "acme", ApiKeyId: id}); err != nil {
		t.Fatal(err)
	}
	h.clock.Advance(29 * time.Second)
	if _, err := sys.WhoAmI(as(tok), &computev1.WhoAmIRequest{}); err != nil {
		t.Fatalf("inside the cache bound the key still works: %v", err)
	}
	h.clock.Advance(2 * time.Second)
	_, err := sys.WhoAmI(as(tok), &computev1.WhoAmIRequest{})
	wantCode(t, err, fault.Unauthenticated, "authorization")
	code, body := h.rest(t, tok, "system/whoAmI", `{}`)
	wantREST(t, code, body, fault.Unauthenticated, "authorization")
	if !strings.Contains(body["message"].(string), "revoked") {
		t.Fatalf("the message should say why: %v", body)
	}
}

func TestRevokedIdentityStopsWithinTheCacheBound(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	ident, tok := h.member(t, "acme", "ci")
	h.policy(t, "acme", "members", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)
	sys := computev1.NewSystemServiceClient(h.conn)
	if _, err := sys.WhoAmI(as(tok), &computev1.WhoAmIRequest{}); err != nil {
		t.Fatal(err)
	}
	if _, err := computev1.NewIdentitiesServiceClient(h.conn).Revoke(as(h.root), &computev1.IdentitiesServiceRevokeRequest{TenantId: "acme", IdentityId: ident}); err != nil {
		t.Fatal(err)
	}
	h.clock.Advance(31 * time.Second)
	_, err := sys.WhoAmI(as(tok), &computev1.WhoAmIRequest{})
	wantCode(t, err, fault.Unauthenticated, "authorization")
}

func TestExpiredKey(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	keys := computev1.NewApiKeysServiceClient(h.conn)
	sys := computev1.NewSystemServiceClient(h.conn)
	who, err := sys.WhoAmI(as(h.root), &computev1.WhoAmIRequest{})
	if err != nil {
		t.Fatal(err)
	}
	k, err := keys.Create(as(h.root), &computev1.ApiKeysServiceCreateRequest{
		TenantId: "root", IdentityId: who.GetIdentityId(), Name: "short", ExpireTime: timestamppb.New(h.clock.Now().Add(time.Hour)),
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sys.WhoAmI(as(k.GetSecret()), &computev1.WhoAmIRequest{}); err != nil {
		t.Fatalf("before expiry: %v", err)
	}
	h.clock.Advance(time.Hour)
	_, err = sys.WhoAmI(as(k.GetSecret()), &computev1.WhoAmIRequest{})
	wantCode(t, err, fault.Unauthenticated, "authorization")

	_, err = keys.Create(as(h.root), &computev1.ApiKeysServiceCreateRequest{
		TenantId: "root", IdentityId: who.GetIdentityId(), ExpireTime: timestamppb.New(h.clock.Now().Add(-time.Minute)),
	})
	wantCode(t, err, fault.InvalidInput, "expireTime")
}

func TestTenantPreCheckDeniesBeforeAnyQuery(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	_, tok := h.member(t, "acme", "ci")
	h.member(t, "other", "ci")
	h.policy(t, "acme", "members", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)
	pools := computev1.NewPoolsServiceClient(h.conn)
	if _, err := pools.List(as(tok), &computev1.PoolsServiceListRequest{TenantId: "acme"}); err != nil {
		t.Fatal(err) // authenticated and cached
	}

	before := h.queries.Load()
	_, err := pools.Create(as(tok), &computev1.PoolsServiceCreateRequest{TenantId: "other", Name: "p", Class: "gpu"})
	wantCode(t, err, fault.AccessDenied, "tenantId")
	_, err = pools.Get(as(tok), &computev1.PoolsServiceGetRequest{TenantId: "root", PoolId: "pool_x"})
	wantCode(t, err, fault.AccessDenied, "tenantId")
	code, body := h.rest(t, tok, "pools/list", `{"tenantId":"other"}`)
	wantREST(t, code, body, fault.AccessDenied, "tenantId")
	code, body = h.rest(t, tok, "tenants/create", `{"tenantId":"root","childTenantId":"mine"}`)
	wantREST(t, code, body, fault.AccessDenied, "tenantId")
	if n := h.queries.Load() - before; n != 0 {
		t.Fatalf("the pre-check ran %d statements; want none", n)
	}

	// A sub-tenant lies inside its parent: acme's member passes the pre-check
	// for acme.ml (its policies decide the rest).
	if _, err := computev1.NewTenantsServiceClient(h.conn).Create(as(tok), &computev1.TenantsServiceCreateRequest{TenantId: "acme", ChildTenantId: "acme.ml"}); err != nil {
		t.Fatal(err)
	}
	if _, err := pools.Create(as(tok), &computev1.PoolsServiceCreateRequest{TenantId: "acme.ml", Name: "p", Class: "gpu"}); err != nil {
		t.Fatal(err)
	}
	if h.queries.Load() == before {
		t.Fatal("the counter counts nothing: the proof above proves nothing")
	}
}

func TestPolicies(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	_, tok := h.member(t, "acme", "dev")
	pools := computev1.NewPoolsServiceClient(h.conn)
	create := func(name string, labels map[string]string) error {
		_, err := pools.Create(as(tok), &computev1.PoolsServiceCreateRequest{TenantId: "acme", Name: name, Class: "gpu", Labels: labels})
		return err
	}

	t.Run("no policy denies and audits the denial", func(t *testing.T) {
		wantCode(t, create("a", nil), fault.AccessDenied, "")
		if n := h.count(t, `SELECT count(*) FROM audit WHERE tenant_id = 'acme' AND decision = 'deny' AND action = 'compute:pools:create'`); n != 1 {
			t.Fatalf("deny rows = %d", n)
		}
		if n := h.count(t, `SELECT count(*) FROM authz_projection WHERE type = 'Pool'`); n != 0 {
			t.Fatalf("a denied create left %d draft rows", n)
		}
	})

	h.policy(t, "acme", "pools", `permit (principal in Tenant::"acme", action in [Action::"compute:pools:create", Action::"compute:pools:get", Action::"compute:pools:update"], resource in Tenant::"acme");`)

	t.Run("a permit allows", func(t *testing.T) {
		if err := create("a", map[string]string{"env": "dev"}); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("actions the permit does not name stay denied", func(t *testing.T) {
		_, err := pools.List(as(tok), &computev1.PoolsServiceListRequest{TenantId: "acme"})
		wantCode(t, err, fault.AccessDenied, "")
	})

	t.Run("a forbid overrides the permit on matching labels", func(t *testing.T) {
		h.policy(t, "acme", "no-prod", `forbid (principal, action == Action::"compute:pools:create", resource)
when { resource.labels has env && resource.labels.env == "prod" };`)
		wantCode(t, create("b", map[string]string{"env": "prod"}), fault.AccessDenied, "")
		if err := create("c", map[string]string{"env": "staging"}); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("an ancestor's forbid applies below it, even to root", func(t *testing.T) {
		h.policy(t, "root", "no-friday", `forbid (principal, action == Action::"compute:pools:create", resource in Tenant::"acme")
when { resource.labels has day && resource.labels.day == "friday" };`)
		wantCode(t, create("d", map[string]string{"day": "friday"}), fault.AccessDenied, "")
		_, err := pools.Create(as(h.root), &computev1.PoolsServiceCreateRequest{TenantId: "acme", Name: "d", Class: "gpu", Labels: map[string]string{"day": "friday"}})
		wantCode(t, err, fault.AccessDenied, "")
	})

	t.Run("deleting the permit denies again", func(t *testing.T) {
		if _, err := computev1.NewPoliciesServiceClient(h.conn).Delete(as(h.root), &computev1.PoliciesServiceDeleteRequest{TenantId: "acme", Name: "pools"}); err != nil {
			t.Fatal(err)
		}
		wantCode(t, create("e", nil), fault.AccessDenied, "")
	})

	t.Run("a bad policy is INVALID_INPUT with the parser's position", func(t *testing.T) {
		code, body := h.rest(t, h.root, "policies/put", `{"tenantId":"acme","name":"bad","body":"permit (principal, action, resource);\nforbid (principal, actoin, resource);"}`)
		wantREST(t, code, body, fault.InvalidInput, "body")
		if msg := body["message"].(string); !strings.Contains(msg, "line 2, column 26") {
			t.Fatalf("the message must give line and column: %s", msg)
		}
		_, err := computev1.NewPoliciesServiceClient(h.conn).Get(as(h.root), &computev1.PoliciesServiceGetRequest{TenantId: "acme", Name: "bad"})
		wantCode(t, err, fault.NotFound, "name")
	})

	t.Run("root's rights come from the bootstrap policy", func(t *testing.T) {
		pol := computev1.NewPoliciesServiceClient(h.conn)
		if _, err := pol.Delete(as(h.root), &computev1.PoliciesServiceDeleteRequest{TenantId: "root", Name: "root-admin"}); err != nil {
			t.Fatal(err)
		}
		_, err := pol.List(as(h.root), &computev1.PoliciesServiceListRequest{TenantId: "root"})
		wantCode(t, err, fault.AccessDenied, "")
	})
}

func TestMethodRegistry(t *testing.T) {
	t.Parallel()
	gs := grpc.NewServer()
	computev1.RegisterPoolsServiceServer(gs, computev1.UnimplementedPoolsServiceServer{})
	if err := api.CheckMethods(gs, api.Methods()); err != nil {
		t.Fatalf("the registry covers pools: %v", err)
	}

	t.Run("a method without an action fails the start", func(t *testing.T) {
		m := api.Methods()
		delete(m, computev1.PoolsService_Get_FullMethodName)
		err := api.CheckMethods(gs, m)
		if err == nil || !strings.Contains(err.Error(), "PoolsService/Get declares no action") {
			t.Fatalf("CheckMethods = %v", err)
		}
		_, err = api.New(api.Config{System: computev1.UnimplementedSystemServiceServer{}, Methods: m})
		if err == nil {
			t.Fatal("New started with a method lacking an action")
		}
	})

	t.Run("an action missing from the catalog fails the start", func(t *testing.T) {
		m := api.Methods()
		m[computev1.PoolsService_Get_FullMethodName] = api.Method{Action: "compute:pools:peek"}
		err := api.CheckMethods(gs, m)
		if err == nil || !strings.Contains(err.Error(), `"compute:pools:peek", which is missing from the catalog`) {
			t.Fatalf("CheckMethods = %v", err)
		}
	})

	t.Run("every registered action is in the catalog", func(t *testing.T) {
		for name, m := range api.Methods() {
			if !authz.Known(m.Action) {
				t.Errorf("%s: %s", name, m.Action)
			}
		}
	})
}

func TestRateLimit(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{RatePerSecond: 1, RateBurst: 2})
	sys := computev1.NewSystemServiceClient(h.conn)
	for i := range 2 {
		if _, err := sys.WhoAmI(as(h.root), &computev1.WhoAmIRequest{}); err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
	}
	_, err := sys.WhoAmI(as(h.root), &computev1.WhoAmIRequest{})
	wantCode(t, err, fault.RateLimited, "")
	code, body := h.rest(t, h.root, "system/whoAmI", `{}`)
	wantREST(t, code, body, fault.RateLimited, "")
	h.clock.Advance(time.Second)
	if _, err := sys.WhoAmI(as(h.root), &computev1.WhoAmIRequest{}); err != nil {
		t.Fatalf("after a second the bucket has a token again: %v", err)
	}
}

func TestBadInputChangesNothing(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	pools := computev1.NewPoolsServiceClient(h.conn)
	before := h.rows(t)

	rest := []struct {
		name, path, body string
		code             fault.Code
		field            string
	}{
		{"unknown field", "pools/create", `{"tenantId":"root","name":"p","class":"gpu","colour":"red"}`, fault.InvalidInput, "colour"},
		{"wrong type", "pools/create", `{"tenantId":"root","name":5,"class":"gpu"}`, fault.InvalidInput, "name"},
		{"wrong type in a map", "pools/create", `{"tenantId":"root","name":"p","class":"gpu","labels":{"a":1}}`, fault.InvalidInput, ""},
		{"missing name", "pools/create", `{"tenantId":"root","class":"gpu"}`, fault.InvalidInput, "name"},
		{"missing tenant", "pools/create", `{"name":"p","class":"gpu"}`, fault.InvalidInput, "tenantId"},
		{"bad tenant id", "pools/create", `{"tenantId":"Root!","name":"p","class":"gpu"}`, fault.InvalidInput, "tenantId"},
		{"bad class", "pools/create", `{"tenantId":"root","name":"p","class":"tpu"}`, fault.InvalidInput, "class"},
		{"bad label", "pools/create", `{"tenantId":"root","name":"p","class":"gpu","labels":{"a b":"c"}}`, fault.InvalidInput, "labels"},
		{"bad page token", "pools/list", `{"tenantId":"root","pageToken":"nope"}`, fault.InvalidInput, "pageToken"},
		{"bad page size", "pools/list", `{"tenantId":"root","pageSize":5000}`, fault.InvalidInput, "pageSize"},
		{"long idempotency key", "pools/create", `{"tenantId":"root","name":"p","class":"gpu","idempotencyKey":"` + strings.Repeat("k", 300) + `"}`, fault.InvalidInput, "idempotencyKey"},
		{"tenant id not under its parent", "tenants/create", `{"tenantId":"root","childTenantId":"a.b"}`, fault.InvalidInput, "childTenantId"},
		{"unknown method", "pools/delete", `{}`, fault.NotFound, ""},
		{"not JSON", "pools/create", `{"tenantId":`, fault.InvalidInput, ""},
	}
	for _, tc := range rest {
		t.Run("REST "+tc.name, func(t *testing.T) {
			code, body := h.rest(t, h.root, tc.path, tc.body)
			wantREST(t, code, body, tc.code, tc.field)
		})
	}

	t.Run("REST oversized body", func(t *testing.T) {
		big := fmt.Sprintf(`{"tenantId":"root","name":"p","class":"gpu","description":"%s"}`, strings.Repeat("x", api.MaxRequestBytes))
		code, raw := h.restRaw(t, h.root, "pools/create", []byte(big))
		if code != http.StatusBadRequest || !strings.Contains(string(raw), `"INVALID_INPUT"`) {
			t.Fatalf("%d %.300s", code, raw)
		}
	})

	t.Run("gRPC missing fields", func(t *testing.T) {
		_, err := pools.Create(as(h.root), &computev1.PoolsServiceCreateRequest{TenantId: "root", Class: "gpu"})
		wantCode(t, err, fault.InvalidInput, "name")
		_, err = pools.Update(as(h.root), &computev1.PoolsServiceUpdateRequest{TenantId: "root", PoolId: "pool_x"})
		wantCode(t, err, fault.InvalidInput, "updateMask")
	})

	t.Run("gRPC oversized message", func(t *testing.T) {
		_, err := pools.Create(as(h.root), &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "p", Class: "gpu", Description: strings.Repeat("x", api.MaxRequestBytes)})
		if c, _ := envelope(err); c != fault.InvalidInput {
			t.Fatalf("oversized: %v", err)
		}
	})

	t.Run("gRPC unknown method is UNSUPPORTED", func(t *testing.T) {
		err := h.conn.Invoke(as(h.root), "/bettercompute.compute.v1.PoolsService/Delete", &computev1.PoolsServiceGetRequest{}, &computev1.PoolsServiceGetResponse{})
		wantCode(t, err, fault.Unsupported, "")
	})

	t.Run("gRPC malformed key", func(t *testing.T) {
		_, err := pools.Create(as("bck_short.secret"), &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "p", Class: "gpu"})
		wantCode(t, err, fault.Unauthenticated, "authorization")
	})

	if after := h.rows(t); after != before {
		t.Fatalf("bad input changed rows (pools, audit, outbox, idempotency, projection): %v → %v", before, after)
	}
}
