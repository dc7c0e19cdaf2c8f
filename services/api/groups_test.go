package api_test

import (
	"fmt"
	"net/http"
	"slices"
	"testing"

	"google.golang.org/protobuf/types/known/fieldmaskpb"
	"google.golang.org/protobuf/types/known/structpb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/services/api"
)

func TestGroups(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	ctx := as(h.root)
	tenants := computev1.NewTenantsServiceClient(h.conn)
	idents := computev1.NewIdentitiesServiceClient(h.conn)
	keys := computev1.NewApiKeysServiceClient(h.conn)
	pols := computev1.NewPoliciesServiceClient(h.conn)
	pools := computev1.NewPoolsServiceClient(h.conn)
	auditLog := computev1.NewAuditServiceClient(h.conn)

	t.Run("tenants create, get and list in pages", func(t *testing.T) {
		for i := range 5 {
			if _, err := tenants.Create(ctx, &computev1.TenantsServiceCreateRequest{TenantId: "root", ChildTenantId: fmt.Sprintf("t%d", i), Labels: map[string]string{"n": fmt.Sprint(i)}}); err != nil {
				t.Fatal(err)
			}
		}
		_, err := tenants.Create(ctx, &computev1.TenantsServiceCreateRequest{TenantId: "root", ChildTenantId: "t0"})
		wantCode(t, err, fault.Conflict, "childTenantId")
		if _, err := tenants.Create(ctx, &computev1.TenantsServiceCreateRequest{TenantId: "t0", ChildTenantId: "t0.child", Name: "Child"}); err != nil {
			t.Fatal(err)
		}
		got, err := tenants.Get(ctx, &computev1.TenantsServiceGetRequest{TenantId: "t0.child"})
		if err != nil || got.GetTenant().GetParentId() != "t0" || got.GetTenant().GetName() != "Child" {
			t.Fatalf("get %v %v", got, err)
		}
		var seen []string
		tok := ""
		for {
			page, err := tenants.List(ctx, &computev1.TenantsServiceListRequest{TenantId: "root", PageSize: 2, PageToken: tok})
			if err != nil {
				t.Fatal(err)
			}
			for _, x := range page.GetTenants() {
				seen = append(seen, x.GetId())
			}
			if tok = page.GetNextPageToken(); tok == "" {
				break
			}
		}
		if fmt.Sprint(seen) != "[t0 t1 t2 t3 t4]" {
			t.Fatalf("paged children of root: %v", seen)
		}
	})

	var identID string
	t.Run("identities create, list and revoke", func(t *testing.T) {
		resp, err := idents.Create(ctx, &computev1.IdentitiesServiceCreateRequest{TenantId: "t1", Name: "deploy-bot", Kind: "service"})
		if err != nil {
			t.Fatal(err)
		}
		identID = resp.GetIdentity().GetId()
		_, err = idents.Create(ctx, &computev1.IdentitiesServiceCreateRequest{TenantId: "t1", Name: "deploy-bot"})
		wantCode(t, err, fault.Conflict, "name")
		_, err = idents.Create(ctx, &computev1.IdentitiesServiceCreateRequest{TenantId: "t1", Name: "x", Kind: "robot"})
		wantCode(t, err, fault.InvalidInput, "kind")
		list, err := idents.List(ctx, &computev1.IdentitiesServiceListRequest{TenantId: "t1"})
		if err != nil || len(list.GetIdentities()) != 1 || list.GetIdentities()[0].GetKind() != "service" {
			t.Fatalf("list %v %v", list, err)
		}
	})

	t.Run("apiKeys create shows the secret once; list and revoke", func(t *testing.T) {
		req := &computev1.ApiKeysServiceCreateRequest{TenantId: "t1", IdentityId: identID, Name: "ci", IdempotencyKey: "key-1"}
		first, err := keys.Create(ctx, req)
		if err != nil || first.GetSecret() == "" {
			t.Fatalf("create %v %v", first, err)
		}
		replay, err := keys.Create(ctx, req)
		if err != nil || replay.GetSecret() != "" || replay.GetApiKey().GetId() != first.GetApiKey().GetId() {
			t.Fatalf("a replay names the key without its secret: %v %v", replay, err)
		}
		var stored int
		if err := h.db.QueryRow(t.Context(), `SELECT count(*) FROM idempotency WHERE response::text LIKE '%' || $1 || '%'`, first.GetSecret()[20:]).Scan(&stored); err != nil || stored != 0 {
			t.Fatalf("the secret is stored: %d %v", stored, err)
		}
		list, err := keys.List(ctx, &computev1.ApiKeysServiceListRequest{TenantId: "t1", IdentityId: identID})
		if err != nil || len(list.GetApiKeys()) != 1 {
			t.Fatalf("list %v %v", list, err)
		}
		rev, err := keys.Revoke(ctx, &computev1.ApiKeysServiceRevokeRequest{TenantId: "t1", ApiKeyId: first.GetApiKey().GetId()})
		if err != nil || rev.GetApiKey().GetRevokeTime() == nil {
			t.Fatalf("revoke %v %v", rev, err)
		}
		_, err = keys.Revoke(ctx, &computev1.ApiKeysServiceRevokeRequest{TenantId: "t2", ApiKeyId: first.GetApiKey().GetId()})
		wantCode(t, err, fault.NotFound, "apiKeyId")
		rid, err := idents.Revoke(ctx, &computev1.IdentitiesServiceRevokeRequest{TenantId: "t1", IdentityId: identID})
		if err != nil || rid.GetIdentity().GetRevokeTime() == nil {
			t.Fatalf("revoke identity %v %v", rid, err)
		}
		_, err = keys.Create(ctx, &computev1.ApiKeysServiceCreateRequest{TenantId: "t1", IdentityId: identID})
		wantCode(t, err, fault.NotFound, "identityId")
	})

	t.Run("policies put, get, list and delete", func(t *testing.T) {
		p1, err := pols.Put(ctx, &computev1.PoliciesServicePutRequest{TenantId: "t2", Name: "readers", Body: `permit (principal in Tenant::"t2", action == Action::"compute:pools:get", resource);`})
		if err != nil || p1.GetPolicy().GetVersion() != 1 {
			t.Fatalf("put %v %v", p1, err)
		}
		p2, err := pols.Put(ctx, &computev1.PoliciesServicePutRequest{TenantId: "t2", Name: "readers", Body: `permit (principal in Tenant::"t2", action in [Action::"compute:pools:get", Action::"compute:pools:list"], resource);`})
		if err != nil || p2.GetPolicy().GetVersion() != 2 {
			t.Fatalf("second put %v %v", p2, err)
		}
		got, err := pols.Get(ctx, &computev1.PoliciesServiceGetRequest{TenantId: "t2", Name: "readers"})
		if err != nil || got.GetPolicy().GetBody() != p2.GetPolicy().GetBody() {
			t.Fatalf("get %v %v", got, err)
		}
		list, err := pols.List(ctx, &computev1.PoliciesServiceListRequest{TenantId: "t2"})
		if err != nil || len(list.GetPolicies()) != 1 {
			t.Fatalf("list %v %v", list, err)
		}
		if _, err := pols.Delete(ctx, &computev1.PoliciesServiceDeleteRequest{TenantId: "t2", Name: "readers"}); err != nil {
			t.Fatal(err)
		}
		_, err = pols.Delete(ctx, &computev1.PoliciesServiceDeleteRequest{TenantId: "t2", Name: "readers"})
		wantCode(t, err, fault.NotFound, "name")
	})

	t.Run("pools create, get, list by class and update", func(t *testing.T) {
		code, body := h.rest(t, h.root, "pools/create", `{"tenantId":"t3","name":"hosts","class":"vps-host","labels":{"zone":"a"}}`)
		if code != http.StatusOK {
			t.Fatalf("%d %v", code, body)
		}
		id := body["pool"].(map[string]any)["id"].(string)
		if _, err := pools.Create(ctx, &computev1.PoolsServiceCreateRequest{TenantId: "t3", Name: "gpus", Class: "gpu"}); err != nil {
			t.Fatal(err)
		}
		got, err := pools.Get(ctx, &computev1.PoolsServiceGetRequest{TenantId: "t3", PoolId: id})
		if err != nil || got.GetPool().GetClass() != "vps-host" || got.GetPool().GetLabels()["zone"] != "a" {
			t.Fatalf("get %v %v", got, err)
		}
		_, err = pools.Get(ctx, &computev1.PoolsServiceGetRequest{TenantId: "t4", PoolId: id})
		wantCode(t, err, fault.NotFound, "poolId")
		list, err := pools.List(ctx, &computev1.PoolsServiceListRequest{TenantId: "t3", Class: "gpu"})
		if err != nil || len(list.GetPools()) != 1 || list.GetPools()[0].GetName() != "gpus" {
			t.Fatalf("list %v %v", list, err)
		}
		up, err := pools.Update(ctx, &computev1.PoolsServiceUpdateRequest{
			TenantId: "t3", PoolId: id, Description: "hosts in zone b", Labels: map[string]string{"zone": "b"},
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"description", "labels"}},
		})
		if err != nil || up.GetPool().GetGeneration() != 2 || up.GetPool().GetLabels()["zone"] != "b" {
			t.Fatalf("update %v %v", up, err)
		}
		var labels string
		if err := h.db.QueryRow(t.Context(), `SELECT labels->>'zone' FROM authz_projection WHERE type = 'Pool' AND id = $1`, id).Scan(&labels); err != nil || labels != "b" {
			t.Fatalf("the projection follows the labels: %q %v", labels, err)
		}
		_, err = pools.Update(ctx, &computev1.PoolsServiceUpdateRequest{TenantId: "t3", PoolId: id, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"class"}}})
		wantCode(t, err, fault.InvalidInput, "updateMask")

		// Site and health settings: NodeSpec sections, validated.
		site, _ := structpb.NewStruct(map[string]any{"logLevel": "debug", "ntpServers": map[string]any{"values": []any{"ntp1"}}, "telemetryInterval": "30s"})
		up, err = pools.Update(ctx, &computev1.PoolsServiceUpdateRequest{TenantId: "t3", PoolId: id, Site: site,
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"site"}}})
		if err != nil || up.GetPool().GetGeneration() != 3 {
			t.Fatalf("update site %v %v", up, err)
		}
		var level string
		var every string
		if err := h.db.QueryRow(t.Context(), `SELECT site->>'logLevel', site->>'telemetryInterval' FROM pools WHERE id = $1`, id).Scan(&level, &every); err != nil || level != "debug" || every != "30s" {
			t.Fatalf("site stored %q %q %v", level, every, err)
		}
		bad, _ := structpb.NewStruct(map[string]any{"logLevl": "debug"})
		_, err = pools.Update(ctx, &computev1.PoolsServiceUpdateRequest{TenantId: "t3", PoolId: id, Site: bad,
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"site"}}})
		wantCode(t, err, fault.InvalidInput, "site")
		// What the node's daemon would refuse (proto/sitespec) is refused
		// here, naming the field: a second directive in a config file, a DNS server that
		// is no address, a log level the daemon does not know.
		for field, v := range map[string]any{
			"site.ntpServers":   map[string]any{"ntpServers": map[string]any{"values": []any{"ntp1 server evil"}}},
			"site.dnsServers":   map[string]any{"dnsServers": map[string]any{"values": []any{"resolver.example"}}},
			"site.logLevel":     map[string]any{"logLevel": "loud"},
			"site.otlpEndpoint": map[string]any{"otlpEndpoint": "collector.example"},
			"site.httpProxy":    map[string]any{"httpProxy": "socks5://proxy:1080"},
		} {
			st, _ := structpb.NewStruct(v.(map[string]any))
			_, err = pools.Update(ctx, &computev1.PoolsServiceUpdateRequest{TenantId: "t3", PoolId: id, Site: st,
				UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"site"}}})
			wantCode(t, err, fault.InvalidInput, field)
		}
		// The telemetry interval: 1 s to 1 h, as bcd takes it.
		for _, v := range []string{"0s", "0.500s", "3601s", "-10s"} {
			st, _ := structpb.NewStruct(map[string]any{"telemetryInterval": v})
			_, err = pools.Update(ctx, &computev1.PoolsServiceUpdateRequest{TenantId: "t3", PoolId: id, Site: st,
				UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"site"}}})
			wantCode(t, err, fault.InvalidInput, "site.telemetryInterval")
		}
		if err := h.db.QueryRow(t.Context(), `SELECT site->>'logLevel' FROM pools WHERE id = $1`, id).Scan(&level); err != nil || level != "debug" {
			t.Fatalf("site after refused updates %q %v, want it unchanged", level, err)
		}
		badHealth, _ := structpb.NewStruct(map[string]any{"checkInterval": 5})
		_, err = pools.Update(ctx, &computev1.PoolsServiceUpdateRequest{TenantId: "t3", PoolId: id, Health: badHealth,
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"health"}}})
		wantCode(t, err, fault.InvalidInput, "health")

		// Runtime settings: the engines to wire to CDI, the CDI
		// directories, a minimum toolkit version; the node's own rule
		// (proto/runtimespec) refuses what its daemon would, naming the
		// field.
		rt, _ := structpb.NewStruct(map[string]any{"engines": []any{"containerd", "docker"}, "cdiSpecDirs": []any{"/etc/cdi", "/var/run/cdi"}, "minContainerToolkitVersion": "1.14.0"})
		up, err = pools.Update(ctx, &computev1.PoolsServiceUpdateRequest{TenantId: "t3", PoolId: id, Runtime: rt,
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"runtime"}}})
		if err != nil || up.GetPool().GetGeneration() != 4 {
			t.Fatalf("update runtime %v %v", up, err)
		}
		var stored string
		if err := h.db.QueryRow(t.Context(), `SELECT runtime::text FROM pools WHERE id = $1`, id).Scan(&stored); err != nil ||
			stored != `{"engines": ["containerd", "docker"], "cdiSpecDirs": ["/etc/cdi", "/var/run/cdi"], "minContainerToolkitVersion": "1.14.0"}` {
			t.Fatalf("runtime stored %s %v", stored, err)
		}
		for _, c := range []struct {
			field string
			v     map[string]any
		}{
			{"runtime", map[string]any{"engine": []any{"containerd"}}},
			{"runtime.engines", map[string]any{"engines": []any{"lxc"}}},
			{"runtime.cdiSpecDirs", map[string]any{"cdiSpecDirs": []any{"var/run/cdi"}}},
			// bcd writes there as root: only the CDI directories.
			{"runtime.cdiSpecDirs", map[string]any{"cdiSpecDirs": []any{"/etc/cron.d"}}},
			{"runtime.minContainerToolkitVersion", map[string]any{"minContainerToolkitVersion": "latest"}},
		} {
			field := c.field
			st, _ := structpb.NewStruct(c.v)
			_, err = pools.Update(ctx, &computev1.PoolsServiceUpdateRequest{TenantId: "t3", PoolId: id, Runtime: st,
				UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"runtime"}}})
			wantCode(t, err, fault.InvalidInput, field)
		}
		if err := h.db.QueryRow(t.Context(), `SELECT runtime->'engines'->>1 FROM pools WHERE id = $1`, id).Scan(&stored); err != nil || stored != "docker" {
			t.Fatalf("runtime after refused updates %q %v, want it unchanged", stored, err)
		}
		// No runtime in the request clears the section.
		_, err = pools.Update(ctx, &computev1.PoolsServiceUpdateRequest{TenantId: "t3", PoolId: id,
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"runtime"}}})
		if err != nil {
			t.Fatal(err)
		}
		if err := h.db.QueryRow(t.Context(), `SELECT runtime::text FROM pools WHERE id = $1`, id).Scan(&stored); err != nil || stored != "{}" {
			t.Fatalf("runtime after clearing %s %v", stored, err)
		}

		// Acceptance checks: known command kinds, each once.
		up, err = pools.Update(ctx, &computev1.PoolsServiceUpdateRequest{TenantId: "t3", PoolId: id, Acceptance: []string{"diag.nvml"},
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"acceptance"}}})
		if err != nil || len(up.GetPool().GetAcceptance()) != 1 || up.GetPool().GetAcceptance()[0] != "diag.nvml" {
			t.Fatalf("update acceptance %v %v", up, err)
		}
		for _, bad := range [][]string{{"disk.wipe"}, {"diag.nvml", "diag.nvml"}} {
			_, err = pools.Update(ctx, &computev1.PoolsServiceUpdateRequest{TenantId: "t3", PoolId: id, Acceptance: bad,
				UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"acceptance"}}})
			wantCode(t, err, fault.InvalidInput, "acceptance")
		}
		_, err = pools.Create(ctx, &computev1.PoolsServiceCreateRequest{TenantId: "t3", Name: "checked", Class: "gpu", Acceptance: []string{"gpu.burn"}})
		wantCode(t, err, fault.InvalidInput, "acceptance")
		checked, err := pools.Create(ctx, &computev1.PoolsServiceCreateRequest{TenantId: "t3", Name: "checked", Class: "gpu", Acceptance: []string{"diag.nvml"}})
		if err != nil || checked.GetPool().GetAcceptance()[0] != "diag.nvml" {
			t.Fatalf("create with acceptance %v %v", checked, err)
		}
		up, err = pools.Update(ctx, &computev1.PoolsServiceUpdateRequest{TenantId: "t3", PoolId: id,
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"acceptance"}}})
		if err != nil || len(up.GetPool().GetAcceptance()) != 0 {
			t.Fatalf("clearing acceptance %v %v", up, err)
		}
	})

	t.Run("audit lists with filters and pages", func(t *testing.T) {
		all, err := auditLog.List(ctx, &computev1.AuditServiceListRequest{TenantId: "t3", Action: "compute:pools:create"})
		if err != nil || len(all.GetRecords()) != 3 { // hosts, gpus, checked
			t.Fatalf("filtered %v %v", all, err)
		}
		r := all.GetRecords()[0]
		if r.GetDecision() != "allow" || r.GetActorTenantId() != "root" || r.GetMethod() != computev1.PoolsService_Create_FullMethodName {
			t.Fatalf("record %v", r)
		}
		everything, err := auditLog.List(ctx, &computev1.AuditServiceListRequest{TenantId: "t3", PageSize: 1000})
		if err != nil || len(everything.GetRecords()) < 3 || everything.GetNextPageToken() != "" {
			t.Fatalf("all records %v %v", everything, err)
		}
		// Pages of two return every record once, in order, then no token.
		var paged []string
		token := ""
		for range 100 {
			page, err := auditLog.List(ctx, &computev1.AuditServiceListRequest{TenantId: "t3", PageSize: 2, PageToken: token})
			if err != nil || len(page.GetRecords()) > 2 {
				t.Fatalf("page %v %v", page, err)
			}
			for _, r := range page.GetRecords() {
				paged = append(paged, r.GetId())
			}
			if token = page.GetNextPageToken(); token == "" {
				break
			}
		}
		var want []string
		for _, r := range everything.GetRecords() {
			want = append(want, r.GetId())
		}
		if !slices.Equal(paged, want) {
			t.Fatalf("paged %v, want %v", paged, want)
		}
		_, err = auditLog.List(ctx, &computev1.AuditServiceListRequest{TenantId: "t3", Decision: "maybe"})
		wantCode(t, err, fault.InvalidInput, "decision")
	})
}
