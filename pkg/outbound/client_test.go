package outbound_test

import (
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/outbound"
)

func TestCheckURL(t *testing.T) {
	t.Parallel()
	long := "https://example.com/" + strings.Repeat("a", outbound.MaxURLLen)
	dev := outbound.Options{AllowInsecure: true, AllowPrivateNetworks: true}
	prod := outbound.Options{}
	for _, tc := range []struct {
		url string
		o   outbound.Options
		ok  bool
	}{
		{url: "https://example.com/hooks?x=1", ok: true},
		{url: "HTTPS://example.com:8443/", ok: true},
		{url: "https://example.com:65535/", ok: true},
		{url: "https://[2001:4860::1]/", ok: true},
		{url: "https://93.184.216.34/", ok: true},
		{url: "https://1e100.net/", ok: true},
		{url: "https://0x.example.com/", ok: true},
		{url: "http://127.0.0.1:8080/hook", o: dev, ok: true},
		{url: "http://localhost/hook", o: dev, ok: true},
		{url: "http://[::1]:9/", o: dev, ok: true},
		{url: "https://10.1.2.3/x", o: dev, ok: true},
		{url: "https://api.example.com/", o: outbound.Options{AllowedHosts: []string{"api.example.com"}}, ok: true},
		{url: "https://eu.api.example.com/", o: outbound.Options{AllowedHosts: []string{"*.api.example.com"}}, ok: true},
		{url: "https://127.0.0.1:9/", o: outbound.Options{AllowLoopback: true}, ok: true},
		{url: "http://127.0.0.1/hook", o: prod},
		{url: "http://127.0.0.1/hook", o: outbound.Options{AllowInsecure: true}},
		{url: "http://example.com/hook", o: dev},
		{url: "http://10.0.0.1/hook", o: dev},
		{url: "ftp://example.com/hook", o: dev},
		{url: "https://user:pass@example.com/"},
		{url: "https://user@example.com/"},
		{url: "https:///path"},
		{url: "https:example.com"},
		{url: "/relative/hook"},
		{url: "https://example.com/#frag"},
		{url: "https://example.com/#"},
		{url: "https://exa mple.com/\x7f"},
		{url: long},
		{url: "https://example.com:0/"},
		{url: "https://10.1.2.3/x"},
		{url: "https://[fd00:ec2::254]/x"},
		{url: "https://[fd00:ec2::254]/x", o: dev},
		{url: "https://169.254.169.254/", o: dev},
		{url: "https://api.localhost/x"},
		{url: "https://LOCALHOST./x"},
		{url: "https://10.0.0.1/", o: outbound.Options{AllowLoopback: true}},
		{url: "https://other.example.com/", o: outbound.Options{AllowedHosts: []string{"api.example.com"}}},
		{url: "https://api.example.com/", o: outbound.Options{AllowedHosts: []string{"*.api.example.com"}}},
	} {
		err := outbound.CheckURL(tc.url, "f", tc.o)
		if tc.ok {
			if err != nil {
				t.Errorf("CheckURL(%.40q, %+v) = %v, want nil", tc.url, tc.o, err)
			}
			continue
		}
		if fe, ok := fault.As(err); !ok || fe.Code != fault.InvalidInput || fe.Field != "f" {
			t.Errorf("CheckURL(%.40q, %+v) = %v, want an INVALID_INPUT fault on f", tc.url, tc.o, err)
		}
	}
}

// TestURLWithPortOver65535OrNonCanonicalIPv4Refused: a port past 65535 and
// the IPv4 spellings resolvers read as loopback (hex, one decimal number,
// octal, shortened) are refused when the URL is checked, before anything
// is stored or dialled — with private networks allowed too, so it is the
// spelling that is refused, not the address.
func TestURLWithPortOver65535OrNonCanonicalIPv4Refused(t *testing.T) {
	t.Parallel()
	for _, raw := range []string{
		"https://example.com:99999/", "https://example.com:65536/",
		"https://0x7f000001/", "https://2130706433/", "https://0177.0.0.1/", "https://127.1/",
		"https://0x7f.0.0.1/", "https://127.0.0.1./", "https://1.2.3.0x4/", "https://example.0x10/", "https://017700000001/",
		"https://0x/",
	} {
		for _, o := range []outbound.Options{{}, {AllowPrivateNetworks: true}} {
			fe, ok := fault.As(outbound.CheckURL(raw, "url", o))
			if !ok || fe.Code != fault.InvalidInput || fe.Field != "url" {
				t.Errorf("CheckURL(%q, private %v): %v, want INVALID_INPUT on url", raw, o.AllowPrivateNetworks, fe)
			}
		}
	}
}

func TestCheckAllowedHost(t *testing.T) {
	t.Parallel()
	for s, ok := range map[string]bool{
		"api.example.com": true, "*.example.com": true, "192.0.2.1": true, "2001:db8::1": true,
		"": false, "*.": false, "https://x": false, "x:443": false, "a/b": false, "*.*.x": false, "127.1": false,
	} {
		if err := outbound.CheckAllowedHost(s); (err == nil) != ok {
			t.Errorf("CheckAllowedHost(%q) = %v, want ok %v", s, err, ok)
		}
	}
}

// serve starts an httptest server (on 127.0.0.1) with h.
func serve(t *testing.T, h http.HandlerFunc) string {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv.URL
}

// get sends a GET with c and returns the answer's status, its body closed.
func get(t *testing.T, c *outbound.Client, url string) (int, http.Header, error) {
	t.Helper()
	t.Cleanup(c.CloseIdleConnections)
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, nil, err
	}
	_ = resp.Body.Close()
	return resp.StatusCode, resp.Header, nil
}

func ok(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) }

