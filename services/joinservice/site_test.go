package joinservice_test

import (
	"context"
	"crypto/x509"
	"errors"
	"strings"
	"testing"
	"time"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/jointoken"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	"github.com/bettercompute/bettercompute/pkg/sites"
)

// siteToken makes a site and a site token of uses for it.
func (f *harness) siteToken(t *testing.T, uses int) (siteID, token string) {
	t.Helper()
	ctx := context.Background()
	s, err := sites.Create(ctx, f.db, sites.Site{ID: sites.NewID(), TenantID: "root", Name: "fra1"})
	if err != nil {
		t.Fatal(err)
	}
	m := sites.MintToken()
	if _, err := sites.CreateToken(ctx, f.db, sites.Token{ID: m.ID, TenantID: "root", SiteID: s.ID, Uses: uses, ExpiresAt: time.Now().Add(time.Hour)}, m.Hash); err != nil {
		t.Fatal(err)
	}
	return s.ID, m.Token
}

func (f *harness) siteRequest(t *testing.T, token, hostname string, role string) (*agentv1.JoinRequest, []byte) {
	t.Helper()
	k := newKey(t)
	csr := csrFor(t, k)
	enc, sealed := seal(t, f.key.PublicKey(), token, csr)
	return &agentv1.JoinRequest{SealedToken: sealed, EncapsulatedKey: enc, JoinserviceKeyId: f.key.ID(), Csr: csr,
		Claims: &agentv1.HardwareClaims{Hostname: hostname}, Role: role}, csr
}

