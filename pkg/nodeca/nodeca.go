// Package nodeca is the node certificate authority: it signs the 24-hour
// X.509 SVIDs of nodes (URI SAN spiffe://<trust-domain>/node/<node id>) and
// of site agents (spiffe://<trust-domain>/site/<site id>/agent/<agent id>;
// see site.go), the gateways' serving certificates, records every node certificate's
// serial so that the gateway can refuse revoked ones, and verifies a
// presented node certificate chain (chain, role, revocation).
//
// The CA's certificate and key come from files named in the configuration,
// or, for development, are generated once into a directory and reused. Only
// joinservice holds the CA; a gateway gets its serving certificate and the
// trust bundle from it and never the key.
package nodeca

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"

	"github.com/bettercompute/bettercompute/proto/spiffepath"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// SVIDValidity is how long a node certificate is valid.
const SVIDValidity = 24 * time.Hour

// Backdate is how far before issuance a certificate becomes valid, to
// absorb clock skew between the CA and its peers.
const Backdate = time.Minute

// DevFile is the file, in a development key directory, holding the
// generated CA certificate and key.
const DevFile = "node-ca.pem"

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Config says where the CA comes from.
type Config struct {
	// TrustDomain is the SPIFFE trust domain, e.g. "bettercompute.example".
	// Required.
	TrustDomain string
	// CertFile and KeyFile are PEM files: the CA certificate (optionally
	// followed by the chain up to a self-signed root, which is then the
	// trust bundle) and its private key (PKCS#8, PKCS#1 or SEC 1). Both, or
	// neither and Dir.
	CertFile, KeyFile string
	// Dir, used when the files are not set, is a directory where a CA is
	// generated once ([DevFile]) and reused: for development.
	Dir string
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// CA signs node and gateway certificates.
type CA struct {
	td     spiffeid.TrustDomain
	cert   *x509.Certificate
	chain  []*x509.Certificate // cert and intermediates above it, not roots
	key    crypto.Signer
	bundle *x509bundle.Bundle
	now    func() time.Time
}

// Open loads the CA from cfg's files, or from (or into) cfg.Dir.
func Open(cfg Config) (*CA, error) {
	td, err := spiffeid.TrustDomainFromString(cfg.TrustDomain)
	if err != nil {
		return nil, fmt.Errorf("trust domain %q: %w", cfg.TrustDomain, err)
	}
	var certPEM, keyPEM []byte
	switch {
	case cfg.CertFile != "" && cfg.KeyFile != "":
		if certPEM, err = os.ReadFile(cfg.CertFile); err != nil {
			return nil, fmt.Errorf("read CA certificate: %w", err)
		}
		if keyPEM, err = os.ReadFile(cfg.KeyFile); err != nil {
			return nil, fmt.Errorf("read CA key: %w", err)
		}
	case cfg.CertFile != "" || cfg.KeyFile != "":
		return nil, errors.New("node CA: set both the certificate and the key file, or neither")
	case cfg.Dir != "":
		b, err := LoadOrCreate(filepath.Join(cfg.Dir, DevFile), func() ([]byte, error) { return generate(td) })
		if err != nil {
			return nil, fmt.Errorf("node CA in %s: %w", cfg.Dir, err)
		}
		certPEM, keyPEM = b, b
	default:
		return nil, errors.New("node CA: no certificate and key files, and no directory to generate one in")
	}
	certs, err := parseCerts(certPEM)
	if err != nil {
		return nil, err
	}
	key, err := parseKey(keyPEM)
	if err != nil {
		return nil, err
	}
	return New(td, certs, key, cfg.Now)
}

// New returns a CA for td signing with key under certs[0]; further certs are
// its chain up to (optionally) a self-signed root. The trust bundle is the
// self-signed certificates of certs, or certs[0] when there are none.
func New(td spiffeid.TrustDomain, certs []*x509.Certificate, key crypto.Signer, now func() time.Time) (*CA, error) {
	if len(certs) == 0 {
		return nil, errors.New("node CA: no certificate")
	}
	if !certs[0].IsCA || certs[0].KeyUsage&x509.KeyUsageCertSign == 0 {
		return nil, errors.New("node CA: the certificate is not a CA certificate (basic constraints CA and key usage certSign)")
	}
	if !publicKeysEqual(certs[0].PublicKey, key.Public()) {
		return nil, errors.New("node CA: the key does not match the certificate")
	}
	if now == nil {
		now = time.Now
	}
	ca := &CA{td: td, cert: certs[0], key: key, now: now}
	var roots []*x509.Certificate
	for _, c := range certs {
		if selfSigned(c) {
			roots = append(roots, c)
		} else {
			ca.chain = append(ca.chain, c)
		}
	}
	if len(roots) == 0 {
		roots = certs[:1]
		ca.chain = nil
	}
	ca.bundle = x509bundle.FromX509Authorities(td, roots)
	return ca, nil
}

func selfSigned(c *x509.Certificate) bool {
	return c.CheckSignatureFrom(c) == nil && string(c.RawIssuer) == string(c.RawSubject)
}

// TrustDomain returns the CA's SPIFFE trust domain.
func (ca *CA) TrustDomain() spiffeid.TrustDomain { return ca.td }

// Certificate returns the signing certificate.
func (ca *CA) Certificate() *x509.Certificate { return ca.cert }

// Bundle returns the trust bundle (for x509svid verification).
func (ca *CA) Bundle() *x509bundle.Bundle { return ca.bundle }

// TrustBundle returns the trust bundle's certificates, DER: what nodes and
// gateways trust.
func (ca *CA) TrustBundle() [][]byte {
	var out [][]byte
	for _, c := range ca.bundle.X509Authorities() {
		out = append(out, c.Raw)
	}
	return out
}

// Pool returns the trust bundle as a pool, for tls.Config's ClientCAs or
// RootCAs.
func (ca *CA) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	for _, c := range ca.bundle.X509Authorities() {
		p.AddCert(c)
	}
	return p
}

