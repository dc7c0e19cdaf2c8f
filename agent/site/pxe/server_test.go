package pxe

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
)

// Fake iPXE binaries the tests serve.
var (
	fakeBIOS = []byte("fake undionly.kpxe " + strings.Repeat("B", 3000)) // several TFTP blocks
	fakeUEFI = []byte("fake ipxe.efi " + strings.Repeat("U", 700))
)

// upstream is an image origin counting its fetches.
type upstream struct {
	srv   *httptest.Server
	mu    sync.Mutex
	blobs map[string][]byte // path → body
	hits  map[string]*atomic.Int64
	gate  chan struct{} // when non-nil, requests wait for it to close
}

func newUpstream(t *testing.T) *upstream {
	t.Helper()
	u := &upstream{blobs: map[string][]byte{}, hits: map[string]*atomic.Int64{}}
	u.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u.mu.Lock()
		body, ok := u.blobs[r.URL.Path]
		hits := u.hits[r.URL.Path]
		gate := u.gate
		u.mu.Unlock()
		if !ok {
			http.NotFound(w, r)
			return
		}
		hits.Add(1)
		if gate != nil {
			<-gate
		}
		_, _ = w.Write(body)
	}))
	t.Cleanup(u.srv.Close)
	return u
}

// add serves body at path and returns an Image claiming digest of want
// (want == body for an honest upstream).
func (u *upstream) add(path string, body, want []byte) Image {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.blobs[path] = body
	u.hits[path] = &atomic.Int64{}
	sum := sha256.Sum256(want)
	return Image{SHA256: hex.EncodeToString(sum[:]), URL: u.srv.URL + path}
}

func (u *upstream) count(path string) int64 {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.hits[path].Load()
}

type harness struct {
	srv      *Server
	table    *Table
	up       *upstream
	cacheDir string
	ipxeDir  string
	base     string
	kernel   Image
	initrd   Image
	kernelB  []byte
}

