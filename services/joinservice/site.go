package joinservice

import (
	"context"
	"crypto/x509"

	"github.com/jackc/pgx/v5"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/audit"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/sites"
)

// Site agents.
//
// `bcd site join` calls Join with role "site" and a site token
// (bcst_<id>.<secret>, sealed like a join token): joinservice spends one
// use of the token, creates the site agent (sag_…) in the token's site and
// signs a 24-hour certificate of role site,
// spiffe://<trust domain>/site/<site id>/agent/<agent id>, with an audit row
// and a site.agent_enrolled event, in one transaction. Renew renews a site
// certificate as a site certificate.

// Roles a JoinRequest may ask for (JoinRequest.role, JoinResponse.role).
const (
	// RoleNode is a node (`bcd join`), and an empty role.
	RoleNode = "node"
	// RoleSite is a site agent (`bcd site join`).
	RoleSite = "site"
)

// MaxHostnameLen bounds the hostname a site agent enrolls with.
const MaxHostnameLen = 253

// siteRedeemAction is the audit log's action for a site enrollment (not a
// catalog action: the token is the credential).
const siteRedeemAction = "compute:site-tokens:redeem"

// enrollSite redeems a site token for a site agent and its certificate.
func (s *Service) enrollSite(ctx context.Context, token string, csr *x509.CertificateRequest, hostname string) (*agentv1.JoinResponse, error) {
	if len(hostname) > MaxHostnameLen {
		return nil, fault.New(fault.InvalidInput, "claims.hostname", "at most %d bytes, got %d", MaxHostnameLen, len(hostname))
	}
	var (
		agent sites.Agent
		chain []*x509.Certificate
	)
	err := db.InTx(ctx, s.db, db.TxOptions{}, func(tx pgx.Tx) error {
		tok, err := sites.RedeemToken(ctx, tx, token)
		if err != nil {
			return err
		}
		agent, err = sites.CreateAgent(ctx, tx, sites.Agent{ID: sites.NewAgentID(), TenantID: tok.TenantID, SiteID: tok.SiteID, TokenID: tok.ID, Hostname: hostname})
		if err != nil {
			return err
		}
		if chain, err = s.ca.IssueSiteAgent(ctx, tx, agent.SiteID, agent.ID, csr.PublicKey); err != nil {
			return err
		}
		res := authz.Resource{Type: authz.TypeSite, ID: agent.SiteID, TenantID: agent.TenantID}
		if err := audit.Write(ctx, tx, audit.Record{
			TenantID: agent.TenantID, Actor: "joinservice", ActorTenantID: agent.TenantID,
			Action: siteRedeemAction, Resource: res.UID(), Decision: audit.Allow, Method: joinMethod,
			Detail: map[string]any{"siteTokenId": tok.ID, "agentId": agent.ID, "hostname": hostname, "serial": nodeca.Serial(chain[0].SerialNumber)},
		}); err != nil {
			return err
		}
		_, err = outbox.Write(ctx, tx, outbox.Event{TenantID: agent.TenantID, Type: "site.agent_enrolled", Resource: agent.SiteID, Payload: map[string]any{
			"siteId": agent.SiteID, "agentId": agent.ID, "siteTokenId": tok.ID, "hostname": hostname,
		}})
		return err
	})
	if err != nil {
		return nil, err
	}
	id, _ := s.ca.SiteAgentSPIFFEID(agent.SiteID, agent.ID)
	s.logger.InfoContext(ctx, "site agent enrolled", "site", agent.SiteID, "agent", agent.ID, "tenant", agent.TenantID, "hostname", hostname)
	return &agentv1.JoinResponse{NodeId: agent.ID, CertificateChain: der(chain), TrustBundle: s.ca.TrustBundle(), SpiffeId: id.String(),
		Role: RoleSite, SiteId: agent.SiteID}, nil
}

// renewSite is Renew for a site agent's certificate: it must verify (chain,
// recorded serial, neither it nor its agent revoked), and the CSR must be
// for its key; the fresh certificate is a site agent's for the same site and
// agent.
func (s *Service) renewSite(ctx context.Context, peer []*x509.Certificate, req *agentv1.RenewRequest) (*agentv1.RenewResponse, error) {
	siteID, agentID, err := s.ca.VerifySiteAgent(ctx, s.db, peer)
	if err != nil {
		return nil, err
	}
	csr, err := nodeca.ParseCSR(req.GetCsr())
	if err != nil {
		return nil, err
	}
	if !nodeca.SameKey(csr.PublicKey, peer[0].PublicKey) {
		return nil, fault.New(fault.InvalidInput, "csr", "the request must be for the key of the certificate presented (site agent %s)", agentID)
	}
	if err := s.allowRenew(agentID); err != nil {
		return nil, err
	}
	var chain []*x509.Certificate
	err = db.InTx(ctx, s.db, db.TxOptions{}, func(tx pgx.Tx) error {
		a, err := sites.GetAgent(ctx, tx, agentID)
		if fault.CodeOf(err) == fault.NotFound || (err == nil && (a.RevokedAt != nil || a.SiteID != siteID)) {
			return fault.New(fault.Unauthenticated, "certificate", "site agent %s is not a live agent of %s", agentID, siteID)
		}
		if err != nil {
			return err
		}
		chain, err = s.ca.IssueSiteAgent(ctx, tx, siteID, agentID, csr.PublicKey)
		return err
	})
	if err != nil {
		return nil, err
	}
	s.logger.DebugContext(ctx, "site agent certificate renewed", "site", siteID, "agent", agentID, "serial", nodeca.Serial(chain[0].SerialNumber))
	return &agentv1.RenewResponse{CertificateChain: der(chain), TrustBundle: s.ca.TrustBundle()}, nil
}

// isSiteAgent reports whether leaf's SPIFFE ID has the shape of a site
// agent's (the trust domain and the rest are checked by VerifySiteAgent).
func isSiteAgent(leaf *x509.Certificate) bool {
	id, err := x509svid.IDFromCert(leaf)
	if err != nil {
		return false
	}
	_, _, ok := nodeca.ParseSiteAgentPath(id.Path())
	return ok
}

// limit cuts s to at most n bytes, for a message quoting caller input.
func limit(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}
