package commands

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Signer is the command-signing key: an Ed25519 key whose public half is
// pinned in every daemon's configuration.
type Signer struct {
	// KeyID is hex of the first 8 bytes of SHA-256 of the public key.
	KeyID string
	Key   ed25519.PrivateKey
}

// KeyID returns the key id of pub.
func KeyID(pub ed25519.PublicKey) string {
	sum := sha256.Sum256(pub)
	return hex.EncodeToString(sum[:8])
}

// NewSigner wraps key.
func NewSigner(key ed25519.PrivateKey) *Signer {
	return &Signer{KeyID: KeyID(key.Public().(ed25519.PublicKey)), Key: key}
}

// Public returns the public key to pin on daemons.
func (s *Signer) Public() ed25519.PublicKey { return s.Key.Public().(ed25519.PublicKey) }

// LoadSigner reads an Ed25519 private key from a PEM file ("PRIVATE KEY",
// PKCS #8). A missing or unreadable file, or another key type, is
// INVALID_CONFIG "commands.signingKeyFile".
func LoadSigner(path string) (*Signer, error) {
	const field = "commands.signingKeyFile"
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fault.Wrap(err, fault.InvalidConfig, field, "read command-signing key: %v", err)
	}
	blk, _ := pem.Decode(b)
	if blk == nil || blk.Type != "PRIVATE KEY" {
		return nil, fault.New(fault.InvalidConfig, field, "%s: want a PEM \"PRIVATE KEY\" block", path)
	}
	k, err := x509.ParsePKCS8PrivateKey(blk.Bytes)
	if err != nil {
		return nil, fault.Wrap(err, fault.InvalidConfig, field, "%s: %v", path, err)
	}
	ek, ok := k.(ed25519.PrivateKey)
	if !ok {
		return nil, fault.New(fault.InvalidConfig, field, "%s: want an Ed25519 key, got %T", path, k)
	}
	return NewSigner(ek), nil
}

// EnsureSigner loads the key at path, generating it (mode 0600) first when
// the file does not exist: the dev control plane's key.
func EnsureSigner(path string) (*Signer, error) {
	if _, err := os.Stat(path); err == nil {
		return LoadSigner(path)
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	_, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, err
	}
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, err
	}
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600); err != nil {
		return nil, fmt.Errorf("write command-signing key: %w", err)
	}
	return NewSigner(key), nil
}