// NodeSPIFFEID returns spiffe://<trust domain>/node/<nodeID>.
func (ca *CA) NodeSPIFFEID(nodeID string) (spiffeid.ID, error) {
	return spiffeid.FromSegments(ca.td, "node", nodeID)
}

// NodeIDOf returns the node id of a node SPIFFE ID in the CA's trust domain,
// or an error for any other ID (another trust domain, another role).
func (ca *CA) NodeIDOf(id spiffeid.ID) (string, error) {
	if id.TrustDomain() != ca.td {
		return "", fmt.Errorf("SPIFFE ID %s is not in trust domain %s", id, ca.td)
	}
	nodeID, ok := spiffepath.NodeID(id.Path())
	if !ok {
		return "", fmt.Errorf("SPIFFE ID %s is not a node's", id)
	}
	return nodeID, nil
}

// ParseCSR parses a DER PKCS#10 request and checks its signature (proof of
// possession of its key) and its key type (ECDSA P-256 or P-384, Ed25519,
// RSA of 2048 bits or more). Failures are INVALID_INPUT on "csr".
func ParseCSR(der []byte) (*x509.CertificateRequest, error) {
	if len(der) == 0 {
		return nil, fault.New(fault.InvalidInput, "csr", "required: a DER PKCS#10 certificate request")
	}
	csr, err := x509.ParseCertificateRequest(der)
	if err != nil {
		return nil, fault.New(fault.InvalidInput, "csr", "not a DER PKCS#10 certificate request: %v", err)
	}
	if err := csr.CheckSignature(); err != nil {
		return nil, fault.New(fault.InvalidInput, "csr", "the request's signature does not verify with its key: %v", err)
	}
	switch k := csr.PublicKey.(type) {
	case *ecdsa.PublicKey:
		if k.Curve != elliptic.P256() && k.Curve != elliptic.P384() {
			return nil, fault.New(fault.InvalidInput, "csr", "ECDSA keys must be on P-256 or P-384")
		}
	case ed25519.PublicKey:
	case *rsa.PublicKey:
		if k.N.BitLen() < 2048 {
			return nil, fault.New(fault.InvalidInput, "csr", "RSA keys must have at least 2048 bits")
		}
	default:
		return nil, fault.New(fault.InvalidInput, "csr", "unsupported key type %T", csr.PublicKey)
	}
	return csr, nil
}

// IssueNode signs a [SVIDValidity] certificate for pub with URI SAN
// spiffe://<trust domain>/node/<nodeID> and records its serial in q (the
// caller's transaction, so a join or renewal that does not commit leaves an
// unrecorded certificate, which [CA.VerifyNode] refuses). It returns the
// chain, leaf first.
func (ca *CA) IssueNode(ctx context.Context, q Querier, nodeID string, pub crypto.PublicKey) ([]*x509.Certificate, error) {
	return ca.issueNode(ctx, q, nodeID, pub, RoleNode, SVIDValidity)
}