func (f *harness) usesLeft(t *testing.T, table string) int {
	t.Helper()
	var n int
	if err := f.db.QueryRow(context.Background(), `SELECT uses_left FROM `+table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestSiteAgentEnrolls: a site token makes a site agent with a site
// certificate, an audit row and a site.agent_enrolled event, and the
// certificate renews as a site certificate.
func TestSiteAgentEnrolls(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := context.Background()
	siteID, tok := f.siteToken(t, 2)
	req, csr := f.siteRequest(t, tok, "pxe-1", "site")
	resp, err := f.svc.Join(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	want := "spiffe://" + trustDomain + "/site/" + siteID + "/agent/" + resp.GetNodeId()
	if resp.GetRole() != "site" || resp.GetSiteId() != siteID || !strings.HasPrefix(resp.GetNodeId(), "sag_") || resp.GetSpiffeId() != want {
		t.Fatalf("answer role %q site %q id %q spiffe %q", resp.GetRole(), resp.GetSiteId(), resp.GetNodeId(), resp.GetSpiffeId())
	}
	chain := parseChain(t, resp.GetCertificateChain())
	if chain[0].URIs[0].String() != want {
		t.Fatalf("certificate %v, want %s", chain[0].URIs, want)
	}
	if s, a, err := f.ca.VerifySiteAgent(ctx, f.db, chain); err != nil || s != siteID || a != resp.GetNodeId() {
		t.Fatalf("VerifySiteAgent %q %q %v", s, a, err)
	}
	a, err := sites.GetAgent(ctx, f.db, resp.GetNodeId())
	if err != nil || a.SiteID != siteID || a.Hostname != "pxe-1" || a.TokenID == "" {
		t.Fatalf("agent %+v %v", a, err)
	}
	if left := f.usesLeft(t, "site_tokens"); left != 1 {
		t.Fatalf("uses left %d, want 1", left)
	}
	var events, audits int
	if err := f.db.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE type = 'site.agent_enrolled' AND resource_id = $1 AND payload->>'agentId' = $2`,
		siteID, a.ID).Scan(&events); err != nil || events != 1 {
		t.Fatalf("%d site.agent_enrolled events (%v)", events, err)
	}
	if err := f.db.QueryRow(ctx, `SELECT count(*) FROM audit WHERE action = 'compute:site-tokens:redeem' AND detail->>'agentId' = $1`, a.ID).Scan(&audits); err != nil || audits != 1 {
		t.Fatalf("%d audit rows (%v)", audits, err)
	}
	if _, err := f.svc.Join(ctx, must(f.siteRequest(t, tok, "pxe-2", "site"))); err != nil {
		t.Fatalf("the token's second use: %v", err)
	}
	if _, err := f.svc.Join(ctx, must(f.siteRequest(t, tok, "pxe-3", "site"))); !errors.Is(err, sites.ErrTokenExhausted) {
		t.Fatalf("a third use: %v, want ErrTokenExhausted", err)
	}

	t.Run("the certificate renews as a site certificate", func(t *testing.T) {
		renewed, err := f.svc.Renew(ctx, chain, &agentv1.RenewRequest{Csr: csr})
		if err != nil {
			t.Fatal(err)
		}
		fresh := parseChain(t, renewed.GetCertificateChain())
		if fresh[0].URIs[0].String() != want {
			t.Fatalf("renewed %v, want %s", fresh[0].URIs, want)
		}
		if _, _, err := f.ca.VerifySiteAgent(ctx, f.db, fresh); err != nil {
			t.Fatal(err)
		}
		if _, err := f.ca.VerifyNode(ctx, f.db, fresh); err == nil {
			t.Fatal("a renewed site certificate verified as a node's")
		}
	})

	t.Run("a revoked agent cannot renew", func(t *testing.T) {
		if _, err := sites.RevokeAgent(ctx, f.db, siteID, a.ID); err != nil {
			t.Fatal(err)
		}
		_, err := f.svc.Renew(ctx, chain, &agentv1.RenewRequest{Csr: csr})
		wantFault(t, err, fault.Unauthenticated, "certificate")
		if !errors.Is(err, nodeca.ErrRevoked) {
			t.Fatalf("%v is not ErrRevoked", err)
		}
	})
}

func must(req *agentv1.JoinRequest, _ []byte) *agentv1.JoinRequest { return req }

// TestTokensNeverCrossRoles: a site token never makes a node, a join token
// never a site agent; either refusal spends nothing.
func TestTokensNeverCrossRoles(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := context.Background()
	_, siteTok := f.siteToken(t, 1)
	joinTok := f.token(t, jointoken.Token{Uses: 1})

	for _, role := range []string{"", "node"} {
		_, err := f.svc.Join(ctx, must(f.siteRequest(t, siteTok, "pxe-1", role)))
		wantFault(t, err, fault.InvalidInput, "role")
	}
	req := f.request(t, joinTok, "SN-X", newKey(t))
	req.Role = "site"
	_, err := f.svc.Join(ctx, req)
	wantFault(t, err, fault.InvalidInput, "role")
	req = f.request(t, joinTok, "SN-X", newKey(t))
	req.Role = "ramdisk"
	_, err = f.svc.Join(ctx, req)
	wantFault(t, err, fault.InvalidInput, "role")

	if left := f.usesLeft(t, "site_tokens"); left != 1 {
		t.Fatalf("the site token has %d uses left, want 1", left)
	}
	if left := f.usesLeft(t, "join_tokens"); left != 1 {
		t.Fatalf("the join token has %d uses left, want 1", left)
	}
	var agents, nodes int
	if err := f.db.QueryRow(ctx, `SELECT (SELECT count(*) FROM site_agents), (SELECT count(*) FROM nodes)`).Scan(&agents, &nodes); err != nil || agents != 0 || nodes != 0 {
		t.Fatalf("%d agents, %d nodes (%v)", agents, nodes, err)
	}
	// Each works for its own role.
	if resp, err := f.svc.Join(ctx, must(f.siteRequest(t, siteTok, "pxe-1", "site"))); err != nil || resp.GetRole() != "site" {
		t.Fatalf("site join: %v %v", resp.GetRole(), err)
	}
	resp, err := f.svc.Join(ctx, f.request(t, joinTok, "SN-X", newKey(t)))
	if err != nil || resp.GetRole() != "node" || !strings.HasPrefix(resp.GetNodeId(), "node_") {
		t.Fatalf("node join: %v %v", resp, err)
	}
	leaf := parseChain(t, resp.GetCertificateChain())[0]
	if _, _, err := f.ca.VerifySiteAgent(ctx, f.db, []*x509.Certificate{leaf}); err == nil {
		t.Fatal("a node certificate verified as a site agent's")
	}
}
