// Package secret mints and parses the product's bearer secrets: API keys
// (bck_…) and join tokens (bcjt_…) share one shape, <prefix><id>.<secret>,
// with a 16-character id (80 random bits) and a 52-character secret (256
// bits), both lowercase base32. Only [Hash] of the secret is ever stored.
package secret

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/base32"
	"strings"
)

var b32 = base32.StdEncoding.WithPadding(base32.NoPadding)

// Random returns n random bytes as lowercase base32.
func Random(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // crypto/rand.Read never fails
	return strings.ToLower(b32.EncodeToString(b))
}

// Minted is a fresh secret. Value is what its holder presents; it is never
// stored.
type Minted struct {
	ID     string
	Secret string
	Value  string
	Hash   []byte
}

// Mint makes a secret with prefix.
func Mint(prefix string) Minted {
	id, s := Random(10), Random(32)
	return Minted{ID: id, Secret: s, Value: prefix + id + "." + s, Hash: Hash(s)}
}

// Parse splits value into its id and secret; ok is false for anything not
// shaped like <prefix><id>.<secret>.
func Parse(prefix, value string) (id, secret string, ok bool) {
	rest, ok := strings.CutPrefix(value, prefix)
	if !ok {
		return "", "", false
	}
	id, secret, ok = strings.Cut(rest, ".")
	if !ok || len(id) != 16 || len(secret) != 52 || !lowerBase32(id) || !lowerBase32(secret) {
		return "", "", false
	}
	return id, secret, true
}

func lowerBase32(s string) bool {
	for _, c := range s {
		if (c < 'a' || c > 'z') && (c < '2' || c > '7') {
			return false
		}
	}
	return true
}

// Hash is what is stored for a secret: its SHA-256.
func Hash(secret string) []byte {
	h := sha256.Sum256([]byte(secret))
	return h[:]
}
