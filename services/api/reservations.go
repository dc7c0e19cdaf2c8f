package api

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/authz"
	capstore "github.com/bettercompute/bettercompute/pkg/capacity"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// TypeReservation is a reservation's type in the authorization projection;
// its row carries the tenant and the pool.
const TypeReservation = "Reservation"

// MaxModelLength bounds a GPU model name in a request.
const MaxModelLength = 128

// reservations implements computev1.ReservationsServiceServer.
type reservations struct {
	*Server
	computev1.UnimplementedReservationsServiceServer
}

func reservationPB(r capstore.Reservation, now time.Time) *computev1.Reservation {
	out := &computev1.Reservation{
		Id: r.ID, TenantId: r.TenantID, PoolId: r.PoolID, GpuCount: int32(r.GPUCount), State: r.State, Reason: r.Reason,
		Constraints: &computev1.Constraints{
			Model: r.Constraints.Model, MinMemoryBytes: r.Constraints.MinMemoryBytes,
			SameNode: r.Constraints.SameNode, NodeLabels: r.Constraints.NodeLabels,
		},
		StartTime: tsp(r.StartTime), EndTime: tsp(r.EndTime), CreateTime: ts(r.CreatedAt), UpdateTime: ts(r.UpdatedAt),
		BoundTime: tsp(r.BoundAt), FinishTime: tsp(r.FinishedAt), GpuHours: r.GPUHours, MigProfile: r.MigProfile,
	}
	if r.State == capstore.StatePending {
		out.Reason = capstore.Why(r, now)
	}
	for _, b := range r.Bookings {
		out.Bookings = append(out.Bookings, &computev1.Booking{NodeId: b.NodeID, DeviceId: b.DeviceID, Model: b.Model,
			MigProfile: b.MigProfile, ParentDeviceId: b.ParentID})
	}
	return out
}

func reservationResource(r capstore.Reservation) *authz.Resource {
	return &authz.Resource{Type: TypeReservation, ID: r.ID, TenantID: r.TenantID, PoolID: r.PoolID}
}

// validTime checks an optional timestamp field.
func validTime(field string, t interface{ CheckValid() error }, set bool) error {
	if !set {
		return nil
	}
	if err := t.CheckValid(); err != nil {
		return fault.New(fault.InvalidInput, field, "%v", err)
	}
	return nil
}

func (s *reservations) Create(ctx context.Context, req *computev1.ReservationsServiceCreateRequest) (*computev1.ReservationsServiceCreateResponse, error) {
	if err := required("poolId", req.GetPoolId()); err != nil {
		return nil, err
	}
	c := req.GetConstraints()
	count := req.GetGpuCount()
	if req.GetMigProfile() != "" {
		// MIG slices: count of them, never gpuCount; placement books by
		// profile, so a size or one-node constraint does not apply.
		switch n := req.GetCount(); {
		case req.GetGpuCount() != 0:
			return nil, fault.New(fault.InvalidInput, "gpuCount", "not with migProfile: give the number of slices in count")
		case len(req.GetMigProfile()) > MaxModelLength:
			return nil, fault.New(fault.InvalidInput, "migProfile", "at most %d characters", MaxModelLength)
		case n < 1 || n > capstore.MaxGPUs:
			return nil, fault.New(fault.InvalidInput, "count", "expected 1 to %d MIG slices, got %d", capstore.MaxGPUs, n)
		case c.GetSameNode():
			return nil, fault.New(fault.InvalidInput, "constraints.sameNode", "not with migProfile")
		case c.GetMinMemoryBytes() != 0:
			return nil, fault.New(fault.InvalidInput, "constraints.minMemoryBytes", "not with migProfile: the profile sets the memory")
		}
		count = req.GetCount()
	} else {
		if req.GetCount() != 0 {
			return nil, fault.New(fault.InvalidInput, "count", "only with migProfile; whole GPUs are counted in gpuCount")
		}
		if n := count; n < 1 || n > capstore.MaxGPUs {
			return nil, fault.New(fault.InvalidInput, "gpuCount", "expected 1 to %d, got %d", capstore.MaxGPUs, n)
		}
	}
	switch {
	case len(c.GetModel()) > MaxModelLength:
		return nil, fault.New(fault.InvalidInput, "constraints.model", "at most %d characters", MaxModelLength)
	case c.GetMinMemoryBytes() < 0:
		return nil, fault.New(fault.InvalidInput, "constraints.minMemoryBytes", "expected 0 or more, got %d", c.GetMinMemoryBytes())
	}
	if err := validLabels(c.GetNodeLabels()); err != nil {
		if fe, ok := fault.As(err); ok {
			fe.Field = "constraints.nodeLabels"
		}
		return nil, err
	}
	if err := validTime("startTime", req.GetStartTime(), req.StartTime != nil); err != nil {
		return nil, err
	}
	if err := validTime("endTime", req.GetEndTime(), req.EndTime != nil); err != nil {
		return nil, err
	}
	now := s.now()
	r := capstore.Reservation{
		TenantID: req.GetTenantId(), PoolID: req.GetPoolId(), GPUCount: int(count), MigProfile: req.GetMigProfile(),
		Constraints: capstore.Constraints{Model: c.GetModel(), MinMemoryBytes: c.GetMinMemoryBytes(), SameNode: c.GetSameNode(), NodeLabels: c.GetNodeLabels()},
	}
	if req.StartTime != nil {
		t := req.GetStartTime().AsTime()
		r.StartTime = &t
	}
	if req.EndTime != nil {
		t := req.GetEndTime().AsTime()
		r.EndTime = &t
		switch {
		case !t.After(now):
			return nil, fault.New(fault.InvalidInput, "endTime", "must be in the future")
		case r.StartTime != nil && !t.After(*r.StartTime):
			return nil, fault.New(fault.InvalidInput, "endTime", "must be after startTime")
		}
	}
	if err := capstore.PoolOf(ctx, s.db, req.GetTenantId(), req.GetPoolId()); err != nil {
		return nil, err
	}
	if r.MigProfile != "" {
		if err := capstore.CheckMigProfile(ctx, s.db, r.PoolID, r.MigProfile); err != nil {
			return nil, err
		}
	}
	out := &computev1.ReservationsServiceCreateResponse{}
	_, err := s.create(ctx, req, req.GetIdempotencyKey(), admission.Create{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: authz.Resource{Type: TypeReservation, TenantID: req.GetTenantId(), PoolID: req.GetPoolId()},
		NewID:    func() string { return iam.NewID("rsv") },
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, id string) (admission.Outcome, error) {
			r := r
			r.ID = id
			inline := r.StartTime == nil || !r.StartTime.After(now)
			if !inline {
				// A future start is placed later (the placer checks
				// again); the pool must be bookable now too. Inline
				// placement checks it itself, under the pool's lock.
				if err := capstore.PoolOf(ctx, tx, r.TenantID, r.PoolID); err != nil {
					return admission.Outcome{}, err
				}
			}
			if err := capstore.Insert(ctx, tx, r); err != nil {
				return admission.Outcome{}, err
			}
			event := "reservation.created"
			if inline {
				// Inline placement: book now, or refuse. Place checks in
				// this transaction that the tenant may book the pool (its
				// own, or an ancestor's shared with descendants) and the
				// quota (its own, an ancestor's or the pool's default).
				nodes, err := capstore.Place(ctx, tx, &r, capstore.PlaceOptions{LostAfter: s.capacity.LostAfter})
				if err != nil {
					return admission.Outcome{}, err
				}
				for _, n := range nodes {
					if err := nodespec.Invalidate(ctx, q, n); err != nil {
						return admission.Outcome{}, err
					}
				}
				event = "reservation.placed"
			}
			stored, err := capstore.Lock(ctx, tx, id)
			if err != nil {
				return admission.Outcome{}, err
			}
			return outcome(&computev1.ReservationsServiceCreateResponse{Reservation: reservationPB(stored, now)}, event, reservationResource(stored))
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *reservations) Get(ctx context.Context, req *computev1.ReservationsServiceGetRequest) (*computev1.ReservationsServiceGetResponse, error) {
	if err := required("reservationId", req.GetReservationId()); err != nil {
		return nil, err
	}
	res, err := authz.Get(ctx, s.db, req.GetTenantId(), TypeReservation, req.GetReservationId(), "reservationId")
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), res); err != nil {
		return nil, err
	}
	r, err := capstore.Get(ctx, s.db, req.GetTenantId(), req.GetReservationId())
	if err != nil {
		return nil, err
	}
	return &computev1.ReservationsServiceGetResponse{Reservation: reservationPB(r, s.now())}, nil
}

