package audit

import (
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/hex"

	"github.com/bettercompute/bettercompute/pkg/keyfile"
)

// Signer is the audit key: the Ed25519 key checkpoints are signed with.
// Verifiers need only its public half.
type Signer struct {
	key   ed25519.PrivateKey
	keyID string
}

// KeyID returns the key id of pub: hex of the first 8 bytes of its SHA-256
// (16 hex digits), as audit_checkpoints.key_id records it.
func KeyID(pub ed25519.PublicKey) string {
	sum := sha256.Sum256(pub)
	return hex.EncodeToString(sum[:8])
}

// NewSigner wraps key.
func NewSigner(key ed25519.PrivateKey) *Signer {
	return &Signer{key: key, keyID: KeyID(key.Public().(ed25519.PublicKey))}
}

// KeyID returns the key's id (see the function [KeyID]).
func (s *Signer) KeyID() string { return s.keyID }

// Public returns the public key that verifies checkpoints.
func (s *Signer) Public() ed25519.PublicKey { return s.key.Public().(ed25519.PublicKey) }

func (s *Signer) sign(chainSeq int64, headHash []byte) []byte {
	return ed25519.Sign(s.key, CheckpointMessage(chainSeq, headHash))
}

// LoadSigner reads an Ed25519 private key from a PEM file ("PRIVATE KEY",
// PKCS #8). A missing or unreadable file, or another key type, is
// INVALID_CONFIG "audit.signingKeyFile".
func LoadSigner(path string) (*Signer, error) {
	key, err := keyfile.LoadEd25519(path, "audit.signingKeyFile", "audit key")
	if err != nil {
		return nil, err
	}
	return NewSigner(key), nil
}

// EnsureSigner loads the key at path, generating it (mode 0600) first when
// the file does not exist: the dev control plane's key.
func EnsureSigner(path string) (*Signer, error) {
	key, err := keyfile.EnsureEd25519(path, "audit.signingKeyFile", "audit key")
	if err != nil {
		return nil, err
	}
	return NewSigner(key), nil
}
