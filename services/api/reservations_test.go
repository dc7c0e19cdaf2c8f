package api_test

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/api"
)

// gpuPool creates a gpu pool of the root tenant with nodes adopted,
// schedulable and live, each with gpus H200s, and returns its id.
func (h *harness) gpuPool(t testing.TB, name string, nodes, gpus int) string {
	t.Helper()
	p, err := computev1.NewPoolsServiceClient(h.conn).Create(as(h.root), &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: name, Class: "gpu"})
	if err != nil {
		t.Fatal(err)
	}
	for i := range nodes {
		h.node(t, p.GetPool().GetId(), fmt.Sprintf("node_%s_%02d", name, i), 1, gpus)
	}
	return p.GetPool().GetId()
}

// node adds node id, adopted and seen now, to pool with gpus H200s: live
// when observed is 1, or never having applied its desired state when 0.
func (h *harness) node(t testing.TB, pool, id string, observed int64, gpus int) {
	t.Helper()
	fixture.Node(t, h.db, fixture.NodeOpts{ID: id, Pool: pool, State: nodes.StateAdopted, Live: observed >= 1, Gateway: "gw-1", GPUs: gpus})
}

func TestReservationsCreate(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	pool := h.gpuPool(t, "h200", 2, 8)
	c := computev1.NewReservationsServiceClient(h.conn)
	ctx := as(h.root)

	t.Run("bad input gets INVALID_INPUT or NOT_FOUND naming the field", func(t *testing.T) {
		past := timestamppb.New(time.Now().Add(-time.Hour))
		for _, tc := range []struct {
			name  string
			req   *computev1.ReservationsServiceCreateRequest
			code  fault.Code
			field string
		}{
			{"no pool", &computev1.ReservationsServiceCreateRequest{TenantId: "root", GpuCount: 1}, fault.InvalidInput, "poolId"},
			{"zero GPUs", &computev1.ReservationsServiceCreateRequest{TenantId: "root", PoolId: pool}, fault.InvalidInput, "gpuCount"},
			{"too many GPUs", &computev1.ReservationsServiceCreateRequest{TenantId: "root", PoolId: pool, GpuCount: 1025}, fault.InvalidInput, "gpuCount"},
			{"negative memory", &computev1.ReservationsServiceCreateRequest{TenantId: "root", PoolId: pool, GpuCount: 1,
				Constraints: &computev1.Constraints{MinMemoryBytes: -1}}, fault.InvalidInput, "constraints.minMemoryBytes"},
			{"bad label", &computev1.ReservationsServiceCreateRequest{TenantId: "root", PoolId: pool, GpuCount: 1,
				Constraints: &computev1.Constraints{NodeLabels: map[string]string{"bad key!": "x"}}}, fault.InvalidInput, "constraints.nodeLabels"},
			{"end in the past", &computev1.ReservationsServiceCreateRequest{TenantId: "root", PoolId: pool, GpuCount: 1, EndTime: past}, fault.InvalidInput, "endTime"},
			{"unknown pool", &computev1.ReservationsServiceCreateRequest{TenantId: "root", PoolId: "pool_nope", GpuCount: 1}, fault.NotFound, "poolId"},
		} {
			_, err := c.Create(ctx, tc.req)
			wantCode(t, err, tc.code, tc.field)
		}
	})

	var first *computev1.Reservation
	t.Run("places inline and the nodes' desired state exposes the GPUs", func(t *testing.T) {
		resp, err := c.Create(ctx, &computev1.ReservationsServiceCreateRequest{TenantId: "root", PoolId: pool, GpuCount: 3, IdempotencyKey: "k1"})
		if err != nil {
			t.Fatal(err)
		}
		first = resp.GetReservation()
		if first.GetState() != "placed" || len(first.GetBookings()) != 3 || !strings.HasPrefix(first.GetId(), "rsv_") {
			t.Fatalf("reservation %v", first)
		}
		node := first.GetBookings()[0].GetNodeId()
		poll.Until(t, 30*time.Second, "the node's spec to expose the reservation", func() bool {
			return h.count(t, `SELECT count(*) FROM nodes WHERE id = $1 AND spec->'devices'->'assignments' @> $2::jsonb`,
				node, fmt.Sprintf(`[{"reservationId": %q}]`, first.GetId())) == 1
		})
		if n := h.count(t, `SELECT count(*) FROM audit WHERE resource = $1`, `Reservation::"`+first.GetId()+`"`); n != 1 {
			t.Fatalf("%d audit rows", n)
		}
		if n := h.count(t, `SELECT count(*) FROM outbox WHERE type = 'reservation.placed'`); n != 1 {
			t.Fatalf("%d outbox rows", n)
		}
	})
	t.Run("a replay returns the same reservation; another request under the key is CONFLICT", func(t *testing.T) {
		resp, err := c.Create(ctx, &computev1.ReservationsServiceCreateRequest{TenantId: "root", PoolId: pool, GpuCount: 3, IdempotencyKey: "k1"})
		if err != nil || resp.GetReservation().GetId() != first.GetId() {
			t.Fatalf("replay: %v %v", resp, err)
		}
		_, err = c.Create(ctx, &computev1.ReservationsServiceCreateRequest{TenantId: "root", PoolId: pool, GpuCount: 4, IdempotencyKey: "k1"})
		wantCode(t, err, fault.Conflict, "idempotencyKey")
		if n := h.count(t, `SELECT count(*) FROM bookings WHERE active`); n != 3 {
			t.Fatalf("%d active bookings after the replay", n)
		}
	})
	t.Run("no capacity is NO_CAPACITY saying what was missing", func(t *testing.T) {
		_, err := c.Create(ctx, &computev1.ReservationsServiceCreateRequest{TenantId: "root", PoolId: pool, GpuCount: 8,
			Constraints: &computev1.Constraints{SameNode: true}})
		// One node has 5 free (3 booked), the other 8: 8 on one node fits.
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.Create(ctx, &computev1.ReservationsServiceCreateRequest{TenantId: "root", PoolId: pool, GpuCount: 6,
			Constraints: &computev1.Constraints{SameNode: true}})
		wantCode(t, err, fault.NoCapacity, "gpuCount")
		if !strings.Contains(err.Error(), "need 6 × GPU on one node; the best node has 5 free") {
			t.Fatalf("message: %v", err)
		}
	})
	t.Run("quota is QUOTA_EXCEEDED naming the limit", func(t *testing.T) {
		g := computev1.NewCapacityServiceClient(h.conn)
		if _, err := g.SetQuota(ctx, &computev1.CapacityServiceSetQuotaRequest{TenantId: "root", PoolId: pool, ForTenantId: "root", GpuLimit: 12}); err != nil {
			t.Fatal(err)
		}
		_, err := g.SetQuota(ctx, &computev1.CapacityServiceSetQuotaRequest{TenantId: "root", PoolId: pool, ForTenantId: "root", GpuLimit: -2})
		wantCode(t, err, fault.InvalidInput, "gpuLimit")
		_, err = c.Create(ctx, &computev1.ReservationsServiceCreateRequest{TenantId: "root", PoolId: pool, GpuCount: 2})
		wantCode(t, err, fault.QuotaExceeded, "gpuCount")
		if !strings.Contains(err.Error(), "is 12 GPUs; 11 in use") {
			t.Fatalf("message: %v", err)
		}
		qs, err := g.ListQuotas(ctx, &computev1.CapacityServiceListQuotasRequest{TenantId: "root", PoolId: pool})
		if err != nil || len(qs.GetQuotas()) != 1 || qs.GetQuotas()[0].GetGpuLimit() != 12 {
			t.Fatalf("quotas %v %v", qs, err)
		}
		if _, err := g.SetQuota(ctx, &computev1.CapacityServiceSetQuotaRequest{TenantId: "root", PoolId: pool, ForTenantId: "root", GpuLimit: -1}); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Create(ctx, &computev1.ReservationsServiceCreateRequest{TenantId: "root", PoolId: pool, GpuCount: 2}); err != nil {
			t.Fatalf("after removing the quota: %v", err)
		}
	})
	t.Run("release frees the GPUs and withdraws them from the node", func(t *testing.T) {
		resp, err := c.Release(ctx, &computev1.ReservationsServiceReleaseRequest{TenantId: "root", ReservationId: first.GetId()})
		if err != nil {
			t.Fatal(err)
		}
		r := resp.GetReservation()
		if r.GetState() != "released" || r.GetFinishTime() == nil || len(r.GetBookings()) != 3 {
			t.Fatalf("released %v", r)
		}
		again, err := c.Release(ctx, &computev1.ReservationsServiceReleaseRequest{TenantId: "root", ReservationId: first.GetId()})
		if err != nil || again.GetReservation().GetState() != "released" || !again.GetReservation().GetFinishTime().AsTime().Equal(r.GetFinishTime().AsTime()) {
			t.Fatalf("second release changed it: %v %v", again, err)
		}
		poll.Until(t, 30*time.Second, "the node's spec to withdraw the reservation", func() bool {
			return h.count(t, `SELECT count(*) FROM nodes WHERE spec::text LIKE '%' || $1 || '%'`, first.GetId()) == 0
		})
		_, err = c.Release(ctx, &computev1.ReservationsServiceReleaseRequest{TenantId: "root", ReservationId: "rsv_nope"})
		wantCode(t, err, fault.NotFound, "reservationId")
	})
	t.Run("a future start stays pending and says why; list is newest first", func(t *testing.T) {
		start := time.Now().Add(time.Hour)
		resp, err := c.Create(ctx, &computev1.ReservationsServiceCreateRequest{TenantId: "root", PoolId: pool, GpuCount: 1,
			StartTime: timestamppb.New(start), EndTime: timestamppb.New(start.Add(time.Hour))})
		if err != nil {
			t.Fatal(err)
		}
		got, err := c.Get(ctx, &computev1.ReservationsServiceGetRequest{TenantId: "root", ReservationId: resp.GetReservation().GetId()})
		if err != nil || got.GetReservation().GetState() != "pending" || !strings.Contains(got.GetReservation().GetReason(), "starts at") {
			t.Fatalf("pending %v %v", got, err)
		}
		list, err := c.List(ctx, &computev1.ReservationsServiceListRequest{TenantId: "root", PageSize: 2})
		if err != nil || len(list.GetReservations()) != 2 || list.GetReservations()[0].GetId() != resp.GetReservation().GetId() || list.GetNextPageToken() == "" {
			t.Fatalf("list %v %v", list, err)
		}
		next, err := c.List(ctx, &computev1.ReservationsServiceListRequest{TenantId: "root", PageSize: 2, PageToken: list.GetNextPageToken()})
		if err != nil || len(next.GetReservations()) != 2 || next.GetReservations()[0].GetId() == list.GetReservations()[1].GetId() {
			t.Fatalf("second page %v %v", next, err)
		}
		_, err = c.List(ctx, &computev1.ReservationsServiceListRequest{TenantId: "root", State: "nope"})
		wantCode(t, err, fault.InvalidInput, "state")
	})
}

