package outbound_test

import (
	"net/netip"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/outbound"
)

// TestDenyListMissesNoSpecialRange: every special-purpose range the
// webhook deny-list used to miss (NAT64 local-use, SIIT, ::/96, 6to4 with
// a private IPv4 inside, site-local, discard-only, the IETF, benchmarking
// and 6to4-relay IPv4 ranges) is refused, as are the ones it caught; the
// public addresses, and the IPv6 forms of public IPv4 ones, are not.
func TestDenyListMissesNoSpecialRange(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		rng, addr string
		refused   bool
	}{
		// IPv4 outside the special ranges.
		{"public IPv4", "93.184.216.34", false},
		{"public IPv4", "8.8.8.8", false},
		{"just below CGNAT", "100.63.255.255", false},
		{"just above CGNAT", "100.128.0.0", false},
		{"just above 172.16/12", "172.32.0.1", false},
		{"just above 198.18/15", "198.20.0.1", false},
		{"just below 192.0.0/24", "191.255.255.255", false},
		// IPv4 special ranges.
		{"this network 0/8", "0.1.2.3", true},
		{"unspecified", "0.0.0.0", true},
		{"private 10/8", "10.1.2.3", true},
		{"CGNAT 100.64/10", "100.64.0.1", true},
		{"loopback 127/8", "127.0.0.1", true},
		{"loopback 127/8", "127.255.255.254", true},
		{"link-local 169.254/16", "169.254.1.1", true},
		{"metadata", "169.254.169.254", true},
		{"ECS metadata", "169.254.170.2", true},
		{"Alibaba metadata", "100.100.100.200", true},
		{"private 172.16/12", "172.16.0.1", true},
		{"IETF 192.0.0/24", "192.0.0.170", true},
		{"TEST-NET-1", "192.0.2.1", true},
		{"6to4 relay 192.88.99/24", "192.88.99.1", true},
		{"private 192.168/16", "192.168.1.1", true},
		{"benchmarking 198.18/15", "198.18.0.1", true},
		{"benchmarking 198.18/15", "198.19.255.255", true},
		{"TEST-NET-2", "198.51.100.7", true},
		{"TEST-NET-3", "203.0.113.7", true},
		{"multicast 224/4", "224.0.0.1", true},
		{"reserved 240/4", "240.0.0.1", true},
		{"broadcast", "255.255.255.255", true},
		// IPv6 global unicast.
		{"public IPv6", "2606:4700::1111", false},
		{"public IPv6", "2001:4860:4860::8888", false},
		{"IPv4-mapped public", "::ffff:8.8.8.8", false},
		{"NAT64 of a public IPv4", "64:ff9b::808:808", false},
		{"6to4 of a public IPv4", "2002:808:808::1", false},
		// IPv6 outside 2000::/3, or special inside it.
		{"unspecified ::", "::", true},
		{"loopback ::1", "::1", true},
		{"IPv4-compatible ::/96", "::7f00:1", true},
		{"IPv4-compatible ::/96, public inside", "::808:808", true},
		{"SIIT ::ffff:0:0:0/96", "::ffff:0:7f00:1", true},
		{"SIIT ::ffff:0:0:0/96, public inside", "::ffff:0:808:808", true},
		{"NAT64 local-use 64:ff9b:1::/48", "64:ff9b:1::808:808", true},
		{"discard-only 100::/64", "100::1", true},
		{"IETF 2001::/23 (Teredo)", "2001:0:4136:e378:8000:63bf:3fff:fdd2", true},
		{"benchmarking 2001:2::/48", "2001:2::1", true},
		{"documentation 2001:db8::/32", "2001:db8::1", true},
		{"documentation 3fff::/20", "3fff::1", true},
		{"6to4 of loopback", "2002:7f00:1::1", true},
		{"6to4 of private", "2002:a00:1::1", true},
		{"6to4 of metadata", "2002:a9fe:a9fe::1", true},
		{"site-local fec0::/10", "fec0::1", true},
		{"unique-local fc00::/7", "fc00::1", true},
		{"unique-local fd00::/8", "fd12:3456::1", true},
		{"AWS metadata over IPv6", "fd00:ec2::254", true},
		{"link-local fe80::/10", "fe80::1", true},
		{"link-local with a zone", "fe80::1%eth0", true},
		{"multicast ff00::/8", "ff02::1", true},
		{"IPv4-mapped loopback", "::ffff:127.0.0.1", true},
		{"IPv4-mapped private", "::ffff:10.0.0.1", true},
		{"IPv4-mapped metadata", "::ffff:169.254.169.254", true},
		{"IPv4-mapped benchmarking", "::ffff:198.18.0.1", true},
		{"IPv4-mapped with a zone", "::ffff:127.0.0.1%eth0", true},
		{"NAT64 of metadata", "64:ff9b::a9fe:a9fe", true},
		{"NAT64 of loopback", "64:ff9b::7f00:1", true},
		{"NAT64 of Alibaba metadata", "64:ff9b::6464:64c8", true},
		{"NAT64 of 192.0.0/24", "64:ff9b::c000:aa", true},
	} {
		if got := outbound.IsRefusedAddr(netip.MustParseAddr(tc.addr)); got != tc.refused {
			t.Errorf("%s: IsRefusedAddr(%s) = %v, want %v", tc.rng, tc.addr, got, tc.refused)
		}
	}
	if !outbound.IsRefusedAddr(netip.Addr{}) {
		t.Error("IsRefusedAddr(zero Addr) = false, want true")
	}
}
