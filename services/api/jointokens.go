package api

import (
	"context"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/attest"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/jointoken"
	nodestore "github.com/bettercompute/bettercompute/pkg/nodes"
	poolstore "github.com/bettercompute/bettercompute/pkg/pools"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// joinTokens implements computev1.JoinTokensServiceServer.
type joinTokens struct {
	*Server
	computev1.UnimplementedJoinTokensServiceServer
}

// Join token limits.
const (
	// MaxJoinTokenUses bounds a token's uses.
	MaxJoinTokenUses = 10000
	// DefaultJoinTokenTTL is a token's lifetime when create names none.
	DefaultJoinTokenTTL = 24 * time.Hour
	// MaxJoinTokenTTL bounds a token's lifetime.
	MaxJoinTokenTTL = 366 * 24 * time.Hour
)

func joinTokenPB(t jointoken.Token) *computev1.JoinToken {
	out := &computev1.JoinToken{
		Id: t.ID, TenantId: t.TenantID, PoolId: t.PoolID, Name: t.Name, Uses: int32(t.Uses), UsesLeft: int32(t.UsesLeft),
		Reclaim: t.Reclaim, ReclaimNodeIds: t.ReclaimNodeIDs, Labels: t.Labels, CreatedBy: t.CreatedBy,
		CreateTime: ts(t.CreatedAt), ExpireTime: tsp(t.ExpiresAt), RevokeTime: tsp(t.RevokedAt),
	}
	if !t.Expect.Zero() {
		out.Expect = &computev1.JoinTokenExpect{GpuCount: int32(t.Expect.GPUCount), GpuModel: t.Expect.GPUModel, SystemSerial: t.Expect.SystemSerial}
	}
	return out
}

func (s *joinTokens) Create(ctx context.Context, req *computev1.JoinTokensServiceCreateRequest) (*computev1.JoinTokensServiceCreateResponse, error) {
	if err := required("poolId", req.GetPoolId()); err != nil {
		return nil, err
	}
	if len(req.GetName()) > 128 {
		return nil, fault.New(fault.InvalidInput, "name", "at most 128 characters")
	}
	uses := int(req.GetUses())
	if uses == 0 {
		uses = 1
	}
	if uses < 1 || uses > MaxJoinTokenUses {
		return nil, fault.New(fault.InvalidInput, "uses", "expected 0 (meaning 1) to %d, got %d", MaxJoinTokenUses, req.GetUses())
	}
	now := s.now()
	expires := now.Add(DefaultJoinTokenTTL)
	if req.ExpireTime != nil {
		if err := req.GetExpireTime().CheckValid(); err != nil {
			return nil, fault.New(fault.InvalidInput, "expireTime", "%v", err)
		}
		expires = req.GetExpireTime().AsTime()
		if !expires.After(now) {
			return nil, fault.New(fault.InvalidInput, "expireTime", "must be in the future")
		}
		if expires.Sub(now) > MaxJoinTokenTTL {
			return nil, fault.New(fault.InvalidInput, "expireTime", "at most %s away", MaxJoinTokenTTL)
		}
	}
	e := req.GetExpect()
	expect := attest.Expect{GPUCount: int(e.GetGpuCount()), GPUModel: e.GetGpuModel(), SystemSerial: e.GetSystemSerial()}
	switch {
	case e.GetGpuCount() < 0 || e.GetGpuCount() > attest.MaxGPUs:
		return nil, fault.New(fault.InvalidInput, "expect.gpuCount", "expected 0 (any) to %d, got %d", attest.MaxGPUs, e.GetGpuCount())
	case len(e.GetGpuModel()) > 128:
		return nil, fault.New(fault.InvalidInput, "expect.gpuModel", "at most 128 characters")
	case len(e.GetSystemSerial()) > 256:
		return nil, fault.New(fault.InvalidInput, "expect.systemSerial", "at most 256 characters")
	}
	if err := validLabels(req.GetLabels()); err != nil {
		return nil, err
	}
	reclaimIDs := req.GetReclaimNodeIds()
	switch {
	case req.GetReclaim() && len(reclaimIDs) == 0:
		return nil, fault.New(fault.InvalidInput, "reclaimNodeIds", "required with reclaim: name the nodes this token may take back (hardware claims alone prove nothing)")
	case !req.GetReclaim() && len(reclaimIDs) > 0:
		return nil, fault.New(fault.InvalidInput, "reclaimNodeIds", "only with reclaim: true")
	case len(reclaimIDs) > MaxJoinTokenUses:
		return nil, fault.New(fault.InvalidInput, "reclaimNodeIds", "at most %d nodes, got %d", MaxJoinTokenUses, len(reclaimIDs))
	}
	seen := make(map[string]bool, len(reclaimIDs))
	for _, id := range reclaimIDs {
		if !strings.HasPrefix(id, "node_") || len(id) > 64 || seen[id] {
			return nil, fault.New(fault.InvalidInput, "reclaimNodeIds", "%q is not a node id, or is named twice", id)
		}
		seen[id] = true
	}
	pool, err := authz.Get(ctx, s.db, req.GetTenantId(), authz.TypePool, req.GetPoolId(), "poolId")
	if err != nil {
		return nil, err
	}
	p, err := poolstore.Get(ctx, s.db, req.GetTenantId(), pool.ID)
	if err != nil {
		return nil, err
	}
	if p.Class == poolstore.ClassProvider {
		return nil, fault.New(fault.InvalidInput, "poolId", "pool %s holds a provider's capacity; nodes join %s or %s pools", p.ID, poolstore.ClassGPU, poolstore.ClassVPSHost)
	}
	secret := jointoken.Mint() // the token is returned only by the call that stores it
	out := &computev1.JoinTokensServiceCreateResponse{}
	res, err := s.create(ctx, req, req.GetIdempotencyKey(), admission.Create{
		Call: admission.Call{TenantID: req.GetTenantId()},
		Resource: authz.Resource{Type: authz.TypeJoinToken, ID: secret.ID, TenantID: req.GetTenantId(), PoolID: p.ID,
			Labels: req.GetLabels()},
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, id string) (admission.Outcome, error) {
			if id != secret.ID {
				// A concurrent identical request owns this id and its secret;
				// only it may store the token.
				return admission.Outcome{}, fault.New(fault.Conflict, "idempotencyKey", "a request under idempotency key %q is still creating this token; retry to read its result", req.GetIdempotencyKey())
			}
			// A reclaim token takes back only nodes of its own tenant:
			// another tenant's node is answered like any id outside the
			// caller's tenant (after the decision, so it tells nothing to
			// a caller who may not create tokens).
			if foreign, err := nodestore.NotInTenant(ctx, tx, req.GetTenantId(), reclaimIDs); err != nil {
				return admission.Outcome{}, err
			} else if len(foreign) > 0 {
				return admission.Outcome{}, fault.New(fault.NotFound, "reclaimNodeIds", "node %q not found in tenant %s", foreign[0], req.GetTenantId())
			}
			caller, _ := iam.PrincipalFrom(ctx)
			t, err := jointoken.Create(ctx, tx, jointoken.Token{
				ID: id, TenantID: req.GetTenantId(), PoolID: p.ID, Name: req.GetName(), Uses: uses, Expect: expect,
				Reclaim: req.GetReclaim(), ReclaimNodeIDs: reclaimIDs, Labels: req.GetLabels(), CreatedBy: caller.IdentityID, ExpiresAt: &expires,
			}, secret.Hash)
			if err != nil {
				return admission.Outcome{}, err
			}
			// The stored (and replayed) response carries no token.
			return outcome(&computev1.JoinTokensServiceCreateResponse{JoinToken: joinTokenPB(t)}, "joinToken.created", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	if !res.Replayed && res.ResourceID == secret.ID {
		out.Token = secret.Token
	}
	return out, nil
}

func (s *joinTokens) List(ctx context.Context, req *computev1.JoinTokensServiceListRequest) (*computev1.JoinTokensServiceListResponse, error) {
	pg, err := readPage(req)
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), authz.TenantResource(req.GetTenantId())); err != nil {
		return nil, err
	}
	toks, err := jointoken.List(ctx, s.db, req.GetTenantId(), strings.TrimSpace(req.GetPoolId()), pg.after, pg.size)
	if err != nil {
		return nil, err
	}
	out := &computev1.JoinTokensServiceListResponse{}
	for _, t := range toks {
		out.JoinTokens = append(out.JoinTokens, joinTokenPB(t))
	}
	out.NextPageToken = nextPage(pg, toks, func(t jointoken.Token) string { return t.ID })
	return out, nil
}

func (s *joinTokens) Revoke(ctx context.Context, req *computev1.JoinTokensServiceRevokeRequest) (*computev1.JoinTokensServiceRevokeResponse, error) {
	if err := required("joinTokenId", req.GetJoinTokenId()); err != nil {
		return nil, err
	}
	res, err := authz.Get(ctx, s.db, req.GetTenantId(), authz.TypeJoinToken, req.GetJoinTokenId(), "joinTokenId")
	if err != nil {
		return nil, err
	}
	out := &computev1.JoinTokensServiceRevokeResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			t, err := jointoken.Revoke(ctx, tx, req.GetTenantId(), req.GetJoinTokenId())
			if err != nil {
				return admission.Outcome{}, err
			}
			return outcome(&computev1.JoinTokensServiceRevokeResponse{JoinToken: joinTokenPB(t)}, "joinToken.revoked", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}
