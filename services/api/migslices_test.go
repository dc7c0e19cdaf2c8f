package api_test

import (
	"fmt"
	"slices"
	"testing"
	"time"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/api"
)

// TestMigSlicesAPI: reservations.create with migProfile and count books
// slices (bad input names the field), capacity.get counts them by profile,
// capacity.setQuota takes a migProfile, and nodes.get shows each GPU's
// layout, its slices and their bookings.
func TestMigSlicesAPI(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	ctx := as(h.root)
	p, err := computev1.NewPoolsServiceClient(h.conn).Create(ctx, &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "slices", Class: "gpu"})
	if err != nil {
		t.Fatal(err)
	}
	poolID := p.GetPool().GetId()
	fixture.Node(t, h.db, fixture.NodeOpts{ID: "node_s", Pool: poolID, State: nodes.StateAdopted, Live: true, GPUs: 2,
		Model: "NVIDIA H200 141GB HBM3e", MemoryBytes: 144384 << 20})
	if err := authz.Put(t.Context(), h.db, authz.Resource{Type: authz.TypeNode, ID: "node_s", TenantID: "root", PoolID: poolID}); err != nil {
		t.Fatal(err)
	}
	nodesC := computev1.NewNodesServiceClient(h.conn)
	seven := []string{"1g.18gb", "1g.18gb", "1g.18gb", "1g.18gb", "1g.18gb", "1g.18gb", "1g.18gb"}
	if _, err := nodesC.Update(ctx, &computev1.NodesServiceUpdateRequest{TenantId: "root", NodeId: "node_s", UpdateMask: migMask(),
		Mig: &computev1.MigSettings{Layouts: []*computev1.MigLayoutSpec{{Name: "g0", GpuSelector: &computev1.MigGpuSelector{Indices: []uint32{0}}, Profiles: seven}}}}); err != nil {
		t.Fatal(err)
	}
	poll.UntilNil(t, 20*time.Second, "GPU 0's layout in nodes.get", func() error {
		n, err := nodesC.Get(ctx, &computev1.NodesServiceGetRequest{TenantId: "root", NodeId: "node_s"})
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(n.GetNode().GetDevices()[0].GetMigLayout(), seven) || len(n.GetNode().GetDevices()[1].GetMigLayout()) != 0 {
			return fmt.Errorf("layouts %v", n.GetNode().GetDevices())
		}
		return nil
	})
	// The node made the slices and reported them.
	var ss []nodes.ReportedSlice
	for i := range 7 {
		ss = append(ss, nodes.ReportedSlice{ID: fmt.Sprintf("MIG-s-%d", i), Parent: "GPU-node_s-0", Profile: "1g.18gb", Start: int32(i),
			MemoryBytes: 18 << 30, ComputeSlices: 1, GPUInstanceID: int32(i + 7)})
	}
	if err := nodes.StoreMigSlices(t.Context(), h.db, "node_s", ss); err != nil {
		t.Fatal(err)
	}

	rsv := computev1.NewReservationsServiceClient(h.conn)
	create := func(req *computev1.ReservationsServiceCreateRequest) (*computev1.Reservation, error) {
		req.TenantId, req.PoolId = "root", poolID
		out, err := rsv.Create(ctx, req)
		return out.GetReservation(), err
	}
	_, err = create(&computev1.ReservationsServiceCreateRequest{MigProfile: "1g.18gb", Count: 1, GpuCount: 1})
	wantCode(t, err, fault.InvalidInput, "gpuCount")
	_, err = create(&computev1.ReservationsServiceCreateRequest{MigProfile: "1g.10gb", Count: 1})
	wantCode(t, err, fault.InvalidInput, "migProfile")
	_, err = create(&computev1.ReservationsServiceCreateRequest{MigProfile: "1g.18gb"})
	wantCode(t, err, fault.InvalidInput, "count")
	_, err = create(&computev1.ReservationsServiceCreateRequest{GpuCount: 1, Count: 2})
	wantCode(t, err, fault.InvalidInput, "count")
	_, err = create(&computev1.ReservationsServiceCreateRequest{MigProfile: "3g.71gb", Count: 1})
	wantCode(t, err, fault.NoCapacity, "count")

	got, err := create(&computev1.ReservationsServiceCreateRequest{MigProfile: "1g.18gb", Count: 2})
	if err != nil {
		t.Fatal(err)
	}
	if got.GetMigProfile() != "1g.18gb" || got.GetGpuCount() != 2 || len(got.GetBookings()) != 2 {
		t.Fatalf("reservation %v", got)
	}
	for _, b := range got.GetBookings() {
		if b.GetParentDeviceId() != "GPU-node_s-0" || b.GetMigProfile() != "1g.18gb" || !slices.ContainsFunc(ss, func(s nodes.ReportedSlice) bool { return s.ID == b.GetDeviceId() }) {
			t.Fatalf("booking %v", b)
		}
	}
	// GPU 1 is whole and bookable; GPU 0 is not.
	whole, err := create(&computev1.ReservationsServiceCreateRequest{GpuCount: 1})
	if err != nil || whole.GetBookings()[0].GetDeviceId() != "GPU-node_s-1" {
		t.Fatalf("whole GPU: %v %v", whole, err)
	}

	c, err := computev1.NewCapacityServiceClient(h.conn).Get(ctx, &computev1.CapacityServiceGetRequest{TenantId: "root", PoolId: poolID})
	if err != nil {
		t.Fatal(err)
	}
	if m := c.GetMigProfiles(); len(m) != 1 || m[0].GetProfile() != "1g.18gb" || m[0].GetCounts().GetFree() != 5 || m[0].GetCounts().GetBooked() != 2 {
		t.Fatalf("capacity.get mig profiles %v", m)
	}

	n, err := nodesC.Get(ctx, &computev1.NodesServiceGetRequest{TenantId: "root", NodeId: "node_s"})
	if err != nil {
		t.Fatal(err)
	}
	g0 := n.GetNode().GetDevices()[0]
	bookedOn := 0
	for _, s := range g0.GetMigSlices() {
		if s.GetReservationId() == got.GetId() {
			bookedOn++
		}
	}
	if len(n.GetNode().GetDevices()) != 2 || len(g0.GetMigSlices()) != 7 || bookedOn != 2 || g0.GetMigSlices()[3].GetStart() != 3 ||
		g0.GetMigSlices()[3].GetComputeSlices() != 1 {
		t.Fatalf("nodes.get GPU 0 %v", g0)
	}

	capC := computev1.NewCapacityServiceClient(h.conn)
	_, err = capC.SetQuota(ctx, &computev1.CapacityServiceSetQuotaRequest{TenantId: "root", PoolId: poolID, ForTenantId: "root",
		Model: "NVIDIA H200", MigProfile: "1g.18gb", GpuLimit: 1})
	wantCode(t, err, fault.InvalidInput, "migProfile")
	q, err := capC.SetQuota(ctx, &computev1.CapacityServiceSetQuotaRequest{TenantId: "root", PoolId: poolID, ForTenantId: "root",
		MigProfile: "1g.18gb", GpuLimit: 2})
	if err != nil || q.GetQuota().GetMigProfile() != "1g.18gb" {
		t.Fatalf("quota %v %v", q, err)
	}
	_, err = create(&computev1.ReservationsServiceCreateRequest{MigProfile: "1g.18gb", Count: 1})
	wantCode(t, err, fault.QuotaExceeded, "count")
}
