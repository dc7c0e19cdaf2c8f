package pxe

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"

	"github.com/bettercompute/bettercompute/agent/kernelargs"
)

// scripts serves /boot/<mac>.ipxe.
type scripts struct {
	machines Machines
	cache    *Cache
	gateway  string
	baseURL  func() string
	log      *slog.Logger
	used     *tokenSet
	// prefetch warms the cache with the ramdisk's images in the background.
	prefetch func(Image)
}

func (s *scripts) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	name := r.PathValue("file")
	macStr, ok := strings.CutSuffix(name, ".ipxe")
	mac, err := net.ParseMAC(macStr)
	if !ok || err != nil || len(mac) != 6 {
		http.Error(w, "want /boot/<mac>.ipxe", http.StatusBadRequest)
		return
	}
	d, ok := s.machines.Lookup(ctx, mac)
	if !ok {
		http.NotFound(w, r)
		return
	}
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	if d.Action == BootLocal {
		s.log.InfoContext(ctx, "ipxe: local boot", "mac", mac.String())
		fmt.Fprint(w, localScript)
		return
	}
	if err := d.Validate(); err != nil {
		s.log.ErrorContext(ctx, "ipxe: bad decision", "mac", mac.String(), "error", err)
		http.Error(w, "bad boot decision", http.StatusInternalServerError)
		return
	}
	script, err := s.ramdisk(ctx, mac, d)
	switch {
	case errors.Is(err, ErrNoBootToken):
		s.log.WarnContext(ctx, "ipxe: boot token already used", "mac", mac.String())
		http.Error(w, "boot token already used", http.StatusGone)
		return
	case err != nil:
		s.log.ErrorContext(ctx, "ipxe: script", "mac", mac.String(), "error", err)
		http.Error(w, "no boot script", http.StatusInternalServerError)
		return
	}
	s.log.InfoContext(ctx, "ipxe: ramdisk boot", "mac", mac.String(), "kernel", d.Kernel.SHA256, "initrd", d.Initrd.SHA256)
	fmt.Fprint(w, script)
}

// ramdisk takes the machine's boot token and writes the script that boots
// `bcd ramdisk` with it.
func (s *scripts) ramdisk(ctx context.Context, mac net.HardwareAddr, d Decision) (string, error) {
	for _, img := range []Image{d.Kernel, d.Initrd} {
		if err := s.cache.Register(img); err != nil {
			return "", err
		}
	}
	tok, err := s.machines.TakeBootToken(ctx, mac)
	if err != nil {
		return "", err
	}
	if err := validToken(tok); err != nil {
		return "", err
	}
	if !s.used.add(tok) { // a Machines that handed the same token out twice
		return "", ErrNoBootToken
	}
	s.prefetch(d.Kernel)
	s.prefetch(d.Initrd)
	base := s.baseURL()
	args := append([]string{"initrd=initrd.img"}, d.Args...)
	args = append(args,
		kernelargs.Gateway+"="+s.gateway,
		kernelargs.BootToken+"="+tok,
		kernelargs.BootMAC+"="+mac.String())
	cmdline := strings.Join(args, " ")
	if len(cmdline) > MaxCmdlineLen {
		return "", fmt.Errorf("kernel command line: %d bytes, at most %d", len(cmdline), MaxCmdlineLen)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "#!ipxe\n# bcd site: bcd ramdisk for %s\nimgfree\n", mac)
	fmt.Fprintf(&b, "kernel --name vmlinuz %s/images/sha256/%s %s\n", base, d.Kernel.SHA256, cmdline)
	fmt.Fprintf(&b, "initrd --name initrd.img %s/images/sha256/%s\n", base, d.Initrd.SHA256)
	b.WriteString("boot\n")
	return b.String(), nil
}

// localScript boots the first local disk: sanboot on BIOS, back to the
// firmware's next boot entry on UEFI.
const localScript = `#!ipxe
# bcd site: boot from the local disk
iseq ${platform} efi && goto efi ||
sanboot --no-describe --drive 0x80 || exit 1
:efi
exit 1
`

// tokenSet remembers the hashes of the last maxUsedTokens boot tokens the
// server handed out, so none is ever handed out twice.
type tokenSet struct {
	mu   sync.Mutex
	m    map[[32]byte]struct{}
	ring [][32]byte
	next int
}

const maxUsedTokens = 65536

func newTokenSet() *tokenSet { return &tokenSet{m: make(map[[32]byte]struct{})} }

// add records tok; false if it was already there.
func (t *tokenSet) add(tok string) bool {
	h := sha256.Sum256([]byte(tok))
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, ok := t.m[h]; ok {
		return false
	}
	if len(t.ring) < maxUsedTokens {
		t.ring = append(t.ring, h)
	} else {
		delete(t.m, t.ring[t.next])
		t.ring[t.next] = h
		t.next = (t.next + 1) % maxUsedTokens
	}
	t.m[h] = struct{}{}
	return true
}

// ServeHTTP serves GET /ipxe/{name}: the iPXE binaries for UEFI HTTP boot.
func (b *bootFiles) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f, fi, err := b.open(r.PathValue("name"))
	if err != nil {
		b.log.WarnContext(r.Context(), "http boot: refused", "file", r.PathValue("name"), "reason", err)
		http.NotFound(w, r)
		return
	}
	defer f.Close()
	w.Header().Set("Content-Type", "application/efi")
	http.ServeContent(w, r, "", fi.ModTime(), f)
}
