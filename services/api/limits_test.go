package api_test

import (
	"strings"
	"testing"

	"google.golang.org/protobuf/types/known/structpb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/services/api"
)

// TestOversizedFieldsAreRefusedNamingTheField: a 3 MiB tenant name and a
// 3 MiB reboot reason were accepted. Every string field has a maximum now
// (one table, checked before any handler), at any depth — a command's
// payload included — and so has every list and map: over it is
// INVALID_INPUT naming the field, over gRPC and REST, and nothing is
// stored.
func TestOversizedFieldsAreRefusedNamingTheField(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	ctx := as(h.root)
	huge := strings.Repeat("x", 3<<20)

	_, err := computev1.NewTenantsServiceClient(h.conn).Create(ctx, &computev1.TenantsServiceCreateRequest{TenantId: "root", ChildTenantId: "big", Name: huge})
	wantCode(t, err, fault.InvalidInput, "name")
	code, body := h.rest(t, h.root, "tenants/create", `{"tenantId":"root","childTenantId":"big","name":"`+strings.Repeat("y", 2000)+`"}`)
	wantREST(t, code, body, fault.InvalidInput, "name")

	payload, _ := structpb.NewStruct(map[string]any{"reason": huge})
	_, err = computev1.NewCommandsServiceClient(h.conn).Run(ctx, &computev1.CommandsServiceRunRequest{
		TenantId: "root", NodeId: "node_x", Kind: "node.reboot", Payload: payload})
	wantCode(t, err, fault.InvalidInput, "payload.reason")

	ids := make([]string, 10001)
	for i := range ids {
		ids[i] = "node_a"
	}
	_, err = computev1.NewJoinTokensServiceClient(h.conn).Create(ctx, &computev1.JoinTokensServiceCreateRequest{TenantId: "root", PoolId: "pool_x", Reclaim: true, ReclaimNodeIds: ids})
	wantCode(t, err, fault.InvalidInput, "reclaimNodeIds")

	var tenants int
	if err := h.db.QueryRow(t.Context(), `SELECT count(*) FROM tenants WHERE length(name) > 1024`).Scan(&tenants); err != nil || tenants != 0 {
		t.Fatalf("%d oversized tenants stored (%v)", tenants, err)
	}
	// Within the bounds the same calls go through to their handlers.
	if _, err := computev1.NewTenantsServiceClient(h.conn).Create(ctx, &computev1.TenantsServiceCreateRequest{TenantId: "root", ChildTenantId: "fine", Name: "fine"}); err != nil {
		t.Fatalf("a normal tenant: %v", err)
	}
}
