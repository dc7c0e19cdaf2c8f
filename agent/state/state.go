// Package state keeps everything bcd stores on disk under one root
// directory: the node key, the node id, the certificate chain and trust
// bundle, and the journal id. Writes are atomic (a temporary file renamed
// into place); the key is readable by its owner only.
//
// Layout under the root:
//
//	node.key           the node's ECDSA P-256 key, PKCS#8 PEM, mode 0600
//	node_id            the node id joinservice assigned
//	cert.pem           the certificate chain, leaf first, PEM
//	bundle.pem         the trust bundle (CA certificates), PEM
//	journal/id         the journal id; a missing journal directory means a new id
package state

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/bettercompute/bettercompute/proto/spiffepath"
)

// File names under the root.
const (
	keyFile     = "node.key"
	nodeIDFile  = "node_id"
	chainFile   = "cert.pem"
	bundleFile  = "bundle.pem"
	journalDir  = "journal"
	journalFile = "id"
)

// ErrNotJoined is returned by Identity when the node has not joined yet.
var ErrNotJoined = errors.New("state: node has not joined (run bcd join)")

// Store is bcd's state under one root directory. It is safe for concurrent
// use within one process.
type Store struct {
	root string
	mu   sync.Mutex
	// noSync skips the fsyncs of atomic writes (OpenUnsynced).
	noSync bool
}

// Identity is what a node holds after joining: its id, its certificate
// chain (DER, leaf first) and the trust bundle (DER CA certificates).
type Identity struct {
	// NodeID is the node's id (node_…).
	NodeID string
	// Chain is the node certificate and its intermediates, DER, leaf first.
	Chain [][]byte
	// Bundle holds the CA certificates that sign gateway and node
	// certificates, DER.
	Bundle [][]byte
}

// Open returns the Store under root, creating the directory (mode 0700)
// when missing.
func Open(root string) (*Store, error) {
	if root == "" {
		return nil, errors.New("state: empty root directory")
	}
	if err := os.MkdirAll(root, 0o700); err != nil {
		return nil, fmt.Errorf("state: %w", err)
	}
	return &Store{root: root}, nil
}

// OpenUnsynced is [Open] for a simulated node: its writes are still atomic
// (a temporary file renamed into place) but never fsynced. Many simulated
// nodes share one disk, where a real fleet has one per node; their fsyncs
// would measure that disk, not the control plane. Never use it for a real
// node: a crash could lose a journal entry or an observed generation.
func OpenUnsynced(root string) (*Store, error) {
	s, err := Open(root)
	if err != nil {
		return nil, err
	}
	s.noSync = true
	return s, nil
}

// Root is the root directory.
func (s *Store) Root() string { return s.root }

// WriteAtomic writes data to path (under Root) atomically, as the package's
// WriteAtomic does, without the fsyncs for a store from OpenUnsynced.
func (s *Store) WriteAtomic(path string, data []byte, mode os.FileMode) error {
	return writeFile(path, data, mode, !s.noSync)
}

// Key returns the node key, generating and storing an ECDSA P-256 key on
// first use.
func (s *Store) Key() (*ecdsa.PrivateKey, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	path := filepath.Join(s.root, keyFile)
	b, err := os.ReadFile(path)
	switch {
	case err == nil:
		blk, _ := pem.Decode(b)
		if blk == nil || blk.Type != "PRIVATE KEY" {
			return nil, fmt.Errorf("state: %s: not a PEM PRIVATE KEY", path)
		}
		k, err := x509.ParsePKCS8PrivateKey(blk.Bytes)
		if err != nil {
			return nil, fmt.Errorf("state: %s: %w", path, err)
		}
		ec, ok := k.(*ecdsa.PrivateKey)
		if !ok {
			return nil, fmt.Errorf("state: %s: %T is not an ECDSA key", path, k)
		}
		return ec, nil
	case errors.Is(err, fs.ErrNotExist):
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return nil, fmt.Errorf("state: generate key: %w", err)
		}
		der, err := x509.MarshalPKCS8PrivateKey(k)
		if err != nil {
			return nil, fmt.Errorf("state: marshal key: %w", err)
		}
		if err := s.WriteAtomic(path, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600); err != nil {
			return nil, err
		}
		return k, nil
	default:
		return nil, fmt.Errorf("state: %w", err)
	}
}

