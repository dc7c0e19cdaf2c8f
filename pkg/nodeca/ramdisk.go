package nodeca

import (
	"context"
	"crypto"
	"crypto/ed25519"
	"crypto/x509"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Ramdisk certificates.
//
// `bcd ramdisk` (a machine in commissioning) holds a certificate of role
// ramdisk: the node's own SPIFFE ID, spiffe://<trust domain>/node/<node
// id>, so its session is a node session, but recorded with role ramdisk and
// its public key in node_certificates (migration 00025). It is valid for
// [RamdiskValidity] (never more than [SVIDValidity]) and never renewed; its
// key is the ramdisk's Ed25519 key, the one every result it reports is
// signed with (proto/resultsig), so [RamdiskCertificates] is where the
// control plane finds the key a result must verify with. The gateway reads
// the role of a session's certificate ([CertificateRole]) and sends a
// ramdisk only the commissioning flow's commands.

// Roles of a node certificate (node_certificates.role).
const (
	// RoleNode is a node's certificate (bcd join, Renew).
	RoleNode = "node"
	// RoleRamdisk is a ramdisk's restricted certificate (bcd ramdisk).
	RoleRamdisk = "ramdisk"
)

// RamdiskValidity is how long a ramdisk certificate is valid at most.
const RamdiskValidity = 2 * time.Hour

// IssueRamdisk signs a ramdisk certificate for pub, which must be Ed25519
// (the ramdisk's result key), valid for min([RamdiskValidity],
// [SVIDValidity]), with URI SAN spiffe://<trust domain>/node/<nodeID>, and
// records it in q with role ramdisk and its public key. It returns the
// chain, leaf first.
func (ca *CA) IssueRamdisk(ctx context.Context, q Querier, nodeID string, pub crypto.PublicKey) ([]*x509.Certificate, error) {
	if _, ok := pub.(ed25519.PublicKey); !ok {
		return nil, fmt.Errorf("ramdisk certificate: the key is a %T, want Ed25519", pub)
	}
	return ca.issueNode(ctx, q, nodeID, pub, RoleRamdisk, min(RamdiskValidity, SVIDValidity))
}

// ErrUnknownCertificate is returned by [CertificateRole] for a serial the
// CA has no node certificate of.
var ErrUnknownCertificate = errors.New("no such node certificate")

// CertificateRole returns the role ([RoleNode] or [RoleRamdisk]) recorded
// for the node certificate with serial (lowercase hex), or
// [ErrUnknownCertificate].
func CertificateRole(ctx context.Context, q Querier, serial string) (string, error) {
	var role string
	err := q.QueryRow(ctx, `SELECT role FROM node_certificates WHERE serial = $1`, serial).Scan(&role)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", ErrUnknownCertificate
	}
	if err != nil {
		return "", fmt.Errorf("read certificate role: %w", err)
	}
	return role, nil
}

// RamdiskCertificate is one ramdisk certificate the CA issued to a node.
type RamdiskCertificate struct {
	Serial    string
	NodeID    string
	PublicKey ed25519.PublicKey
	NotBefore time.Time
	NotAfter  time.Time
	CreatedAt time.Time
	RevokedAt *time.Time
}

// MaxRamdiskCertificates bounds what [RamdiskCertificates] returns: a
// machine boots its ramdisk a few times per commissioning, and rows are
// pruned once expired past the grace period.
const MaxRamdiskCertificates = 32

// RamdiskCertificates returns the ramdisk certificates of nodeID that have
// a recorded Ed25519 key, newest first, at most [MaxRamdiskCertificates].
func RamdiskCertificates(ctx context.Context, q interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}, nodeID string) ([]RamdiskCertificate, error) {
	rows, err := q.Query(ctx, `SELECT serial, node_id, public_key, not_before, not_after, created_at, revoked_at FROM node_certificates
		WHERE node_id = $1 AND role = 'ramdisk' AND public_key IS NOT NULL ORDER BY created_at DESC, serial LIMIT $2`, nodeID, MaxRamdiskCertificates)
	if err != nil {
		return nil, fmt.Errorf("read ramdisk certificates of %s: %w", nodeID, err)
	}
	certs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (RamdiskCertificate, error) {
		var c RamdiskCertificate
		var der []byte
		if err := r.Scan(&c.Serial, &c.NodeID, &der, &c.NotBefore, &c.NotAfter, &c.CreatedAt, &c.RevokedAt); err != nil {
			return c, err
		}
		k, err := x509.ParsePKIXPublicKey(der)
		if err != nil {
			return c, fmt.Errorf("certificate %s: public key: %w", c.Serial, err)
		}
		pub, ok := k.(ed25519.PublicKey)
		if !ok {
			return c, fmt.Errorf("certificate %s: the key is a %T, want Ed25519", c.Serial, k)
		}
		c.PublicKey = pub
		return c, nil
	})
	if err != nil {
		return nil, fmt.Errorf("read ramdisk certificates of %s: %w", nodeID, err)
	}
	return certs, nil
}
