//go:build linux

package pxe

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/insomniacslk/dhcp/dhcpv4"
	"github.com/insomniacslk/dhcp/dhcpv4/nclient4"
	"github.com/insomniacslk/dhcp/iana"
	"github.com/pin/tftp/v3"
	"golang.org/x/sys/unix"
)

// The server side of TestNetnsDHCPExchange runs as this test binary
// re-executed under `ip netns exec`, configured through this variable.
const netnsHelperEnv = "BC_PXE_NETNS_HELPER"

const (
	netnsServerIP = "10.213.0.1"
	netnsClientIP = "10.213.0.2"
	netnsHTTPPort = "8080"
	netnsToken    = "netns-boot-token"
	helperReady   = "PXE-NETNS-HELPER-READY"
)

type netnsHelperConfig struct {
	Interface string
	Dir       string
}

// TestNetnsDHCPExchange is the real thing: two network namespaces joined
// by a veth pair, the proxy DHCP server in one, a raw-socket DHCP client
// (nclient4) broadcasting a PXE DISCOVER in the other, then the rest of the
// boot chain across the link: TFTP of the boot file, the iPXE DISCOVER,
// the per-machine script over HTTP and the kernel from the image cache.
func TestNetnsDHCPExchange(t *testing.T) {
	if os.Getenv(netnsHelperEnv) != "" {
		t.Skip("running as the netns helper")
	}
	if os.Geteuid() != 0 {
		t.Skip("skipping the network-namespace DHCP exchange: needs root (ip netns add)")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("skipping the network-namespace DHCP exchange: iproute2's ip is not installed")
	}
	var rnd [3]byte
	rand.Read(rnd[:])
	sfx := hex.EncodeToString(rnd[:])
	srvNS, cliNS := "bcpxe-s-"+sfx, "bcpxe-c-"+sfx
	srvIf, cliIf := "bcs"+sfx, "bcc"+sfx

	ip := func(args ...string) error {
		out, err := exec.Command("ip", args...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
		}
		return nil
	}
	if err := ip("netns", "add", srvNS); err != nil {
		t.Skipf("skipping the network-namespace DHCP exchange: the kernel refuses namespaces: %v", err)
	}
	t.Cleanup(func() { _ = ip("netns", "del", srvNS) })
	if err := ip("netns", "add", cliNS); err != nil {
		t.Skipf("skipping: %v", err)
	}
	t.Cleanup(func() { _ = ip("netns", "del", cliNS) })
	if err := ip("link", "add", srvIf, "type", "veth", "peer", "name", cliIf); err != nil {
		t.Skipf("skipping the network-namespace DHCP exchange: no veth: %v", err)
	}
	t.Cleanup(func() { _ = ip("link", "del", srvIf) }) // gone with its namespace unless a step below failed
	for _, args := range [][]string{
		{"link", "set", srvIf, "netns", srvNS},
		{"link", "set", cliIf, "netns", cliNS},
		{"-n", cliNS, "link", "set", cliIf, "address", knownMAC.String()},
		{"-n", srvNS, "addr", "add", netnsServerIP + "/24", "dev", srvIf},
		{"-n", srvNS, "link", "set", "lo", "up"},
		{"-n", srvNS, "link", "set", srvIf, "up"},
		{"-n", cliNS, "link", "set", "lo", "up"},
		{"-n", cliNS, "link", "set", cliIf, "up"},
	} {
		if err := ip(args...); err != nil {
			t.Fatal(err)
		}
	}

	// The server, in its namespace.
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cfg, _ := json.Marshal(netnsHelperConfig{Interface: srvIf, Dir: t.TempDir()})
	cmd := exec.Command("ip", "netns", "exec", srvNS, exe, "-test.run=^TestNetnsServerHelper$", "-test.count=1")
	cmd.Env = append(os.Environ(), netnsHelperEnv+"="+string(cfg))
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{}) // closed once the helper has exited
	var exitErr error
	ready := make(chan struct{})
	var helperOut bytes.Buffer
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			helperOut.WriteString(sc.Text() + "\n")
			if sc.Text() == helperReady {
				close(ready)
			}
		}
		exitErr = cmd.Wait()
		close(exited)
	}()
	t.Cleanup(func() {
		stdin.Close() // the helper stops its server and exits
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			t.Logf("helper stderr:\n%s", stderr.String())
		}
	})
	select {
	case <-ready:
	case <-exited:
		t.Fatalf("helper exited before it was ready: %v\n%s\n%s", exitErr, helperOut.String(), stderr.String())
	case <-time.After(2 * time.Minute):
		t.Fatal("helper not ready (its stderr follows once it is stopped)")
	}

	// The client, on a thread moved into the client namespace (locked and
	// never unlocked, so the runtime discards the thread afterwards).
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread()
		fd, err := unix.Open("/run/netns/"+cliNS, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Errorf("open client netns: %v", err)
			return
		}
		defer unix.Close(fd)
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			t.Errorf("setns: %v", err)
			return
		}
		netnsClient(t, cliIf, func() error { return ip("-n", cliNS, "addr", "add", netnsClientIP+"/24", "dev", cliIf) })
	}()
	<-done
}

