package clientaddr

import (
	"net/netip"
	"testing"
)

// FuzzResolve: whatever X-Forwarded-For a client sends, Resolve does not
// panic, answers an untrusted peer with the peer itself, and from a trusted
// peer answers the peer or an IP address (never the client's other text).
func FuzzResolve(f *testing.F) {
	for _, s := range []string{"203.0.113.9", "1.1.1.1, 203.0.113.9, 10.0.0.7", "nonsense, 10.0.0.7", "[::1]:80", "", ",,,", "::ffff:10.0.0.1"} {
		f.Add("127.0.0.1", s)
		f.Add("198.51.100.1", s)
	}
	tr, err := Parse([]string{"10.0.0.0/8", "127.0.0.1", "2001:db8::/32"})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, peer, xff string) {
		got := tr.Resolve(peer, []string{xff})
		if !tr.Contains(peer) {
			if got != peer {
				t.Fatalf("untrusted peer %q resolved to %q", peer, got)
			}
			return
		}
		if got == peer {
			return
		}
		if _, err := netip.ParseAddr(got); err != nil {
			t.Fatalf("resolved to %q, not an address", got)
		}
	})
}