func (s *reservations) List(ctx context.Context, req *computev1.ReservationsServiceListRequest) (*computev1.ReservationsServiceListResponse, error) {
	pg, err := readPage(req)
	if err != nil {
		return nil, err
	}
	if st := req.GetState(); st != "" && !slicesContains(capstore.States, st) {
		return nil, fault.New(fault.InvalidInput, "state", "expected one of pending, placed, bound, released, expired, failed, got %q", st)
	}
	if err := s.read(ctx, req.GetTenantId(), authz.TenantResource(req.GetTenantId())); err != nil {
		return nil, err
	}
	rs, err := capstore.List(ctx, s.db, capstore.ListFilter{TenantID: req.GetTenantId(), PoolID: req.GetPoolId(), State: req.GetState(), After: pg.after, Limit: pg.size})
	if err != nil {
		return nil, err
	}
	out := &computev1.ReservationsServiceListResponse{}
	now := s.now()
	for _, r := range rs {
		out.Reservations = append(out.Reservations, reservationPB(r, now))
	}
	out.NextPageToken = nextPage(pg, rs, func(r capstore.Reservation) string { return r.ID })
	return out, nil
}

func (s *reservations) Release(ctx context.Context, req *computev1.ReservationsServiceReleaseRequest) (*computev1.ReservationsServiceReleaseResponse, error) {
	if err := required("reservationId", req.GetReservationId()); err != nil {
		return nil, err
	}
	res, err := authz.Get(ctx, s.db, req.GetTenantId(), TypeReservation, req.GetReservationId(), "reservationId")
	if err != nil {
		return nil, err
	}
	out := &computev1.ReservationsServiceReleaseResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			if _, err := capstore.Lock(ctx, tx, req.GetReservationId()); err != nil {
				return admission.Outcome{}, err
			}
			nodes, _, err := capstore.Finish(ctx, tx, req.GetReservationId(), capstore.StateReleased, "")
			if err != nil {
				return admission.Outcome{}, err
			}
			for _, n := range nodes {
				if err := nodespec.Invalidate(ctx, q, n); err != nil {
					return admission.Outcome{}, err
				}
			}
			r, err := capstore.Get(ctx, tx, req.GetTenantId(), req.GetReservationId())
			if err != nil {
				return admission.Outcome{}, err
			}
			return outcome(&computev1.ReservationsServiceReleaseResponse{Reservation: reservationPB(r, s.now())}, "reservation.released", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}
