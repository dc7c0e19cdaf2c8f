// Package commandsig is the signature on a command, part of the wire
// contract between the control plane and the node daemon: the control plane
// signs destructive commands with its Ed25519 command-signing key, and the
// daemon verifies them against the public key pinned in its configuration.
//
// The signature covers exactly what the daemon acts on: the node, the seq,
// the kind, the deadline, the minimum generation and the SHA-256 of the
// serialized body. Changing any of them, or replaying the command to another
// node or under another seq, breaks it.
package commandsig

import (
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/binary"
	"errors"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// domain separates command signatures from anything else the key could sign.
const domain = "bc-command-v1"

// Input returns the bytes a command's signature is over: the domain, then
// the node id, kind, seq, not_after (Unix nanoseconds), min_generation and
// SHA-256 of body, each length-prefixed or fixed-size so no two commands
// share an input.
func Input(c *agentv1.Command) []byte {
	sum := sha256.Sum256(c.GetBody())
	b := make([]byte, 0, len(domain)+len(c.GetNodeId())+len(c.GetKind())+64)
	b = appendString(b, domain)
	b = appendString(b, c.GetNodeId())
	b = appendString(b, c.GetKind())
	b = binary.BigEndian.AppendUint64(b, uint64(c.GetSeq()))
	b = binary.BigEndian.AppendUint64(b, uint64(c.GetNotAfter().AsTime().UnixNano()))
	b = binary.BigEndian.AppendUint64(b, uint64(c.GetMinGeneration()))
	return append(b, sum[:]...)
}

func appendString(b []byte, s string) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(len(s)))
	return append(b, s...)
}

// Sign sets c's signature (and key_id) with key.
func Sign(c *agentv1.Command, keyID string, key ed25519.PrivateKey) {
	c.KeyId = keyID
	c.Signature = ed25519.Sign(key, Input(c))
}

// ErrBadSignature is a command unsigned or not signed by the pinned key.
var ErrBadSignature = errors.New("command signature missing or invalid")

// Verify checks c's signature against pub; a nil pub verifies nothing and
// fails.
func Verify(c *agentv1.Command, pub ed25519.PublicKey) error {
	if len(pub) != ed25519.PublicKeySize || len(c.GetSignature()) != ed25519.SignatureSize {
		return ErrBadSignature
	}
	if !ed25519.Verify(pub, Input(c), c.GetSignature()) {
		return ErrBadSignature
	}
	return nil
}
