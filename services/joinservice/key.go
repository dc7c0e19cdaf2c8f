package joinservice

import (
	"crypto/ecdh"
	"crypto/hpke"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/bettercompute/bettercompute/pkg/nodeca"
)

// The HPKE suite join tokens are sealed with (RFC 9180): DHKEM(X25519,
// HKDF-SHA256), HKDF-SHA256, AES-128-GCM, info [HPKEInfo], no AAD. The
// daemon seals with exactly these (crypto/hpke.NewSender, then Seal(nil,
// token)) and sends the encapsulated key and the ciphertext apart.
const HPKEInfo = "bettercompute join v1"

// DevKeyFile is the file, in a development key directory, holding the
// generated HPKE key.
const DevKeyFile = "joinservice-hpke.pem"

// Key is joinservice's HPKE key pair: daemons seal join tokens to its public
// key so that a gateway in between cannot read them.
type Key struct {
	priv *ecdh.PrivateKey
	hpke hpke.PrivateKey
	id   string
}

// NewKey generates a key.
func NewKey() (*Key, error) {
	priv, err := ecdh.X25519().GenerateKey(rand.Reader)
	if err != nil {
		return nil, err
	}
	return newKey(priv)
}

func newKey(priv *ecdh.PrivateKey) (*Key, error) {
	k, err := hpke.NewDHKEMPrivateKey(priv)
	if err != nil {
		return nil, fmt.Errorf("HPKE key: %w", err)
	}
	return &Key{priv: priv, hpke: k, id: KeyID(priv.PublicKey().Bytes())}, nil
}

// ParseKey reads a PEM "PRIVATE KEY" block holding a PKCS#8 X25519 key.
func ParseKey(b []byte) (*Key, error) {
	for {
		var blk *pem.Block
		blk, b = pem.Decode(b)
		if blk == nil {
			return nil, errors.New("joinservice HPKE key: no PEM PRIVATE KEY block")
		}
		if blk.Type != "PRIVATE KEY" {
			continue
		}
		k, err := x509.ParsePKCS8PrivateKey(blk.Bytes)
		if err != nil {
			return nil, fmt.Errorf("joinservice HPKE key: %w", err)
		}
		priv, ok := k.(*ecdh.PrivateKey)
		if !ok || priv.Curve() != ecdh.X25519() {
			return nil, fmt.Errorf("joinservice HPKE key: expected an X25519 key, got %T", k)
		}
		return newKey(priv)
	}
}

// LoadKey reads a key file written by [Key.MarshalPEM] (or `openssl genpkey
// -algorithm X25519`).
func LoadKey(file string) (*Key, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("read joinservice HPKE key: %w", err)
	}
	return ParseKey(b)
}

// LoadOrCreateKey reads dir/[DevKeyFile], generating it once: for
// development.
func LoadOrCreateKey(dir string) (*Key, error) {
	b, err := nodeca.LoadOrCreate(filepath.Join(dir, DevKeyFile), func() ([]byte, error) {
		k, err := NewKey()
		if err != nil {
			return nil, err
		}
		return k.MarshalPEM()
	})
	if err != nil {
		return nil, fmt.Errorf("joinservice HPKE key in %s: %w", dir, err)
	}
	return ParseKey(b)
}

// KeyID is the id of an HPKE public key (32 raw X25519 bytes): the first 8
// bytes of its SHA-256 in hex. Daemons send it as joinservice_key_id.
func KeyID(pub []byte) string {
	h := sha256.Sum256(pub)
	return hex.EncodeToString(h[:8])
}

// ID returns the key's id ([KeyID] of its public key).
func (k *Key) ID() string { return k.id }

// PublicKey returns the raw 32-byte X25519 public key, what a daemon's
// configuration pins (crypto/hpke: ecdh.X25519().NewPublicKey, then
// hpke.NewDHKEMPublicKey).
func (k *Key) PublicKey() []byte { return k.priv.PublicKey().Bytes() }

// PublicKeyPEM returns the public key as a PEM "PUBLIC KEY" (PKIX) block
// with a "Key-Id" header: the file `bcd join` reads.
func (k *Key) PublicKeyPEM() ([]byte, error) {
	der, err := x509.MarshalPKIXPublicKey(k.priv.PublicKey())
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Headers: map[string]string{"Key-Id": k.id}, Bytes: der}), nil
}

// MarshalPEM returns the private key as a PEM "PRIVATE KEY" (PKCS#8) block.
func (k *Key) MarshalPEM() ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(k.priv)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}

// Open decrypts a token sealed for the CSR csr (see [SealAAD]).
func (k *Key) Open(enc, sealed, csr []byte) ([]byte, error) {
	r, err := hpke.NewRecipient(enc, k.hpke, hpke.HKDFSHA256(), hpke.AES128GCM(), []byte(HPKEInfo))
	if err != nil {
		return nil, err
	}
	return r.Open(SealAAD(csr), sealed)
}

// SealAAD is the additional authenticated data a join token is sealed with:
// the SHA-256 of the DER CSR sent beside it. It binds the token to the node's
// key, so a gateway relaying a Join cannot swap in a CSR for a key of its own
// and get the node's certificate.
func SealAAD(csr []byte) []byte {
	h := sha256.Sum256(csr)
	return h[:]
}
