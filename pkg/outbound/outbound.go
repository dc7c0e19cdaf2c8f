// Package outbound is the one HTTP client for every request the control
// plane makes on a tenant's behalf — webhook deliveries, provider APIs and
// anything later — to a URL a tenant names.
//
// A tenant names the URL, so the request must not become the tenant's way
// into the control plane's own network (server-side request forgery). The
// rules, applied by [CheckURL] when the URL is stored and again by
// [Client.Do] on every request:
//
//   - https only; http to a loopback host only with [Options.AllowInsecure]
//     (development);
//   - no user info, no fragment, a port from 1 to 65535, and an IPv4
//     literal only as a dotted quad (0x7f000001, 2130706433, 0177.0.0.1 and
//     127.1 are refused: resolvers disagree on what they mean);
//   - a literal address or localhost name that [IsRefusedAddr] refuses is
//     refused at once, and every address dialled, after DNS resolution, is
//     checked again in the dialer's Control hook — DNS rebinding cannot get
//     around it;
//   - redirects are never followed (a 3xx is an answer like any other), no
//     proxy is used whatever the environment says;
//   - with [Options.AllowedHosts], the host must be one of the operator's.
//
// What a tenant may read about a failure is one of a fixed set of classes
// ([Reason]); the details (addresses, resolver answers, the peer's text) go
// only to the server's log.
package outbound

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// MaxURLLen is the longest URL [CheckURL] accepts.
const MaxURLLen = 2048

// DefaultTimeout bounds a request when [Options.Timeout] is zero.
const DefaultTimeout = 15 * time.Second

// ErrDestinationRefused is wrapped by the error of a request whose URL or
// dialled address the rules refuse; errors.Is finds it through *url.Error
// and *net.OpError.
var ErrDestinationRefused = errors.New("outbound: destination refused")

// Options are the rules of one kind of outbound request. The zero value is
// what production wants.
type Options struct {
	// Setting is the configuration section the options come from
	// ("webhooks", "providers"), named in refusals so an operator knows
	// which key opens them.
	Setting string
	// AllowInsecure lets http reach a loopback host (localhost or a
	// loopback literal); anything else must be https. For development.
	AllowInsecure bool
	// AllowPrivateNetworks lets a request reach the addresses
	// [IsRefusedAddr] refuses, except the cloud metadata addresses, which
	// stay refused. For development, or with AllowedHosts for a service on
	// the operator's own network.
	AllowPrivateNetworks bool
	// AllowLoopback lets a request reach loopback addresses (only): the
	// happy path of a test against an httptest server, with every other
	// refusal in force. Not a configuration setting.
	AllowLoopback bool
	// AllowedHosts, when not empty, are the only hosts a URL may name:
	// a name ("api.example.com"), a wildcard for its subdomains
	// ("*.example.com") or an IP literal. The address checks still apply.
	AllowedHosts []string
	// Timeout bounds a whole request: dial, TLS, request and reading the
	// response body. Zero means [DefaultTimeout].
	Timeout time.Duration

	// lookup replaces DNS resolution in this package's tests.
	lookup func(host string) ([]netip.Addr, error)
}

func (o Options) key(k string) string { return cmp.Or(o.Setting, "outbound") + "." + k }

