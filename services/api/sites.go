package api

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/sites"
)

// sitesAPI implements computev1.SitesServiceServer.
type sitesAPI struct {
	*Server
	computev1.UnimplementedSitesServiceServer
}

func sitePB(s sites.Site, agents []sites.Agent) *computev1.Site {
	out := &computev1.Site{
		Id: s.ID, TenantId: s.TenantID, Name: s.Name, Description: s.Description, Labels: s.Labels,
		BootEpoch: s.BootEpoch, CreateTime: ts(s.CreatedAt),
	}
	// A lapsed lease is no one's: say who serves the site only while
	// someone does.
	if s.BootHolder != "" && s.BootExpiresAt != nil && s.BootExpiresAt.After(time.Now()) {
		out.BootAgentId, out.BootLeaseExpireTime = s.BootHolder, tsp(s.BootExpiresAt)
	}
	for _, a := range agents {
		out.Agents = append(out.Agents, siteAgentPB(a))
	}
	return out
}

func siteAgentPB(a sites.Agent) *computev1.SiteAgent {
	return &computev1.SiteAgent{Id: a.ID, Hostname: a.Hostname, TokenId: a.TokenID, CreateTime: ts(a.CreatedAt),
		LastSeenTime: tsp(a.LastSeenAt), RevokeTime: tsp(a.RevokedAt)}
}

func siteTokenPB(t sites.Token) *computev1.SiteToken {
	return &computev1.SiteToken{Id: t.ID, SiteId: t.SiteID, Name: t.Name, Uses: int32(t.Uses), UsesLeft: int32(t.UsesLeft),
		CreatedBy: t.CreatedBy, CreateTime: ts(t.CreatedAt), ExpireTime: ts(t.ExpiresAt), RevokeTime: tsp(t.RevokedAt)}
}

func siteResource(s sites.Site) *authz.Resource {
	return &authz.Resource{Type: authz.TypeSite, ID: s.ID, TenantID: s.TenantID, Labels: s.Labels}
}

// site reads the projection row of a site named by siteId.
func (s *sitesAPI) site(ctx context.Context, tenant, id string) (authz.Resource, error) {
	if err := required("siteId", id); err != nil {
		return authz.Resource{}, err
	}
	return authz.Get(ctx, s.db, tenant, authz.TypeSite, id, "siteId")
}

func (s *sitesAPI) Create(ctx context.Context, req *computev1.SitesServiceCreateRequest) (*computev1.SitesServiceCreateResponse, error) {
	if err := validName("name", req.GetName()); err != nil {
		return nil, err
	}
	if len(req.GetName()) > sites.MaxNameLen {
		return nil, fault.New(fault.InvalidInput, "name", "at most %d characters", sites.MaxNameLen)
	}
	if len(req.GetDescription()) > sites.MaxDescriptionLen {
		return nil, fault.New(fault.InvalidInput, "description", "at most %d bytes", sites.MaxDescriptionLen)
	}
	if err := validLabels(req.GetLabels()); err != nil {
		return nil, err
	}
	out := &computev1.SitesServiceCreateResponse{}
	_, err := s.create(ctx, req, req.GetIdempotencyKey(), admission.Create{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: authz.Resource{Type: authz.TypeSite, TenantID: req.GetTenantId(), Labels: req.GetLabels()},
		NewID:    sites.NewID,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, id string) (admission.Outcome, error) {
			site, err := sites.Create(ctx, tx, sites.Site{ID: id, TenantID: req.GetTenantId(), Name: req.GetName(),
				Description: req.GetDescription(), Labels: req.GetLabels()})
			if err != nil {
				return admission.Outcome{}, err
			}
			return outcome(&computev1.SitesServiceCreateResponse{Site: sitePB(site, nil)}, "site.created", siteResource(site))
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *sitesAPI) Get(ctx context.Context, req *computev1.SitesServiceGetRequest) (*computev1.SitesServiceGetResponse, error) {
	res, err := s.site(ctx, req.GetTenantId(), req.GetSiteId())
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), res); err != nil {
		return nil, err
	}
	site, err := sites.Get(ctx, s.db, req.GetTenantId(), req.GetSiteId())
	if err != nil {
		return nil, err
	}
	agents, err := sites.ListAgents(ctx, s.db, site.ID)
	if err != nil {
		return nil, err
	}
	return &computev1.SitesServiceGetResponse{Site: sitePB(site, agents)}, nil
}

func (s *sitesAPI) List(ctx context.Context, req *computev1.SitesServiceListRequest) (*computev1.SitesServiceListResponse, error) {
	pg, err := readPage(req)
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), authz.TenantResource(req.GetTenantId())); err != nil {
		return nil, err
	}
	list, err := sites.List(ctx, s.db, req.GetTenantId(), pg.after, pg.size)
	if err != nil {
		return nil, err
	}
	out := &computev1.SitesServiceListResponse{}
	for _, site := range list {
		out.Sites = append(out.Sites, sitePB(site, nil))
	}
	out.NextPageToken = nextPage(pg, list, func(site sites.Site) string { return site.ID })
	return out, nil
}

