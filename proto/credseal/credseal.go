// Package credseal seals small secrets (a BMC's credentials, a machine's
// boot token) from the control plane to one site agent, as JWE compact
// serializations (RFC 7516) with ECDH-ES+A256KW key agreement on P-256 and
// A256GCM content encryption (github.com/go-jose/go-jose/v4).
//
// The site agent makes a fresh key with [NewKey] for every session and says
// its public half ([PublicJWK], a JWK with the RFC 7638 thumbprint as its
// kid) in SiteHello; the control plane stores it and [Seal]s each secret to
// it when it queues a site task, so a secret is stored and carried only
// encrypted, and only the agent that holds the private key ([Open]) reads
// it — a gateway or a database reader cannot. A key dies with the session
// that made it: a task sealed to a previous session's key is re-sealed by
// its producer or fails to open.
//
// Seal's additional data is bound into the JWE's protected header (compact
// serialization has no aad member), so a JWE sealed for one task or machine
// does not open as another's: Open must be given the same additional data.
//
// This package sits in the proto module so the agent and the control plane
// share it without either importing the other.
package credseal

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/subtle"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"

	jose "github.com/go-jose/go-jose/v4"
)

// Limits on what is sealed and opened.
const (
	// MaxPlaintext bounds a sealed secret.
	MaxPlaintext = 16 << 10
	// MaxJWE bounds a JWE compact serialization accepted by Open.
	MaxJWE = 32 << 10
	// MaxJWK bounds a public JWK accepted by Seal (a P-256 JWK is about
	// 200 bytes).
	MaxJWK = 1024
	// MaxAAD bounds the additional data.
	MaxAAD = 1024
)

// Algorithm and Encryption are the JWE "alg" and "enc" this package uses
// and accepts; nothing else opens.
const (
	Algorithm  = jose.ECDH_ES_A256KW
	Encryption = jose.A256GCM
)

// aadHeader carries Seal's additional data in the protected header.
const aadHeader jose.HeaderKey = "bc_aad"

// Errors Open and Seal wrap.
var (
	// ErrWrongKey: the JWE was sealed to another key.
	ErrWrongKey = errors.New("credseal: sealed to another key")
	// ErrInvalid: the JWE, the JWK or the additional data is malformed,
	// tampered with, or does not match.
	ErrInvalid = errors.New("credseal: invalid")
)

// NewKey returns a fresh P-256 private key to open with.
func NewKey() (*ecdsa.PrivateKey, error) {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("credseal: new key: %w", err)
	}
	return k, nil
}

// PublicJWK returns priv's public key as a JWK (JSON): kty EC, crv P-256,
// use enc, alg ECDH-ES+A256KW, kid its RFC 7638 SHA-256 thumbprint.
func PublicJWK(priv *ecdsa.PrivateKey) (string, error) {
	if priv == nil || priv.Curve != elliptic.P256() {
		return "", fmt.Errorf("%w: want a P-256 key", ErrInvalid)
	}
	kid, err := thumbprint(&priv.PublicKey)
	if err != nil {
		return "", err
	}
	b, err := jose.JSONWebKey{Key: &priv.PublicKey, KeyID: kid, Algorithm: string(Algorithm), Use: "enc"}.MarshalJSON()
	if err != nil {
		return "", fmt.Errorf("credseal: marshal jwk: %w", err)
	}
	return string(b), nil
}

// KeyID returns the kid of a public JWK as PublicJWK wrote it (its
// thumbprint, recomputed, so a JWK whose kid lies is refused).
func KeyID(publicJWK string) (string, error) {
	pub, err := parsePublic(publicJWK)
	if err != nil {
		return "", err
	}
	return thumbprint(pub)
}

func thumbprint(pub *ecdsa.PublicKey) (string, error) {
	t, err := (&jose.JSONWebKey{Key: pub}).Thumbprint(crypto.SHA256)
	if err != nil {
		return "", fmt.Errorf("credseal: thumbprint: %w", err)
	}
	return base64.RawURLEncoding.EncodeToString(t), nil
}

func parsePublic(publicJWK string) (*ecdsa.PublicKey, error) {
	if publicJWK == "" || len(publicJWK) > MaxJWK {
		return nil, fmt.Errorf("%w: jwk: want 1 to %d bytes, got %d", ErrInvalid, MaxJWK, len(publicJWK))
	}
	var k jose.JSONWebKey
	if err := json.Unmarshal([]byte(publicJWK), &k); err != nil {
		return nil, fmt.Errorf("%w: jwk: %v", ErrInvalid, err)
	}
	pub, ok := k.Key.(*ecdsa.PublicKey)
	if !ok || !k.IsPublic() || pub.Curve != elliptic.P256() {
		return nil, fmt.Errorf("%w: jwk: want a public P-256 key", ErrInvalid)
	}
	if k.Algorithm != "" && k.Algorithm != string(Algorithm) {
		return nil, fmt.Errorf("%w: jwk: alg %q, want %s", ErrInvalid, k.Algorithm, Algorithm)
	}
	if k.KeyID != "" {
		kid, err := thumbprint(pub)
		if err != nil {
			return nil, err
		}
		if subtle.ConstantTimeCompare([]byte(kid), []byte(k.KeyID)) != 1 {
			return nil, fmt.Errorf("%w: jwk: kid is not the key's thumbprint", ErrInvalid)
		}
	}
	return pub, nil
}

