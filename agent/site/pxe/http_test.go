package pxe

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestIPXEScript(t *testing.T) {
	t.Parallel()

	t.Run("ramdisk script carries a one-time token", func(t *testing.T) {
		t.Parallel()
		h := setup(t)
		if err := h.table.SetBootToken(knownMAC, "tok-1.abc"); err != nil {
			t.Fatal(err)
		}
		url := h.base + "/boot/" + knownMAC.String() + ".ipxe"
		code, body, hdr := get(t, url)
		if code != http.StatusOK {
			t.Fatalf("status %d: %s", code, body)
		}
		for _, want := range []string{
			"#!ipxe\n",
			"kernel --name vmlinuz " + h.base + "/images/sha256/" + h.kernel.SHA256 + " initrd=initrd.img console=ttyS0,115200n8 ",
			" bc.gateway=gw.example.net:443 ",
			" bc.boot_token=tok-1.abc ",
			" bc.boot_mac=02:bc:00:00:00:01\n",
			"initrd --name initrd.img " + h.base + "/images/sha256/" + h.initrd.SHA256 + "\n",
			"boot\n",
		} {
			if !strings.Contains(body, want) {
				t.Errorf("script lacks %q:\n%s", want, body)
			}
		}
		if hdr.Get("Cache-Control") != "no-store" {
			t.Errorf("Cache-Control = %q", hdr.Get("Cache-Control"))
		}
		code, body, _ = get(t, url)
		if code != http.StatusGone || strings.Contains(body, "tok-1") {
			t.Fatalf("second fetch: %d %q, want 410 without the token", code, body)
		}
		// A new token from the control plane boots again.
		if err := h.table.SetBootToken(knownMAC, "tok-2"); err != nil {
			t.Fatal(err)
		}
		if code, body, _ := get(t, url); code != http.StatusOK || !strings.Contains(body, "bc.boot_token=tok-2 ") {
			t.Fatalf("after a new token: %d %s", code, body)
		}
		// The kernel the script names is served from the cache.
		code, body, _ = get(t, h.base+"/images/sha256/"+h.kernel.SHA256)
		if code != http.StatusOK || body != string(h.kernelB) {
			t.Fatalf("kernel: %d, %d bytes", code, len(body))
		}
	})
	t.Run("no token is 410", func(t *testing.T) {
		t.Parallel()
		h := setup(t)
		if code, _, _ := get(t, h.base+"/boot/"+knownMAC.String()+".ipxe"); code != http.StatusGone {
			t.Fatalf("status %d, want 410", code)
		}
	})
	t.Run("a token handed out twice is refused the second time", func(t *testing.T) {
		t.Parallel()
		h := setup(t)
		sc := &scripts{machines: sameToken{h.table}, cache: h.srv.cache, gateway: "gw:1",
			baseURL: func() string { return "http://x" }, log: quietLogger(), used: newTokenSet(), prefetch: func(Image) {}}
		for i, want := range []int{http.StatusOK, http.StatusGone} {
			rec := httptest.NewRecorder()
			req, _ := http.NewRequest(http.MethodGet, "/boot/"+knownMAC.String()+".ipxe", nil)
			req.SetPathValue("file", knownMAC.String()+".ipxe")
			sc.ServeHTTP(rec, req)
			if rec.Code != want {
				t.Errorf("fetch %d: status %d, want %d", i, rec.Code, want)
			}
		}
	})
	t.Run("local boot", func(t *testing.T) {
		t.Parallel()
		h := setup(t)
		if err := h.table.Set(knownMAC, Decision{Action: BootLocal}); err != nil {
			t.Fatal(err)
		}
		code, body, _ := get(t, h.base+"/boot/"+strings.ToUpper(knownMAC.String())+".ipxe")
		if code != http.StatusOK || !strings.Contains(body, "sanboot --no-describe --drive 0x80") || !strings.Contains(body, "exit") ||
			strings.Contains(body, "kernel") {
			t.Fatalf("%d:\n%s", code, body)
		}
	})
	t.Run("unknown and malformed", func(t *testing.T) {
		t.Parallel()
		h := setup(t)
		for path, want := range map[string]int{
			"/boot/" + unknownMAC.String() + ".ipxe": http.StatusNotFound,
			"/boot/not-a-mac.ipxe":                   http.StatusBadRequest,
			"/boot/" + knownMAC.String():             http.StatusBadRequest,
			"/boot/02:bc:00:00:00:01:02:03.ipxe":     http.StatusBadRequest,
		} {
			if code, _, _ := get(t, h.base+path); code != want {
				t.Errorf("%s: %d, want %d", path, code, want)
			}
		}
	})
	t.Run("UEFI HTTP boot of ipxe.efi", func(t *testing.T) {
		t.Parallel()
		h := setup(t)
		code, body, hdr := get(t, h.base+"/ipxe/ipxe.efi")
		if code != http.StatusOK || body != string(fakeUEFI) || hdr.Get("Content-Type") != "application/efi" {
			t.Fatalf("%d %q %d bytes", code, hdr.Get("Content-Type"), len(body))
		}
		for _, p := range []string{"/ipxe/other.bin", "/ipxe/..%2fundionly.kpxe", "/ipxe/%2e%2e"} {
			if code, _, _ := get(t, h.base+p); code != http.StatusNotFound {
				t.Errorf("%s: %d, want 404", p, code)
			}
		}
	})
}

// sameToken is a broken Machines that hands out the same token forever.
type sameToken struct{ *Table }

func (sameToken) TakeBootToken(context.Context, net.HardwareAddr) (string, error) { return "same", nil }
