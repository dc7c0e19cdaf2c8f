package webhooks_test

import (
	"net/netip"
	"net/url"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/webhooks"
)

// FuzzCheckEndpoint checks webhook endpoint URLs as the API does (a create
// or update request's "url"): no panic, a refusal is INVALID_INPUT on "url",
// the stricter rules accept a subset of what the looser ones do, and an
// accepted URL is https (or http to a loopback host, when insecure is
// allowed), has a host and no fragment, and, under the production options,
// names no refused literal address or localhost.
func FuzzCheckEndpoint(f *testing.F) {
	for _, s := range []string{
		"https://example.com/hook", "https://example.com:8443/a?b=c", "http://localhost:8080/h", "http://127.0.0.1/h",
		"http://[::1]:9/h", "https://10.0.0.1/h", "https://169.254.169.254/latest", "https://[::ffff:127.0.0.1]/",
		"https://user:pw@example.com/", "https://example.com/#frag", "ftp://example.com/", "//example.com/", "https://",
		"https://a.localhost/", "https://LOCALHOST/", "https://[fe80::1%25eth0]/", "https://0x7f.1/", "https://%31%32%37.0.0.1/",
		"https://[::]/", "https://0.0.0.0/", "\x00https://example.com/", "https:example.com", "https://example.com:99999/",
	} {
		f.Add(s, false, false)
		f.Add(s, true, false)
		f.Add(s, true, true)
	}
	f.Fuzz(func(t *testing.T, raw string, insecure, private bool) {
		err := webhooks.CheckEndpoint(raw, webhooks.Options{AllowInsecure: insecure, AllowPrivateNetworks: private})
		urlErr := webhooks.CheckURL(raw, insecure)
		for _, e := range []error{err, urlErr} {
			if e == nil {
				continue
			}
			if fe, ok := fault.As(e); !ok || fe.Code != fault.InvalidInput || fe.Field != "url" {
				t.Fatalf("%q: %v, want INVALID_INPUT on url", raw, e)
			}
		}
		if err == nil && urlErr != nil {
			t.Fatalf("%q: CheckEndpoint accepts what CheckURL refuses: %v", raw, urlErr)
		}
		if webhooks.CheckURL(raw, false) == nil && webhooks.CheckURL(raw, true) != nil {
			t.Fatalf("%q: allowing http refuses an https URL", raw)
		}
		if webhooks.CheckEndpoint(raw, webhooks.Options{AllowInsecure: insecure}) == nil && err != nil {
			t.Fatalf("%q: allowing private networks refuses a URL: %v", raw, err)
		}
		if urlErr != nil {
			return
		}
		u, perr := url.Parse(raw)
		switch {
		case perr != nil:
			t.Fatalf("%q: accepted but url.Parse fails: %v", raw, perr)
		case len(raw) > webhooks.MaxURLLen, u.Hostname() == "", u.User != nil, strings.Contains(raw, "#"):
			t.Fatalf("%q: accepted though too long, hostless, with user info or a fragment", raw)
		case u.Scheme != "https" && (!insecure || u.Scheme != "http"):
			t.Fatalf("%q: accepted scheme %q (insecure %v)", raw, u.Scheme, insecure)
		}
		if err != nil || private {
			return
		}
		host := strings.ToLower(u.Hostname())
		if ip, e := netip.ParseAddr(host); e == nil && webhooks.IsRefusedAddr(ip) {
			t.Fatalf("%q: accepted a refused address %s", raw, ip)
		}
		if host == "localhost" || strings.HasSuffix(host, ".localhost") {
			t.Fatalf("%q: accepted a localhost name", raw)
		}
	})
}