// CheckURL validates raw under o's rules (see the package comment), with
// an INVALID_INPUT fault naming field. It does not resolve the host:
// [Client] checks each address it dials.
func CheckURL(raw, field string, o Options) error {
	bad := func(format string, args ...any) error {
		return fault.New(fault.InvalidInput, field, format, args...)
	}
	if len(raw) > MaxURLLen {
		return bad("expected at most %d characters, got %d", MaxURLLen, len(raw))
	}
	u, err := url.Parse(raw)
	switch {
	case err != nil || !u.IsAbs() || u.Opaque != "":
		return bad("expected an absolute URL such as https://example.com/path")
	case u.User != nil:
		return bad("expected no user info (user:password@) in the URL")
	case strings.Trim(u.Hostname(), ".") == "":
		return bad("expected a host in the URL")
	case strings.Contains(raw, "#"):
		return bad("expected no fragment (#...) in the URL")
	}
	if p := u.Port(); p != "" {
		if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
			return bad("expected a port from 1 to 65535, got %s", p)
		}
	}
	host := strings.ToLower(u.Hostname())
	ip, lit := parseHost(host)
	if !lit && ipv4ish(host) {
		return bad("expected an IPv4 address as four decimal numbers (such as 192.0.2.1), got %q", host)
	}
	loopback := isLocalhost(host) || (lit && ip.Unmap().IsLoopback())
	switch {
	case u.Scheme == "https":
	case u.Scheme == "http" && o.AllowInsecure && loopback:
	case u.Scheme == "http" && o.AllowInsecure:
		return bad("expected https; http is allowed only to localhost or a loopback IP")
	default:
		return bad("expected scheme https, got %q", u.Scheme)
	}
	if lit && IsMetadataAddr(ip) {
		return bad("%s is a cloud metadata address: refused", host)
	}
	loopbackAllowed := o.AllowLoopback && loopback
	if !o.AllowPrivateNetworks && !loopbackAllowed {
		if isLocalhost(host) {
			return bad("%s is a loopback name: requests to private networks are refused (%s)", host, o.key("allowPrivateNetworks"))
		}
		if lit && IsRefusedAddr(ip) {
			return bad("%s is a private, loopback, link-local, reserved or metadata address: requests to private networks are refused (%s)", host, o.key("allowPrivateNetworks"))
		}
	}
	if len(o.AllowedHosts) > 0 && !hostAllowed(host, o.AllowedHosts) {
		return bad("%s is not one of the hosts %s lists", host, o.key("allowedHosts"))
	}
	return nil
}

// parseHost reads host as an IP literal.
func parseHost(host string) (netip.Addr, bool) {
	ip, err := netip.ParseAddr(host)
	return ip, err == nil
}

// ipv4ish reports whether host would be read as an IPv4 address by a URL
// parser or resolver (WHATWG: its last label is a number, decimal or 0x
// hex): one that is not a dotted quad is refused.
func ipv4ish(host string) bool {
	h := strings.TrimSuffix(host, ".")
	last := h[strings.LastIndexByte(h, '.')+1:]
	if last == "" {
		return false
	}
	digits := "0123456789"
	if len(last) >= 2 && last[0] == '0' && (last[1] == 'x' || last[1] == 'X') {
		last, digits = last[2:], "0123456789abcdefABCDEF"
		if last == "" {
			return true
		}
	}
	return strings.Trim(last, digits) == ""
}

func isLocalhost(host string) bool {
	host = strings.TrimSuffix(strings.ToLower(host), ".")
	return host == "localhost" || strings.HasSuffix(host, ".localhost")
}

// hostAllowed reports whether host matches one of the allowed patterns.
func hostAllowed(host string, allowed []string) bool {
	host = strings.TrimSuffix(host, ".")
	for _, a := range allowed {
		a = strings.ToLower(a)
		if suffix, ok := strings.CutPrefix(a, "*."); ok {
			if strings.HasSuffix(host, "."+suffix) {
				return true
			}
			continue
		}
		if ip, err := netip.ParseAddr(a); err == nil {
			if hip, ok := parseHost(host); ok && hip.Unmap() == ip.Unmap() {
				return true
			}
			continue
		}
		if host == a {
			return true
		}
	}
	return false
}

// CheckAllowedHost validates one entry of [Options.AllowedHosts] (a
// configuration value): a host name, "*." and a host name, or an IP
// literal; no scheme, port or path.
func CheckAllowedHost(s string) error {
	if _, err := netip.ParseAddr(s); err == nil {
		return nil
	}
	name := strings.TrimPrefix(s, "*.")
	if name == "" || len(name) > 253 || strings.ContainsAny(name, "*/:@[] ") || ipv4ish(name) {
		return fmt.Errorf("expected a host name, *.name or an IP address, got %q", s)
	}
	if u, err := url.Parse("https://" + name + "/"); err != nil || u.Hostname() != name {
		return fmt.Errorf("expected a host name, *.name or an IP address, got %q", s)
	}
	return nil
}

