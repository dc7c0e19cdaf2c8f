// Package agentrelease is the signed release manifest of a bcd build, part
// of the wire contract between the control plane and the node daemon: the
// operator signs it with an Ed25519 release key (`better-compute artifacts
// publish`), the NodeSpec's agent section carries it, and bcd verifies it
// against the release public key pinned in its install configuration
// (`bcd node --release-key`) before it downloads, checks and runs the build
// it names.
//
// The release key is not the command-signing key: the control plane holds
// the command-signing key online (it signs every destructive command it
// queues); the release key signs builds and can stay offline, so a control
// plane that is broken into can queue an upgrade but cannot make a node run
// a build the release key did not sign.
//
// The signature covers every field bcd acts on — version, artifact URL,
// SHA-256, size, platform, expiry and the monotonic counter — plus the key
// id, length-prefixed under a domain of its own, so no manifest's signature
// fits another, and nothing else the key could sign (a command, a result)
// is a manifest. The counter is what stops a replay of an older, vulnerable
// build: bcd refuses a counter lower than the highest it has installed, and
// the same counter with other content.
package agentrelease

import (
	"crypto/ed25519"
	"crypto/sha256"
	"crypto/x509"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// domain separates manifest signatures from anything else the key could
// sign, and this input layout from later ones.
const domain = "bc-agent-release-v1"

// MaxManifestBytes bounds an encoded manifest.
const MaxManifestBytes = 16 << 10

// MaxArtifactBytes bounds a bcd build: a manifest naming a larger one is
// malformed, and bcd stops reading a download at its manifest's size.
const MaxArtifactBytes = 512 << 20

// Manifest names one bcd build and how to fetch and check it.
type Manifest struct {
	// Version is the build's version, a semantic version with a leading v
	// ("v0.3.1"), what the build reports in its Hello.
	Version string `json:"version"`
	// URL is where the build is downloaded: https, or http to a loopback
	// address (tests, a node's own relay).
	URL string `json:"url"`
	// SHA256 is the hex SHA-256 of the build's bytes.
	SHA256 string `json:"sha256"`
	// Size is the build's size in bytes (1 to MaxArtifactBytes).
	Size int64 `json:"size"`
	// Platform is the GOOS/GOARCH the build runs on ("linux/amd64").
	Platform string `json:"platform"`
	// NotAfter is when the manifest expires: bcd refuses it after.
	NotAfter time.Time `json:"notAfter"`
	// Counter increases with every release signed by the key: bcd refuses
	// a lower one than it has installed (no replay of an older build), and
	// an equal one with other content.
	Counter uint64 `json:"counter"`
	// KeyID names the release key that signed it (KeyID of its public key).
	KeyID string `json:"keyId"`
	// Signature is the Ed25519 signature over Input.
	Signature []byte `json:"signature"`
}

// The refusals of Verify and Parse, each a named error callers match with
// errors.Is.
var (
	// ErrBadSignature is a manifest unsigned, signed by another key, or
	// changed since it was signed.
	ErrBadSignature = errors.New("release manifest signature missing or invalid")
	// ErrExpired is a manifest past its NotAfter.
	ErrExpired = errors.New("release manifest expired")
	// ErrMalformed is a manifest with a field out of range.
	ErrMalformed = errors.New("release manifest malformed")
)

// KeyID returns the key id of pub: hex of the first 8 bytes of its SHA-256.
func KeyID(pub ed25519.PublicKey) string {
	sum := sha256.Sum256(pub)
	return hex.EncodeToString(sum[:8])
}

// Input returns the bytes m's signature is over: the domain, key id,
// version, URL, SHA-256, platform (each length-prefixed), size, NotAfter
// (Unix nanoseconds) and counter (fixed-size).
func Input(m *Manifest) []byte {
	b := make([]byte, 0, 128+len(m.KeyID)+len(m.Version)+len(m.URL)+len(m.SHA256)+len(m.Platform))
	b = appendString(b, domain)
	b = appendString(b, m.KeyID)
	b = appendString(b, m.Version)
	b = appendString(b, m.URL)
	b = appendString(b, m.SHA256)
	b = appendString(b, m.Platform)
	b = binary.BigEndian.AppendUint64(b, uint64(m.Size))
	b = binary.BigEndian.AppendUint64(b, uint64(m.NotAfter.UnixNano()))
	return binary.BigEndian.AppendUint64(b, m.Counter)
}

func appendString(b []byte, s string) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(len(s)))
	return append(b, s...)
}

