package iam

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base32"
	"errors"
	"strings"
)

// KeyPrefix starts every API key.
const KeyPrefix = "bck_"

// ErrMalformedKey is returned by [ParseKey] for anything not shaped like
// bck_<id>.<secret>.
var ErrMalformedKey = errors.New("malformed API key: expected bck_<id>.<secret>")

var b32 = base32.StdEncoding.WithPadding(base32.NoPadding)

// randomString returns n random bytes as lowercase base32.
func randomString(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // crypto/rand.Read never fails
	return strings.ToLower(b32.EncodeToString(b))
}

// NewID returns a fresh id with the given prefix, e.g. NewID("pool") →
// "pool_k3x…" (80 random bits).
func NewID(prefix string) string { return prefix + "_" + randomString(10) }

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
	id := randomString(10)
	secret := randomString(32)
	return Key{ID: id, Token: KeyPrefix + id + "." + secret, Hash: HashSecret(secret), secret: secret}
}

// ParseKey splits a token into its id and secret.
func ParseKey(token string) (id, secret string, err error) {
	rest, ok := strings.CutPrefix(token, KeyPrefix)
	if !ok {
		return "", "", ErrMalformedKey
	}
	id, secret, ok = strings.Cut(rest, ".")
	if !ok || len(id) != 16 || len(secret) != 52 || !lowerBase32(id) || !lowerBase32(secret) {
		return "", "", ErrMalformedKey
	}
	return id, secret, nil
}

func lowerBase32(s string) bool {
	for _, c := range s {
		if (c < 'a' || c > 'z') && (c < '2' || c > '7') {
			return false
		}
	}
	return true
}

// HashSecret is what is stored for a secret.
func HashSecret(secret string) []byte {
	h := sha256.Sum256([]byte(secret))
	return h[:]
}

// secretMatches compares in constant time.
func secretMatches(secret string, hash []byte) bool {
	return subtle.ConstantTimeCompare(HashSecret(secret), hash) == 1
}
