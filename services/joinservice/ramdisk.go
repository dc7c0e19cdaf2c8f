package joinservice

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/rsa"
	"crypto/x509"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/jointoken"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	"github.com/bettercompute/bettercompute/pkg/nodes"
)

// Ramdisks and named nodes.
//
// A join token may name its node (join_tokens.node_id, minted by the metal
// workflow for a machine's reserved node id): a join with it creates that
// node, or takes it back when it exists — whatever hardware key it had, the
// token names it — revoking its old certificates. Role "ramdisk" (`bcd
// ramdisk`, a machine booted into its commissioning ramdisk) needs a
// ramdisk token (role ramdisk) and a CSR for an Ed25519 key, the key that
// signs the ramdisk's results; the node is left commissioning (never
// adopted) and the certificate is a ramdisk's: the node's SPIFFE ID,
// recorded with role ramdisk and its public key, valid at most
// nodeca.RamdiskValidity and never renewed (Renew refuses it: a ramdisk
// that needs longer boots again with a fresh boot token). A node token
// naming the node (the installed system's, in its cloud-init) makes it
// adopting again with a node certificate, under the same id.

// RoleRamdisk is a machine's commissioning ramdisk (`bcd ramdisk`).
const RoleRamdisk = "ramdisk"

// joinNamed creates, or takes back, the node tok names for a join with
// hardware key hwKey: commissioning for a ramdisk token, adopting
// otherwise. It reports whether the node existed (its certificates are then
// revoked). A node of another tenant under that id is CONFLICT on
// "nodeId"; the hardware being another node of the tenant CONFLICT on
// "claims".
func (s *Service) joinNamed(ctx context.Context, tx pgx.Tx, tok jointoken.Token, hostname, hwKey string) (nodes.Node, bool, error) {
	state := nodes.StateAdopting
	if tok.Role == jointoken.RoleRamdisk {
		state = nodes.StateCommissioning
	}
	old, found, err := nodes.Lock(ctx, tx, tok.NodeID)
	if err != nil {
		return nodes.Node{}, false, err
	}
	if found && old.TenantID != tok.TenantID {
		return nodes.Node{}, false, fault.New(fault.Conflict, "nodeId", "the join token names node %s, which is not a node of its tenant", tok.NodeID)
	}
	other, taken, err := nodes.ByHardwareKey(ctx, tx, tok.TenantID, hwKey)
	if err != nil {
		return nodes.Node{}, false, err
	}
	if taken && other.ID != tok.NodeID {
		return nodes.Node{}, false, fault.Wrap(nodes.ErrHardwareTaken, fault.Conflict, "claims",
			"this hardware has joined as node %s; the join token names node %s: retire %s first", other.ID, tok.NodeID, other.ID)
	}
	n := nodes.Node{ID: tok.NodeID, TenantID: tok.TenantID, PoolID: tok.PoolID, Labels: tok.Labels, Hostname: hostname,
		HardwareKey: hwKey, JoinTokenID: tok.ID, State: state}
	if !found {
		n, err = nodes.Create(ctx, tx, n)
		return n, false, err
	}
	if n, err = nodes.TakeBack(ctx, tx, n); err != nil {
		return nodes.Node{}, false, err
	}
	// Whatever ran as the node before (the installed system, or an
	// earlier ramdisk boot) holds no certificate after this.
	if _, err := nodeca.RevokeNode(ctx, tx, n.ID); err != nil {
		return nodes.Node{}, false, err
	}
	return n, true, nil
}

// refuseRamdiskRenew refuses Renew for a ramdisk certificate: ACCESS_DENIED
// on "certificate". A ramdisk's certificate lives at most
// nodeca.RamdiskValidity from its issue, so it is never renewed.
func (s *Service) refuseRamdiskRenew(ctx context.Context, leaf *x509.Certificate, nodeID string) error {
	role, err := nodeca.CertificateRole(ctx, s.db, nodeca.Serial(leaf.SerialNumber))
	if err != nil {
		return err
	}
	if role == nodeca.RoleRamdisk {
		return fault.New(fault.AccessDenied, "certificate", "the ramdisk certificate of %s is not renewed (valid at most %s): boot the ramdisk again for a new one",
			nodeID, nodeca.RamdiskValidity)
	}
	return nil
}

// keyType names a public key's type for a message.
func keyType(k crypto.PublicKey) string {
	switch k := k.(type) {
	case *ecdsa.PublicKey:
		return "ECDSA " + k.Curve.Params().Name
	case *rsa.PublicKey:
		return fmt.Sprintf("RSA %d", k.N.BitLen())
	case ed25519.PublicKey:
		return "Ed25519"
	}
	return fmt.Sprintf("%T", k)
}
