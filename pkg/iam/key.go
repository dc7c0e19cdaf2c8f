package iam

import (
	"crypto/subtle"
	"errors"

	"github.com/bettercompute/bettercompute/pkg/secret"
)

// KeyPrefix starts every API key.
const KeyPrefix = "bck_"

// ErrMalformedKey is returned by [ParseKey] for anything not shaped like
// bck_<id>.<secret>.
var ErrMalformedKey = errors.New("malformed API key: expected bck_<id>.<secret>")

// NewID returns a fresh id with the given prefix, e.g. NewID("pool") →
// "pool_k3x…" (80 random bits).
func NewID(prefix string) string { return prefix + "_" + secret.Random(10) }

// Key is a freshly minted API key. Token is what the caller presents; it is
// never stored.
type Key struct {
	ID     string
	Token  string
	Hash   []byte
	secret string
}

// NewKey mints a key: a 16-character id and a 256-bit secret.
func NewKey() Key {
	m := secret.Mint(KeyPrefix)
	return Key{ID: m.ID, Token: m.Value, Hash: m.Hash, secret: m.Secret}
}

// ParseKey splits a token into its id and secret.
func ParseKey(token string) (id, sec string, err error) {
	id, sec, ok := secret.Parse(KeyPrefix, token)
	if !ok {
		return "", "", ErrMalformedKey
	}
	return id, sec, nil
}

// HashSecret is what is stored for a secret.
func HashSecret(s string) []byte {
	return secret.Hash(s)
}

// secretMatches compares in constant time.
func secretMatches(secret string, hash []byte) bool {
	return subtle.ConstantTimeCompare(HashSecret(secret), hash) == 1
}
