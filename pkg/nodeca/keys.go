package nodeca

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net/url"
	"os"
	"path/filepath"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

// generate makes a self-signed CA for td: an ECDSA P-256 key, valid for ten
// years, returned as PEM (certificate, then key). It signs node and gateway
// certificates itself (path length 0): the development CA.
func generate(td spiffeid.TrustDomain) ([]byte, error) {
	cert, key, err := generateCA(td, "Better Compute node CA ("+td.Name()+")", 0, 10*365*24*time.Hour, nil, nil)
	if err != nil {
		return nil, err
	}
	return append(cert, key...), nil
}

// GenerateRoot makes a self-signed root CA for trustDomain that may sign one
// level of subordinate CAs (path length 1): an ECDSA P-256 key valid for
// twenty years, as PEM certificate and PEM PKCS #8 key. `better-compute pki
// init` signs the node CA with it, so that the node CA can be rotated under
// the root every node pins.
func GenerateRoot(trustDomain string) (certPEM, keyPEM []byte, err error) {
	td, err := spiffeid.TrustDomainFromString(trustDomain)
	if err != nil {
		return nil, nil, fmt.Errorf("trust domain %q: %w", trustDomain, err)
	}
	return generateCA(td, "Better Compute root CA ("+td.Name()+")", 1, 20*365*24*time.Hour, nil, nil)
}

// IntermediateValidity is how long a node CA made by [GenerateIntermediate]
// is valid (at most its parent's remaining life): rotate it before then.
const IntermediateValidity = 5 * 365 * 24 * time.Hour

// GenerateIntermediate makes a node CA for trustDomain signed by the CA in
// parentCertPEM (its first certificate) and parentKeyPEM: a fresh ECDSA
// P-256 key, path length 0, valid for [IntermediateValidity] or until the
// parent expires. It returns the new certificate followed by the parent's
// certificates (the chain [Open] reads from caCertFile) and the new key, as
// PEM.
func GenerateIntermediate(trustDomain string, parentCertPEM, parentKeyPEM []byte) (chainPEM, keyPEM []byte, err error) {
	td, err := spiffeid.TrustDomainFromString(trustDomain)
	if err != nil {
		return nil, nil, fmt.Errorf("trust domain %q: %w", trustDomain, err)
	}
	parents, err := parseCerts(parentCertPEM)
	if err != nil {
		return nil, nil, err
	}
	parentKey, err := parseKey(parentKeyPEM)
	if err != nil {
		return nil, nil, err
	}
	if !publicKeysEqual(parents[0].PublicKey, parentKey.Public()) {
		return nil, nil, errors.New("node CA: the parent key does not match the parent certificate")
	}
	if !parents[0].IsCA || parents[0].KeyUsage&x509.KeyUsageCertSign == 0 || (parents[0].MaxPathLen == 0 && parents[0].MaxPathLenZero) {
		return nil, nil, errors.New("node CA: the parent certificate may not sign CA certificates (CA, certSign, path length of at least 1)")
	}
	cert, key, err := generateCA(td, "Better Compute node CA ("+td.Name()+") "+time.Now().UTC().Format("2006-01-02"), 0, IntermediateValidity, parents[0], parentKey)
	if err != nil {
		return nil, nil, err
	}
	for _, p := range parents {
		cert = append(cert, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: p.Raw})...)
	}
	return cert, key, nil
}

// generateCA makes a CA certificate and key for td, self-signed when parent
// is nil, as PEM.
func generateCA(td spiffeid.TrustDomain, name string, maxPathLen int, validity time.Duration, parent *x509.Certificate, parentKey crypto.Signer) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial.Add(serial, big.NewInt(1)),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             now.Add(-Backdate),
		NotAfter:              now.Add(validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLen:            maxPathLen,
		MaxPathLenZero:        maxPathLen == 0,
		URIs:                  []*url.URL{td.ID().URL()},
	}
	signer, signerKey := tmpl, crypto.Signer(key)
	if parent != nil {
		signer, signerKey = parent, parentKey
		if tmpl.NotAfter.After(parent.NotAfter) {
			tmpl.NotAfter = parent.NotAfter
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, signer, key.Public(), signerKey)
	if err != nil {
		return nil, nil, err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), nil
}

// LoadOrCreate reads the file at path, or creates it once (mode 0600, its
// directory 0700) with create's content. Concurrent creators agree on one
// file: each writes a temporary file and links it into place, and a loser
// reads the winner's. Development keys (the CA, joinservice's HPKE key) are
// kept this way.
func LoadOrCreate(path string, create func() ([]byte, error)) ([]byte, error) {
	if b, err := os.ReadFile(path); err == nil {
		return b, nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	b, err := create()
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".tmp-"+filepath.Base(path)+"-*")
	if err != nil {
		return nil, err
	}
	defer func() { _ = os.Remove(tmp.Name()) }()
	if _, err := tmp.Write(b); err != nil {
		_ = tmp.Close()
		return nil, err
	}
	if err := tmp.Close(); err != nil {
		return nil, err
	}
	if err := os.Link(tmp.Name(), path); err != nil {
		if errors.Is(err, os.ErrExist) {
			return os.ReadFile(path)
		}
		return nil, err
	}
	return b, nil
}

func parseCerts(b []byte) ([]*x509.Certificate, error) {
	var out []*x509.Certificate
	for {
		var blk *pem.Block
		blk, b = pem.Decode(b)
		if blk == nil {
			break
		}
		if blk.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(blk.Bytes)
		if err != nil {
			return nil, fmt.Errorf("node CA certificate: %w", err)
		}
		out = append(out, c)
	}
	if len(out) == 0 {
		return nil, errors.New("node CA: no PEM CERTIFICATE block")
	}
	return out, nil
}

func parseKey(b []byte) (crypto.Signer, error) {
	for {
		var blk *pem.Block
		blk, b = pem.Decode(b)
		if blk == nil {
			return nil, errors.New("node CA: no PEM private key block")
		}
		var (
			k   any
			err error
		)
		switch blk.Type {
		case "PRIVATE KEY":
			k, err = x509.ParsePKCS8PrivateKey(blk.Bytes)
		case "EC PRIVATE KEY":
			k, err = x509.ParseECPrivateKey(blk.Bytes)
		case "RSA PRIVATE KEY":
			k, err = x509.ParsePKCS1PrivateKey(blk.Bytes)
		default:
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("node CA key: %w", err)
		}
		s, ok := k.(crypto.Signer)
		if !ok {
			return nil, fmt.Errorf("node CA key: %T cannot sign", k)
		}
		return s, nil
	}
}
