package clientaddr

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	if tr, err := Parse(nil); err != nil || tr != nil {
		t.Fatalf("no proxies: %v %v", tr, err)
	}
	for _, bad := range []string{"10.0.0.0/33", "proxy.example", "10.0.0.0/8/8", ""} {
		if _, err := Parse([]string{bad}); err == nil {
			t.Errorf("%q was accepted", bad)
		}
	}
	tr, err := Parse([]string{"10.0.0.0/8", "192.0.2.1", "2001:db8::/32"})
	if err != nil {
		t.Fatal(err)
	}
	for host, want := range map[string]bool{
		"10.1.2.3": true, "::ffff:10.1.2.3": true, "192.0.2.1": true, "192.0.2.2": false,
		"2001:db8::5": true, "[2001:db8::5]": true, "11.0.0.1": false, "": false, "garbage": false,
	} {
		if got := tr.Contains(host); got != want {
			t.Errorf("Contains(%q) = %v, want %v", host, got, want)
		}
	}
}

func TestResolve(t *testing.T) {
	tr, err := Parse([]string{"10.0.0.0/8", "127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name, peer string
		xff        []string
		want       string
	}{
		{"untrusted peer: its header is ignored", "198.51.100.1", []string{"203.0.113.9"}, "198.51.100.1"},
		{"no proxies configured", "198.51.100.1", nil, "198.51.100.1"},
		{"trusted peer, one client", "127.0.0.1", []string{"203.0.113.9"}, "203.0.113.9"},
		{"right-most untrusted, spoofed left ignored", "127.0.0.1", []string{"1.1.1.1, 203.0.113.9, 10.0.0.7"}, "203.0.113.9"},
		{"several header lines", "127.0.0.1", []string{"1.1.1.1", "203.0.113.9", "10.0.0.7"}, "203.0.113.9"},
		{"host:port entries", "127.0.0.1", []string{"203.0.113.9:4711"}, "203.0.113.9"},
		{"mapped IPv4", "127.0.0.1", []string{"::ffff:203.0.113.9"}, "203.0.113.9"},
		{"garbage ends at the trusted hop", "127.0.0.1", []string{"203.0.113.9, nonsense, 10.0.0.7"}, "10.0.0.7"},
		{"all trusted: the left-most", "127.0.0.1", []string{"10.0.0.1, 10.0.0.2"}, "10.0.0.1"},
		{"trusted peer without a header", "127.0.0.1", nil, "127.0.0.1"},
	} {
		if got := tr.Resolve(c.peer, c.xff); got != c.want {
			t.Errorf("%s: Resolve(%q, %q) = %q, want %q", c.name, c.peer, c.xff, got, c.want)
		}
	}
	var none *Trusted
	if got := none.Resolve("127.0.0.1", []string{"203.0.113.9"}); got != "127.0.0.1" {
		t.Errorf("nil Trusted: %q", got)
	}
	// A long header: only the right-most MaxHops entries are looked at.
	long := strings.Repeat("10.0.0.1, ", 5000) + "10.0.0.2"
	if got := tr.Resolve("127.0.0.1", []string{long}); got != "10.0.0.1" {
		t.Errorf("long chain: %q", got)
	}
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.RemoteAddr = "127.0.0.1:5555"
	r.Header.Add("X-Forwarded-For", "203.0.113.9")
	if got := tr.FromRequest(r); got != "203.0.113.9" {
		t.Errorf("FromRequest: %q", got)
	}
}