// Seal encrypts plain to publicJWK and returns the JWE compact
// serialization. aad, when given, is joined (in order, each
// length-prefixed) and bound into the protected header: Open must be given
// the same.
func Seal(publicJWK string, plain []byte, aad ...[]byte) (string, error) {
	if len(plain) > MaxPlaintext {
		return "", fmt.Errorf("%w: plaintext: %d bytes, at most %d", ErrInvalid, len(plain), MaxPlaintext)
	}
	pub, err := parsePublic(publicJWK)
	if err != nil {
		return "", err
	}
	kid, err := thumbprint(pub)
	if err != nil {
		return "", err
	}
	ad, err := joinAAD(aad)
	if err != nil {
		return "", err
	}
	opts := (&jose.EncrypterOptions{}).WithType("JWE")
	if ad != "" {
		opts = opts.WithHeader(aadHeader, ad)
	}
	enc, err := jose.NewEncrypter(Encryption, jose.Recipient{Algorithm: Algorithm, Key: pub, KeyID: kid}, opts)
	if err != nil {
		return "", fmt.Errorf("credseal: encrypter: %w", err)
	}
	obj, err := enc.Encrypt(plain)
	if err != nil {
		return "", fmt.Errorf("credseal: encrypt: %w", err)
	}
	out, err := obj.CompactSerialize()
	if err != nil {
		return "", fmt.Errorf("credseal: serialize: %w", err)
	}
	return out, nil
}

// Open decrypts a JWE that Seal made for priv's public key, with the same
// additional data. The caller owns the plaintext: zero it after use.
// ErrWrongKey when it was sealed to another key; ErrInvalid when it is
// malformed, tampered with or its additional data differs.
func Open(priv *ecdsa.PrivateKey, jwe string, aad ...[]byte) ([]byte, error) {
	if priv == nil {
		return nil, fmt.Errorf("%w: no key", ErrInvalid)
	}
	if jwe == "" || len(jwe) > MaxJWE {
		return nil, fmt.Errorf("%w: jwe: want 1 to %d bytes, got %d", ErrInvalid, MaxJWE, len(jwe))
	}
	obj, err := jose.ParseEncryptedCompact(jwe, []jose.KeyAlgorithm{Algorithm}, []jose.ContentEncryption{Encryption})
	if err != nil {
		return nil, fmt.Errorf("%w: jwe: %v", ErrInvalid, err)
	}
	kid, err := thumbprint(&priv.PublicKey)
	if err != nil {
		return nil, err
	}
	if obj.Header.KeyID != kid {
		return nil, fmt.Errorf("%w (kid %q, this key is %q)", ErrWrongKey, obj.Header.KeyID, kid)
	}
	want, err := joinAAD(aad)
	if err != nil {
		return nil, err
	}
	got, _ := obj.Header.ExtraHeaders[aadHeader].(string)
	if subtle.ConstantTimeCompare([]byte(got), []byte(want)) != 1 {
		return nil, fmt.Errorf("%w: additional data differs", ErrInvalid)
	}
	plain, err := obj.Decrypt(priv)
	if err != nil {
		// The kid matched, so this is tampering (or a forged kid).
		return nil, fmt.Errorf("%w: decrypt: %v", ErrInvalid, err)
	}
	return plain, nil
}

// joinAAD encodes aad unambiguously: each part's length (4 bytes, big
// endian) and bytes, base64url.
func joinAAD(aad [][]byte) (string, error) {
	if len(aad) == 0 {
		return "", nil
	}
	var b bytes.Buffer
	for _, a := range aad {
		n := len(a)
		b.Write([]byte{byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)})
		b.Write(a)
	}
	if b.Len() > MaxAAD {
		return "", fmt.Errorf("%w: additional data: %d bytes, at most %d", ErrInvalid, b.Len(), MaxAAD)
	}
	return base64.RawURLEncoding.EncodeToString(b.Bytes()), nil
}

// Zero overwrites b with zeros: for plaintexts once used.
func Zero(b []byte) { clear(b) }

// SealedKeyID returns the kid a JWE was sealed to, from its protected
// header, without decrypting it: which key can open it.
func SealedKeyID(jwe string) (string, error) {
	if jwe == "" || len(jwe) > MaxJWE {
		return "", fmt.Errorf("%w: jwe: want 1 to %d bytes, got %d", ErrInvalid, MaxJWE, len(jwe))
	}
	obj, err := jose.ParseEncryptedCompact(jwe, []jose.KeyAlgorithm{Algorithm}, []jose.ContentEncryption{Encryption})
	if err != nil {
		return "", fmt.Errorf("%w: jwe: %v", ErrInvalid, err)
	}
	if obj.Header.KeyID == "" {
		return "", fmt.Errorf("%w: jwe: no kid", ErrInvalid)
	}
	return obj.Header.KeyID, nil
}

// TaskAAD is the additional data a site task's secrets are sealed with:
// the task's id and its machine's, so a JWE copied into another task or
// machine does not open.
func TaskAAD(taskID, machineID string) [][]byte {
	return [][]byte{[]byte("bettercompute site task v1"), []byte(taskID), []byte(machineID)}
}

// BMCCredentials is the plaintext of a site task's sealed BMC credentials,
// as JSON.
type BMCCredentials struct {
	Username string `json:"username"`
	Password string `json:"password"`
}