// Digest is the hex SHA-256 of m's signed content (Input): two manifests
// with the same counter and another digest are a conflict.
func Digest(m *Manifest) string {
	sum := sha256.Sum256(Input(m))
	return hex.EncodeToString(sum[:])
}

// Sign checks m's fields, then sets its key id (of key's public half) and
// signature. Every other field must be final.
func Sign(m *Manifest, key ed25519.PrivateKey) error {
	if len(key) != ed25519.PrivateKeySize {
		return fmt.Errorf("%w: no release key", ErrBadSignature)
	}
	if err := Check(m); err != nil {
		return err
	}
	m.KeyID = KeyID(key.Public().(ed25519.PublicKey))
	m.Signature = ed25519.Sign(key, Input(m))
	return nil
}

// Verify checks m against the pinned release key pub at now: a well-formed
// manifest (ErrMalformed), signed by pub as it is (ErrBadSignature), not
// expired (ErrExpired). A nil pub verifies nothing and fails.
func Verify(m *Manifest, pub ed25519.PublicKey, now time.Time) error {
	if m == nil || len(pub) != ed25519.PublicKeySize || len(m.Signature) != ed25519.SignatureSize || m.KeyID != KeyID(pub) {
		return ErrBadSignature
	}
	if !ed25519.Verify(pub, Input(m), m.Signature) {
		return ErrBadSignature
	}
	if err := Check(m); err != nil {
		return err
	}
	if !now.Before(m.NotAfter) {
		return fmt.Errorf("%w: version %s expired at %s", ErrExpired, m.Version, m.NotAfter.UTC().Format(time.RFC3339))
	}
	return nil
}

// Check reports the first field of m out of range (ErrMalformed, naming it).
func Check(m *Manifest) error {
	bad := func(field, format string, args ...any) error {
		return fmt.Errorf("%w: %s: %s", ErrMalformed, field, fmt.Sprintf(format, args...))
	}
	if _, err := ParseVersion(m.Version); err != nil {
		return bad("version", "%v", err)
	}
	if err := CheckURL(m.URL); err != nil {
		return bad("url", "%v", err)
	}
	if b, err := hex.DecodeString(m.SHA256); err != nil || len(b) != sha256.Size || strings.ToLower(m.SHA256) != m.SHA256 {
		return bad("sha256", "want 64 lower-case hex digits, got %q", m.SHA256)
	}
	if m.Size < 1 || m.Size > MaxArtifactBytes {
		return bad("size", "want 1 to %d bytes, got %d", MaxArtifactBytes, m.Size)
	}
	if os, arch, ok := strings.Cut(m.Platform, "/"); !ok || os == "" || arch == "" || len(m.Platform) > 64 {
		return bad("platform", "want GOOS/GOARCH, got %q", m.Platform)
	}
	if m.NotAfter.IsZero() {
		return bad("notAfter", "an expiry is required")
	}
	if m.Counter == 0 {
		return bad("counter", "want a counter from 1")
	}
	return nil
}

// CheckURL accepts an https URL, or http to a loopback address.
func CheckURL(raw string) error {
	if len(raw) > 2048 {
		return errors.New("longer than 2048 bytes")
	}
	u, err := url.Parse(raw)
	if err != nil {
		return err
	}
	if u.Host == "" || u.User != nil {
		return fmt.Errorf("want https://host/path without credentials, got %q", raw)
	}
	switch u.Scheme {
	case "https":
		return nil
	case "http":
		switch h := u.Hostname(); {
		case h == "localhost", strings.HasPrefix(h, "127."), h == "::1":
			return nil
		}
		return fmt.Errorf("http only to a loopback address, got %q", raw)
	}
	return fmt.Errorf("want https, got %q", raw)
}

// Encode returns m as JSON.
func Encode(m *Manifest) ([]byte, error) { return json.MarshalIndent(m, "", "  ") }

