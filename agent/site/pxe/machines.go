package pxe

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"sync"
)

// Action is what a machine should do when it network-boots.
type Action int

const (
	// BootRamdisk boots `bcd ramdisk` from the image cache.
	BootRamdisk Action = iota + 1
	// BootLocal hands the machine back to its local disk (sanboot on BIOS,
	// exit to the firmware's next boot entry on UEFI).
	BootLocal
)

// String names the action for logs.
func (a Action) String() string {
	switch a {
	case BootRamdisk:
		return "ramdisk"
	case BootLocal:
		return "local"
	default:
		return fmt.Sprintf("action(%d)", int(a))
	}
}

// Image is one content-addressed file of the image cache: its SHA-256 and
// the upstream URL the cache fetches it from on first use.
type Image struct {
	// SHA256 is the lowercase hex digest (64 characters).
	SHA256 string
	// URL is the upstream http(s) URL, at most MaxURLLen bytes.
	URL string
}

// Decision is the boot decision for one machine, as the control plane
// made it.
type Decision struct {
	// Action is BootRamdisk or BootLocal.
	Action Action
	// Kernel and Initrd are the ramdisk's images (BootRamdisk only).
	Kernel Image
	Initrd Image
	// Args are extra kernel arguments (BootRamdisk only); the server adds
	// the gateway address, the boot token and the boot MAC itself.
	Args []string
}

// Machines gives the server the boot decision for each MAC it may answer.
// Implementations must be safe for concurrent use and fast: Lookup runs on
// every PXE DHCP packet. Table is the in-memory implementation the site
// session fills.
type Machines interface {
	// Lookup returns the decision for mac; ok is false for a MAC the site
	// does not manage, which the server then ignores entirely.
	Lookup(ctx context.Context, mac net.HardwareAddr) (d Decision, ok bool)
	// TakeBootToken returns the machine's one-time boot token and forgets
	// it: a second call returns ErrNoBootToken until the control plane
	// issues a new one.
	TakeBootToken(ctx context.Context, mac net.HardwareAddr) (string, error)
}

// ErrNoBootToken: the machine has no unused boot token.
var ErrNoBootToken = errors.New("no unused boot token")

// Limits on what the control plane hands the site, checked before use.
const (
	// MaxURLLen bounds an upstream image URL.
	MaxURLLen = 2048
	// MaxTokenLen bounds a boot token.
	MaxTokenLen = 512
	// MaxCmdlineLen bounds the whole kernel command line (x86
	// COMMAND_LINE_SIZE is 2048).
	MaxCmdlineLen = 2048
	// MaxArgs bounds the number of extra kernel arguments.
	MaxArgs = 64
	// MaxMachines bounds a Table.
	MaxMachines = 100_000
)

// Validate checks a decision before it is stored or used.
func (d Decision) Validate() error {
	switch d.Action {
	case BootLocal:
		return nil
	case BootRamdisk:
	default:
		return fmt.Errorf("action: unknown %d", int(d.Action))
	}
	if err := d.Kernel.Validate(); err != nil {
		return fmt.Errorf("kernel: %w", err)
	}
	if err := d.Initrd.Validate(); err != nil {
		return fmt.Errorf("initrd: %w", err)
	}
	if len(d.Args) > MaxArgs {
		return fmt.Errorf("args: %d, at most %d", len(d.Args), MaxArgs)
	}
	n := 0
	for i, a := range d.Args {
		if a == "" || !cmdlineSafe(a) {
			return fmt.Errorf("args[%d]: %q: only letters, digits and -_.,:=/+@%%~ allowed", i, a)
		}
		n += len(a) + 1
	}
	if n > MaxCmdlineLen/2 {
		return fmt.Errorf("args: %d bytes, at most %d", n, MaxCmdlineLen/2)
	}
	return nil
}

// Validate checks an image reference.
func (i Image) Validate() error {
	if !validDigest(i.SHA256) {
		return fmt.Errorf("sha256: %q is not 64 lowercase hex digits", i.SHA256)
	}
	if len(i.URL) > MaxURLLen {
		return fmt.Errorf("url: %d bytes, at most %d", len(i.URL), MaxURLLen)
	}
	u, err := url.Parse(i.URL)
	if err != nil {
		return fmt.Errorf("url: %w", err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("url: %q: want an absolute http or https URL", i.URL)
	}
	return nil
}

func validDigest(s string) bool {
	if len(s) != 64 {
		return false
	}
	for _, c := range s {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// cmdlineSafe: characters that mean nothing to iPXE's script parser
// (no ${expansion}, no && ||, no quotes, no comments) nor to the kernel's
// command-line splitter.
func cmdlineSafe(s string) bool {
	for _, c := range s {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case strings.ContainsRune("-_.,:=/+@%~", c):
		default:
			return false
		}
	}
	return true
}

// Table is an in-memory Machines: the site session sets decisions and
// tokens as the control plane sends them. The zero value is not usable;
// call NewTable.
type Table struct {
	mu sync.Mutex
	m  map[string]*tableEntry
}

type tableEntry struct {
	d     Decision
	token string
}

// NewTable returns an empty table.
func NewTable() *Table { return &Table{m: make(map[string]*tableEntry)} }

// Set stores mac's decision, keeping any unused token.
func (t *Table) Set(mac net.HardwareAddr, d Decision) error {
	if len(mac) != 6 {
		return fmt.Errorf("mac: %q is not an Ethernet address", mac)
	}
	if err := d.Validate(); err != nil {
		return err
	}
	d.Args = append([]string(nil), d.Args...)
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.m[mac.String()]
	if !ok {
		if len(t.m) >= MaxMachines {
			return fmt.Errorf("table full: %d machines", MaxMachines)
		}
		e = &tableEntry{}
		t.m[mac.String()] = e
	}
	e.d = d
	return nil
}

// SetBootToken gives a known mac a new one-time boot token.
func (t *Table) SetBootToken(mac net.HardwareAddr, token string) error {
	if err := validToken(token); err != nil {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.m[mac.String()]
	if !ok {
		return fmt.Errorf("mac %s: unknown", mac)
	}
	e.token = token
	return nil
}

// Delete forgets mac.
func (t *Table) Delete(mac net.HardwareAddr) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.m, mac.String())
}

// Lookup implements Machines.
func (t *Table) Lookup(_ context.Context, mac net.HardwareAddr) (Decision, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.m[mac.String()]
	if !ok {
		return Decision{}, false
	}
	d := e.d
	d.Args = append([]string(nil), d.Args...)
	return d, true
}

// TakeBootToken implements Machines.
func (t *Table) TakeBootToken(_ context.Context, mac net.HardwareAddr) (string, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.m[mac.String()]
	if !ok || e.token == "" {
		return "", ErrNoBootToken
	}
	tok := e.token
	e.token = ""
	return tok, nil
}

func validToken(tok string) error {
	if tok == "" || len(tok) > MaxTokenLen {
		return fmt.Errorf("boot token: %d bytes, want 1 to %d", len(tok), MaxTokenLen)
	}
	for _, c := range tok {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case strings.ContainsRune("-_.~+/=", c):
		default:
			return errors.New("boot token: only letters, digits and -_.~+/= allowed")
		}
	}
	return nil
}
