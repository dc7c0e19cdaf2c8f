// Package resultsig is the node's signature on a finished command's report,
// part of the wire contract between the node daemon and the control plane:
// bcd ramdisk signs every CommandUpdate that finishes a command (disk.wipe,
// image.deploy, diag.nvml burn-in, …) with its own Ed25519 key, and the
// control plane verifies it before its metal workflow advances, so a
// gateway, which only relays frames, cannot report a wipe that did not
// happen or change what a wipe reported. It mirrors proto/commandsig, which
// signs in the other direction.
//
// The signature covers the trust domain of the installation, the key id,
// the command id, the node id, the kind, the seq, the outcome, the reason
// and the SHA-256 of the result serialized deterministically
// (proto.MarshalOptions{Deterministic: true}), each length-prefixed or
// fixed-size under the domain "bc-result-v1". Changing any of them — or
// replaying the report to another command, node, seq or installation —
// breaks it. The verifier takes the command id, node id, kind and seq from
// its own record of the command (a [Subject]), never from the report.
//
// Determinism: the hash is over the result re-serialized by the verifier,
// so signer and verifier must agree on the schema's field order. Go's
// deterministic marshalling writes known fields in field-number order and
// unknown fields after them, so a verifier with an older schema still
// reproduces the bytes as long as fields are only ever appended with new,
// higher numbers (the rule for this package's messages).
//
// Where the key comes from: bcd ramdisk generates an Ed25519 key in memory
// at boot (it is never written to disk; a new boot is a new key) and joins
// with a CSR for it, which joinservice accepts (nodeca.ParseCSR takes
// Ed25519); the restricted certificate it issues (role ramdisk, at most
// 2 hours) therefore binds the public key, and the ramdisk uses the same
// key for its mutual TLS. The control plane verifies a report against the
// public key of the ramdisk certificate it issued for that node and boot
// ([PublicKey] reads it from the certificate), never against a key the
// report names: key_id only selects and must match. A node's long-lived
// key (bcd node, ECDSA P-256 in agent/state) signs nothing here.
package resultsig

import (
	"crypto/ed25519"
	"crypto/sha256"
	"crypto/x509"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// domain separates result signatures from anything else the key could
// sign (its TLS handshakes, a command signature) and this input layout from
// later ones.
const domain = "bc-result-v1"

// Algorithm is NodeSignature.algorithm for Ed25519, the only one.
const Algorithm = "ed25519"

// Bounds of NodeSignature, for whoever stores or relays it.
const (
	// KeyIDLen is the length of a key id (hex of 8 bytes).
	KeyIDLen = 16
	// MaxAlgorithm bounds NodeSignature.algorithm.
	MaxAlgorithm = 16
)

// KeyID returns the key id of pub: hex of the first 8 bytes of its SHA-256
// (the same as commandsig.KeyID).
func KeyID(pub ed25519.PublicKey) string {
	sum := sha256.Sum256(pub)
	return hex.EncodeToString(sum[:8])
}

// Subject is the command a report is about, as the control plane knows it
// from its own record (or, on the node, from the Command it ran).
type Subject struct {
	// TrustDomain is the installation's SPIFFE trust domain.
	TrustDomain string
	// NodeID is the node the command was for.
	NodeID string
	// CommandID is the command's id, "cmd_…".
	CommandID string
	// Kind is the command's kind, e.g. "disk.wipe".
	Kind string
	// Seq is the command's seq on the node.
	Seq int64
}

// Input returns the bytes a report's signature is over, for the key keyID:
// the domain, s's trust domain, keyID, s's command id, node id and kind,
// the seq, u's outcome, u's reason and the SHA-256 of u's result serialized
// deterministically (of nothing when u has no result). It reads only
// u.Outcome, u.Reason and u.Result: the id and seq are s's.
func Input(u *agentv1.CommandUpdate, s Subject, keyID string) ([]byte, error) {
	var res []byte
	if u.GetResult() != nil {
		var err error
		res, err = proto.MarshalOptions{Deterministic: true}.Marshal(u.GetResult())
		if err != nil {
			return nil, fmt.Errorf("resultsig: serialize the result: %w", err)
		}
	}
	sum := sha256.Sum256(res)
	b := make([]byte, 0, 96+len(domain)+len(s.TrustDomain)+len(keyID)+len(s.CommandID)+len(s.NodeID)+len(s.Kind)+len(u.GetReason()))
	b = appendString(b, domain)
	b = appendString(b, s.TrustDomain)
	b = appendString(b, keyID)
	b = appendString(b, s.CommandID)
	b = appendString(b, s.NodeID)
	b = appendString(b, s.Kind)
	b = binary.BigEndian.AppendUint64(b, uint64(s.Seq))
	b = binary.BigEndian.AppendUint32(b, uint32(u.GetOutcome()))
	b = appendString(b, u.GetReason())
	return append(b, sum[:]...), nil
}

func appendString(b []byte, s string) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(len(s)))
	return append(b, s...)
}

