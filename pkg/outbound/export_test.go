package outbound

import "net/netip"

// WithLookup returns o resolving names with f instead of DNS.
func WithLookup(o Options, f func(host string) ([]netip.Addr, error)) Options {
	o.lookup = f
	return o
}
