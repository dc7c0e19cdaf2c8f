package outbound

import "net/netip"

// global6 is IPv6 global unicast (RFC 4291): the only IPv6 range an
// outbound request may reach, once the forms that carry an IPv4 address
// are unwrapped (see [IsRefusedAddr]).
var global6 = netip.MustParsePrefix("2000::/3")

// refused4 are the IPv4 ranges that are not globally reachable (IANA's
// special-purpose registry) beyond those netip.Addr.IsGlobalUnicast already
// excludes (0.0.0.0, loopback, link-local, multicast, broadcast).
var refused4 = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/8"),       // "this network"
	netip.MustParsePrefix("10.0.0.0/8"),      // private (RFC 1918)
	netip.MustParsePrefix("100.64.0.0/10"),   // CGNAT (RFC 6598)
	netip.MustParsePrefix("172.16.0.0/12"),   // private
	netip.MustParsePrefix("192.0.0.0/24"),    // IETF protocol assignments
	netip.MustParsePrefix("192.0.2.0/24"),    // TEST-NET-1
	netip.MustParsePrefix("192.88.99.0/24"),  // 6to4 relay anycast (deprecated)
	netip.MustParsePrefix("192.168.0.0/16"),  // private
	netip.MustParsePrefix("198.18.0.0/15"),   // benchmarking
	netip.MustParsePrefix("198.51.100.0/24"), // TEST-NET-2
	netip.MustParsePrefix("203.0.113.0/24"),  // TEST-NET-3
	netip.MustParsePrefix("240.0.0.0/4"),     // reserved
}

// refused6 are the ranges inside 2000::/3 that are not globally reachable.
var refused6 = []netip.Prefix{
	netip.MustParsePrefix("2001::/23"),     // IETF protocol assignments: Teredo, benchmarking, ORCHID
	netip.MustParsePrefix("2001:db8::/32"), // documentation
	netip.MustParsePrefix("3fff::/20"),     // documentation (RFC 9637)
}

// metadata are the cloud instance-metadata addresses: refused even with
// [Options.AllowPrivateNetworks].
var metadata = []netip.Addr{
	netip.MustParseAddr("169.254.169.254"), // AWS, GCP, Azure, OpenStack, ...
	netip.MustParseAddr("169.254.170.2"),   // AWS ECS task metadata
	netip.MustParseAddr("169.254.170.23"),  // AWS EKS pod identity
	netip.MustParseAddr("100.100.100.200"), // Alibaba Cloud
	netip.MustParseAddr("fd00:ec2::254"),   // AWS over IPv6
	netip.MustParseAddr("fd00:ec2::23"),    // AWS EKS pod identity over IPv6
}

// Prefixes of IPv6 forms that carry an IPv4 address a packet reaches.
var (
	nat64 = netip.MustParsePrefix("64:ff9b::/96") // well-known NAT64 (RFC 6052): the last 32 bits
	sixTo = netip.MustParsePrefix("2002::/16")    // 6to4 (RFC 3056): bits 16 to 48
)

// embeddedIPv4 returns the IPv4 address an IPv6 address delivers to: the
// IPv4-mapped form, well-known NAT64 and 6to4; ip itself otherwise.
func embeddedIPv4(ip netip.Addr) netip.Addr {
	if ip.Is4In6() {
		return ip.Unmap()
	}
	b := ip.As16()
	switch {
	case !ip.Is6():
		return ip
	case nat64.Contains(ip):
		return netip.AddrFrom4([4]byte(b[12:16]))
	case sixTo.Contains(ip):
		return netip.AddrFrom4([4]byte(b[2:6]))
	}
	return ip
}

// IsRefusedAddr reports whether an outbound request on a tenant's behalf
// may not reach ip. It is an allowlist: an IPv4 address must be global
// unicast and in none of the special-purpose ranges (private, CGNAT,
// "this network", the IETF, documentation, benchmarking and 6to4-relay
// ranges, reserved); an IPv6 address must be in 2000::/3 (which leaves out
// loopback, ::/96, the SIIT and IPv4-compatible forms, NAT64's local-use
// 64:ff9b:1::/48, 100::/64, site-local fec0::/10, unique-local fc00::/7,
// link-local and multicast) and outside the IETF and documentation ranges.
// An IPv6 address that carries an IPv4 one (IPv4-mapped, NAT64
// 64:ff9b::/96, 6to4 2002::/16) is judged by the IPv4 address. The cloud
// metadata addresses are refused too. It is the one place these ranges
// live.
func IsRefusedAddr(ip netip.Addr) bool {
	if !ip.IsValid() {
		return true
	}
	ip = embeddedIPv4(ip.WithZone("")) // Prefix.Contains never matches a zoned address.
	if IsMetadataAddr(ip) {
		return true
	}
	if ip.Is4() {
		return !ip.IsGlobalUnicast() || inAny(ip, refused4)
	}
	return !global6.Contains(ip) || inAny(ip, refused6)
}

// IsMetadataAddr reports whether ip is a cloud instance-metadata address,
// in any of the forms [IsRefusedAddr] unwraps.
func IsMetadataAddr(ip netip.Addr) bool {
	ip = embeddedIPv4(ip.WithZone(""))
	for _, m := range metadata {
		if ip == m {
			return true
		}
	}
	return false
}

func inAny(ip netip.Addr, ps []netip.Prefix) bool {
	for _, p := range ps {
		if p.Contains(ip) {
			return true
		}
	}
	return false
}
