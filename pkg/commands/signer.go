package commands

import (
	"crypto/ed25519"

	"github.com/bettercompute/bettercompute/pkg/keyfile"
	"github.com/bettercompute/bettercompute/proto/commandsig"
)

// Signer is the command-signing key: an Ed25519 key whose public half is
// pinned in every daemon's configuration. Only the processes that admit
// commands hold it (see [Registry.Signing]); the gateway never does.
type Signer struct {
	// KeyID is hex of the first 8 bytes of SHA-256 of the public key.
	KeyID string
	Key   ed25519.PrivateKey
}

// KeyID returns the key id of pub.
func KeyID(pub ed25519.PublicKey) string { return commandsig.KeyID(pub) }

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
	key, err := keyfile.LoadEd25519(path, "commands.signingKeyFile", "command-signing key")
	if err != nil {
		return nil, err
	}
	return NewSigner(key), nil
}

// EnsureSigner loads the key at path, generating it (mode 0600) first when
// the file does not exist: the dev control plane's key.
func EnsureSigner(path string) (*Signer, error) {
	key, err := keyfile.EnsureEd25519(path, "commands.signingKeyFile", "command-signing key")
	if err != nil {
		return nil, err
	}
	return NewSigner(key), nil
}