// Client sends requests under one set of [Options]. Make one per kind of
// request and share it: it keeps connections.
type Client struct {
	hc *http.Client
	o  Options
}

// NewClient returns a client that applies o's rules to every request and
// every address it dials (see the package comment). It uses TLS 1.2 or
// later and no proxy.
func NewClient(o Options) *Client {
	dialer := &net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second, Control: o.control}
	dial := dialer.DialContext
	if o.lookup != nil {
		dial = o.testDial(dialer)
	}
	tr := &http.Transport{
		Proxy:               nil,
		DialContext:         dial,
		TLSClientConfig:     &tls.Config{MinVersion: tls.VersionTLS12},
		ForceAttemptHTTP2:   true,
		TLSHandshakeTimeout: 10 * time.Second,
		MaxIdleConns:        1024,
		// Requests to one endpoint run several at a time: keep their
		// connections, or every request pays a dial and a handshake.
		MaxIdleConnsPerHost:   64,
		IdleConnTimeout:       90 * time.Second,
		ExpectContinueTimeout: time.Second,
	}
	return &Client{o: o, hc: &http.Client{
		Transport: tr,
		Timeout:   cmp.Or(o.Timeout, DefaultTimeout),
		CheckRedirect: func(*http.Request, []*http.Request) error {
			return http.ErrUseLastResponse
		},
	}}
}

// Options are the client's rules.
func (c *Client) Options() Options { return c.o }

// CheckURL is [CheckURL] under the client's rules.
func (c *Client) CheckURL(raw, field string) error { return CheckURL(raw, field, c.o) }

// Do sends req when its URL passes the client's rules; otherwise it fails
// with an error wrapping [ErrDestinationRefused]. A redirect is returned as
// the response, never followed.
func (c *Client) Do(req *http.Request) (*http.Response, error) {
	if err := CheckURL(req.URL.String(), "url", c.o); err != nil {
		if req.Body != nil {
			_ = req.Body.Close()
		}
		return nil, fmt.Errorf("%w: %w", ErrDestinationRefused, err)
	}
	return c.hc.Do(req)
}

// CloseIdleConnections closes the client's idle connections.
func (c *Client) CloseIdleConnections() { c.hc.CloseIdleConnections() }

// control runs on every address the dialer is about to connect to, after
// resolution and before the connection is attempted: this is the check DNS
// rebinding cannot get around.
func (o Options) control(_, address string, _ syscall.RawConn) error {
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return fmt.Errorf("%w: unparseable address %q", ErrDestinationRefused, address)
	}
	ip := ap.Addr()
	switch {
	case IsMetadataAddr(ip):
		return fmt.Errorf("%w: %s is a cloud metadata address", ErrDestinationRefused, ip)
	case o.AllowPrivateNetworks, o.AllowLoopback && ip.WithZone("").Unmap().IsLoopback():
		return nil
	case IsRefusedAddr(ip):
		return fmt.Errorf("%w: %s is not a public address", ErrDestinationRefused, ip)
	}
	return nil
}

// testDial resolves with o.lookup and dials the answers in turn with d
// (whose Control hook still checks each): tests use it to prove a name
// that resolves to a refused address is refused before any connection.
func (o Options) testDial(d *net.Dialer) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		host, port, err := net.SplitHostPort(addr)
		if err != nil {
			return nil, err
		}
		ips, err := o.lookup(host)
		if err != nil {
			return nil, &net.DNSError{Err: err.Error(), Name: host, IsNotFound: true}
		}
		var last error = &net.DNSError{Err: "no addresses", Name: host, IsNotFound: true}
		for _, ip := range ips {
			c, err := d.DialContext(ctx, network, net.JoinHostPort(ip.String(), port))
			if err == nil {
				return c, nil
			}
			last = err
		}
		return nil, last
	}
}
