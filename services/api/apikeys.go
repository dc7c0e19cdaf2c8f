package api

import (
	"context"

	"github.com/jackc/pgx/v5"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/audit"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// apiKeys implements computev1.ApiKeysServiceServer.
type apiKeys struct {
	*Server
	computev1.UnimplementedApiKeysServiceServer
}

func apiKeyPB(k iam.APIKey) *computev1.ApiKey {
	return &computev1.ApiKey{
		Id: k.ID, TenantId: k.TenantID, IdentityId: k.IdentityID, Name: k.Name,
		CreateTime: ts(k.CreatedAt), ExpireTime: tsp(k.ExpiresAt), RevokeTime: tsp(k.RevokedAt),
	}
}

func (s *apiKeys) Create(ctx context.Context, req *computev1.ApiKeysServiceCreateRequest) (*computev1.ApiKeysServiceCreateResponse, error) {
	if err := required("identityId", req.GetIdentityId()); err != nil {
		return nil, err
	}
	if len(req.GetName()) > 128 {
		return nil, fault.New(fault.InvalidInput, "name", "at most 128 characters")
	}
	k := iam.APIKey{IdentityID: req.GetIdentityId(), TenantID: req.GetTenantId(), Name: req.GetName()}
	if req.ExpireTime != nil {
		if err := req.GetExpireTime().CheckValid(); err != nil {
			return nil, fault.New(fault.InvalidInput, "expireTime", "%v", err)
		}
		t := req.GetExpireTime().AsTime()
		if !t.After(s.now()) {
			return nil, fault.New(fault.InvalidInput, "expireTime", "must be in the future")
		}
		k.ExpiresAt = &t
	}
	if err := s.mayImpersonate(ctx, req.GetTenantId(), req.GetIdentityId()); err != nil {
		return nil, err
	}
	key := iam.NewKey() // its secret is returned only by the call that stores it
	out := &computev1.ApiKeysServiceCreateResponse{}
	res, err := s.create(ctx, req, req.GetIdempotencyKey(), admission.Create{
		Call: admission.Call{TenantID: req.GetTenantId()},
		// Decided on the identity the key is for, not on the key alone: a
		// key acts as its identity, so minting one for another identity is
		// acting on that identity.
		Resource: authz.Resource{Type: authz.TypeAPIKey, ID: key.ID, TenantID: req.GetTenantId(), Identity: req.GetIdentityId()},
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, id string) (admission.Outcome, error) {
			if id != key.ID {
				// A concurrent identical request owns this key's id and its
				// secret; only it may store the key.
				return admission.Outcome{}, fault.New(fault.Conflict, "idempotencyKey", "a request under idempotency key %q is still creating this key; retry to read its result", req.GetIdempotencyKey())
			}
			k.ID = id
			created, err := iam.CreateKey(ctx, tx, k, key.Hash)
			if err != nil {
				return admission.Outcome{}, err
			}
			// The stored (and replayed) response carries no secret.
			return outcome(&computev1.ApiKeysServiceCreateResponse{ApiKey: apiKeyPB(created)}, "apiKey.created", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	if !res.Replayed && res.ResourceID == key.ID {
		out.Secret = key.Token
	}
	return out, nil
}

// mayImpersonate decides, for a key for an identity other than the
// caller, compute:identities:impersonate on that identity (of tenant): a
// key acts as its identity, so minting one for somebody else is acting as
// them, and compute:api-keys:create alone is a key for oneself. Service
// accounts' keys too: whoever the tenant's policies let act as the
// service identity (an admin whose policy permits every action does)
// mints them. A denial writes a "deny" audit row naming the action.
func (s *apiKeys) mayImpersonate(ctx context.Context, tenant, target string) error {
	c, err := s.call(ctx, tenant)
	if err != nil {
		return err
	}
	if target == c.Principal.IdentityID {
		return nil
	}
	res := authz.Resource{Type: authz.TypeIdentity, ID: target, TenantID: tenant}
	err = s.authz.Authorize(ctx, nil, c.Principal, authz.IdentitiesImpersonate, res)
	if fault.CodeOf(err) == fault.AccessDenied {
		if werr := audit.Write(context.WithoutCancel(ctx), s.db, audit.Record{
			TenantID: tenant, Actor: c.Principal.IdentityID, ActorTenantID: c.Principal.TenantID,
			Action: string(authz.IdentitiesImpersonate), Resource: res.UID(), Decision: audit.Deny,
			RequestID: c.RequestID, Method: c.Method, Detail: map[string]any{"for": string(authz.APIKeysCreate)},
		}); werr != nil {
			s.logger.WarnContext(ctx, "audit a denial", "method", c.Method, "err", werr)
		}
	}
	return err
}

func (s *apiKeys) List(ctx context.Context, req *computev1.ApiKeysServiceListRequest) (*computev1.ApiKeysServiceListResponse, error) {
	pg, err := readPage(req)
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), authz.TenantResource(req.GetTenantId())); err != nil {
		return nil, err
	}
	ks, err := iam.ListKeys(ctx, s.db, req.GetTenantId(), req.GetIdentityId(), pg.after, pg.size)
	if err != nil {
		return nil, err
	}
	out := &computev1.ApiKeysServiceListResponse{}
	for _, k := range ks {
		out.ApiKeys = append(out.ApiKeys, apiKeyPB(k))
	}
	out.NextPageToken = nextPage(pg, ks, func(k iam.APIKey) string { return k.ID })
	return out, nil
}

func (s *apiKeys) Revoke(ctx context.Context, req *computev1.ApiKeysServiceRevokeRequest) (*computev1.ApiKeysServiceRevokeResponse, error) {
	if err := required("apiKeyId", req.GetApiKeyId()); err != nil {
		return nil, err
	}
	res, err := authz.Get(ctx, s.db, req.GetTenantId(), authz.TypeAPIKey, req.GetApiKeyId(), "apiKeyId")
	if err != nil {
		return nil, err
	}
	k, err := iam.GetKey(ctx, s.db, req.GetTenantId(), req.GetApiKeyId())
	if err != nil {
		return nil, err
	}
	res.Identity = k.IdentityID // decided on the key's owner
	out := &computev1.ApiKeysServiceRevokeResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			k, err := iam.RevokeKey(ctx, tx, req.GetTenantId(), req.GetApiKeyId())
			if err != nil {
				return admission.Outcome{}, err
			}
			return outcome(&computev1.ApiKeysServiceRevokeResponse{ApiKey: apiKeyPB(k)}, "apiKey.revoked", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}
