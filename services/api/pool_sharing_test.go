package api_test

import (
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/fieldmaskpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/services/api"
)

// share makes root's pool shared with root's descendants, each child
// tenant getting defaultQuota GPUs unless a quota is set for it.
func (h *harness) share(t testing.TB, pool string, defaultQuota int32) {
	t.Helper()
	_, err := computev1.NewPoolsServiceClient(h.conn).Update(as(h.root), &computev1.PoolsServiceUpdateRequest{
		TenantId: "root", PoolId: pool, Sharing: "descendants", DefaultQuota: defaultQuota,
		UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"sharing", "default_quota"}},
	})
	if err != nil {
		t.Fatal(err)
	}
}

// acmeMember makes tenant acme with a member allowed everything in acme.
func (h *harness) acmeMember(t testing.TB) string {
	t.Helper()
	_, key := h.member(t, "acme", "ops")
	h.policy(t, "acme", "members", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)
	return key
}

// TestDescendantCannotBookAnUnsharedAncestorPool (security review,
// finding #8): a pool is its tenant's alone unless it is shared. A child
// tenant's create in root's unshared pool is refused as a pool it cannot
// see (NOT_FOUND on poolId, as another tenant's pool is), inline or with a
// future start, and books nothing; sharing the pool opens it.
func TestDescendantCannotBookAnUnsharedAncestorPool(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	pool := h.gpuPool(t, "unshared", 2, 8)
	key := h.acmeMember(t)
	c := computev1.NewReservationsServiceClient(h.conn)
	later := timestamppb.New(time.Now().Add(time.Hour))
	for _, req := range []*computev1.ReservationsServiceCreateRequest{
		{TenantId: "acme", PoolId: pool, GpuCount: 1},
		{TenantId: "acme", PoolId: pool, GpuCount: 16},
		{TenantId: "acme", PoolId: pool, GpuCount: 1, StartTime: later},
	} {
		_, err := c.Create(as(key), req)
		wantCode(t, err, fault.NotFound, "poolId")
		if !strings.Contains(err.Error(), `no pool "`+pool+`" that tenant acme can book`) {
			t.Fatalf("message %v", err)
		}
	}
	// The refusal reads as an unknown pool's: it does not tell acme that
	// root has such a pool.
	_, unknown := c.Create(as(key), &computev1.ReservationsServiceCreateRequest{TenantId: "acme", PoolId: "pool_nope", GpuCount: 1})
	wantCode(t, unknown, fault.NotFound, "poolId")
	if n := h.count(t, `SELECT count(*) FROM reservations`) + h.count(t, `SELECT count(*) FROM bookings`); n != 0 {
		t.Fatalf("refused creates left %d rows", n)
	}
	// Root itself books its pool.
	if _, err := c.Create(as(h.root), &computev1.ReservationsServiceCreateRequest{TenantId: "root", PoolId: pool, GpuCount: 2}); err != nil {
		t.Fatal(err)
	}
	// Shared, acme books; unshared again, acme's next create is refused
	// and what it holds stays.
	h.share(t, pool, 2)
	held, err := c.Create(as(key), &computev1.ReservationsServiceCreateRequest{TenantId: "acme", PoolId: pool, GpuCount: 2})
	if err != nil {
		t.Fatalf("in the shared pool: %v", err)
	}
	_, err = computev1.NewPoolsServiceClient(h.conn).Update(as(h.root), &computev1.PoolsServiceUpdateRequest{
		TenantId: "root", PoolId: pool, Sharing: "none", UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"sharing"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Create(as(key), &computev1.ReservationsServiceCreateRequest{TenantId: "acme", PoolId: pool, GpuCount: 1})
	wantCode(t, err, fault.NotFound, "poolId")
	got, err := c.Get(as(key), &computev1.ReservationsServiceGetRequest{TenantId: "acme", ReservationId: held.GetReservation().GetId()})
	if err != nil || got.GetReservation().GetState() != "placed" || len(got.GetReservation().GetBookings()) != 2 {
		t.Fatalf("after unsharing: %v %v", got, err)
	}
}

// TestSharedPoolGivesDescendantsOnlyTheDefaultQuota: in a shared pool, a
// child tenant without a quota of its own books at most the pool's default
// quota (QUOTA_EXCEEDED on gpuCount naming it; none when it is 0), and an
// explicit quota set for it overrides the default.
func TestSharedPoolGivesDescendantsOnlyTheDefaultQuota(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	pool := h.gpuPool(t, "shared", 2, 8)
	key := h.acmeMember(t)
	c := computev1.NewReservationsServiceClient(h.conn)
	create := func(n int32) error {
		_, err := c.Create(as(key), &computev1.ReservationsServiceCreateRequest{TenantId: "acme", PoolId: pool, GpuCount: n})
		return err
	}

	h.share(t, pool, 0)
	err := create(1)
	wantCode(t, err, fault.QuotaExceeded, "gpuCount")
	if !strings.Contains(err.Error(), "default quota is 0 GPUs") {
		t.Fatalf("message %v", err)
	}

	h.share(t, pool, 3)
	if err := create(2); err != nil {
		t.Fatalf("within the default quota: %v", err)
	}
	err = create(2)
	wantCode(t, err, fault.QuotaExceeded, "gpuCount")
	if !strings.Contains(err.Error(), "default quota applies: 3 GPUs for acme and its descendants; 2 in use, this reservation asks for 2 more") {
		t.Fatalf("message %v", err)
	}
	// A tenant acme makes below it shares acme's default.
	mlKey := func() string {
		_, k := h.member(t, "acme.ml", "ops")
		h.policy(t, "acme.ml", "members", `permit (principal in Tenant::"acme.ml", action, resource in Tenant::"acme.ml");`)
		return k
	}()
	_, err = c.Create(as(mlKey), &computev1.ReservationsServiceCreateRequest{TenantId: "acme.ml", PoolId: pool, GpuCount: 2})
	wantCode(t, err, fault.QuotaExceeded, "gpuCount")

	// An explicit quota overrides the default, up or down.
	caps := computev1.NewCapacityServiceClient(h.conn)
	if _, err := caps.SetQuota(as(h.root), &computev1.CapacityServiceSetQuotaRequest{TenantId: "root", PoolId: pool, ForTenantId: "acme", GpuLimit: 10}); err != nil {
		t.Fatal(err)
	}
	if err := create(8); err != nil {
		t.Fatalf("under the explicit quota: %v", err)
	}
	err = create(1)
	wantCode(t, err, fault.QuotaExceeded, "gpuCount")
	if !strings.Contains(err.Error(), "quota of tenant acme in pool "+pool+" is 10 GPUs; 10 in use") {
		t.Fatalf("message %v", err)
	}
	if n := h.count(t, `SELECT count(*) FROM bookings WHERE active AND tenant_id LIKE 'acme%'`); n != 10 {
		t.Fatalf("acme holds %d GPUs, want 10", n)
	}
}

// TestPoolSharingBadInput: bad sharing or default quotas on pools.create
// and pools.update are INVALID_INPUT naming the field; the pool shows
// what was set.
func TestPoolSharingBadInput(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	pools := computev1.NewPoolsServiceClient(h.conn)
	ctx := as(h.root)
	for _, tc := range []struct {
		req   *computev1.PoolsServiceCreateRequest
		field string
	}{
		{&computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "a", Class: "gpu", Sharing: "everyone"}, "sharing"},
		{&computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "a", Class: "gpu", Sharing: "Descendants"}, "sharing"},
		{&computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "a", Class: "gpu", DefaultQuota: -1}, "defaultQuota"},
		{&computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "a", Class: "gpu", DefaultQuota: 1<<20 + 1}, "defaultQuota"},
	} {
		_, err := pools.Create(ctx, tc.req)
		wantCode(t, err, fault.InvalidInput, tc.field)
	}
	p, err := pools.Create(ctx, &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "a", Class: "gpu"})
	if err != nil || p.GetPool().GetSharing() != "none" || p.GetPool().GetDefaultQuota() != 0 {
		t.Fatalf("default sharing: %v %v", p, err)
	}
	id := p.GetPool().GetId()
	for _, tc := range []struct {
		req   *computev1.PoolsServiceUpdateRequest
		field string
	}{
		{&computev1.PoolsServiceUpdateRequest{Sharing: "all", UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"sharing"}}}, "sharing"},
		{&computev1.PoolsServiceUpdateRequest{DefaultQuota: -5, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"default_quota"}}}, "defaultQuota"},
	} {
		tc.req.TenantId, tc.req.PoolId = "root", id
		_, err := pools.Update(ctx, tc.req)
		wantCode(t, err, fault.InvalidInput, tc.field)
	}
	s, err := pools.Create(ctx, &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "b", Class: "gpu", Sharing: "descendants", DefaultQuota: 4})
	if err != nil || s.GetPool().GetSharing() != "descendants" || s.GetPool().GetDefaultQuota() != 4 {
		t.Fatalf("shared pool: %v %v", s, err)
	}
	got, err := pools.Get(ctx, &computev1.PoolsServiceGetRequest{TenantId: "root", PoolId: s.GetPool().GetId()})
	if err != nil || got.GetPool().GetSharing() != "descendants" || got.GetPool().GetDefaultQuota() != 4 {
		t.Fatalf("get: %v %v", got, err)
	}
}