func (s *sitesAPI) Delete(ctx context.Context, req *computev1.SitesServiceDeleteRequest) (*computev1.SitesServiceDeleteResponse, error) {
	res, err := s.site(ctx, req.GetTenantId(), req.GetSiteId())
	if err != nil {
		return nil, err
	}
	out := &computev1.SitesServiceDeleteResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			site, err := sites.Lock(ctx, tx, req.GetTenantId(), req.GetSiteId())
			if err != nil {
				return admission.Outcome{}, err
			}
			agents, err := sites.ListAgents(ctx, tx, site.ID)
			if err != nil {
				return admission.Outcome{}, err
			}
			if err := sites.Delete(ctx, tx, req.GetTenantId(), site.ID); err != nil {
				return admission.Outcome{}, err
			}
			if err := authz.Delete(ctx, tx, authz.TypeSite, site.ID); err != nil {
				return admission.Outcome{}, err
			}
			return outcome(&computev1.SitesServiceDeleteResponse{Site: sitePB(site, agents)}, "site.deleted", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *sitesAPI) CreateToken(ctx context.Context, req *computev1.SitesServiceCreateTokenRequest) (*computev1.SitesServiceCreateTokenResponse, error) {
	if len(req.GetName()) > 128 {
		return nil, fault.New(fault.InvalidInput, "name", "at most 128 characters")
	}
	uses := int(req.GetUses())
	if uses == 0 {
		uses = 1
	}
	if uses < 1 || uses > sites.MaxTokenUses {
		return nil, fault.New(fault.InvalidInput, "uses", "expected 0 (meaning 1) to %d, got %d", sites.MaxTokenUses, req.GetUses())
	}
	now := s.now()
	expires := now.Add(sites.DefaultTokenTTL)
	if req.ExpireTime != nil {
		if err := req.GetExpireTime().CheckValid(); err != nil {
			return nil, fault.New(fault.InvalidInput, "expireTime", "%v", err)
		}
		expires = req.GetExpireTime().AsTime()
		if !expires.After(now) {
			return nil, fault.New(fault.InvalidInput, "expireTime", "must be in the future")
		}
		if expires.Sub(now) > sites.MaxTokenTTL {
			return nil, fault.New(fault.InvalidInput, "expireTime", "at most %s away", sites.MaxTokenTTL)
		}
	}
	res, err := s.site(ctx, req.GetTenantId(), req.GetSiteId())
	if err != nil {
		return nil, err
	}
	minted := sites.MintToken() // the token is returned only by the call that stores it
	out := &computev1.SitesServiceCreateTokenResponse{}
	result, err := s.create(ctx, req, req.GetIdempotencyKey(), admission.Create{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Existing: true, // decided on the site; the token has no projection row of its own
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, _ string) (admission.Outcome, error) {
			caller, _ := iam.PrincipalFrom(ctx)
			t, err := sites.CreateToken(ctx, tx, sites.Token{ID: minted.ID, TenantID: req.GetTenantId(), SiteID: req.GetSiteId(),
				Name: req.GetName(), Uses: uses, CreatedBy: caller.IdentityID, ExpiresAt: expires}, minted.Hash)
			if err != nil {
				return admission.Outcome{}, err
			}
			// The stored (and replayed) response carries no token.
			return outcome(&computev1.SitesServiceCreateTokenResponse{SiteToken: siteTokenPB(t)}, "siteToken.created", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	if !result.Replayed && out.GetSiteToken().GetId() == minted.ID {
		out.Token = minted.Token
	}
	return out, nil
}

func (s *sitesAPI) ListTokens(ctx context.Context, req *computev1.SitesServiceListTokensRequest) (*computev1.SitesServiceListTokensResponse, error) {
	pg, err := readPage(req)
	if err != nil {
		return nil, err
	}
	res, err := s.site(ctx, req.GetTenantId(), req.GetSiteId())
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), res); err != nil {
		return nil, err
	}
	toks, err := sites.ListTokens(ctx, s.db, req.GetTenantId(), req.GetSiteId(), pg.after, pg.size)
	if err != nil {
		return nil, err
	}
	out := &computev1.SitesServiceListTokensResponse{}
	for _, t := range toks {
		out.SiteTokens = append(out.SiteTokens, siteTokenPB(t))
	}
	out.NextPageToken = nextPage(pg, toks, func(t sites.Token) string { return t.ID })
	return out, nil
}

func (s *sitesAPI) RevokeToken(ctx context.Context, req *computev1.SitesServiceRevokeTokenRequest) (*computev1.SitesServiceRevokeTokenResponse, error) {
	if err := required("tokenId", req.GetTokenId()); err != nil {
		return nil, err
	}
	res, err := s.site(ctx, req.GetTenantId(), req.GetSiteId())
	if err != nil {
		return nil, err
	}
	out := &computev1.SitesServiceRevokeTokenResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			t, err := sites.RevokeToken(ctx, tx, req.GetTenantId(), req.GetSiteId(), req.GetTokenId())
			if err != nil {
				return admission.Outcome{}, err
			}
			return outcome(&computev1.SitesServiceRevokeTokenResponse{SiteToken: siteTokenPB(t)}, "siteToken.revoked", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *sitesAPI) RevokeAgent(ctx context.Context, req *computev1.SitesServiceRevokeAgentRequest) (*computev1.SitesServiceRevokeAgentResponse, error) {
	if err := required("agentId", req.GetAgentId()); err != nil {
		return nil, err
	}
	res, err := s.site(ctx, req.GetTenantId(), req.GetSiteId())
	if err != nil {
		return nil, err
	}
	out := &computev1.SitesServiceRevokeAgentResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			a, err := sites.RevokeAgent(ctx, tx, req.GetSiteId(), req.GetAgentId())
			if err != nil {
				return admission.Outcome{}, err
			}
			return outcome(&computev1.SitesServiceRevokeAgentResponse{Agent: siteAgentPB(a)}, "site.agent_revoked", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}
