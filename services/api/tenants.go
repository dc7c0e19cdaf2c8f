package api

import (
	"context"
	"strings"

	"github.com/jackc/pgx/v5"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// tenants implements computev1.TenantsServiceServer.
type tenants struct {
	*Server
	computev1.UnimplementedTenantsServiceServer
}

func tenantPB(t iam.Tenant) *computev1.Tenant {
	return &computev1.Tenant{Id: t.ID, ParentId: t.ParentID, Name: t.Name, Labels: t.Labels, CreateTime: ts(t.CreatedAt)}
}

func (s *tenants) Create(ctx context.Context, req *computev1.TenantsServiceCreateRequest) (*computev1.TenantsServiceCreateResponse, error) {
	if err := required("childTenantId", req.GetChildTenantId()); err != nil {
		return nil, err
	}
	if !iam.ValidTenantID(req.GetChildTenantId()) || !iam.ChildOf(req.GetChildTenantId(), req.GetTenantId()) {
		return nil, fault.New(fault.InvalidInput, "childTenantId", "%q is not a child id of %s: expected %s", req.GetChildTenantId(), req.GetTenantId(), childExample(req.GetTenantId()))
	}
	if err := validLabels(req.GetLabels()); err != nil {
		return nil, err
	}
	name := req.GetName()
	if name == "" {
		name = req.GetChildTenantId()[strings.LastIndexByte(req.GetChildTenantId(), '.')+1:]
	}
	out := &computev1.TenantsServiceCreateResponse{}
	_, err := s.create(ctx, req, req.GetIdempotencyKey(), admission.Create{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: authz.Resource{Type: authz.TypeTenant, ID: req.GetChildTenantId(), TenantID: req.GetChildTenantId(), Labels: req.GetLabels()},
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, id string) (admission.Outcome, error) {
			t, err := iam.CreateTenant(ctx, tx, iam.Tenant{ID: id, ParentID: req.GetTenantId(), Name: name, Labels: req.GetLabels()})
			if err != nil {
				return admission.Outcome{}, err
			}
			return outcome(&computev1.TenantsServiceCreateResponse{Tenant: tenantPB(t)}, "tenant.created", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

func childExample(parent string) string {
	if parent == iam.RootTenant {
		return "a segment such as \"acme\" (lowercase letters, digits, inner hyphens)"
	}
	return parent + ".<segment>"
}

func (s *tenants) Get(ctx context.Context, req *computev1.TenantsServiceGetRequest) (*computev1.TenantsServiceGetResponse, error) {
	if err := s.read(ctx, req.GetTenantId(), authz.TenantResource(req.GetTenantId())); err != nil {
		return nil, err
	}
	t, err := iam.GetTenant(ctx, s.db, req.GetTenantId())
	if err != nil {
		return nil, err
	}
	return &computev1.TenantsServiceGetResponse{Tenant: tenantPB(t)}, nil
}

func (s *tenants) List(ctx context.Context, req *computev1.TenantsServiceListRequest) (*computev1.TenantsServiceListResponse, error) {
	pg, err := readPage(req)
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), authz.TenantResource(req.GetTenantId())); err != nil {
		return nil, err
	}
	ts, err := iam.ListTenants(ctx, s.db, req.GetTenantId(), pg.after, pg.size)
	if err != nil {
		return nil, err
	}
	out := &computev1.TenantsServiceListResponse{}
	for _, t := range ts {
		out.Tenants = append(out.Tenants, tenantPB(t))
	}
	out.NextPageToken = nextPage(pg, ts, func(t iam.Tenant) string { return t.ID })
	return out, nil
}
