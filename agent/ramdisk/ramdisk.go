// Package ramdisk is what bcd ramdisk does on a machine in commissioning,
// booted from the network into a ramdisk with a restricted certificate
// (role ramdisk, at most 2 hours): the burn-in check of its disks, disk.wipe,
// image.deploy and node.kexec. A *Ramdisk is the agent/command executor's
// Config.Ramdisk; the executor signs every finished command's report with
// the ramdisk's Ed25519 key (Config.ResultKey, see [NewKey]) through
// proto/resultsig, so the control plane can tell the machine itself did the
// wipe.
//
// Every path it touches must be in its disk inventory (Config.Disks): a
// disk outside it is refused with a [FieldError] naming the payload field,
// before anything is opened for writing. Disks are device paths on a real
// machine and plain files in tests and simulation; the file backend wipes
// with zeros (discard punches holes), and a drive's secure erase goes
// through an [Eraser] (nvme format, hdparm; [ToolEraser]).
//
// Images and kernels are streamed from HTTP, hashed as they are written and
// never held in memory whole; nothing is reported good until its SHA-256 is
// the one the (signed) command named.
package ramdisk

import (
	"cmp"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/bettercompute/bettercompute/proto/commandkinds"
)

// Config configures a Ramdisk. Disks is required.
type Config struct {
	// Disks is the machine's disk inventory: the only paths disk.wipe,
	// image.deploy and the burn-in check touch. Symbolic links are
	// resolved, so /dev/disk/by-id/… names the disk it points to.
	Disks []string
	// Eraser performs a drive's secure erase on a block device; nil
	// refuses WIPE_METHOD_SECURE_ERASE on block devices (a file-backed
	// disk is zeroed instead, and the result says ZERO).
	Eraser Eraser
	// Kexec loads and boots a kernel for node.kexec; nil refuses it.
	Kexec Kexecer
	// WorkDir is where node.kexec's kernel and initrd are downloaded (a
	// tmpfs in the ramdisk); required for node.kexec.
	WorkDir string
	// HTTPClient fetches images, kernels and initrds; nil means a client
	// whose only overall bound is the command's context.
	HTTPClient *http.Client
	// Logger; nil means slog.Default().
	Logger *slog.Logger
}

// MaxKexecFile bounds a kernel or an initrd, in bytes. The bounds the
// control plane checks too (disks, device paths, URLs, the kexec command
// line) are declared in proto/commandkinds.
const MaxKexecFile = 1 << 30

// Ramdisk runs the commissioning kinds. Its methods are safe for concurrent
// use, though the executor runs them one at a time (the exclusive lane).
type Ramdisk struct {
	cfg    Config
	log    *slog.Logger
	client *http.Client

	mu     sync.Mutex
	loaded bool // a kexec kernel is loaded
}

// New returns a Ramdisk for cfg.
func New(cfg Config) (*Ramdisk, error) {
	if len(cfg.Disks) == 0 {
		return nil, errors.New("ramdisk: no disks in the inventory")
	}
	client := cfg.HTTPClient
	if client == nil {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.ResponseHeaderTimeout = time.Minute
		client = &http.Client{Transport: tr}
	}
	return &Ramdisk{cfg: cfg, log: cmp.Or(cfg.Logger, slog.Default()), client: client}, nil
}

// FieldError is a payload refused: Field is its proto3 JSON path, e.g.
// "payload.disks", as the control plane's faults name it.
type FieldError struct {
	Field  string
	Reason string
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Reason }

func fieldErr(field, format string, args ...any) error {
	return &FieldError{Field: field, Reason: fmt.Sprintf(format, args...)}
}

// disk resolves p, a device path from payload field, to the inventory disk
// it names: refused unless it is one.
func (r *Ramdisk) disk(field, p string) (string, error) {
	if p == "" || len(p) > commandkinds.MaxDiskPath || !filepath.IsAbs(p) {
		return "", fieldErr(field, "%.256q is not an absolute device path of at most %d characters", p, commandkinds.MaxDiskPath)
	}
	want, err := filepath.EvalSymlinks(filepath.Clean(p))
	if err != nil {
		want = filepath.Clean(p)
	}
	for _, d := range r.cfg.Disks {
		got, err := filepath.EvalSymlinks(filepath.Clean(d))
		if err != nil {
			got = filepath.Clean(d)
		}
		if got == want {
			if _, err := os.Stat(got); err != nil {
				return "", fieldErr(field, "disk %s of the inventory: %v", p, err)
			}
			return got, nil
		}
	}
	return "", fieldErr(field, "%s is not a disk of this machine's inventory", p)
}

// NewKey returns a new Ed25519 key for a ramdisk boot: kept in memory only,
// it is the key of the ramdisk's CSR (see [CSR]), so the certificate the
// control plane issues binds it, and it signs every result
// (agent/command's Config.ResultKey; proto/resultsig verifies).
func NewKey() (ed25519.PrivateKey, error) {
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("ramdisk: generate key: %w", err)
	}
	return priv, nil
}

// CSR returns a DER PKCS#10 request for key, naming no identity
// (joinservice sets the SPIFFE id and the ramdisk role).
func CSR(key ed25519.PrivateKey) ([]byte, error) {
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, key)
	if err != nil {
		return nil, fmt.Errorf("ramdisk: csr: %w", err)
	}
	return der, nil
}