// netnsClient runs the machine's side of the boot, inside the client
// namespace. Every socket is made on the calling (locked) thread.
func netnsClient(t *testing.T, iface string, addAddress func() error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	srvIP := net.ParseIP(netnsServerIP).To4()

	c, err := nclient4.New(iface, nclient4.WithTimeout(3*time.Second), nclient4.WithRetry(5))
	if err != nil {
		t.Errorf("dhcp client: %v", err)
		return
	}
	defer c.Close()

	// 1. The PXE ROM's broadcast DISCOVER.
	offer, err := c.DiscoverOffer(ctx,
		dhcpv4.WithOption(dhcpv4.OptClassIdentifier("PXEClient:Arch:00000:UNDI:002001")),
		dhcpv4.WithOption(dhcpv4.OptClientArch(iana.INTEL_X86PC)),
		dhcpv4.WithGeneric(dhcpv4.OptionClientMachineIdentifier, netnsGUID))
	if err != nil {
		t.Errorf("PXE DISCOVER got no OFFER: %v", err)
		return
	}
	t.Logf("OFFER: %s", offer.Summary())
	if !offer.YourIPAddr.Equal(net.IPv4zero) || !offer.ServerIPAddr.Equal(srvIP) || offer.BootFileName != "undionly.kpxe" ||
		offer.ClassIdentifier() != "PXEClient" || !bytes.HasPrefix(offer.GetOneOption(dhcpv4.OptionVendorSpecificInformation), []byte{6, 1, 8}) ||
		!offer.ServerIdentifier().Equal(srvIP) || offer.Options.Has(dhcpv4.OptionIPAddressLeaseTime) {
		t.Errorf("OFFER is not a proxy PXE offer: %s", offer.Summary())
	}
	if got := offer.GetOneOption(dhcpv4.OptionClientMachineIdentifier); !bytes.Equal(got, netnsGUID) {
		t.Errorf("option 97 = % x, want the client's GUID echoed", got)
	}

	// The site's DHCP server (not ours) gives the lease.
	if err := addAddress(); err != nil {
		t.Errorf("client address: %v", err)
		return
	}

	// 2. TFTP of the boot file from next-server.
	tc, err := tftp.NewClient(net.JoinHostPort(offer.ServerIPAddr.String(), "69"))
	if err != nil {
		t.Errorf("tftp client: %v", err)
		return
	}
	wt, err := tc.Receive(offer.BootFileName, "octet")
	var got bytes.Buffer
	if err == nil {
		_, err = wt.WriteTo(&got)
	}
	if err != nil || !bytes.Equal(got.Bytes(), fakeBIOS) {
		t.Errorf("tftp %s: %v (%d bytes)", offer.BootFileName, err, got.Len())
	}

	// 3. iPXE's DISCOVER gets the script URL.
	ioffer, err := c.DiscoverOffer(ctx,
		dhcpv4.WithOption(dhcpv4.OptClassIdentifier("PXEClient:Arch:00000:UNDI:002001")),
		dhcpv4.WithOption(dhcpv4.OptClientArch(iana.INTEL_X86PC)),
		dhcpv4.WithUserClass("iPXE", false))
	if err != nil {
		t.Errorf("iPXE DISCOVER got no OFFER: %v", err)
		return
	}
	wantURL := "http://" + netnsServerIP + ":" + netnsHTTPPort + "/boot/" + knownMAC.String() + ".ipxe"
	if ioffer.BootFileName != wantURL {
		t.Errorf("iPXE boot file = %q, want %q", ioffer.BootFileName, wantURL)
	}

	// 4. The script, once, then the kernel it names.
	code, script := rawGet(t, ioffer.BootFileName)
	if code != http.StatusOK || !strings.Contains(script, "bc.boot_token="+netnsToken+" ") {
		t.Errorf("script: %d\n%s", code, script)
	}
	if code, _ := rawGet(t, ioffer.BootFileName); code != http.StatusGone {
		t.Errorf("second script fetch: %d, want 410", code)
	}
	var kernelURL string
	for _, line := range strings.Split(script, "\n") {
		if f := strings.Fields(line); len(f) >= 4 && f[0] == "kernel" {
			kernelURL = f[3]
		}
	}
	if code, body := rawGet(t, kernelURL); code != http.StatusOK || body != netnsKernel {
		t.Errorf("kernel %s: %d, %d bytes", kernelURL, code, len(body))
	}
}

