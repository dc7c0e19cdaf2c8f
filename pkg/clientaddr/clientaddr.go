// Package clientaddr finds a request's client address behind trusted
// proxies (server.trustedProxies): the address the per-address limits
// (failed authentications, anonymous requests) and the audit log key on.
//
// Without trusted proxies the client is the connection's peer and
// X-Forwarded-For is ignored. When the peer is a trusted proxy, the client
// is the right-most X-Forwarded-For entry that is not itself a trusted
// proxy: every entry to the right of it was written by a proxy the operator
// trusts, every entry to its left by whoever the client is, so a client can
// prepend what it likes and not change the address it is known by.
package clientaddr

import (
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strings"
)

// Bounds on what is read from X-Forwarded-For.
const (
	// MaxHops is how many entries, from the right, are looked at; a chain
	// of trusted proxies longer than that ends at the last one looked at.
	MaxHops = 16
	// maxHeader bounds the X-Forwarded-For text read.
	maxHeader = 4096
)

// Trusted is the set of trusted proxies. The nil *Trusted trusts none.
type Trusted struct {
	prefixes []netip.Prefix
}

// Parse reads CIDRs (a bare address is a /32 or /128). An entry that is
// neither is an error naming it.
func Parse(cidrs []string) (*Trusted, error) {
	t := &Trusted{}
	for _, c := range cidrs {
		c = strings.TrimSpace(c)
		if p, err := netip.ParsePrefix(c); err == nil {
			t.prefixes = append(t.prefixes, p.Masked())
			continue
		}
		a, err := netip.ParseAddr(c)
		if err != nil {
			return nil, fmt.Errorf("%q is not a CIDR (such as 10.0.0.0/8) or an IP address", c)
		}
		a = a.Unmap()
		t.prefixes = append(t.prefixes, netip.PrefixFrom(a, a.BitLen()))
	}
	if len(t.prefixes) == 0 {
		return nil, nil
	}
	return t, nil
}

// Contains says host (an IP address, without a port) is a trusted proxy.
func (t *Trusted) Contains(host string) bool {
	if t == nil {
		return false
	}
	a, err := netip.ParseAddr(strings.Trim(host, "[]"))
	if err != nil {
		return false
	}
	a = a.Unmap().WithZone("")
	for _, p := range t.prefixes {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// Resolve is the client address of a request whose connection came from
// peer (a host, without a port) and that carried the X-Forwarded-For
// values xff (in header order; each may be a comma-separated list). The
// peer itself unless it is a trusted proxy; else the right-most entry that
// is not a trusted proxy. An entry that is not an IP address ends the walk
// at the trusted hop to its right (a proxy writes addresses only), as do
// MaxHops entries; a chain of nothing but trusted proxies resolves to its
// left-most one.
func (t *Trusted) Resolve(peer string, xff []string) string {
	if !t.Contains(peer) {
		return peer
	}
	hops := entries(xff)
	client := peer
	for i := len(hops) - 1; i >= 0 && len(hops)-i <= MaxHops; i-- {
		a, ok := addr(hops[i])
		if !ok {
			return client
		}
		client = a.String()
		if !t.Contains(client) {
			return client
		}
	}
	return client
}

// addr reads an X-Forwarded-For entry: an IP address, or one with a port
// (some proxies write host:port).
func addr(s string) (netip.Addr, bool) {
	if a, err := netip.ParseAddr(s); err == nil {
		return a.Unmap().WithZone(""), true
	}
	if ap, err := netip.ParseAddrPort(s); err == nil {
		return ap.Addr().Unmap().WithZone(""), true
	}
	return netip.Addr{}, false
}

// entries splits X-Forwarded-For values into their entries, trimmed, at
// most maxHeader bytes of them (the right-most ones).
func entries(xff []string) []string {
	joined := strings.Join(xff, ",")
	if len(joined) > maxHeader {
		joined = joined[len(joined)-maxHeader:]
		if i := strings.IndexByte(joined, ','); i >= 0 {
			joined = joined[i+1:] // drop the cut entry
		}
	}
	var out []string
	for e := range strings.SplitSeq(joined, ",") {
		if e = strings.TrimSpace(e); e != "" {
			out = append(out, e)
		}
	}
	return out
}

// FromRequest is the client address of an HTTP request (see Resolve).
func (t *Trusted) FromRequest(r *http.Request) string {
	return t.Resolve(Host(r.RemoteAddr), r.Header.Values("X-Forwarded-For"))
}

// Host is the host of a host:port address (the whole string if it has no
// port).
func Host(addr string) string {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	return host
}