// CSR returns a DER PKCS#10 request for the node key (created when
// missing). It names no identity: joinservice sets the SPIFFE id.
func (s *Store) CSR() ([]byte, error) {
	k, err := s.Key()
	if err != nil {
		return nil, err
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, k)
	if err != nil {
		return nil, fmt.Errorf("state: csr: %w", err)
	}
	return der, nil
}

// Identity returns the stored identity, or ErrNotJoined.
func (s *Store) Identity() (Identity, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	id, err := os.ReadFile(filepath.Join(s.root, nodeIDFile))
	if errors.Is(err, fs.ErrNotExist) {
		return Identity{}, ErrNotJoined
	}
	if err != nil {
		return Identity{}, fmt.Errorf("state: %w", err)
	}
	chain, err := readCerts(filepath.Join(s.root, chainFile))
	if err != nil {
		return Identity{}, err
	}
	bundle, err := readCerts(filepath.Join(s.root, bundleFile))
	if err != nil {
		return Identity{}, err
	}
	return Identity{NodeID: strings.TrimSpace(string(id)), Chain: chain, Bundle: bundle}, nil
}

// SaveIdentity stores id. The certificates are written before the node id,
// so a node id on disk always comes with its certificates.
func (s *Store) SaveIdentity(id Identity) error {
	if id.NodeID == "" || len(id.Chain) == 0 || len(id.Bundle) == 0 {
		return errors.New("state: identity needs a node id, a certificate chain and a trust bundle")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.WriteAtomic(filepath.Join(s.root, chainFile), encodeCerts(id.Chain), 0o644); err != nil {
		return err
	}
	if err := s.WriteAtomic(filepath.Join(s.root, bundleFile), encodeCerts(id.Bundle), 0o644); err != nil {
		return err
	}
	return s.WriteAtomic(filepath.Join(s.root, nodeIDFile), []byte(id.NodeID+"\n"), 0o644)
}

// JournalID returns the journal id, creating the journal directory and a
// new random id when the directory is missing (the journal was lost).
func (s *Store) JournalID() (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	dir := filepath.Join(s.root, journalDir)
	path := filepath.Join(dir, journalFile)
	b, err := os.ReadFile(path)
	if err == nil && len(strings.TrimSpace(string(b))) > 0 {
		return strings.TrimSpace(string(b)), nil
	}
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("state: %w", err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("state: %w", err)
	}
	id := "jrn_" + randomHex(16)
	if err := s.WriteAtomic(path, []byte(id+"\n"), 0o644); err != nil {
		return "", err
	}
	return id, nil
}

// BootID returns override when set (simulated nodes give each daemon its
// own), else the kernel's /proc/sys/kernel/random/boot_id.
func BootID(override string) (string, error) {
	if override != "" {
		return override, nil
	}
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return "", fmt.Errorf("state: boot id: %w", err)
	}
	return strings.TrimSpace(string(b)), nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // crypto/rand.Read never fails
	return hex.EncodeToString(b)
}

func encodeCerts(ders [][]byte) []byte {
	var out []byte
	for _, d := range ders {
		out = append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: d})...)
	}
	return out
}

func readCerts(path string) ([][]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("state: %w", err)
	}
	var ders [][]byte
	for {
		var blk *pem.Block
		blk, b = pem.Decode(b)
		if blk == nil {
			break
		}
		if blk.Type == "CERTIFICATE" {
			ders = append(ders, blk.Bytes)
		}
	}
	if len(ders) == 0 {
		return nil, fmt.Errorf("state: %s: no certificates", path)
	}
	return ders, nil
}

