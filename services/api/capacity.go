package api

import (
	"context"
	"slices"

	"github.com/jackc/pgx/v5"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/authz"
	capstore "github.com/bettercompute/bettercompute/pkg/capacity"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/instances"
	nodestore "github.com/bettercompute/bettercompute/pkg/nodes"
	poolstore "github.com/bettercompute/bettercompute/pkg/pools"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// capacityGroup implements computev1.CapacityServiceServer.
type capacityGroup struct {
	*Server
	computev1.UnimplementedCapacityServiceServer
}

func slicesContains(s []string, v string) bool { return slices.Contains(s, v) }

func quotaPB(q capstore.Quota) *computev1.Quota {
	return &computev1.Quota{PoolId: q.PoolID, TenantId: q.TenantID, Model: q.Model, GpuLimit: int32(q.GPULimit), UpdateTime: ts(q.UpdatedAt),
		MigProfile: q.MigProfile}
}

// pool reads the pool's projection row (tenant's own pool) and authorizes
// a read of it.
func (s *capacityGroup) pool(ctx context.Context, tenant, pool string) (authz.Resource, error) {
	if err := required("poolId", pool); err != nil {
		return authz.Resource{}, err
	}
	return authz.Get(ctx, s.db, tenant, authz.TypePool, pool, "poolId")
}

func (s *capacityGroup) Get(ctx context.Context, req *computev1.CapacityServiceGetRequest) (*computev1.CapacityServiceGetResponse, error) {
	res, err := s.pool(ctx, req.GetTenantId(), req.GetPoolId())
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), res); err != nil {
		return nil, err
	}
	out := &computev1.CapacityServiceGetResponse{Total: &computev1.CapacityCounts{}}
	counts, err := capstore.RolledUp(ctx, s.db, res.ID)
	if err != nil {
		return nil, err
	}
	for _, r := range counts {
		c := &computev1.CapacityCounts{Free: r.Free, Booked: r.Booked, Unavailable: r.Unavailable, Quarantined: r.Quarantined}
		out.ComputeTime = ts(r.ComputedAt)
		if r.Model == "" {
			out.Total = c
			continue
		}
		out.Models = append(out.Models, &computev1.ModelCapacity{Model: r.Model, Counts: c})
	}
	if err := s.hosts(ctx, res.ID, out); err != nil {
		return nil, err
	}
	drifted, err := nodestore.CountDrifted(ctx, s.db, res.ID)
	if err != nil {
		return nil, err
	}
	out.DriftedNodes = int32(drifted)
	migs, err := capstore.MigCounts(ctx, s.db, res.ID, s.capacity.LostAfter)
	if err != nil {
		return nil, err
	}
	for _, m := range migs {
		out.MigProfiles = append(out.MigProfiles, &computev1.MigProfileCapacity{Profile: m.Profile,
			Counts: &computev1.CapacityCounts{Free: m.Free, Booked: m.Booked, Unavailable: m.Unavailable, Quarantined: m.Quarantined}})
	}
	usage, err := capstore.UsageOf(ctx, s.db, res.ID)
	if err != nil {
		return nil, err
	}
	for _, u := range usage {
		out.Tenants = append(out.Tenants, &computev1.TenantUsage{TenantId: u.TenantID, Booked: u.Booked, GpuHours: u.GPUHours})
	}
	return out, nil
}

// hosts fills a hosted pool's host capacity (read now) into out.
func (s *capacityGroup) hosts(ctx context.Context, pool string, out *computev1.CapacityServiceGetResponse) error {
	class, err := poolstore.ClassOf(ctx, s.db, pool)
	if err != nil {
		return err
	}
	if class != "vps-host" {
		return nil
	}
	c, err := instances.Capacity(ctx, s.db, pool, s.capacity.LostAfter)
	if err != nil {
		return err
	}
	out.Hosts = &computev1.HostCapacity{
		Hosts: int32(c.Hosts), SchedulableHosts: int32(c.SchedulableHosts),
		VcpusTotal: int64(c.Total.VCPUs), VcpusFree: int64(c.Free.VCPUs),
		MemoryMibTotal: c.Total.MemoryMiB, MemoryMibFree: c.Free.MemoryMiB,
		DiskGibTotal: c.Total.DiskGiB, DiskGibFree: c.Free.DiskGiB,
		GpusTotal: int64(c.Total.GPUs), GpusFree: int64(c.Free.GPUs),
	}
	return nil
}

func (s *capacityGroup) SetQuota(ctx context.Context, req *computev1.CapacityServiceSetQuotaRequest) (*computev1.CapacityServiceSetQuotaResponse, error) {
	if err := required("forTenantId", req.GetForTenantId()); err != nil {
		return nil, err
	}
	if !iam.ValidTenantID(req.GetForTenantId()) || !iam.Covers(req.GetTenantId(), req.GetForTenantId()) {
		return nil, fault.New(fault.InvalidInput, "forTenantId", "%q is not %s or one of its descendants", req.GetForTenantId(), req.GetTenantId())
	}
	if len(req.GetModel()) > MaxModelLength {
		return nil, fault.New(fault.InvalidInput, "model", "at most %d characters", MaxModelLength)
	}
	if req.GetMigProfile() != "" && req.GetModel() != "" {
		return nil, fault.New(fault.InvalidInput, "migProfile", "not with model: a quota counts either one profile's MIG slices or GPUs of a model")
	}
	if len(req.GetMigProfile()) > MaxModelLength {
		return nil, fault.New(fault.InvalidInput, "migProfile", "at most %d characters", MaxModelLength)
	}
	if req.GetGpuLimit() < -1 || req.GetGpuLimit() > capstore.MaxGPUs*1024 {
		return nil, fault.New(fault.InvalidInput, "gpuLimit", "expected -1 (remove), 0 (forbid) or a positive limit, got %d", req.GetGpuLimit())
	}
	res, err := s.pool(ctx, req.GetTenantId(), req.GetPoolId())
	if err != nil {
		return nil, err
	}
	out := &computev1.CapacityServiceSetQuotaResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, _ *reconcile.Queue) (admission.Outcome, error) {
			exists, err := iam.TenantExists(ctx, tx, req.GetForTenantId())
			if err != nil {
				return admission.Outcome{}, err
			}
			if !exists {
				return admission.Outcome{}, fault.New(fault.NotFound, "forTenantId", "no tenant %q", req.GetForTenantId())
			}
			q, set, err := capstore.SetQuota(ctx, tx, capstore.Quota{PoolID: res.ID, TenantID: req.GetForTenantId(), Model: req.GetModel(),
				MigProfile: req.GetMigProfile(), GPULimit: int(req.GetGpuLimit())})
			if err != nil {
				return admission.Outcome{}, err
			}
			resp := &computev1.CapacityServiceSetQuotaResponse{}
			if set {
				resp.Quota = quotaPB(q)
			}
			return outcome(resp, "quota.set", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *capacityGroup) ListQuotas(ctx context.Context, req *computev1.CapacityServiceListQuotasRequest) (*computev1.CapacityServiceListQuotasResponse, error) {
	res, err := s.pool(ctx, req.GetTenantId(), req.GetPoolId())
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), res); err != nil {
		return nil, err
	}
	qs, err := capstore.ListQuotas(ctx, s.db, res.ID)
	if err != nil {
		return nil, err
	}
	out := &computev1.CapacityServiceListQuotasResponse{}
	for _, q := range qs {
		out.Quotas = append(out.Quotas, quotaPB(q))
	}
	return out, nil
}