// Sign sets u.NodeSignature: key's key id, "ed25519" and the signature of
// u for s. u's id and seq must be s's, and its outcome, reason and result
// final. An empty trust domain, node id, command id or kind is an error.
func Sign(u *agentv1.CommandUpdate, s Subject, key ed25519.PrivateKey) error {
	if len(key) != ed25519.PrivateKeySize {
		return errors.New("resultsig: want an Ed25519 private key")
	}
	if err := s.check(); err != nil {
		return err
	}
	if u.GetId() != s.CommandID || u.GetSeq() != s.Seq {
		return fmt.Errorf("resultsig: the report is for command %q seq %d, not %q seq %d", u.GetId(), u.GetSeq(), s.CommandID, s.Seq)
	}
	keyID := KeyID(key.Public().(ed25519.PublicKey))
	in, err := Input(u, s, keyID)
	if err != nil {
		return err
	}
	u.NodeSignature = &agentv1.NodeSignature{KeyId: keyID, Algorithm: Algorithm, Signature: ed25519.Sign(key, in)}
	return nil
}

func (s Subject) check() error {
	switch "" {
	case s.TrustDomain:
		return errors.New("resultsig: no trust domain")
	case s.NodeID:
		return errors.New("resultsig: no node id")
	case s.CommandID:
		return errors.New("resultsig: no command id")
	case s.Kind:
		return errors.New("resultsig: no kind")
	}
	return nil
}

// ErrBadSignature is the error every failed [Verify] wraps: the report is
// unsigned, signed by another key, for another command, node, seq or
// installation, or changed since it was signed. The wrapping error says
// which check failed.
var ErrBadSignature = errors.New("node signature missing or invalid")

func bad(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrBadSignature}, args...)...)
}

// Verify checks u's node signature against pub (the key of the ramdisk
// certificate the control plane issued) for s (taken from the control
// plane's own record of the command): u must be for s's command and seq,
// signed with "ed25519" by the key key_id names, which must be pub, over u
// as it is. Every failure wraps ErrBadSignature. A nil pub or an empty
// field of s verifies nothing and fails.
func Verify(u *agentv1.CommandUpdate, s Subject, pub ed25519.PublicKey) error {
	sig := u.GetNodeSignature()
	switch {
	case len(pub) != ed25519.PublicKeySize:
		return bad("no Ed25519 public key to verify with")
	case s.check() != nil:
		return bad("%v", s.check())
	case sig == nil:
		return bad("the report is unsigned")
	case u.GetId() != s.CommandID || u.GetSeq() != s.Seq:
		return bad("the report is for command %q seq %d, not %q seq %d", u.GetId(), u.GetSeq(), s.CommandID, s.Seq)
	case sig.GetAlgorithm() != Algorithm:
		return bad("algorithm %.16q, want %q", sig.GetAlgorithm(), Algorithm)
	case sig.GetKeyId() != KeyID(pub):
		return bad("signed by key %.16q, want %s (the node's certified key)", sig.GetKeyId(), KeyID(pub))
	case len(sig.GetSignature()) != ed25519.SignatureSize:
		return bad("the signature has %d bytes, want %d", len(sig.GetSignature()), ed25519.SignatureSize)
	}
	in, err := Input(u, s, sig.GetKeyId())
	if err != nil {
		return bad("%v", err)
	}
	if !ed25519.Verify(pub, in, sig.GetSignature()) {
		return bad("the signature does not verify: the report was changed or signed for another command, node or installation")
	}
	return nil
}

// PublicKey returns the Ed25519 public key a certificate binds: the key a
// ramdisk's reports must verify with. Another key type is an error.
func PublicKey(cert *x509.Certificate) (ed25519.PublicKey, error) {
	if cert == nil {
		return nil, errors.New("resultsig: no certificate")
	}
	pub, ok := cert.PublicKey.(ed25519.PublicKey)
	if !ok {
		return nil, fmt.Errorf("resultsig: the certificate's key is a %T, want Ed25519", cert.PublicKey)
	}
	return pub, nil
}
