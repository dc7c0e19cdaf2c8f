package api_test

import (
	"strings"
	"testing"

	"google.golang.org/protobuf/types/known/fieldmaskpb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

const poolProviderToken = "pool-prov-tok-31d9a7-never-shown"

// TestInstancesProviderPool: pools.update "provider" stores the provider and
// its token as a secret, validated field by field; instances.create on the
// pool inserts the instance without a host and enqueues vps.provider, as
// stop, start and delete do; the token shows in no answer, log, event,
// audit or idempotency row. The api role alone runs here, so the work
// stays queued (services/vps tests the workflow).
func TestInstancesProviderPool(t *testing.T) {
	t.Parallel()
	h, logs := setupLogged(t, true)
	ctx := as(h.root)
	pc := computev1.NewPoolsServiceClient(h.conn)
	ic := computev1.NewInstancesServiceClient(h.conn)
	p, err := pc.Create(ctx, &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "prov", Class: "provider"})
	if err != nil {
		t.Fatal(err)
	}
	pool := p.GetPool().GetId()
	hosted, err := pc.Create(ctx, &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "hosted", Class: "vps-host"})
	if err != nil {
		t.Fatal(err)
	}
	update := func(poolID string, ps *computev1.ProviderSettings) error {
		_, err := pc.Update(ctx, &computev1.PoolsServiceUpdateRequest{TenantId: "root", PoolId: poolID,
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"provider"}}, Provider: ps})
		return err
	}
	create := func() (*computev1.Instance, error) {
		r, err := ic.Create(ctx, &computev1.InstancesServiceCreateRequest{TenantId: "root", PoolId: pool, Vcpus: 2, MemoryMib: 2048,
			DiskGib: 20, Image: "ubuntu-24.04"})
		return r.GetInstance(), err
	}

	t.Run("a provider pool without a provider refuses instances", func(t *testing.T) {
		_, err := create()
		wantCode(t, err, fault.InvalidInput, "poolId")
	})

	t.Run("bad provider settings name their field", func(t *testing.T) {
		for _, tc := range []struct {
			name  string
			pool  string
			ps    *computev1.ProviderSettings
			code  fault.Code
			field string
		}{
			{"no endpoint", pool, &computev1.ProviderSettings{Token: poolProviderToken}, fault.InvalidInput, "provider.endpoint"},
			{"plain http off loopback", pool, &computev1.ProviderSettings{Endpoint: "http://api.example.com", Token: poolProviderToken}, fault.InvalidInput, "provider.endpoint"},
			{"credentials in the url", pool, &computev1.ProviderSettings{Endpoint: "https://u:p@api.example.com", Token: poolProviderToken}, fault.InvalidInput, "provider.endpoint"},
			{"no token or reference", pool, &computev1.ProviderSettings{Endpoint: "https://api.example.com"}, fault.InvalidInput, "provider.token"},
			{"a token with a space", pool, &computev1.ProviderSettings{Endpoint: "https://api.example.com", Token: "a b"}, fault.InvalidInput, "provider.token"},
			{"token and reference", pool, &computev1.ProviderSettings{Endpoint: "https://api.example.com", Token: poolProviderToken, CredentialsRef: "sec_x"}, fault.InvalidInput, "provider.token"},
			{"a reference that is no secret id", pool, &computev1.ProviderSettings{Endpoint: "https://api.example.com", CredentialsRef: "x"}, fault.InvalidInput, "provider.credentialsRef"},
			{"a reference to no secret", pool, &computev1.ProviderSettings{Endpoint: "https://api.example.com", CredentialsRef: "sec_missing"}, fault.NotFound, "provider.credentialsRef"},
			{"a hosted pool", hosted.GetPool().GetId(), &computev1.ProviderSettings{Endpoint: "https://api.example.com", Token: poolProviderToken}, fault.InvalidInput, "provider"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				err := update(tc.pool, tc.ps)
				wantCode(t, err, tc.code, tc.field)
				if strings.Contains(err.Error(), poolProviderToken) {
					t.Fatalf("the error shows the token: %v", err)
				}
			})
		}
		if n := h.count(t, `SELECT count(*) FROM secrets`); n != 0 {
			t.Fatalf("%d secrets stored by refused updates", n)
		}
	})

	if err := update(pool, &computev1.ProviderSettings{Endpoint: "https://provider.example.com:9", Token: poolProviderToken}); err != nil {
		t.Fatal(err)
	}
	if n := h.count(t, `SELECT count(*) FROM secrets s JOIN provider_pool_settings p ON p.credentials_ref = s.id
		WHERE s.kind = 'provider' AND s.tenant_id = 'root' AND p.pool_id = $1 AND p.endpoint = 'https://provider.example.com:9'`, pool); n != 1 {
		t.Fatalf("%d provider secrets behind the pool, want 1", n)
	}
	var ref string
	if err := h.db.QueryRow(t.Context(), `SELECT credentials_ref FROM provider_pool_settings WHERE pool_id = $1`, pool).Scan(&ref); err != nil {
		t.Fatal(err)
	}
	t.Run("a reference to the tenant's provider secret is taken", func(t *testing.T) {
		if err := update(pool, &computev1.ProviderSettings{Endpoint: "https://api.example.com/v1", CredentialsRef: ref}); err != nil {
			t.Fatal(err)
		}
		if err := update(pool, &computev1.ProviderSettings{Endpoint: "https://provider.example.com:9", CredentialsRef: ref}); err != nil {
			t.Fatal(err)
		}
	})

	queued := func(id string) int {
		return h.count(t, `SELECT count(*) FROM work_queue WHERE kind = 'vps.provider' AND key = $1`, id)
	}
	in, err := create()
	if err != nil {
		t.Fatal(err)
	}
	if in.GetState() != "pending" || in.GetNodeId() != "" || in.GetPowerState() != "running" {
		t.Fatalf("created %+v, want pending on no host", in)
	}
	if queued(in.GetId()) != 1 {
		t.Fatal("instances.create did not enqueue vps.provider")
	}
	for _, step := range []struct {
		name  string
		call  func() (*computev1.Instance, error)
		state string
	}{
		{"stop", func() (*computev1.Instance, error) {
			r, err := ic.Stop(ctx, &computev1.InstancesServiceStopRequest{TenantId: "root", InstanceId: in.GetId()})
			return r.GetInstance(), err
		}, "pending"},
		{"start", func() (*computev1.Instance, error) {
			r, err := ic.Start(ctx, &computev1.InstancesServiceStartRequest{TenantId: "root", InstanceId: in.GetId()})
			return r.GetInstance(), err
		}, "pending"},
		{"delete", func() (*computev1.Instance, error) {
			r, err := ic.Delete(ctx, &computev1.InstancesServiceDeleteRequest{TenantId: "root", InstanceId: in.GetId()})
			return r.GetInstance(), err
		}, "deleting"},
	} {
		t.Run(step.name+" enqueues the workflow", func(t *testing.T) {
			if _, err := h.db.Exec(t.Context(), `DELETE FROM work_queue WHERE kind = 'vps.provider'`); err != nil {
				t.Fatal(err)
			}
			got, err := step.call()
			if err != nil {
				t.Fatal(err)
			}
			if got.GetState() != step.state || queued(in.GetId()) != 1 {
				t.Fatalf("%s: state %s, %d work rows", step.name, got.GetState(), queued(in.GetId()))
			}
		})
	}

	t.Run("the token shows nowhere", func(t *testing.T) {
		if strings.Contains(logs.String(), poolProviderToken) {
			t.Fatal("the token is in the logs")
		}
		for _, table := range []string{"outbox", "audit", "idempotency", "provider_pool_settings", "instances"} {
			if n := h.count(t, `SELECT count(*) FROM `+table+` x WHERE x::text LIKE '%' || $1 || '%'`, poolProviderToken); n != 0 {
				t.Fatalf("the token is in %d rows of %s", n, table)
			}
		}
		if n := h.count(t, `SELECT count(*) FROM outbox WHERE type = 'instance.created' AND resource_id = $1`, in.GetId()); n != 1 {
			t.Fatalf("%d instance.created events", n)
		}
	})
}
