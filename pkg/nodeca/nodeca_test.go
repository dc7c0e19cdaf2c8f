package nodeca_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestDevCAIsGeneratedOnce(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "pki")
	cas := make([]*nodeca.CA, 8)
	var wg sync.WaitGroup
	for i := range cas {
		wg.Go(func() {
			ca, err := nodeca.Open(nodeca.Config{TrustDomain: "dev.test", Dir: dir})
			if err != nil {
				t.Error(err)
			}
			cas[i] = ca
		})
	}
	wg.Wait()
	for _, ca := range cas[1:] {
		if ca == nil || !ca.Certificate().Equal(cas[0].Certificate()) {
			t.Fatal("concurrent opens must agree on one CA")
		}
	}
	fi, err := os.Stat(filepath.Join(dir, nodeca.DevFile))
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("CA file: %v %v", fi, err)
	}
	if _, err := nodeca.Open(nodeca.Config{TrustDomain: "dev.test", CertFile: "x"}); err == nil {
		t.Fatal("a certificate file without a key file must fail")
	}
}

func TestIssueVerifyRevoke(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t)
	fixture.Node(t, db, fixture.NodeOpts{ID: "node_a"})
	ca, err := nodeca.Open(nodeca.Config{TrustDomain: "fleet.test", Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	chain, err := ca.IssueNode(ctx, db, "node_a", key.Public())
	if err != nil {
		t.Fatal(err)
	}
	if chain[0].URIs[0].String() != "spiffe://fleet.test/node/node_a" || chain[0].IsCA {
		t.Fatalf("leaf %v", chain[0].URIs)
	}
	if id, err := ca.VerifyNode(ctx, db, chain); err != nil || id != "node_a" {
		t.Fatalf("verify %q %v", id, err)
	}
	serial := nodeca.Serial(chain[0].SerialNumber)
	if revoked, err := nodeca.RevokedSerial(ctx, db, serial); err != nil || revoked {
		t.Fatalf("fresh certificate revoked=%v %v", revoked, err)
	}
	if revoked, _ := nodeca.RevokedSerial(ctx, db, "abc"); !revoked {
		t.Fatal("an unrecorded serial must be refused")
	}
	other, err := ca.IssueNode(ctx, db, "node_a", key.Public())
	if err != nil {
		t.Fatal(err)
	}
	if err := nodeca.RevokeSerial(ctx, db, chain[0].SerialNumber); err != nil {
		t.Fatal(err)
	}
	if _, err := ca.VerifyNode(ctx, db, chain); !errors.Is(err, nodeca.ErrRevoked) {
		t.Fatalf("revoked: %v", err)
	}
	// The gateway's recheck of every session at once: the revoked and the
	// unknown are refused, the valid one is not.
	refused, err := nodeca.RevokedAmong(ctx, db, []string{serial, nodeca.Serial(other[0].SerialNumber), "abc"})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(refused)
	if want := []string{"abc", serial}; !slices.Equal(refused, slices.Sorted(slices.Values(want))) {
		t.Fatalf("refused %v, want %v", refused, want)
	}

	t.Run("the gateway's serving certificate", func(t *testing.T) {
		cert, err := ca.ServingCertificate("gw-1", []string{"gw.example", "127.0.0.1"}, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cert.Leaf.Verify(x509.VerifyOptions{DNSName: "gw.example", Roots: ca.Pool()}); err != nil {
			t.Fatal(err)
		}
		if cert.Leaf.URIs[0].String() != "spiffe://fleet.test/gateway/gw-1" || len(cert.Leaf.IPAddresses) != 1 {
			t.Fatalf("gateway certificate %v %v", cert.Leaf.URIs, cert.Leaf.IPAddresses)
		}
		if _, err := ca.VerifyNode(ctx, db, []*x509.Certificate{cert.Leaf}); err == nil {
			t.Fatal("a gateway certificate is not a node's")
		}
	})
}
