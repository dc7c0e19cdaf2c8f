package webhooks

import (
	"cmp"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"syscall"
	"time"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// MaxURLLen is the longest endpoint URL [CheckURL] accepts.
const MaxURLLen = 2048

// DefaultTimeout bounds a delivery attempt when [Options.Timeout] is zero.
const DefaultTimeout = 15 * time.Second

// ErrDestinationRefused is wrapped by the error of a request from a
// [NewClient] client that would have dialled a refused address (see
// [IsRefusedAddr]); errors.Is finds it through *url.Error.
var ErrDestinationRefused = errors.New("webhooks: destination address refused")

// CheckURL validates an endpoint URL: absolute, at most [MaxURLLen]
// characters, with a host, no user info and no fragment, and https — or http
// when allowInsecure is set and the host is "localhost" or a loopback IP
// literal (for development). It fails with an INVALID_INPUT fault on field
// "url". It does not resolve the host: [NewClient] checks the address dialled.
func CheckURL(raw string, allowInsecure bool) error {
	bad := func(format string, args ...any) error {
		return fault.New(fault.InvalidInput, "url", format, args...)
	}
	if len(raw) > MaxURLLen {
		return bad("expected at most %d characters, got %d", MaxURLLen, len(raw))
	}
	u, err := url.Parse(raw)
	switch {
	case err != nil || !u.IsAbs():
		return bad("expected an absolute URL such as https://example.com/hook")
	case u.User != nil:
		return bad("expected no user info (user:password@) in the URL")
	case u.Hostname() == "":
		return bad("expected a host in the URL")
	case strings.Contains(raw, "#"):
		return bad("expected no fragment (#...) in the URL")
	case u.Scheme == "https":
		return nil
	case u.Scheme == "http" && allowInsecure && isLoopbackHost(u.Hostname()):
		return nil
	case u.Scheme == "http" && allowInsecure:
		return bad("expected https; http is allowed only to localhost or a loopback IP")
	default:
		return bad("expected scheme https, got %q", u.Scheme)
	}
}

// CheckEndpoint is CheckURL under o's rules, and, without
// o.AllowPrivateNetworks, also refuses a host that is a literal refused
// address ([IsRefusedAddr]) or a localhost name — at once, rather than at
// every delivery. A name is checked on each address dialled ([NewClient]).
func CheckEndpoint(raw string, o Options) error {
	if err := CheckURL(raw, o.AllowInsecure); err != nil {
		return err
	}
	if o.AllowPrivateNetworks {
		return nil
	}
	u, _ := url.Parse(raw) // CheckURL parsed it
	host := strings.ToLower(u.Hostname())
	if host == "localhost" || strings.HasSuffix(host, ".localhost") {
		return fault.New(fault.InvalidInput, "url", "%s is a loopback name: webhooks to private networks are refused (webhooks.allowPrivateNetworks)", host)
	}
	if ip, err := netip.ParseAddr(host); err == nil && IsRefusedAddr(ip) {
		return fault.New(fault.InvalidInput, "url", "%s is a private, loopback, link-local or metadata address: webhooks to private networks are refused (webhooks.allowPrivateNetworks)", host)
	}
	return nil
}

func isLoopbackHost(host string) bool {
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip, err := netip.ParseAddr(host)
	return err == nil && ip.Unmap().IsLoopback()
}

// Options configures [NewClient]. The zero value is what production wants.
type Options struct {
	// AllowPrivateNetworks lets the client dial the addresses [IsRefusedAddr]
	// refuses; for development and tests only.
	AllowPrivateNetworks bool
	// AllowInsecure lets the client send over http to localhost or a loopback
	// IP, as [CheckURL] with allowInsecure does; anything else must be https.
	AllowInsecure bool
	// Timeout bounds a whole attempt: dial, TLS, request and reading the
	// response body. Zero means [DefaultTimeout].
	Timeout time.Duration
}

// NewClient returns the client to deliver webhooks with. Each request's URL
// must pass [CheckURL]; each address it dials, after DNS resolution, must
// pass [IsRefusedAddr] unless o.AllowPrivateNetworks is set, so DNS
// rebinding cannot reach an internal service. It uses no proxy (whatever the
// environment says), TLS 1.2 or later, and returns redirects as responses
// instead of following them.
func NewClient(o Options) *http.Client {
	dialer := &net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}
	if !o.AllowPrivateNetworks {
		dialer.Control = refuseControl
	}
	tr := &http.Transport{
		Proxy:               nil,
		DialContext:         dialer.DialContext,
		TLSClientConfig:     &tls.Config{MinVersion: tls.VersionTLS12},
		ForceAttemptHTTP2:   true,
		TLSHandshakeTimeout: 10 * time.Second,
		MaxIdleConns:        1024,
		// Deliveries to one endpoint run several at a time: keep their
		// connections, or every attempt pays a dial and a handshake.
		MaxIdleConnsPerHost:   64,
		IdleConnTimeout:       90 * time.Second,
		ExpectContinueTimeout: time.Second,
	}
	return &http.Client{
		Transport: checkedTransport{next: tr, allowInsecure: o.AllowInsecure},
		Timeout:   cmp.Or(o.Timeout, DefaultTimeout),
		CheckRedirect: func(*http.Request, []*http.Request) error {
			return http.ErrUseLastResponse
		},
	}
}

