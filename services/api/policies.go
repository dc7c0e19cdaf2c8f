package api

import (
	"context"

	"github.com/jackc/pgx/v5"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// policies implements computev1.PoliciesServiceServer.
type policies struct {
	*Server
	computev1.UnimplementedPoliciesServiceServer
}

// MaxPolicyBytes bounds a policy document (authz.MaxPolicyBytes; a tenant
// holds at most authz.MaxPoliciesPerTenant).
const MaxPolicyBytes = authz.MaxPolicyBytes

func policyPB(p authz.Policy) *computev1.Policy {
	return &computev1.Policy{
		TenantId: p.TenantID, Name: p.Name, Body: p.Body, Version: p.Version,
		CreateTime: ts(p.CreatedAt), UpdateTime: ts(p.UpdatedAt),
	}
}

func policyResource(tenant, name string) authz.Resource {
	return authz.Resource{Type: authz.TypePolicy, ID: tenant + "/" + name, TenantID: tenant}
}

func (s *policies) Put(ctx context.Context, req *computev1.PoliciesServicePutRequest) (*computev1.PoliciesServicePutResponse, error) {
	if err := validName("name", req.GetName()); err != nil {
		return nil, err
	}
	if err := required("body", req.GetBody()); err != nil {
		return nil, err
	}
	if err := authz.CheckPolicySize(req.GetBody()); err != nil {
		return nil, err
	}
	if _, err := authz.Parse(req.GetName(), req.GetBody()); err != nil {
		return nil, err // before the decision: bad input changes nothing
	}
	out := &computev1.PoliciesServicePutResponse{}
	err := s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: policyResource(req.GetTenantId(), req.GetName()),
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			p, err := authz.PutPolicy(ctx, tx, authz.Policy{TenantID: req.GetTenantId(), Name: req.GetName(), Body: req.GetBody()})
			if err != nil {
				return admission.Outcome{}, err
			}
			q.WakePolicies(req.GetTenantId())
			return outcome(&computev1.PoliciesServicePutResponse{Policy: policyPB(p)}, "policy.put", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *policies) Get(ctx context.Context, req *computev1.PoliciesServiceGetRequest) (*computev1.PoliciesServiceGetResponse, error) {
	if err := required("name", req.GetName()); err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), policyResource(req.GetTenantId(), req.GetName())); err != nil {
		return nil, err
	}
	p, err := authz.GetPolicy(ctx, s.db, req.GetTenantId(), req.GetName())
	if err != nil {
		return nil, err
	}
	return &computev1.PoliciesServiceGetResponse{Policy: policyPB(p)}, nil
}

func (s *policies) List(ctx context.Context, req *computev1.PoliciesServiceListRequest) (*computev1.PoliciesServiceListResponse, error) {
	pg, err := readPage(req)
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), authz.TenantResource(req.GetTenantId())); err != nil {
		return nil, err
	}
	ps, err := authz.ListPolicies(ctx, s.db, req.GetTenantId(), pg.after, pg.size)
	if err != nil {
		return nil, err
	}
	out := &computev1.PoliciesServiceListResponse{}
	for _, p := range ps {
		out.Policies = append(out.Policies, policyPB(p))
	}
	out.NextPageToken = nextPage(pg, ps, func(p authz.Policy) string { return p.Name })
	return out, nil
}

func (s *policies) Delete(ctx context.Context, req *computev1.PoliciesServiceDeleteRequest) (*computev1.PoliciesServiceDeleteResponse, error) {
	if err := required("name", req.GetName()); err != nil {
		return nil, err
	}
	out := &computev1.PoliciesServiceDeleteResponse{}
	err := s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: policyResource(req.GetTenantId(), req.GetName()),
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			if err := authz.DeletePolicy(ctx, tx, req.GetTenantId(), req.GetName()); err != nil {
				return admission.Outcome{}, err
			}
			q.WakePolicies(req.GetTenantId())
			o, err := outcome(out, "policy.deleted", nil)
			o.Event.Payload = map[string]string{"tenantId": req.GetTenantId(), "name": req.GetName()}
			return o, err
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}
