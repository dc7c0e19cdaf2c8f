package nodeca_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/sites"
)

func TestSiteAgentIDOf(t *testing.T) {
	t.Parallel()
	ca, err := nodeca.Open(nodeca.Config{TrustDomain: "fleet.test", Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	id, err := ca.SiteAgentSPIFFEID("site_a", "sag_1")
	if err != nil || id.String() != "spiffe://fleet.test/site/site_a/agent/sag_1" {
		t.Fatalf("SPIFFE ID %s %v", id, err)
	}
	if s, a, err := ca.SiteAgentIDOf(id); err != nil || s != "site_a" || a != "sag_1" {
		t.Fatalf("SiteAgentIDOf %q %q %v", s, a, err)
	}
	for _, bad := range []string{
		"spiffe://fleet.test/node/node_a",
		"spiffe://fleet.test/site/site_a",
		"spiffe://fleet.test/site/site_a/agent",
		"spiffe://fleet.test/site/site_a/agent/sag_1/x",
		"spiffe://fleet.test/site/site_a/node/sag_1",
		"spiffe://other.test/site/site_a/agent/sag_1",
	} {
		if _, _, err := ca.SiteAgentIDOf(spiffeid.RequireFromString(bad)); err == nil {
			t.Errorf("%s is not a site agent of fleet.test", bad)
		}
	}
	node, _ := ca.NodeSPIFFEID("node_a")
	if _, err := ca.NodeIDOf(id); err == nil {
		t.Error("a site agent's ID is not a node's")
	}
	if _, _, err := ca.SiteAgentIDOf(node); err == nil {
		t.Error("a node's ID is not a site agent's")
	}
}

func TestSiteAgentCertificates(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t)
	ca, err := nodeca.Open(nodeca.Config{TrustDomain: "fleet.test", Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	s, err := sites.Create(ctx, db, sites.Site{ID: sites.NewID(), TenantID: "root", Name: "fra1"})
	if err != nil {
		t.Fatal(err)
	}
	a, err := sites.CreateAgent(ctx, db, sites.Agent{ID: sites.NewAgentID(), TenantID: "root", SiteID: s.ID, Hostname: "pxe-1"})
	if err != nil {
		t.Fatal(err)
	}
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	chain, err := ca.IssueSiteAgent(ctx, db, s.ID, a.ID, key.Public())
	if err != nil {
		t.Fatal(err)
	}
	leaf := chain[0]
	if leaf.URIs[0].String() != "spiffe://fleet.test/site/"+s.ID+"/agent/"+a.ID || leaf.IsCA ||
		len(leaf.ExtKeyUsage) != 1 || leaf.NotAfter.Sub(leaf.NotBefore) != nodeca.SVIDValidity+nodeca.Backdate {
		t.Fatalf("leaf %v %v %s..%s", leaf.URIs, leaf.ExtKeyUsage, leaf.NotBefore, leaf.NotAfter)
	}

	t.Run("it verifies as the site agent and never as a node", func(t *testing.T) {
		site, agent, err := ca.VerifySiteAgent(ctx, db, chain)
		if err != nil || site != s.ID || agent != a.ID {
			t.Fatalf("VerifySiteAgent %q %q %v", site, agent, err)
		}
		if _, err := ca.VerifyNode(ctx, db, chain); fault.CodeOf(err) != fault.Unauthenticated {
			t.Fatalf("VerifyNode of a site certificate: %v, want UNAUTHENTICATED", err)
		}
		if refused, err := nodeca.RevokedAmong(ctx, db, []string{nodeca.Serial(leaf.SerialNumber)}); err != nil || len(refused) != 0 {
			t.Fatalf("RevokedAmong a live site certificate: %v %v", refused, err)
		}
	})

	t.Run("an unrecorded certificate is refused", func(t *testing.T) {
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		unrecorded, err := ca.IssueSiteAgent(ctx, tx, s.ID, a.ID, key.Public())
		_ = tx.Rollback(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := ca.VerifySiteAgent(ctx, db, unrecorded); !errors.Is(err, nodeca.ErrRevoked) || fault.CodeOf(err) != fault.Unauthenticated {
			t.Fatalf("unrecorded: %v, want UNAUTHENTICATED wrapping ErrRevoked", err)
		}
	})

	t.Run("a certificate recorded for another agent is refused", func(t *testing.T) {
		other, err := sites.CreateAgent(ctx, db, sites.Agent{ID: sites.NewAgentID(), TenantID: "root", SiteID: s.ID})
		if err != nil {
			t.Fatal(err)
		}
		// Signed for a but recorded as other's: the row must name the
		// SPIFFE ID's agent.
		c, err := ca.IssueSiteAgent(ctx, db, s.ID, a.ID, key.Public())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := db.Exec(ctx, `UPDATE site_agent_certificates SET agent_id = $1 WHERE serial = $2`, other.ID, nodeca.Serial(c[0].SerialNumber)); err != nil {
			t.Fatal(err)
		}
		if _, _, err := ca.VerifySiteAgent(ctx, db, c); !errors.Is(err, nodeca.ErrRevoked) {
			t.Fatalf("mismatched row: %v, want refused", err)
		}
	})

	t.Run("revoking the agent revokes its certificates", func(t *testing.T) {
		if _, err := sites.RevokeAgent(ctx, db, s.ID, a.ID); err != nil {
			t.Fatal(err)
		}
		if _, _, err := ca.VerifySiteAgent(ctx, db, chain); !errors.Is(err, nodeca.ErrRevoked) {
			t.Fatalf("revoked agent: %v, want ErrRevoked", err)
		}
		serial := nodeca.Serial(leaf.SerialNumber)
		if refused, err := nodeca.RevokedAmong(ctx, db, []string{serial}); err != nil || !slices.Equal(refused, []string{serial}) {
			t.Fatalf("RevokedAmong after revocation: %v %v", refused, err)
		}
		var live int
		if err := db.QueryRow(ctx, `SELECT count(*) FROM site_agent_certificates WHERE agent_id = $1 AND revoked_at IS NULL`, a.ID).Scan(&live); err != nil || live != 0 {
			t.Fatalf("%d unrevoked certificates left (%v)", live, err)
		}
	})

	t.Run("expired rows are pruned with nodes'", func(t *testing.T) {
		var before int
		if err := db.QueryRow(ctx, `SELECT count(*) FROM site_agent_certificates`).Scan(&before); err != nil || before < 2 {
			t.Fatalf("%d rows (%v)", before, err)
		}
		n, err := nodeca.PruneExpired(ctx, db, time.Now().Add(nodeca.SVIDValidity+time.Hour), 100)
		if err != nil || n != int64(before) {
			t.Fatalf("pruned %d of %d (%v)", n, before, err)
		}
	})
}
