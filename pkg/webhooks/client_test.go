package webhooks_test

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/webhooks"
)

func TestCheckURL(t *testing.T) {
	t.Parallel()
	long := "https://example.com/" + strings.Repeat("a", webhooks.MaxURLLen)
	for _, tc := range []struct {
		url      string
		insecure bool
		ok       bool
	}{
		{url: "https://example.com/hooks?x=1", ok: true},
		{url: "HTTPS://example.com:8443/", ok: true},
		{url: "https://[2001:db8::1]/", ok: true},
		{url: "http://127.0.0.1:8080/hook", insecure: true, ok: true},
		{url: "http://localhost/hook", insecure: true, ok: true},
		{url: "http://[::1]:9/", insecure: true, ok: true},
		{url: "http://127.0.0.1/hook"},
		{url: "http://example.com/hook", insecure: true},
		{url: "http://10.0.0.1/hook", insecure: true},
		{url: "ftp://example.com/hook", insecure: true},
		{url: "https://user:pass@example.com/"},
		{url: "https://user@example.com/"},
		{url: "https:///path"},
		{url: "https:example.com"},
		{url: "/relative/hook"},
		{url: "https://example.com/#frag"},
		{url: "https://example.com/#"},
		{url: "https://exa mple.com/\x7f"},
		{url: long},
	} {
		err := webhooks.CheckURL(tc.url, tc.insecure)
		if tc.ok {
			if err != nil {
				t.Errorf("CheckURL(%.40q, %v) = %v, want nil", tc.url, tc.insecure, err)
			}
			continue
		}
		fe, ok := fault.As(err)
		if !ok || fe.Code != fault.InvalidInput || fe.Field != "url" || !strings.HasPrefix(fe.Message, "expected") {
			t.Errorf("CheckURL(%.40q, %v) = %v, want an INVALID_INPUT fault on url", tc.url, tc.insecure, err)
		}
	}
}

func TestIsRefusedAddr(t *testing.T) {
	t.Parallel()
	for addr, want := range map[string]bool{
		"93.184.216.34":          false,
		"8.8.8.8":                false,
		"100.63.255.255":         false,
		"100.128.0.0":            false,
		"172.32.0.1":             false,
		"2606:4700::1111":        false,
		"::ffff:8.8.8.8":         false,
		"64:ff9b::808:808":       false,
		"::ffff:93.184.216.34":   false,
		"2001:4860:4860::8888":   false,
		"127.0.0.1":              true,
		"10.1.2.3":               true,
		"172.16.0.1":             true,
		"192.168.1.1":            true,
		"169.254.169.254":        true,
		"100.64.0.1":             true,
		"100.100.100.200":        true,
		"0.0.0.0":                true,
		"0.1.2.3":                true,
		"224.0.0.1":              true,
		"255.255.255.255":        true,
		"::":                     true,
		"::1":                    true,
		"fc00::1":                true,
		"fd00:ec2::254":          true,
		"fe80::1":                true,
		"fe80::1%eth0":           true,
		"ff02::1":                true,
		"::ffff:127.0.0.1":       true,
		"::ffff:10.0.0.1":        true,
		"::ffff:169.254.169.254": true,
		"::ffff:100.100.100.200": true,
		"64:ff9b::a9fe:a9fe":     true,
		"64:ff9b::7f00:1":        true,
		"::ffff:127.0.0.1%eth0":  true,
		"64:ff9b::6464:64c8":     true,
	} {
		if got := webhooks.IsRefusedAddr(netip.MustParseAddr(addr)); got != want {
			t.Errorf("IsRefusedAddr(%s) = %v, want %v", addr, got, want)
		}
	}
	if !webhooks.IsRefusedAddr(netip.Addr{}) {
		t.Error("IsRefusedAddr(zero Addr) = false, want true")
	}
}

func TestClient(t *testing.T) {
	t.Parallel()
	setup := func(t *testing.T, h http.HandlerFunc) string {
		t.Helper()
		srv := httptest.NewServer(h) // Listens on 127.0.0.1.
		t.Cleanup(srv.Close)
		return srv.URL
	}
	ok := func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) }
	// post returns the answer's status and headers, its body closed.
	type answer struct {
		StatusCode int
		Header     http.Header
	}
	post := func(t *testing.T, c *http.Client, url string) (*answer, error) {
		t.Helper()
		t.Cleanup(c.CloseIdleConnections)
		resp, err := c.Post(url, "application/json", strings.NewReader(`{}`))
		if err != nil {
			return nil, err
		}
		_ = resp.Body.Close()
		return &answer{StatusCode: resp.StatusCode, Header: resp.Header}, nil
	}

	t.Run("refuses a loopback destination", func(t *testing.T) {
		t.Parallel()
		url := setup(t, ok)
		c := webhooks.NewClient(webhooks.Options{AllowInsecure: true})
		for _, u := range []string{url, strings.Replace(url, "127.0.0.1", "localhost", 1)} {
			if _, err := post(t, c, u); !errors.Is(err, webhooks.ErrDestinationRefused) {
				t.Errorf("POST %s: %v, want ErrDestinationRefused", u, err)
			}
		}
	})
	t.Run("delivers with AllowPrivateNetworks", func(t *testing.T) {
		t.Parallel()
		url := setup(t, ok)
		c := webhooks.NewClient(webhooks.Options{AllowPrivateNetworks: true, AllowInsecure: true})
		resp, err := post(t, c, url)
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("POST: %v, %v", resp, err)
		}
	})
	t.Run("refuses http without AllowInsecure", func(t *testing.T) {
		t.Parallel()
		url := setup(t, ok)
		c := webhooks.NewClient(webhooks.Options{AllowPrivateNetworks: true})
		if _, err := post(t, c, url); fault.CodeOf(err) != fault.InvalidInput {
			t.Fatalf("POST: %v, want an INVALID_INPUT fault", err)
		}
	})
	t.Run("returns a redirect instead of following it", func(t *testing.T) {
		t.Parallel()
		target := setup(t, func(w http.ResponseWriter, _ *http.Request) {
			t.Error("the redirect was followed")
		})
		url := setup(t, func(w http.ResponseWriter, r *http.Request) {
			http.Redirect(w, r, target, http.StatusFound)
		})
		c := webhooks.NewClient(webhooks.Options{AllowPrivateNetworks: true, AllowInsecure: true})
		resp, err := post(t, c, url)
		if err != nil || resp.StatusCode != http.StatusFound || resp.Header.Get("Location") != target {
			t.Fatalf("POST: %v, %v", resp, err)
		}
	})
}

func TestCheckEndpointRefusesLiteralPrivateHosts(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		url     string
		private bool
		ok      bool
	}{
		{"https://hooks.example.com/x", false, true},
		{"https://10.1.2.3/x", false, false},
		{"https://[fd00:ec2::254]/x", false, false},
		{"https://api.localhost/x", false, false},
		{"https://10.1.2.3/x", true, true},
		{"http://127.0.0.1:9000/x", true, false}, // http still needs AllowInsecure
	} {
		err := webhooks.CheckEndpoint(c.url, webhooks.Options{AllowPrivateNetworks: c.private})
		if c.ok && err != nil {
			t.Errorf("%s (private %v): %v", c.url, c.private, err)
		}
		if fe, is := fault.As(err); !c.ok && (!is || fe.Code != fault.InvalidInput || fe.Field != "url") {
			t.Errorf("%s (private %v): %v, want INVALID_INPUT url", c.url, c.private, err)
		}
	}
}
