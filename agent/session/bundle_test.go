package session

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"testing"
	"time"
)

// ca makes a CA certificate named name, self-signed or signed by parent.
func ca(t *testing.T, name string, parent *x509.Certificate, parentKey *ecdsa.PrivateKey) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: name}, IsCA: true,
		BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	signer, signerKey := tmpl, key
	if parent != nil {
		signer, signerKey = parent, parentKey
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, signer, &key.PublicKey, signerKey)
	if err != nil {
		t.Fatal(err)
	}
	c, _ := x509.ParseCertificate(der)
	return c, key
}

// TestARenewCannotSwapTheTrustBundle: the bundle pinned at join stays; a
// Renew answer may add a CA only when it chains to the pinned one (a
// rotation), and one offering a CA of its own is refused whole.
func TestARenewCannotSwapTheTrustBundle(t *testing.T) {
	old, oldKey := ca(t, "node CA", nil, nil)
	rotated, _ := ca(t, "node CA 2", old, oldKey)
	rogue, _ := ca(t, "rogue CA", nil, nil)
	pinned := [][]byte{old.Raw}

	if got, err := pinnedBundle(pinned, nil); err != nil || len(got) != 1 {
		t.Fatalf("no bundle offered: %d CAs, %v; want the pinned one", len(got), err)
	}
	if got, err := pinnedBundle(pinned, [][]byte{old.Raw}); err != nil || len(got) != 1 {
		t.Fatalf("the same bundle offered: %d CAs, %v", len(got), err)
	}
	got, err := pinnedBundle(pinned, [][]byte{old.Raw, rotated.Raw})
	if err != nil || len(got) != 2 {
		t.Fatalf("a rotation signed by the pinned CA: %d CAs, %v; want both", len(got), err)
	}
	if _, err := pinnedBundle(pinned, [][]byte{rogue.Raw}); err == nil {
		t.Fatal("a bundle of a CA of its own was accepted")
	}
	if _, err := pinnedBundle(pinned, [][]byte{old.Raw, rogue.Raw}); err == nil {
		t.Fatal("a rogue CA beside the pinned one was accepted")
	}
	if _, err := pinnedBundle(pinned, [][]byte{[]byte("junk")}); err == nil {
		t.Fatal("an unparseable bundle was accepted")
	}
}
