package api

import (
	"context"

	"github.com/jackc/pgx/v5"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// identities implements computev1.IdentitiesServiceServer.
type identities struct {
	*Server
	computev1.UnimplementedIdentitiesServiceServer
}

func identityPB(i iam.Identity) *computev1.Identity {
	return &computev1.Identity{Id: i.ID, TenantId: i.TenantID, Kind: i.Kind, Name: i.Name, CreateTime: ts(i.CreatedAt), RevokeTime: tsp(i.RevokedAt)}
}

func (s *identities) Create(ctx context.Context, req *computev1.IdentitiesServiceCreateRequest) (*computev1.IdentitiesServiceCreateResponse, error) {
	if err := required("name", req.GetName()); err != nil {
		return nil, err
	}
	if !identityRE.MatchString(req.GetName()) {
		return nil, fault.New(fault.InvalidInput, "name", "%q: expected lowercase letters, digits, '.', '_', '@', '-', at most 64 characters", req.GetName())
	}
	kind := req.GetKind()
	if kind == "" {
		kind = iam.KindUser
	}
	if kind != iam.KindUser && kind != iam.KindService {
		return nil, fault.New(fault.InvalidInput, "kind", "expected user or service, got %q", kind)
	}
	out := &computev1.IdentitiesServiceCreateResponse{}
	_, err := s.create(ctx, req, req.GetIdempotencyKey(), admission.Create{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: authz.Resource{Type: authz.TypeIdentity, TenantID: req.GetTenantId()},
		NewID:    func() string { return iam.NewID("idn") },
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, id string) (admission.Outcome, error) {
			i, err := iam.CreateIdentity(ctx, tx, iam.Identity{ID: id, TenantID: req.GetTenantId(), Kind: kind, Name: req.GetName()})
			if err != nil {
				return admission.Outcome{}, err
			}
			return outcome(&computev1.IdentitiesServiceCreateResponse{Identity: identityPB(i)}, "identity.created", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *identities) List(ctx context.Context, req *computev1.IdentitiesServiceListRequest) (*computev1.IdentitiesServiceListResponse, error) {
	pg, err := readPage(req)
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), authz.TenantResource(req.GetTenantId())); err != nil {
		return nil, err
	}
	is, err := iam.ListIdentities(ctx, s.db, req.GetTenantId(), pg.after, pg.size)
	if err != nil {
		return nil, err
	}
	out := &computev1.IdentitiesServiceListResponse{}
	for _, i := range is {
		out.Identities = append(out.Identities, identityPB(i))
	}
	out.NextPageToken = nextPage(pg, is, func(i iam.Identity) string { return i.ID })
	return out, nil
}

func (s *identities) Revoke(ctx context.Context, req *computev1.IdentitiesServiceRevokeRequest) (*computev1.IdentitiesServiceRevokeResponse, error) {
	if err := required("identityId", req.GetIdentityId()); err != nil {
		return nil, err
	}
	// The resource is the target identity: the decision's context says
	// whether it is the caller itself (authz.Resource.Target).
	res, err := authz.Get(ctx, s.db, req.GetTenantId(), authz.TypeIdentity, req.GetIdentityId(), "identityId")
	if err != nil {
		return nil, err
	}
	out := &computev1.IdentitiesServiceRevokeResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			i, err := iam.RevokeIdentity(ctx, tx, req.GetTenantId(), req.GetIdentityId())
			if err != nil {
				return admission.Outcome{}, err
			}
			return outcome(&computev1.IdentitiesServiceRevokeResponse{Identity: identityPB(i)}, "identity.revoked", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}
