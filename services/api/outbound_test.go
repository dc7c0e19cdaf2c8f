package api_test

import (
	"testing"

	"google.golang.org/protobuf/types/known/fieldmaskpb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/services/api"
)

// TestWebhookURLLoopbackSpelledOtherwiseOrPortOver65535RefusedAtCreate:
// webhooks.create used to store loopback written as hex, one decimal
// number, octal or shortened (the relay refused it only when dialling) and
// a port of 99999; each is refused at create, INVALID_INPUT on url.
func TestWebhookURLLoopbackSpelledOtherwiseOrPortOver65535RefusedAtCreate(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	for _, u := range []string{
		"https://0x7f000001/hook", "https://2130706433/hook", "https://0177.0.0.1/hook", "https://127.1/hook",
		"https://hooks.example.com:99999/hook", "https://[::ffff:7f00:1]/hook", "https://[64:ff9b:1::a00:1]/hook",
		"https://198.18.0.1/hook", "https://[2002:a9fe:a9fe::]/hook",
	} {
		code, body := h.rest(t, h.root, "webhooks/create", `{"tenantId":"root","url":"`+u+`","eventTypes":["*"]}`)
		wantREST(t, code, body, fault.InvalidInput, "url")
	}
	if n := h.count(t, `SELECT count(*) FROM webhooks`); n != 0 {
		t.Fatalf("%d webhooks stored", n)
	}
}

// TestProviderEndpointInternalAddressRefusedAtPoolsUpdate: the endpoints a
// tenant admin used to point the provider client at the control plane's
// own network — the metadata service, etcd on a private address, NATS
// monitoring and PostgreSQL on loopback, and other spellings of them — are
// refused by pools.update (INVALID_INPUT on provider.endpoint), and
// nothing is stored.
func TestProviderEndpointInternalAddressRefusedAtPoolsUpdate(t *testing.T) {
	t.Parallel()
	h, _ := setupLogged(t, true)
	ctx := as(h.root)
	pc := computev1.NewPoolsServiceClient(h.conn)
	p, err := pc.Create(ctx, &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "prov", Class: "provider"})
	if err != nil {
		t.Fatal(err)
	}
	for _, endpoint := range []string{
		"https://169.254.169.254/", "https://10.0.0.1:2379/", "http://127.0.0.1:8222/", "http://localhost:5432/",
		"https://127.0.0.1:8222/", "https://localhost:5432/", "https://[::1]/", "https://[fd00:ec2::254]/",
		"https://0xa9fea9fe/", "https://2852039166/", "https://100.100.100.200/", "https://api.example.com:99999/",
	} {
		_, err := pc.Update(ctx, &computev1.PoolsServiceUpdateRequest{TenantId: "root", PoolId: p.GetPool().GetId(),
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"provider"}},
			Provider:   &computev1.ProviderSettings{Endpoint: endpoint, Token: poolProviderToken}})
		wantCode(t, err, fault.InvalidInput, "provider.endpoint")
	}
	if n := h.count(t, `SELECT count(*) FROM provider_pool_settings`); n != 0 {
		t.Fatalf("%d provider settings stored", n)
	}
}