// checkedTransport refuses a request whose URL fails CheckURL.
type checkedTransport struct {
	next          *http.Transport
	allowInsecure bool
}

func (t checkedTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if err := CheckURL(r.URL.String(), t.allowInsecure); err != nil {
		if r.Body != nil {
			_ = r.Body.Close() // A RoundTripper must close the body, even on error.
		}
		return nil, err
	}
	return t.next.RoundTrip(r)
}

// CloseIdleConnections closes the idle connections of the underlying
// transport, so that http.Client.CloseIdleConnections reaches it.
func (t checkedTransport) CloseIdleConnections() { t.next.CloseIdleConnections() }

// refuseControl runs on every address the dialer is about to connect to,
// after resolution: this is the check DNS rebinding cannot get around.
func refuseControl(network, address string, _ syscall.RawConn) error {
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return fmt.Errorf("%w: unparseable address %q", ErrDestinationRefused, address)
	}
	if IsRefusedAddr(ap.Addr()) {
		return fmt.Errorf("%w: %s is not a public address", ErrDestinationRefused, ap.Addr())
	}
	return nil
}

// refusedPrefixes are the ranges netip.Addr's predicates do not cover, and
// the cloud metadata addresses, listed although their ranges are refused too.
var refusedPrefixes = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/8"),          // "this network"
	netip.MustParsePrefix("100.64.0.0/10"),      // CGNAT (RFC 6598)
	netip.MustParsePrefix("240.0.0.0/4"),        // reserved, and broadcast 255.255.255.255
	netip.MustParsePrefix("169.254.169.254/32"), // AWS, GCP, Azure metadata
	netip.MustParsePrefix("100.100.100.200/32"), // Alibaba Cloud metadata
	netip.MustParsePrefix("fd00:ec2::254/128"),  // AWS metadata over IPv6
}

// nat64 is the well-known NAT64 prefix (RFC 6052): an address in it reaches
// the IPv4 address in its last 32 bits.
var nat64 = netip.MustParsePrefix("64:ff9b::/96")

// IsRefusedAddr reports whether a webhook may not be delivered to ip:
// invalid, unspecified, loopback, private (RFC 1918, fc00::/7), link-local
// (169.254.0.0/16, fe80::/10), CGNAT (100.64.0.0/10), 0.0.0.0/8, multicast,
// broadcast and reserved, or a cloud metadata address — including the
// IPv4-mapped and NAT64 forms of the IPv4 ones. It is the one place these
// ranges live.
func IsRefusedAddr(ip netip.Addr) bool {
	ip = ip.WithZone("").Unmap() // Prefix.Contains never matches a zoned or mapped address.
	if nat64.Contains(ip) {
		b := ip.As16()
		ip = netip.AddrFrom4([4]byte(b[12:]))
	}
	if !ip.IsValid() || ip.IsUnspecified() || ip.IsLoopback() || ip.IsPrivate() ||
		ip.IsLinkLocalUnicast() || ip.IsMulticast() {
		return true
	}
	for _, p := range refusedPrefixes {
		if p.Contains(ip) {
			return true
		}
	}
	return false
}
