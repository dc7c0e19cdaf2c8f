package webhooks_test

import (
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/outbound"
	"github.com/bettercompute/bettercompute/pkg/webhooks"
)

// FuzzCheckEndpoint checks webhook endpoint URLs as the API does (a create
// or update request's "url"): no panic, a refusal is INVALID_INPUT on "url",
// the stricter rules accept a subset of what the looser ones do, and an
// accepted URL is https (or http to a loopback host, when insecure is
// allowed), has a host, a port within 1-65535 and no fragment, names no
// IPv4 address other than as a dotted quad, and, under the production
// options, names no refused literal address or localhost.
func FuzzCheckEndpoint(f *testing.F) {
	for _, s := range []string{
		"https://example.com/hook", "https://example.com:8443/a?b=c", "http://localhost:8080/h", "http://127.0.0.1/h",
		"http://[::1]:9/h", "https://10.0.0.1/h", "https://169.254.169.254/latest", "https://[::ffff:127.0.0.1]/",
		"https://user:pw@example.com/", "https://example.com/#frag", "ftp://example.com/", "//example.com/", "https://",
		"https://a.localhost/", "https://LOCALHOST/", "https://[fe80::1%25eth0]/", "https://0x7f.1/", "https://%31%32%37.0.0.1/",
		"https://[::]/", "https://0.0.0.0/", "\x00https://example.com/", "https:example.com", "https://example.com:99999/",
		"https://0x7f000001/", "https://2130706433/", "https://0177.0.0.1/", "https://127.1/", "https://[64:ff9b:1::a00:1]/",
		"https://[2002:a00:1::]/", "https://198.18.0.1/",
	} {
		f.Add(s, false, false)
		f.Add(s, true, false)
		f.Add(s, true, true)
	}
	f.Fuzz(func(t *testing.T, raw string, insecure, private bool) {
		o := outbound.Options{AllowInsecure: insecure, AllowPrivateNetworks: private}
		err := webhooks.CheckEndpoint(raw, o)
		if err != nil {
			if fe, ok := fault.As(err); !ok || fe.Code != fault.InvalidInput || fe.Field != "url" {
				t.Fatalf("%q: %v, want INVALID_INPUT on url", raw, err)
			}
		}
		loose := outbound.Options{AllowInsecure: true, AllowPrivateNetworks: true}
		if err == nil && webhooks.CheckEndpoint(raw, loose) != nil {
			t.Fatalf("%q: the loosest rules refuse what %+v accepts", raw, o)
		}
		if webhooks.CheckEndpoint(raw, outbound.Options{}) == nil && err != nil {
			t.Fatalf("%q: the production rules accept what %+v refuses: %v", raw, o, err)
		}
		if err != nil {
			return
		}
		u, perr := url.Parse(raw)
		switch {
		case perr != nil:
			t.Fatalf("%q: accepted but url.Parse fails: %v", raw, perr)
		case len(raw) > outbound.MaxURLLen, u.Hostname() == "", u.User != nil, strings.Contains(raw, "#"):
			t.Fatalf("%q: accepted though too long, hostless, with user info or a fragment", raw)
		case u.Scheme != "https" && (!insecure || u.Scheme != "http"):
			t.Fatalf("%q: accepted scheme %q (insecure %v)", raw, u.Scheme, insecure)
		}
		if p := u.Port(); p != "" {
			if n, e := strconv.Atoi(p); e != nil || n < 1 || n > 65535 {
				t.Fatalf("%q: accepted port %q", raw, p)
			}
		}
		host := strings.ToLower(u.Hostname())
		ip, ipErr := netip.ParseAddr(host)
		name := strings.TrimSuffix(host, ".")
		if last := name[strings.LastIndexByte(name, '.')+1:]; ipErr != nil && last != "" && strings.Trim(last, "0123456789") == "" {
			t.Fatalf("%q: accepted a host %q read as a number", raw, host)
		}
		if ipErr == nil && outbound.IsMetadataAddr(ip) {
			t.Fatalf("%q: accepted a metadata address", raw)
		}
		if private {
			return
		}
		if ipErr == nil && outbound.IsRefusedAddr(ip) {
			t.Fatalf("%q: accepted a refused address %s", raw, ip)
		}
		if host == "localhost" || strings.HasSuffix(strings.TrimSuffix(host, "."), ".localhost") {
			t.Fatalf("%q: accepted a localhost name", raw)
		}
	})
}
