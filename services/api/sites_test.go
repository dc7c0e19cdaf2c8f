package api_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/sites"
	"github.com/bettercompute/bettercompute/services/api"
)

// TestSites: create, get, list, delete; tokens minted once and shown once,
// listed without secrets, redeemable until revoked; an agent holding the
// boot lease blocks a delete until it is revoked; another tenant sees
// none of it. Every bad input names its field.
func TestSites(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	_, acme := h.member(t, "acme", "ops")
	h.policy(t, "acme", "members", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)
	_, other := h.member(t, "other", "ops")
	h.policy(t, "other", "members", `permit (principal in Tenant::"other", action, resource in Tenant::"other");`)
	c := computev1.NewSitesServiceClient(h.conn)
	ctx := as(acme)

	created, err := c.Create(ctx, &computev1.SitesServiceCreateRequest{TenantId: "acme", Name: "fra1", Labels: map[string]string{"dc": "fra"},
		IdempotencyKey: "k1"})
	if err != nil {
		t.Fatal(err)
	}
	site := created.GetSite()
	if !strings.HasPrefix(site.GetId(), "site_") || site.GetName() != "fra1" || site.GetBootAgentId() != "" {
		t.Fatalf("created %v", site)
	}
	again, err := c.Create(ctx, &computev1.SitesServiceCreateRequest{TenantId: "acme", Name: "fra1", Labels: map[string]string{"dc": "fra"},
		IdempotencyKey: "k1"})
	if err != nil || again.GetSite().GetId() != site.GetId() {
		t.Fatalf("a retry under the same key: %v %v, want the same site", again, err)
	}
	_, err = c.Create(ctx, &computev1.SitesServiceCreateRequest{TenantId: "acme", Name: "fra1"})
	wantCode(t, err, fault.Conflict, "name")

	for _, bad := range []struct {
		req   *computev1.SitesServiceCreateRequest
		field string
	}{
		{&computev1.SitesServiceCreateRequest{TenantId: "acme"}, "name"},
		{&computev1.SitesServiceCreateRequest{TenantId: "acme", Name: "Not_A_Name"}, "name"},
		{&computev1.SitesServiceCreateRequest{TenantId: "acme", Name: strings.Repeat("a", 64)}, "name"},
		{&computev1.SitesServiceCreateRequest{TenantId: "acme", Name: "ok", Description: strings.Repeat("d", 1025)}, "description"},
		{&computev1.SitesServiceCreateRequest{TenantId: "acme", Name: "ok", Labels: map[string]string{"bad key!": "v"}}, "labels"},
	} {
		_, err := c.Create(ctx, bad.req)
		wantCode(t, err, fault.InvalidInput, bad.field)
	}

	// Tokens.
	tok, err := c.CreateToken(ctx, &computev1.SitesServiceCreateTokenRequest{TenantId: "acme", SiteId: site.GetId(), Uses: 2, IdempotencyKey: "t1"})
	if err != nil {
		t.Fatal(err)
	}
	if !sites.IsToken(tok.GetToken()) || tok.GetSiteToken().GetUsesLeft() != 2 {
		t.Fatalf("minted %v", tok)
	}
	replay, err := c.CreateToken(ctx, &computev1.SitesServiceCreateTokenRequest{TenantId: "acme", SiteId: site.GetId(), Uses: 2, IdempotencyKey: "t1"})
	if err != nil || replay.GetToken() != "" || replay.GetSiteToken().GetId() != tok.GetSiteToken().GetId() {
		t.Fatalf("a replayed createToken: %v %v, want the same token without its secret", replay, err)
	}
	for _, bad := range []struct {
		req   *computev1.SitesServiceCreateTokenRequest
		code  fault.Code
		field string
	}{
		{&computev1.SitesServiceCreateTokenRequest{TenantId: "acme"}, fault.InvalidInput, "siteId"},
		{&computev1.SitesServiceCreateTokenRequest{TenantId: "acme", SiteId: "site_nope"}, fault.NotFound, "siteId"},
		{&computev1.SitesServiceCreateTokenRequest{TenantId: "acme", SiteId: site.GetId(), Uses: 101}, fault.InvalidInput, "uses"},
		{&computev1.SitesServiceCreateTokenRequest{TenantId: "acme", SiteId: site.GetId(), Uses: -1}, fault.InvalidInput, "uses"},
		{&computev1.SitesServiceCreateTokenRequest{TenantId: "acme", SiteId: site.GetId(), Name: strings.Repeat("n", 129)}, fault.InvalidInput, "name"},
		{&computev1.SitesServiceCreateTokenRequest{TenantId: "acme", SiteId: site.GetId(),
			ExpireTime: timestamppb.New(time.Now().Add(-time.Minute))}, fault.InvalidInput, "expireTime"},
		{&computev1.SitesServiceCreateTokenRequest{TenantId: "acme", SiteId: site.GetId(),
			ExpireTime: timestamppb.New(time.Now().Add(31 * 24 * time.Hour))}, fault.InvalidInput, "expireTime"},
	} {
		_, err := c.CreateToken(ctx, bad.req)
		wantCode(t, err, bad.code, bad.field)
	}
	list, err := c.ListTokens(ctx, &computev1.SitesServiceListTokensRequest{TenantId: "acme", SiteId: site.GetId()})
	if err != nil || len(list.GetSiteTokens()) != 1 {
		t.Fatalf("list tokens: %v %v", list, err)
	}
	if strings.Contains(list.String(), tok.GetToken()[strings.IndexByte(tok.GetToken(), '.')+1:]) {
		t.Fatal("listTokens shows the secret")
	}
	if _, err := sites.RedeemToken(context.Background(), h.db, tok.GetToken()); err != nil {
		t.Fatalf("redeem the minted token: %v", err)
	}
	if _, err := c.RevokeToken(ctx, &computev1.SitesServiceRevokeTokenRequest{TenantId: "acme", SiteId: site.GetId(), TokenId: tok.GetSiteToken().GetId()}); err != nil {
		t.Fatal(err)
	}
	if _, err := sites.RedeemToken(context.Background(), h.db, tok.GetToken()); fault.CodeOf(err) != fault.Unauthenticated {
		t.Fatalf("redeem a revoked token: %v", err)
	}
	_, err = c.RevokeToken(ctx, &computev1.SitesServiceRevokeTokenRequest{TenantId: "acme", SiteId: site.GetId()})
	wantCode(t, err, fault.InvalidInput, "tokenId")
	_, err = c.RevokeToken(ctx, &computev1.SitesServiceRevokeTokenRequest{TenantId: "acme", SiteId: site.GetId(), TokenId: "nope"})
	wantCode(t, err, fault.NotFound, "tokenId")

	// An agent holding the boot lease blocks the delete; revoking it ends
	// the lease.
	agent, err := sites.CreateAgent(context.Background(), h.db, sites.Agent{ID: sites.NewAgentID(), TenantID: "acme", SiteID: site.GetId(),
		TokenID: tok.GetSiteToken().GetId(), Hostname: "pxe-1"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sites.AcquireLease(context.Background(), h.db, site.GetId(), agent.ID, time.Minute); err != nil {
		t.Fatal(err)
	}
	got, err := c.Get(ctx, &computev1.SitesServiceGetRequest{TenantId: "acme", SiteId: site.GetId()})
	if err != nil || got.GetSite().GetBootAgentId() != agent.ID || got.GetSite().GetBootEpoch() != 1 || len(got.GetSite().GetAgents()) != 1 {
		t.Fatalf("get: %v %v, want %s holding the lease at epoch 1", got, err, agent.ID)
	}
	_, err = c.Delete(ctx, &computev1.SitesServiceDeleteRequest{TenantId: "acme", SiteId: site.GetId()})
	wantCode(t, err, fault.Conflict, "siteId")
	_, err = c.RevokeAgent(ctx, &computev1.SitesServiceRevokeAgentRequest{TenantId: "acme", SiteId: site.GetId(), AgentId: "sag_nope"})
	wantCode(t, err, fault.NotFound, "agentId")
	if _, err := c.RevokeAgent(ctx, &computev1.SitesServiceRevokeAgentRequest{TenantId: "acme", SiteId: site.GetId(), AgentId: agent.ID}); err != nil {
		t.Fatal(err)
	}
	got, err = c.Get(ctx, &computev1.SitesServiceGetRequest{TenantId: "acme", SiteId: site.GetId()})
	if err != nil || got.GetSite().GetBootAgentId() != "" || got.GetSite().GetAgents()[0].GetRevokeTime() == nil {
		t.Fatalf("after revokeAgent: %v %v, want no lease holder and the agent revoked", got, err)
	}

	// Another tenant sees none of it.
	_, err = c.Get(as(other), &computev1.SitesServiceGetRequest{TenantId: "other", SiteId: site.GetId()})
	wantCode(t, err, fault.NotFound, "siteId")
	_, err = c.Get(as(other), &computev1.SitesServiceGetRequest{TenantId: "acme", SiteId: site.GetId()})
	if code, _ := envelope(err); code != fault.AccessDenied && code != fault.NotFound {
		t.Fatalf("another tenant reading acme's site: %v", err)
	}
	otherList, err := c.List(as(other), &computev1.SitesServiceListRequest{TenantId: "other"})
	if err != nil || len(otherList.GetSites()) != 0 {
		t.Fatalf("other's list: %v %v", otherList, err)
	}

	// Over REST, with the new name rule.
	status, body := h.rest(t, acme, "sites/get", `{"tenantId":"acme","siteId":"`+site.GetId()+`"}`)
	if status != 200 || body["site"].(map[string]any)["name"] != "fra1" {
		t.Fatalf("REST sites/get: %d %v", status, body)
	}
	status, body = h.rest(t, acme, "sites/get", `{"tenantId":"acme"}`)
	wantREST(t, status, body, fault.InvalidInput, "siteId")

	if _, err := c.Delete(ctx, &computev1.SitesServiceDeleteRequest{TenantId: "acme", SiteId: site.GetId()}); err != nil {
		t.Fatal(err)
	}
	_, err = c.Get(ctx, &computev1.SitesServiceGetRequest{TenantId: "acme", SiteId: site.GetId()})
	wantCode(t, err, fault.NotFound, "siteId")
	if n := h.count(t, `SELECT count(*) FROM outbox WHERE type IN ('site.created', 'site.deleted', 'siteToken.created', 'siteToken.revoked', 'site.agent_revoked')`); n != 5 {
		t.Fatalf("%d site events, want 5 (created, token created, token revoked, agent revoked, deleted)", n)
	}
}