// WriteAtomic writes data to path atomically (see writeFile): other
// packages of bcd use it for their files under the root.
func WriteAtomic(path string, data []byte, mode os.FileMode) error {
	return writeFile(path, data, mode, true)
}

// writeFile writes data to a temporary file beside path, syncs it (when
// sync is set), renames it over path, then syncs the directory.
func writeFile(path string, data []byte, mode os.FileMode, sync bool) (err error) {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return fmt.Errorf("state: %w", err)
	}
	defer func() {
		if err != nil {
			_ = os.Remove(f.Name())
		}
	}()
	if err := f.Chmod(mode); err != nil {
		_ = f.Close()
		return fmt.Errorf("state: %w", err)
	}
	if _, err := f.Write(data); err != nil {
		_ = f.Close()
		return fmt.Errorf("state: write %s: %w", path, err)
	}
	if sync {
		if err := f.Sync(); err != nil {
			_ = f.Close()
			return fmt.Errorf("state: sync %s: %w", path, err)
		}
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("state: %w", err)
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return fmt.Errorf("state: %w", err)
	}
	if !sync {
		return nil
	}
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		_ = d.Close()
	}
	return nil
}

// Leaf parses the node certificate (the chain's first).
func (id Identity) Leaf() (*x509.Certificate, error) {
	if len(id.Chain) == 0 {
		return nil, errors.New("state: empty certificate chain")
	}
	c, err := x509.ParseCertificate(id.Chain[0])
	if err != nil {
		return nil, fmt.Errorf("state: node certificate: %w", err)
	}
	return c, nil
}

// Pool returns the trust bundle as a certificate pool.
func (id Identity) Pool() (*x509.CertPool, error) {
	pool := x509.NewCertPool()
	for _, der := range id.Bundle {
		c, err := x509.ParseCertificate(der)
		if err != nil {
			return nil, fmt.Errorf("state: trust bundle: %w", err)
		}
		pool.AddCert(c)
	}
	return pool, nil
}

// Verify checks that the identity hangs together: the leaf certifies key,
// chains to the trust bundle for client authentication, and carries the
// SPIFFE id spiffe://<trust-domain>/node/<NodeID>. The validity period is
// not checked here (the chain is verified as of the leaf's NotBefore);
// callers look at Leaf().NotAfter.
func (id Identity) Verify(key crypto.Signer) error {
	return id.VerifyPath(key, spiffepath.Node(id.NodeID))
}

// VerifyPath is [Identity.Verify] for a certificate whose SPIFFE id has
// path want: a site agent's identity (NodeID is then the agent id) carries
// /site/<site id>/agent/<agent id>.
func (id Identity) VerifyPath(key crypto.Signer, want string) error {
	leaf, err := id.Leaf()
	if err != nil {
		return err
	}
	pub, ok := key.Public().(interface{ Equal(crypto.PublicKey) bool })
	if !ok || !pub.Equal(leaf.PublicKey) {
		return errors.New("state: the certificate is not for the key")
	}
	roots, err := id.Pool()
	if err != nil {
		return err
	}
	inter := x509.NewCertPool()
	for _, der := range id.Chain[1:] {
		c, err := x509.ParseCertificate(der)
		if err != nil {
			return fmt.Errorf("state: certificate chain: %w", err)
		}
		inter.AddCert(c)
	}
	if _, err := leaf.Verify(x509.VerifyOptions{
		Roots:         roots,
		Intermediates: inter,
		CurrentTime:   leaf.NotBefore,
		KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}); err != nil {
		return fmt.Errorf("state: node certificate does not chain to the trust bundle: %w", err)
	}
	for _, u := range leaf.URIs {
		if u.Scheme == "spiffe" && u.Host != "" && u.Path == want {
			return nil
		}
	}
	return fmt.Errorf("state: node certificate has no SPIFFE id spiffe://<trust-domain>%s", want)
}