func setup(t *testing.T) *harness {
	t.Helper()
	h := &harness{table: NewTable(), up: newUpstream(t), cacheDir: t.TempDir(), ipxeDir: t.TempDir()}
	for name, body := range map[string][]byte{"undionly.kpxe": fakeBIOS, "ipxe.efi": fakeUEFI, "other.bin": []byte("not served")} {
		if err := os.WriteFile(filepath.Join(h.ipxeDir, name), body, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	h.kernelB = []byte("kernel image bytes " + strings.Repeat("K", 4096))
	h.kernel = h.up.add("/vmlinuz", h.kernelB, h.kernelB)
	initrdB := []byte("initrd image bytes")
	h.initrd = h.up.add("/initrd", initrdB, initrdB)
	if err := h.table.Set(knownMAC, Decision{Action: BootRamdisk, Kernel: h.kernel, Initrd: h.initrd,
		Args: []string{"console=ttyS0,115200n8"}}); err != nil {
		t.Fatal(err)
	}
	srv, err := New(Config{
		IP:       netip.MustParseAddr("127.0.0.1"),
		DHCPAddr: "127.0.0.1:0",
		PXEAddr:  "127.0.0.1:0",
		TFTPAddr: "127.0.0.1:0",
		HTTPAddr: "127.0.0.1:0",
		IPXEDir:  h.ipxeDir,
		CacheDir: h.cacheDir,
		Gateway:  "gw.example.net:443",
		Machines: h.table,
		Logger:   quietLogger(),
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	h.srv = srv
	h.base = srv.Addrs().BaseURL
	return h
}

func get(t *testing.T, url string, hdr ...string) (int, string, http.Header) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b), resp.Header
}

func TestServerLifecycle(t *testing.T) {
	t.Parallel()
	cfg := Config{IP: netip.MustParseAddr("127.0.0.1"), CacheDir: t.TempDir(), Gateway: "gw:443",
		Machines: NewTable(), Logger: quietLogger(),
		DHCPAddr: "127.0.0.1:0", PXEAddr: "127.0.0.1:0", TFTPAddr: "127.0.0.1:0", HTTPAddr: "127.0.0.1:0"}

	t.Run("stop before start and twice", func(t *testing.T) {
		s, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		s.Stop()
		s.Stop()
		if err := s.Start(context.Background()); err == nil {
			t.Error("started after Stop")
		}
	})
	t.Run("start fails cleanly when a port is taken", func(t *testing.T) {
		ln, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		c := cfg
		c.HTTPAddr = ln.Addr().String()
		s, err := New(c)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Start(context.Background()); err == nil || !strings.Contains(err.Error(), "http") {
			t.Fatalf("Start = %v, want an http listen error", err)
		}
		if a := s.Addrs(); a.DHCP != nil {
			t.Errorf("addrs after failed start: %+v", a)
		}
		s.Stop()
	})
	t.Run("bad config", func(t *testing.T) {
		for name, mut := range map[string]func(*Config){
			"no ip":          func(c *Config) { c.IP = netip.Addr{} },
			"ipv6":           func(c *Config) { c.IP = netip.MustParseAddr("::1") },
			"no machines":    func(c *Config) { c.Machines = nil },
			"no cache dir":   func(c *Config) { c.CacheDir = "" },
			"bad gateway":    func(c *Config) { c.Gateway = "gw 443" },
			"boot file path": func(c *Config) { c.BIOSBootFile = "../undionly.kpxe" },
		} {
			c := cfg
			mut(&c)
			if _, err := New(c); err == nil {
				t.Errorf("%s: accepted", name)
			}
		}
	})
}

func TestTableValidation(t *testing.T) {
	t.Parallel()
	tab := NewTable()
	good := Image{SHA256: strings.Repeat("a", 64), URL: "https://images.example/k"}
	for name, d := range map[string]Decision{
		"no action":       {},
		"bad digest":      {Action: BootRamdisk, Kernel: Image{SHA256: "abc", URL: good.URL}, Initrd: good},
		"upper hex":       {Action: BootRamdisk, Kernel: Image{SHA256: strings.Repeat("A", 64), URL: good.URL}, Initrd: good},
		"file url":        {Action: BootRamdisk, Kernel: Image{SHA256: good.SHA256, URL: "file:///etc/passwd"}, Initrd: good},
		"arg with space":  {Action: BootRamdisk, Kernel: good, Initrd: good, Args: []string{"a b"}},
		"arg expands":     {Action: BootRamdisk, Kernel: good, Initrd: good, Args: []string{"x=${net0/ip}"}},
		"arg with &&":     {Action: BootRamdisk, Kernel: good, Initrd: good, Args: []string{"x&&shell"}},
		"too many args":   {Action: BootRamdisk, Kernel: good, Initrd: good, Args: make([]string, MaxArgs+1)},
		"long cmdline":    {Action: BootRamdisk, Kernel: good, Initrd: good, Args: []string{strings.Repeat("x", MaxCmdlineLen)}},
		"empty arg":       {Action: BootRamdisk, Kernel: good, Initrd: good, Args: []string{""}},
		"url too long":    {Action: BootRamdisk, Kernel: Image{SHA256: good.SHA256, URL: "https://x/" + strings.Repeat("a", MaxURLLen)}, Initrd: good},
		"no initrd":       {Action: BootRamdisk, Kernel: good},
		"unknown action9": {Action: 9},
	} {
		if err := tab.Set(knownMAC, d); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if err := tab.Set(net.HardwareAddr{1, 2, 3}, Decision{Action: BootLocal}); err == nil {
		t.Error("short MAC accepted")
	}
	if err := tab.SetBootToken(unknownMAC, "tok"); err == nil {
		t.Error("token for an unknown MAC accepted")
	}
	if err := tab.Set(knownMAC, Decision{Action: BootLocal}); err != nil {
		t.Fatal(err)
	}
	for _, tok := range []string{"", "a b", "a\nb", "${x}", strings.Repeat("t", MaxTokenLen+1)} {
		if err := tab.SetBootToken(knownMAC, tok); err == nil {
			t.Errorf("token %q accepted", tok)
		}
	}
}