// TestReservationsConcurrentCreates: 50 concurrent creates through the
// whole admission sequence against 16 GPUs: exactly 16 succeed, no atom is
// booked twice, the rest are NO_CAPACITY.
func TestReservationsConcurrentCreates(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	pool := h.gpuPool(t, "c", 2, 8)
	// A node that has not applied desired state yet is never booked.
	h.node(t, pool, "node_unschedulable", 0, 8)
	c := computev1.NewReservationsServiceClient(h.conn)
	var wg sync.WaitGroup
	errs := make([]error, 50)
	ids := make([]string, 50)
	for i := range 50 {
		wg.Go(func() {
			resp, err := c.Create(as(h.root), &computev1.ReservationsServiceCreateRequest{TenantId: "root", PoolId: pool, GpuCount: 1,
				IdempotencyKey: fmt.Sprintf("c-%d", i)})
			errs[i], ids[i] = err, resp.GetReservation().GetId()
		})
	}
	wg.Wait()
	placed := 0
	for i, err := range errs {
		switch code, _ := envelope(err); {
		case err == nil:
			placed++
		case code != fault.NoCapacity:
			t.Fatalf("create %d: %v", i, err)
		}
	}
	if placed != 16 {
		t.Fatalf("%d placed, want 16", placed)
	}
	if n := h.count(t, `SELECT count(DISTINCT (node_id, device_id)) FROM bookings WHERE active`); n != 16 {
		t.Fatalf("%d distinct atoms booked", n)
	}
	if n := h.count(t, `SELECT count(*) FROM bookings WHERE node_id = 'node_unschedulable'`); n != 0 {
		t.Fatalf("the unschedulable node got %d bookings", n)
	}
	if n := h.count(t, `SELECT count(*) FROM reservations`); n != 16 {
		t.Fatalf("%d reservations stored; refused creates must leave none", n)
	}
}

