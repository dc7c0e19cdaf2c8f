// Package commandsig is the signature on a command, part of the wire
// contract between the control plane and the node daemon: the control plane
// signs destructive commands with its Ed25519 command-signing key when it
// admits them (in the transaction that queues the command, never at
// dispatch: the gateway holds no key), and the daemon verifies them against
// the public key pinned in its configuration.
//
// The signature covers every field the daemon acts on — the id, the node,
// the seq, the kind, the SHA-256 of the serialized body, the deadline, the
// minimum generation and the timeout — plus the key id and the SPIFFE trust
// domain of the installation, so it is valid for exactly one command of one
// installation: changing any of them, replaying the command to another node,
// under another seq or id, or to a node of another installation that pins
// the same key, breaks it.
package commandsig

import (
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// domain separates command signatures from anything else the key could sign,
// and this input layout from earlier ones.
const domain = "bc-command-v2"

// KeyID returns the key id of pub: hex of the first 8 bytes of its SHA-256.
func KeyID(pub ed25519.PublicKey) string {
	sum := sha256.Sum256(pub)
	return hex.EncodeToString(sum[:8])
}

// Input returns the bytes a command's signature is over: the domain, the
// trust domain, the key id, the command id, node id, kind, seq, not_after
// (Unix nanoseconds), min_generation, timeout (nanoseconds; 0 when unset)
// and SHA-256 of body, each length-prefixed or fixed-size so no two
// commands share an input.
func Input(c *agentv1.Command, trustDomain string) []byte {
	sum := sha256.Sum256(c.GetBody())
	b := make([]byte, 0, 128+len(trustDomain)+len(c.GetKeyId())+len(c.GetId())+len(c.GetNodeId())+len(c.GetKind()))
	b = appendString(b, domain)
	b = appendString(b, trustDomain)
	b = appendString(b, c.GetKeyId())
	b = appendString(b, c.GetId())
	b = appendString(b, c.GetNodeId())
	b = appendString(b, c.GetKind())
	b = binary.BigEndian.AppendUint64(b, uint64(c.GetSeq()))
	var notAfter int64
	if c.GetNotAfter() != nil {
		notAfter = c.GetNotAfter().AsTime().UnixNano()
	}
	b = binary.BigEndian.AppendUint64(b, uint64(notAfter))
	b = binary.BigEndian.AppendUint64(b, uint64(c.GetMinGeneration()))
	var timeout int64
	if c.GetTimeout() != nil {
		timeout = int64(c.GetTimeout().AsDuration())
	}
	b = binary.BigEndian.AppendUint64(b, uint64(timeout))
	return append(b, sum[:]...)
}

func appendString(b []byte, s string) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(len(s)))
	return append(b, s...)
}

// Sign sets c's key_id (the key id of key's public half) and signature, for
// trustDomain. Every other field must be final.
func Sign(c *agentv1.Command, trustDomain string, key ed25519.PrivateKey) {
	c.KeyId = KeyID(key.Public().(ed25519.PublicKey))
	c.Signature = ed25519.Sign(key, Input(c, trustDomain))
}

// ErrBadSignature is a command unsigned, signed by another key, or signed
// for another command or installation.
var ErrBadSignature = errors.New("command signature missing or invalid")

// Verify checks c's signature against pub for trustDomain (the daemon's
// own, from its SPIFFE id): key_id must name pub and the signature must
// cover c as it is. A nil pub or an empty trust domain verifies nothing and
// fails.
func Verify(c *agentv1.Command, trustDomain string, pub ed25519.PublicKey) error {
	if len(pub) != ed25519.PublicKeySize || len(c.GetSignature()) != ed25519.SignatureSize || trustDomain == "" {
		return ErrBadSignature
	}
	if c.GetKeyId() != KeyID(pub) {
		return ErrBadSignature
	}
	if !ed25519.Verify(pub, Input(c, trustDomain), c.GetSignature()) {
		return ErrBadSignature
	}
	return nil
}
