package nodeca

import (
	"context"
	"crypto"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"net/url"

	"github.com/jackc/pgx/v5"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"

	"github.com/bettercompute/bettercompute/proto/spiffepath"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Site agent certificates.
//
// A site agent (`bcd site`) holds a certificate of role site: URI SAN
// spiffe://<trust domain>/site/<site id>/agent/<agent id>, client
// authentication, valid for [SVIDValidity] like a node's. Its serial is
// recorded in site_agent_certificates (migration 00022), and
// [CA.VerifySiteAgent] refuses a certificate that is unrecorded, revoked,
// or whose agent is revoked, as [CA.VerifyNode] does for nodes. The two
// roles never stand in for each other: a node certificate is not a site
// agent's and a site agent's is not a node's.

// SiteAgentSPIFFEID returns spiffe://<trust domain>/site/<siteID>/agent/<agentID>.
func (ca *CA) SiteAgentSPIFFEID(siteID, agentID string) (spiffeid.ID, error) {
	return spiffeid.FromSegments(ca.td, "site", siteID, "agent", agentID)
}

// SiteAgentIDOf returns the site and agent ids of a site agent SPIFFE ID in
// the CA's trust domain, or an error for any other ID (another trust
// domain, another role, extra or empty segments).
func (ca *CA) SiteAgentIDOf(id spiffeid.ID) (siteID, agentID string, err error) {
	if id.TrustDomain() != ca.td {
		return "", "", fmt.Errorf("SPIFFE ID %s is not in trust domain %s", id, ca.td)
	}
	site, agent, ok := ParseSiteAgentPath(id.Path())
	if !ok {
		return "", "", fmt.Errorf("SPIFFE ID %s is not a site agent's", id)
	}
	return site, agent, nil
}

// ParseSiteAgentPath splits a SPIFFE ID path /site/<site id>/agent/<agent
// id>; ok is false for any other path (see proto/spiffepath).
func ParseSiteAgentPath(path string) (siteID, agentID string, ok bool) {
	return spiffepath.SiteAgentIDs(path)
}

// IssueSiteAgent signs a [SVIDValidity] client certificate for pub with URI
// SAN spiffe://<trust domain>/site/<siteID>/agent/<agentID> and records its
// serial in q (the caller's transaction: an enrollment or renewal that does
// not commit leaves an unrecorded certificate, which
// [CA.VerifySiteAgent] refuses). It returns the chain, leaf first.
func (ca *CA) IssueSiteAgent(ctx context.Context, q Querier, siteID, agentID string, pub crypto.PublicKey) ([]*x509.Certificate, error) {
	id, err := ca.SiteAgentSPIFFEID(siteID, agentID)
	if err != nil {
		return nil, fmt.Errorf("site agent SPIFFE ID: %w", err)
	}
	now := ca.now()
	tmpl := &x509.Certificate{
		Subject:     pkix.Name{CommonName: agentID},
		NotBefore:   now.Add(-Backdate),
		NotAfter:    now.Add(SVIDValidity),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		URIs:        []*url.URL{id.URL()},
	}
	leaf, err := ca.sign(tmpl, pub)
	if err != nil {
		return nil, err
	}
	if _, err := q.Exec(ctx, `INSERT INTO site_agent_certificates (serial, agent_id, not_before, not_after) VALUES ($1, $2, $3, $4)`,
		Serial(leaf.SerialNumber), agentID, leaf.NotBefore, leaf.NotAfter); err != nil {
		return nil, fmt.Errorf("record certificate of site agent %s: %w", agentID, err)
	}
	return append([]*x509.Certificate{leaf}, ca.chain...), nil
}

// VerifySiteAgent checks a site agent's certificate chain (leaf first) as
// the gateway and Renew must: it chains to the trust bundle and is valid
// now, its SPIFFE ID is a site agent's in this trust domain, its serial is
// recorded for that agent, and neither the certificate nor the agent is
// revoked. It returns the site and agent ids. Failures are UNAUTHENTICATED
// on "certificate" (a revoked one wraps [ErrRevoked]).
func (ca *CA) VerifySiteAgent(ctx context.Context, q Querier, chain []*x509.Certificate) (siteID, agentID string, err error) {
	id, _, err := x509svid.Verify(chain, ca.bundle, x509svid.WithTime(ca.now()))
	if err != nil {
		return "", "", fault.Wrap(err, fault.Unauthenticated, "certificate", "the site agent certificate does not verify: %v", err)
	}
	if siteID, agentID, err = ca.SiteAgentIDOf(id); err != nil {
		return "", "", fault.Wrap(err, fault.Unauthenticated, "certificate", "%v", err)
	}
	var refused bool
	err = q.QueryRow(ctx, `SELECT c.revoked_at IS NOT NULL OR a.revoked_at IS NOT NULL OR a.site_id <> $3
		FROM site_agent_certificates c JOIN site_agents a ON a.id = c.agent_id
		WHERE c.serial = $1 AND c.agent_id = $2`, Serial(chain[0].SerialNumber), agentID, siteID).Scan(&refused)
	if errors.Is(err, pgx.ErrNoRows) {
		refused = true
	} else if err != nil {
		return "", "", fmt.Errorf("check revocation: %w", err)
	}
	if refused {
		return "", "", fault.Wrap(ErrRevoked, fault.Unauthenticated, "certificate", "the certificate of site agent %s (serial %s) is revoked", agentID, Serial(chain[0].SerialNumber))
	}
	return siteID, agentID, nil
}

// RevokeSiteAgent revokes every unrevoked certificate of site agent
// agentID and returns how many it revoked.
func RevokeSiteAgent(ctx context.Context, q Querier, agentID string) (int64, error) {
	tag, err := q.Exec(ctx, `UPDATE site_agent_certificates SET revoked_at = now() WHERE agent_id = $1 AND revoked_at IS NULL`, agentID)
	if err != nil {
		return 0, fmt.Errorf("revoke certificates of site agent %s: %w", agentID, err)
	}
	return tag.RowsAffected(), nil
}