// TestReservationsPoolOfAnAncestor: a tenant books in its own pools and in
// its ancestors' pools shared with descendants, never in another tenant's.
func TestReservationsPoolOfAnAncestor(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	rootPool := h.gpuPool(t, "shared", 1, 8)
	h.share(t, rootPool, 8)
	_, acmeKey := h.member(t, "acme", "ops")
	h.policy(t, "acme", "members", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)
	_, otherKey := h.member(t, "other", "ops")
	h.policy(t, "other", "members", `permit (principal in Tenant::"other", action, resource in Tenant::"other");`)
	p, err := computev1.NewPoolsServiceClient(h.conn).Create(as(otherKey), &computev1.PoolsServiceCreateRequest{TenantId: "other", Name: "mine", Class: "gpu"})
	if err != nil {
		t.Fatal(err)
	}
	c := computev1.NewReservationsServiceClient(h.conn)
	resp, err := c.Create(as(acmeKey), &computev1.ReservationsServiceCreateRequest{TenantId: "acme", PoolId: rootPool, GpuCount: 2})
	if err != nil || resp.GetReservation().GetTenantId() != "acme" || len(resp.GetReservation().GetBookings()) != 2 {
		t.Fatalf("acme in root's pool: %v %v", resp, err)
	}
	_, err = c.Create(as(acmeKey), &computev1.ReservationsServiceCreateRequest{TenantId: "acme", PoolId: p.GetPool().GetId(), GpuCount: 1})
	wantCode(t, err, fault.NotFound, "poolId")
	// Another tenant cannot read acme's reservation.
	_, err = c.Get(as(otherKey), &computev1.ReservationsServiceGetRequest{TenantId: "other", ReservationId: resp.GetReservation().GetId()})
	wantCode(t, err, fault.NotFound, "reservationId")
	got, err := c.Get(as(acmeKey), &computev1.ReservationsServiceGetRequest{TenantId: "acme", ReservationId: resp.GetReservation().GetId()})
	if err != nil || got.GetReservation().GetState() != "placed" {
		t.Fatalf("acme reads its reservation: %v %v", got, err)
	}
}
