package secrets

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// KeySize is the length of a key: AES-256.
const KeySize = 32

// MaxKeys bounds a keyring (the sealing key and the older keys kept to open
// what they sealed).
const MaxKeys = 16

// ConfigField is the setting that names the sealing key's file; errors about
// a missing or bad keyring name it.
const ConfigField = "secrets.keyFile"

// ErrUnknownKey is returned when a secret was sealed by a key the keyring
// does not hold (rotated out, or another deployment's).
var ErrUnknownKey = errors.New("sealed by a key this keyring does not hold")

// ErrTampered is returned when a secret does not open: its ciphertext, its
// nonce, or the tenant, id or kind it was sealed for were changed.
var ErrTampered = errors.New("does not open: the row was changed or sealed for another secret")

// Keyring holds the keys secrets are sealed with: the first seals, every one
// opens (so a rotated-out key still opens what it sealed until those secrets
// are sealed again). Safe for concurrent use.
type Keyring struct {
	keys []ringKey
	mac  []byte // HMAC key of Fingerprint, derived from the sealing key
}

type ringKey struct {
	id   string
	aead cipher.AEAD
}

// KeyID returns a key's id: hex of the first 8 bytes of its SHA-256.
func KeyID(key []byte) string {
	h := sha256.Sum256(key)
	return hex.EncodeToString(h[:8])
}

// NewKeyring returns a keyring of keys, each KeySize bytes; keys[0] seals.
func NewKeyring(keys ...[]byte) (*Keyring, error) {
	if len(keys) == 0 {
		return nil, errors.New("a keyring needs at least one key")
	}
	if len(keys) > MaxKeys {
		return nil, fmt.Errorf("at most %d keys, got %d", MaxKeys, len(keys))
	}
	kr := &Keyring{}
	seen := map[string]bool{}
	for i, k := range keys {
		if len(k) != KeySize {
			return nil, fmt.Errorf("key %d: %d bytes, want %d", i, len(k), KeySize)
		}
		block, err := aes.NewCipher(k)
		if err != nil {
			return nil, err
		}
		aead, err := cipher.NewGCM(block)
		if err != nil {
			return nil, err
		}
		id := KeyID(k)
		if seen[id] {
			return nil, fmt.Errorf("key %d (%s) is in the keyring twice", i, id)
		}
		seen[id] = true
		kr.keys = append(kr.keys, ringKey{id: id, aead: aead})
	}
	m := hmac.New(sha256.New, keys[0])
	m.Write([]byte("bettercompute secrets fingerprint v1"))
	kr.mac = m.Sum(nil)
	return kr, nil
}

// LoadKeyring reads the key files at paths (the first seals, the rest only
// open). A file holds the 32 key bytes raw, or as 64 hex digits, or in
// base64 (with or without a trailing newline). A missing, unreadable or
// malformed file is INVALID_CONFIG on [ConfigField].
func LoadKeyring(paths ...string) (*Keyring, error) {
	var keys [][]byte
	for _, p := range paths {
		k, err := ReadKeyFile(p)
		if err != nil {
			return nil, err
		}
		keys = append(keys, k)
	}
	kr, err := NewKeyring(keys...)
	if err != nil {
		return nil, fault.Wrap(err, fault.InvalidConfig, ConfigField, "%v", err)
	}
	return kr, nil
}

// ReadKeyFile reads one key file (see [LoadKeyring] for its forms).
func ReadKeyFile(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fault.Wrap(err, fault.InvalidConfig, ConfigField, "read the secrets key: %v", err)
	}
	if len(b) == KeySize {
		return b, nil
	}
	s := strings.TrimSpace(string(b))
	if k, err := hex.DecodeString(s); err == nil && len(k) == KeySize {
		return k, nil
	}
	if k, err := base64.StdEncoding.DecodeString(s); err == nil && len(k) == KeySize {
		return k, nil
	}
	return nil, fault.New(fault.InvalidConfig, ConfigField,
		"%s: want %d bytes (raw, 64 hex digits or base64, e.g. `head -c 32 /dev/urandom`), got a %d-byte file", path, KeySize, len(b))
}

// NewKey returns a fresh random key, the content of a new key file.
func NewKey() []byte {
	k := make([]byte, KeySize)
	_, _ = rand.Read(k) // crypto/rand.Read never fails
	return k
}

// EnsureKeyFile loads the key file at path, first writing a fresh key there
// (mode 0600, its directory 0700) when the file does not exist: the dev
// control plane's key.
func EnsureKeyFile(path string) (*Keyring, error) {
	if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
		if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
			return nil, err
		}
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil && !errors.Is(err, os.ErrExist) {
			return nil, fmt.Errorf("write the secrets key: %w", err)
		}
		if err == nil {
			_, werr := f.Write(NewKey())
			if cerr := f.Close(); werr == nil {
				werr = cerr
			}
			if werr != nil {
				return nil, fmt.Errorf("write the secrets key: %w", werr)
			}
		}
	} else if err != nil {
		return nil, err
	}
	return LoadKeyring(path)
}

// KeyID returns the id of the sealing key.
func (k *Keyring) KeyID() string { return k.keys[0].id }

// KeyIDs returns the ids of every key, the sealing key first.
func (k *Keyring) KeyIDs() []string {
	out := make([]string, len(k.keys))
	for i, rk := range k.keys {
		out[i] = rk.id
	}
	return out
}

// Fingerprint returns a keyed hash (HMAC-SHA256 under a key derived from the
// sealing key) of b: what stands for a credential where equality must be
// checked without keeping it, such as an idempotent request's hash. It
// reveals nothing about b to whoever lacks the key.
func (k *Keyring) Fingerprint(b []byte) []byte {
	m := hmac.New(sha256.New, k.mac)
	m.Write(b)
	return m.Sum(nil)
}

// additional is the AEAD's additional data: the secret is bound to its
// tenant, id and kind, so a row copied onto another secret does not open.
func additional(tenant, id string, kind Kind) []byte {
	var b []byte
	b = append(b, "bettercompute secret v1"...)
	for _, s := range []string{tenant, id, string(kind)} {
		b = binary.BigEndian.AppendUint32(b, uint32(len(s)))
		b = append(b, s...)
	}
	return b
}

// seal encrypts plain for (tenant, id, kind) with the sealing key.
func (k *Keyring) seal(tenant, id string, kind Kind, plain []byte) (keyID string, nonce, ciphertext []byte) {
	rk := k.keys[0]
	nonce = make([]byte, rk.aead.NonceSize())
	_, _ = rand.Read(nonce)
	return rk.id, nonce, rk.aead.Seal(nil, nonce, plain, additional(tenant, id, kind))
}

// open decrypts what seal made.
func (k *Keyring) open(keyID, tenant, id string, kind Kind, nonce, ciphertext []byte) ([]byte, error) {
	for _, rk := range k.keys {
		if rk.id != keyID {
			continue
		}
		if len(nonce) != rk.aead.NonceSize() {
			return nil, ErrTampered
		}
		plain, err := rk.aead.Open(nil, nonce, ciphertext, additional(tenant, id, kind))
		if err != nil {
			return nil, ErrTampered
		}
		return plain, nil
	}
	return nil, fmt.Errorf("key %s: %w", keyID, ErrUnknownKey)
}