// TestLoopbackDestinationRefusedAtDial: a URL that passes the literal
// checks (localhost with http allowed) is still refused on the address it
// resolves to, before any request reaches the server.
func TestLoopbackDestinationRefusedAtDial(t *testing.T) {
	t.Parallel()
	var hits atomic.Int32
	url := serve(t, func(w http.ResponseWriter, _ *http.Request) { hits.Add(1) })
	c := outbound.NewClient(outbound.Options{AllowInsecure: true})
	for _, u := range []string{url, strings.Replace(url, "127.0.0.1", "localhost", 1)} {
		if _, _, err := get(t, c, u); !errors.Is(err, outbound.ErrDestinationRefused) || outbound.Reason(err) != outbound.ReasonRefused {
			t.Errorf("GET %s: %v, want ErrDestinationRefused", u, err)
		}
	}
	if hits.Load() != 0 {
		t.Fatal("the loopback server was reached")
	}
	// The same server is reachable when the test says so.
	c = outbound.NewClient(outbound.Options{AllowInsecure: true, AllowLoopback: true})
	if code, _, err := get(t, c, url); err != nil || code != http.StatusOK {
		t.Fatalf("GET with AllowLoopback: %d %v", code, err)
	}
}

// TestNameResolvingToMetadataRefusedBeforeConnect: a public-looking name
// whose DNS answer is the metadata address (or a private one: DNS
// rebinding) is refused by the dialer's Control hook, which runs before the
// connection is attempted — the metadata address even with private
// networks allowed. The test resolves names itself: no DNS, and no packet
// leaves for the refused address.
func TestNameResolvingToMetadataRefusedBeforeConnect(t *testing.T) {
	t.Parallel()
	lookup := func(host string) ([]netip.Addr, error) {
		switch host {
		case "metadata.example.com":
			return []netip.Addr{netip.MustParseAddr("169.254.169.254")}, nil
		case "rebind.example.com":
			return []netip.Addr{netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("::ffff:192.168.0.1")}, nil
		case "nat64.example.com":
			return []netip.Addr{netip.MustParseAddr("64:ff9b::a9fe:a9fe")}, nil
		}
		return nil, errors.New("no such host")
	}
	for _, tc := range []struct {
		url  string
		o    outbound.Options
		want string
	}{
		{"https://metadata.example.com/latest/meta-data/", outbound.Options{}, outbound.ReasonRefused},
		{"https://metadata.example.com/latest/meta-data/", outbound.Options{AllowPrivateNetworks: true}, outbound.ReasonRefused},
		{"https://nat64.example.com/", outbound.Options{AllowPrivateNetworks: true}, outbound.ReasonRefused},
		{"https://rebind.example.com:2379/", outbound.Options{}, outbound.ReasonRefused},
		{"https://missing.example.com/", outbound.Options{}, outbound.ReasonDNS},
	} {
		c := outbound.NewClient(outbound.WithLookup(tc.o, lookup))
		_, _, err := get(t, c, tc.url)
		if got := outbound.Reason(err); got != tc.want {
			t.Errorf("GET %s (%+v): %v (%q), want %q", tc.url, tc.o, err, got, tc.want)
		}
	}
}

// TestRedirectToLoopbackNotFollowed: a 302 to another (loopback) server is
// the answer; the client never requests its Location.
func TestRedirectToLoopbackNotFollowed(t *testing.T) {
	t.Parallel()
	var hits atomic.Int32
	target := serve(t, func(w http.ResponseWriter, _ *http.Request) { hits.Add(1) })
	url := serve(t, func(w http.ResponseWriter, r *http.Request) { http.Redirect(w, r, target, http.StatusFound) })
	c := outbound.NewClient(outbound.Options{AllowInsecure: true, AllowLoopback: true})
	code, h, err := get(t, c, url)
	if err != nil || code != http.StatusFound || h.Get("Location") != target {
		t.Fatalf("GET: %d %v %v", code, h, err)
	}
	if hits.Load() != 0 {
		t.Fatal("the redirect was followed")
	}
}

func TestHTTPRefusedWithoutAllowInsecure(t *testing.T) {
	t.Parallel()
	url := serve(t, ok)
	c := outbound.NewClient(outbound.Options{AllowLoopback: true})
	if _, _, err := get(t, c, url); outbound.Reason(err) != outbound.ReasonRefused {
		t.Fatalf("GET: %v, want refused", err)
	}
}

// TestReasonsAreFixedClasses: TLS, connection and timeout failures are told
// apart by a fixed class that carries no address.
func TestReasonsAreFixedClasses(t *testing.T) {
	t.Parallel()
	tlsSrv := httptest.NewTLSServer(http.HandlerFunc(ok)) // a certificate no client trusts
	t.Cleanup(tlsSrv.Close)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := "http://" + ln.Addr().String() + "/"
	_ = ln.Close()
	release := make(chan struct{})
	slow := serve(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})
	t.Cleanup(func() { close(release) })
	for _, tc := range []struct {
		url, want string
		o         outbound.Options
	}{
		{tlsSrv.URL, outbound.ReasonTLS, outbound.Options{AllowLoopback: true}},
		{closed, outbound.ReasonConnection, outbound.Options{AllowLoopback: true, AllowInsecure: true}},
		{slow, outbound.ReasonTimeout, outbound.Options{AllowLoopback: true, AllowInsecure: true, Timeout: 50 * time.Millisecond}},
	} {
		_, _, err := get(t, outbound.NewClient(tc.o), tc.url)
		if got := outbound.Reason(err); got != tc.want {
			t.Errorf("GET %s: %v: class %q, want %q", tc.url, err, got, tc.want)
		}
	}
	if outbound.Reason(nil) != "" || outbound.StatusReason(503) != "HTTP status 503" {
		t.Fatal("Reason(nil) or StatusReason")
	}
}
