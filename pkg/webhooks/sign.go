// Package webhooks signs outbound webhook deliveries in the Standard Webhooks
// format (https://www.standardwebhooks.com) and sends them safely.
//
// A delivery carries three headers: webhook-id (the same across retries),
// webhook-timestamp (unix seconds, fresh for each attempt) and
// webhook-signature, a space-separated list of "v1,<base64 HMAC-SHA256>"
// signatures over "id.timestamp.body", one per current key so that a receiver
// keeps verifying while a secret is rotated. [Verify] is what a receiver does.
//
// [NewClient] returns the HTTP client to deliver with: it refuses to dial
// private, loopback and metadata addresses, whatever DNS answers, and never
// follows redirects. [CheckURL] validates an endpoint URL when it is saved.
package webhooks

import (
	"cmp"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// SecretPrefix starts every secret token, as Standard Webhooks libraries
// expect.
const SecretPrefix = "whsec_"

// The bounds on a key's length, in bytes, that [ParseSecret] accepts.
const (
	MinKeyLen = 24
	MaxKeyLen = 64
)

// DefaultTolerance is how far a delivery's timestamp may be from the
// receiver's clock when [Verify] is given a tolerance of zero.
const DefaultTolerance = 5 * time.Minute

// The headers of a delivery.
const (
	HeaderID        = "webhook-id"
	HeaderTimestamp = "webhook-timestamp"
	HeaderSignature = "webhook-signature"
)

// Why [Verify] rejects a delivery.
var (
	// ErrNoSignature: the id, timestamp or signature header is missing.
	ErrNoSignature = errors.New("webhooks: missing webhook headers")
	// ErrBadTimestamp: the timestamp is malformed or outside the tolerance.
	ErrBadTimestamp = errors.New("webhooks: bad timestamp")
	// ErrNoMatch: no v1 signature matches the key.
	ErrNoMatch = errors.New("webhooks: no matching signature")
)

// NewSecret returns a new 32-byte key and its token, "whsec_" followed by the
// key in standard base64: the token is what an endpoint's owner is shown.
func NewSecret() (token string, key []byte) {
	key = make([]byte, 32)
	_, _ = rand.Read(key) // crypto/rand.Read never fails (Go 1.24+).
	return SecretPrefix + base64.StdEncoding.EncodeToString(key), key
}

// ParseSecret returns the key of a token, with or without [SecretPrefix]. It
// fails with an INVALID_INPUT fault when the token is not standard base64 or
// the key is not [MinKeyLen] to [MaxKeyLen] bytes long.
func ParseSecret(token string) ([]byte, error) {
	key, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(token, SecretPrefix))
	if err != nil {
		return nil, fault.Wrap(err, fault.InvalidInput, "secret", "expected %q followed by standard base64", SecretPrefix)
	}
	if len(key) < MinKeyLen || len(key) > MaxKeyLen {
		return nil, fault.New(fault.InvalidInput, "secret", "expected a key of %d to %d bytes, got %d", MinKeyLen, MaxKeyLen, len(key))
	}
	return key, nil
}

// Sign returns the v1 signature of a delivery: "v1," followed by the base64
// HMAC-SHA256, under key, of id + "." + ts in unix seconds + "." + body.
func Sign(key []byte, id string, ts time.Time, body []byte) string {
	return "v1," + base64.StdEncoding.EncodeToString(mac(key, id, ts.Unix(), body))
}

func mac(key []byte, id string, unix int64, body []byte) []byte {
	m := hmac.New(sha256.New, key)
	fmt.Fprintf(m, "%s.%d.", id, unix)
	m.Write(body)
	return m.Sum(nil)
}

// Headers returns the headers of a delivery: its id, timestamp, the v1
// signature under each key in order (space-separated) and a JSON content type.
func Headers(id string, ts time.Time, body []byte, keys ...[]byte) http.Header {
	sigs := make([]string, len(keys))
	for i, k := range keys {
		sigs[i] = Sign(k, id, ts, body)
	}
	h := make(http.Header, 4)
	h.Set(HeaderID, id)
	h.Set(HeaderTimestamp, strconv.FormatInt(ts.Unix(), 10))
	h.Set(HeaderSignature, strings.Join(sigs, " "))
	h.Set("Content-Type", "application/json")
	return h
}

// Verify checks a delivery as a receiver does: the headers must be present,
// the timestamp within tolerance of now either way ([DefaultTolerance] when
// tolerance is zero) and any one of the v1 signatures must match key. Its
// errors wrap [ErrNoSignature], [ErrBadTimestamp] or [ErrNoMatch].
func Verify(key []byte, h http.Header, body []byte, now time.Time, tolerance time.Duration) error {
	id, tsText, sigs := h.Get(HeaderID), h.Get(HeaderTimestamp), h.Get(HeaderSignature)
	if id == "" || tsText == "" || sigs == "" {
		return ErrNoSignature
	}
	unix, err := strconv.ParseInt(tsText, 10, 64)
	if err != nil {
		return fmt.Errorf("%w: %q is not unix seconds", ErrBadTimestamp, tsText)
	}
	tolerance = cmp.Or(tolerance, DefaultTolerance)
	if d := now.Sub(time.Unix(unix, 0)); d > tolerance || d < -tolerance {
		return fmt.Errorf("%w: %s off the receiver's clock", ErrBadTimestamp, d.Round(time.Second))
	}
	want := mac(key, id, unix, body)
	for s := range strings.FieldsSeq(sigs) {
		b64, ok := strings.CutPrefix(s, "v1,")
		if !ok {
			continue
		}
		if got, err := base64.StdEncoding.DecodeString(b64); err == nil && hmac.Equal(got, want) {
			return nil
		}
	}
	return ErrNoMatch
}