// Parse decodes a manifest (JSON, at most MaxManifestBytes) without
// verifying it.
func Parse(b []byte) (*Manifest, error) {
	if len(b) > MaxManifestBytes {
		return nil, fmt.Errorf("%w: larger than %d bytes", ErrMalformed, MaxManifestBytes)
	}
	var m Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	return &m, nil
}

// ParsePublicKey reads a release public key: PEM PUBLIC KEY (PKIX, Ed25519).
func ParsePublicKey(pemBytes []byte) (ed25519.PublicKey, error) {
	blk, _ := pem.Decode(pemBytes)
	if blk == nil || blk.Type != "PUBLIC KEY" {
		return nil, errors.New("release key: want a PEM PUBLIC KEY block")
	}
	k, err := x509.ParsePKIXPublicKey(blk.Bytes)
	if err != nil {
		return nil, fmt.Errorf("release key: %w", err)
	}
	pub, ok := k.(ed25519.PublicKey)
	if !ok {
		return nil, fmt.Errorf("release key: a %T, want Ed25519", k)
	}
	return pub, nil
}

// ParsePrivateKey reads a release private key: PEM PRIVATE KEY (PKCS#8,
// Ed25519).
func ParsePrivateKey(pemBytes []byte) (ed25519.PrivateKey, error) {
	blk, _ := pem.Decode(pemBytes)
	if blk == nil || blk.Type != "PRIVATE KEY" {
		return nil, errors.New("release key: want a PEM PRIVATE KEY block")
	}
	k, err := x509.ParsePKCS8PrivateKey(blk.Bytes)
	if err != nil {
		return nil, fmt.Errorf("release key: %w", err)
	}
	priv, ok := k.(ed25519.PrivateKey)
	if !ok {
		return nil, fmt.Errorf("release key: a %T, want Ed25519", k)
	}
	return priv, nil
}

// Version is a parsed semantic version: v<major>.<minor>.<patch>, with an
// optional -pre-release (ordered before its release, compared as a string)
// and +build metadata (ignored).
type Version struct {
	Major, Minor, Patch uint64
	Pre                 string
}

// ParseVersion parses "v1.2.3", "v1.2.3-rc.1" or "1.2.3+abc".
func ParseVersion(s string) (Version, error) {
	if len(s) > 128 {
		return Version{}, errors.New("version longer than 128 bytes")
	}
	t := strings.TrimPrefix(s, "v")
	t, _, _ = strings.Cut(t, "+")
	t, pre, hasPre := strings.Cut(t, "-")
	if hasPre && pre == "" {
		return Version{}, fmt.Errorf("want a semantic version such as v0.3.1, got %q", s)
	}
	parts := strings.Split(t, ".")
	if len(parts) != 3 {
		return Version{}, fmt.Errorf("want a semantic version such as v0.3.1, got %q", s)
	}
	var n [3]uint64
	for i, p := range parts {
		v, err := strconv.ParseUint(p, 10, 32)
		if err != nil || (len(p) > 1 && p[0] == '0') {
			return Version{}, fmt.Errorf("want a semantic version such as v0.3.1, got %q", s)
		}
		n[i] = v
	}
	return Version{Major: n[0], Minor: n[1], Patch: n[2], Pre: pre}, nil
}

// Compare returns -1, 0 or +1 as a is older than, the same as or newer
// than b.
func (a Version) Compare(b Version) int {
	for _, d := range [][2]uint64{{a.Major, b.Major}, {a.Minor, b.Minor}, {a.Patch, b.Patch}} {
		if d[0] != d[1] {
			if d[0] < d[1] {
				return -1
			}
			return 1
		}
	}
	switch {
	case a.Pre == b.Pre:
		return 0
	case a.Pre == "":
		return 1
	case b.Pre == "":
		return -1
	case a.Pre < b.Pre:
		return -1
	}
	return 1
}

func (a Version) String() string {
	s := fmt.Sprintf("v%d.%d.%d", a.Major, a.Minor, a.Patch)
	if a.Pre != "" {
		s += "-" + a.Pre
	}
	return s
}