// issueNode signs a certificate of role for pub, valid for validity, with
// URI SAN spiffe://<trust domain>/node/<nodeID>, and records its serial,
// role and public key.
func (ca *CA) issueNode(ctx context.Context, q Querier, nodeID string, pub crypto.PublicKey, role string, validity time.Duration) ([]*x509.Certificate, error) {
	id, err := ca.NodeSPIFFEID(nodeID)
	if err != nil {
		return nil, fmt.Errorf("node SPIFFE ID: %w", err)
	}
	pkix509, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return nil, fmt.Errorf("node certificate key: %w", err)
	}
	now := ca.now()
	tmpl := &x509.Certificate{
		Subject:     pkix.Name{CommonName: nodeID},
		NotBefore:   now.Add(-Backdate),
		NotAfter:    now.Add(validity),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		URIs:        []*url.URL{id.URL()},
	}
	if role != RoleNode {
		// Informative: the role that counts is the one recorded below.
		tmpl.Subject.OrganizationalUnit = []string{role}
	}
	leaf, err := ca.sign(tmpl, pub)
	if err != nil {
		return nil, err
	}
	if _, err := q.Exec(ctx, `INSERT INTO node_certificates (serial, node_id, not_before, not_after, role, public_key) VALUES ($1, $2, $3, $4, $5, $6)`,
		Serial(leaf.SerialNumber), nodeID, leaf.NotBefore, leaf.NotAfter, role, pkix509); err != nil {
		return nil, fmt.Errorf("record certificate of %s: %w", nodeID, err)
	}
	return append([]*x509.Certificate{leaf}, ca.chain...), nil
}

// ServingCertificate makes a fresh key and a certificate for a gateway
// named name, valid for validity (0 means 30 days), with DNS (and IP) SANs
// hosts and URI SAN spiffe://<trust domain>/gateway/<name>, for its TLS
// listener. Nothing is recorded.
func (ca *CA) ServingCertificate(name string, hosts []string, validity time.Duration) (tls.Certificate, error) {
	return ca.ServiceCertificate(name, hosts, validity, "gateway", name)
}

// ServiceCertificate is [CA.ServingCertificate] for another control-plane
// service: common name name, URI SAN spiffe://<trust domain>/<path...>
// (joinservice's internal listener: path "joinservice"), server and client
// authentication. Nothing is recorded.
func (ca *CA) ServiceCertificate(name string, hosts []string, validity time.Duration, path ...string) (tls.Certificate, error) {
	id, err := spiffeid.FromSegments(ca.td, path...)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("service SPIFFE ID: %w", err)
	}
	if validity <= 0 {
		validity = 30 * 24 * time.Hour
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	now := ca.now()
	tmpl := &x509.Certificate{
		Subject:     pkix.Name{CommonName: name},
		NotBefore:   now.Add(-Backdate),
		NotAfter:    now.Add(validity),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		URIs:        []*url.URL{id.URL()},
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	leaf, err := ca.sign(tmpl, key.Public())
	if err != nil {
		return tls.Certificate{}, err
	}
	out := tls.Certificate{PrivateKey: key, Leaf: leaf, Certificate: [][]byte{leaf.Raw}}
	for _, c := range ca.chain {
		out.Certificate = append(out.Certificate, c.Raw)
	}
	return out, nil
}

func (ca *CA) sign(tmpl *x509.Certificate, pub crypto.PublicKey) (*x509.Certificate, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, err
	}
	tmpl.SerialNumber = serial.Add(serial, big.NewInt(1)) // never 0
	if tmpl.NotAfter.After(ca.cert.NotAfter) {
		tmpl.NotAfter = ca.cert.NotAfter
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, pub, ca.key)
	if err != nil {
		return nil, fmt.Errorf("sign certificate: %w", err)
	}
	return x509.ParseCertificate(der)
}

// VerifyNode checks a node's certificate chain (leaf first) as the gateway
// and Renew must: it chains to the trust bundle and is valid now, its SPIFFE
// ID is a node's in this trust domain, and it is not revoked. It returns the
// node id. Failures are UNAUTHENTICATED (a revoked one wraps [ErrRevoked]).
func (ca *CA) VerifyNode(ctx context.Context, q Querier, chain []*x509.Certificate) (string, error) {
	id, _, err := x509svid.Verify(chain, ca.bundle, x509svid.WithTime(ca.now()))
	if err != nil {
		return "", fault.Wrap(err, fault.Unauthenticated, "certificate", "the node certificate does not verify: %v", err)
	}
	nodeID, err := ca.NodeIDOf(id)
	if err != nil {
		return "", fault.Wrap(err, fault.Unauthenticated, "certificate", "%v", err)
	}
	revoked, err := Revoked(ctx, q, chain[0].SerialNumber)
	if err != nil {
		return "", err
	}
	if revoked {
		return "", fault.Wrap(ErrRevoked, fault.Unauthenticated, "certificate", "the certificate of %s (serial %s) is revoked", nodeID, Serial(chain[0].SerialNumber))
	}
	return nodeID, nil
}

// BundlePEM returns the trust bundle as PEM certificates: the ca.pem that
// `bcd join --ca` and bcsim read.
func (ca *CA) BundlePEM() []byte {
	var out []byte
	for _, der := range ca.TrustBundle() {
		out = append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})...)
	}
	return out
}

func publicKeysEqual(a, b crypto.PublicKey) bool {
	x, ok := a.(interface{ Equal(crypto.PublicKey) bool })
	return ok && x.Equal(b)
}

// SameKey reports whether two public keys are equal.
func SameKey(a, b crypto.PublicKey) bool { return publicKeysEqual(a, b) }
