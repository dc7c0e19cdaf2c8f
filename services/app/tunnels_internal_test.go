package app

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"net/url"
	"testing"
	"time"
)

// A relaying API process takes the peer for a gateway only with a chain
// to the bundle, server authentication and a gateway SPIFFE id of the
// trust domain: a node's certificate, another trust domain's gateway or
// another CA's is refused.
func TestVerifyGateway(t *testing.T) {
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "ca"}, IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	caDER, _ := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	ca, _ := x509.ParseCertificate(caDER)
	bundle := x509.NewCertPool()
	bundle.AddCert(ca)
	leaf := func(spiffe string) *x509.Certificate {
		k, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		u, _ := url.Parse(spiffe)
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), URIs: []*url.URL{u}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}}
		der, _ := x509.CreateCertificate(rand.Reader, tmpl, ca, &k.PublicKey, caKey)
		c, _ := x509.ParseCertificate(der)
		return c
	}
	for _, c := range []struct {
		name   string
		leaf   *x509.Certificate
		bundle *x509.CertPool
		ok     bool
	}{
		{"a gateway", leaf("spiffe://bc.test/gateway/gw-1"), bundle, true},
		{"a node", leaf("spiffe://bc.test/node/node_1"), bundle, false},
		{"another trust domain's gateway", leaf("spiffe://other.test/gateway/gw-1"), bundle, false},
		{"another CA", leaf("spiffe://bc.test/gateway/gw-1"), x509.NewCertPool(), false},
	} {
		err := verifyGateway(c.bundle, "bc.test")(tls.ConnectionState{PeerCertificates: []*x509.Certificate{c.leaf}})
		if (err == nil) != c.ok {
			t.Errorf("%s: %v, want ok=%v", c.name, err, c.ok)
		}
	}
}
