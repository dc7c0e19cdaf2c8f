// Package keyfile reads and, for development, makes the Ed25519 private
// keys the control plane signs with (command signing, audit checkpoints):
// PEM "PRIVATE KEY" blocks in PKCS #8, the form `openssl genpkey -algorithm
// ed25519` writes.
package keyfile

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// LoadEd25519 reads the key at path. A missing or unreadable file, or
// another key type, is INVALID_CONFIG on field (the setting that names the
// file); what names the key in messages ("audit key").
func LoadEd25519(path, field, what string) (ed25519.PrivateKey, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fault.Wrap(err, fault.InvalidConfig, field, "read %s: %v", what, err)
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
	return ek, nil
}

// EnsureEd25519 loads the key at path, generating it (mode 0600, its
// directory 0700) first when the file does not exist: the dev control
// plane's keys.
func EnsureEd25519(path, field, what string) (ed25519.PrivateKey, error) {
	if _, err := os.Stat(path); err == nil {
		return LoadEd25519(path, field, what)
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	key, b, err := NewEd25519()
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, err
	}
	if err := os.WriteFile(path, b, 0o600); err != nil {
		return nil, fmt.Errorf("write %s: %w", what, err)
	}
	return key, nil
}

// NewEd25519 generates a key and returns it with its file content (PEM
// "PRIVATE KEY", PKCS #8): what [EnsureEd25519] writes and `better-compute
// pki init` puts on disk.
func NewEd25519() (ed25519.PrivateKey, []byte, error) {
	_, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return key, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}

// PublicPEM returns pub as a PEM "PUBLIC KEY" (PKIX) block: the form daemons
// pin (`bcd node --command-key`) and `openssl pkey -pubout` writes.
func PublicPEM(pub ed25519.PublicKey) ([]byte, error) {
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}), nil
}