// rawGet is an HTTP/1.0 GET on a socket made on this thread (an
// http.Client would dial from another thread, in another namespace).
func rawGet(t *testing.T, url string) (int, string) {
	host, path, ok := strings.Cut(strings.TrimPrefix(url, "http://"), "/")
	if !ok {
		t.Errorf("bad url %q", url)
		return 0, ""
	}
	conn, err := net.DialTimeout("tcp4", host, 30*time.Second)
	if err != nil {
		t.Errorf("dial %s: %v", host, err)
		return 0, ""
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(time.Minute))
	fmt.Fprintf(conn, "GET /%s HTTP/1.0\r\nHost: %s\r\n\r\n", path, host)
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Errorf("GET %s: %v", url, err)
		return 0, ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// netnsGUID is option 97: type 0, then a 16-byte UUID.
var netnsGUID = append([]byte{0}, bytes.Repeat([]byte{0xab}, 16)...)

func sha256Hex(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

const netnsKernel = "the ramdisk kernel, fetched through the site's image cache"

// TestNetnsServerHelper is the server half of TestNetnsDHCPExchange; it
// only runs re-executed inside the server namespace.
func TestNetnsServerHelper(t *testing.T) {
	raw := os.Getenv(netnsHelperEnv)
	if raw == "" {
		t.Skip("helper process for TestNetnsDHCPExchange")
	}
	var cfg netnsHelperConfig
	if err := json.Unmarshal([]byte(raw), &cfg); err != nil {
		t.Fatal(err)
	}
	ipxeDir := filepath.Join(cfg.Dir, "ipxe")
	if err := os.MkdirAll(ipxeDir, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, body := range map[string][]byte{"undionly.kpxe": fakeBIOS, "ipxe.efi": fakeUEFI} {
		if err := os.WriteFile(filepath.Join(ipxeDir, name), body, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, netnsKernel)
	}))
	defer up.Close()
	sum := sha256Hex([]byte(netnsKernel))
	img := Image{SHA256: sum, URL: up.URL + "/kernel"}
	tab := NewTable()
	if err := tab.Set(knownMAC, Decision{Action: BootRamdisk, Kernel: img, Initrd: img}); err != nil {
		t.Fatal(err)
	}
	if err := tab.SetBootToken(knownMAC, netnsToken); err != nil {
		t.Fatal(err)
	}
	srv, err := New(Config{
		IP:        netip.MustParseAddr(netnsServerIP),
		Interface: cfg.Interface,
		TFTPAddr:  netnsServerIP + ":69",
		HTTPAddr:  netnsServerIP + ":" + netnsHTTPPort,
		IPXEDir:   ipxeDir,
		CacheDir:  filepath.Join(cfg.Dir, "cache"),
		Gateway:   "gw.example.net:443",
		Machines:  tab,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	defer srv.Stop()
	fmt.Println(helperReady)
	_, _ = io.Copy(io.Discard, os.Stdin) // until the test closes stdin
}
