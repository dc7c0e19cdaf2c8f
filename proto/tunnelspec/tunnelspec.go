// Package tunnelspec is the one rule for a NodeSpec tunnels section and a
// tunnel's target, read by both sides of the wire: pools.update and
// nodes.update refuse exactly the rules the node's daemon would refuse, and
// the daemon decides with Allows, on every open, whether it connects — the
// control plane's word is never enough (docs/tunnels.md).
//
// A target is "host:port" (TCP) or "unix:/absolute/path" (a unix socket).
// A rule allows TCP targets by host (exact, case-insensitive) or CIDR (the
// target must be an IP literal in it: a host name never matches a CIDR, so
// no DNS answer decides), and a port range; or one unix socket by path. The
// empty section allows nothing.
package tunnelspec

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"path"
	"strconv"
	"strings"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// Bounds.
const (
	// MaxRules bounds allow and narrow each.
	MaxRules = 64
	// MaxHost bounds a rule's host.
	MaxHost = 253
	// MaxTarget bounds a target.
	MaxTarget = 512
	// MaxFrame is the most data one TunnelRequest or TunnelResponse
	// carries.
	MaxFrame = 32 << 10
	// MaxError bounds a refusal's reason.
	MaxError = 1024
)

// UnixPrefix starts a unix socket target.
const UnixPrefix = "unix:"

// Target is a parsed target.
type Target struct {
	// Network is "tcp" or "unix".
	Network string
	// Host and Port are a TCP target's; Host is lower-cased, without
	// brackets.
	Host string
	Port uint32
	// Path is a unix target's.
	Path string
}

// Addr is what net.Dial takes.
func (t Target) Addr() string {
	if t.Network == "unix" {
		return t.Path
	}
	return net.JoinHostPort(t.Host, strconv.FormatUint(uint64(t.Port), 10))
}

// ParseTarget parses and bounds a target.
func ParseTarget(s string) (Target, error) {
	if s == "" {
		return Target{}, errors.New("the target is empty")
	}
	if len(s) > MaxTarget {
		return Target{}, fmt.Errorf("the target is %d bytes, at most %d", len(s), MaxTarget)
	}
	if strings.ContainsFunc(s, func(r rune) bool { return r < 0x20 || r == 0x7f }) {
		return Target{}, errors.New("the target holds a control character")
	}
	if p, ok := strings.CutPrefix(s, UnixPrefix); ok {
		if !path.IsAbs(p) || path.Clean(p) != p {
			return Target{}, fmt.Errorf("unix target %q: want an absolute, clean path", p)
		}
		return Target{Network: "unix", Path: p}, nil
	}
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		return Target{}, fmt.Errorf("target %q: want host:port or unix:/path", s)
	}
	n, err := strconv.ParseUint(port, 10, 16)
	if err != nil || n == 0 {
		return Target{}, fmt.Errorf("target %q: the port must be 1 to 65535", s)
	}
	if host == "" || len(host) > MaxHost {
		return Target{}, fmt.Errorf("target %q: the host must be 1 to %d bytes", s, MaxHost)
	}
	return Target{Network: "tcp", Host: strings.ToLower(host), Port: uint32(n)}, nil
}

// Validate returns what is wrong with the section, one string per fault.
func Validate(s *agentv1.TunnelSettings) []string {
	var bad []string
	for _, f := range []struct {
		name  string
		rules []*agentv1.TunnelRule
	}{{"allow", s.GetAllow()}, {"narrow", s.GetNarrow()}} {
		if len(f.rules) > MaxRules {
			bad = append(bad, fmt.Sprintf("%s: %d rules, at most %d", f.name, len(f.rules), MaxRules))
			continue
		}
		for i, r := range f.rules {
			if err := ValidateRule(r); err != nil {
				bad = append(bad, fmt.Sprintf("%s[%d]: %v", f.name, i, err))
			}
		}
	}
	return bad
}

// ValidateRule checks one rule.
func ValidateRule(r *agentv1.TunnelRule) error {
	set := 0
	for _, v := range []string{r.GetHost(), r.GetCidr(), r.GetUnixPath()} {
		if v != "" {
			set++
		}
	}
	if set != 1 {
		return errors.New("exactly one of host, cidr and unixPath must be set")
	}
	if p := r.GetUnixPath(); p != "" {
		if !path.IsAbs(p) || path.Clean(p) != p || len(p) > MaxTarget-len(UnixPrefix) {
			return fmt.Errorf("unixPath %q: want an absolute, clean path", p)
		}
		if r.GetPortMin() != 0 || r.GetPortMax() != 0 {
			return errors.New("a unixPath rule takes no ports")
		}
		return nil
	}
	if h := r.GetHost(); h != "" {
		if len(h) > MaxHost || (strings.ContainsAny(h, " /:\t\r\n") && net.ParseIP(h) == nil) {
			return fmt.Errorf("host %q: want a host name or an IP literal of at most %d bytes", h, MaxHost)
		}
	}
	if c := r.GetCidr(); c != "" {
		if _, err := netip.ParsePrefix(c); err != nil {
			return fmt.Errorf("cidr %q: %v", c, err)
		}
	}
	lo, hi := ports(r)
	if lo == 0 || lo > 65535 || hi > 65535 || hi < lo {
		return fmt.Errorf("ports %d-%d: want 1 <= portMin <= portMax <= 65535", r.GetPortMin(), r.GetPortMax())
	}
	return nil
}

func ports(r *agentv1.TunnelRule) (lo, hi uint32) {
	lo, hi = r.GetPortMin(), r.GetPortMax()
	if hi == 0 {
		hi = lo
	}
	return lo, hi
}

// Matches reports whether rule r allows t; an invalid rule matches nothing.
func Matches(r *agentv1.TunnelRule, t Target) bool {
	if ValidateRule(r) != nil {
		return false
	}
	if t.Network == "unix" {
		return r.GetUnixPath() != "" && r.GetUnixPath() == t.Path
	}
	if t.Network != "tcp" || r.GetUnixPath() != "" {
		return false
	}
	if lo, hi := ports(r); t.Port < lo || t.Port > hi {
		return false
	}
	if h := r.GetHost(); h != "" {
		return strings.EqualFold(strings.Trim(h, "[]"), t.Host)
	}
	ip, err := netip.ParseAddr(t.Host)
	if err != nil {
		return false // a host name never matches a CIDR
	}
	p, _ := netip.ParsePrefix(r.GetCidr())
	return p.Contains(ip.Unmap())
}

// Allows returns nil when the section allows the target, and otherwise why
// not: the node's whole decision.
func Allows(s *agentv1.TunnelSettings, target string) error {
	t, err := ParseTarget(target)
	if err != nil {
		return err
	}
	if bad := Validate(s); len(bad) > 0 {
		return fmt.Errorf("the tunnels section is invalid (%s): nothing is allowed", strings.Join(bad, "; "))
	}
	if !matchesAny(s.GetAllow(), t) {
		return fmt.Errorf("target %s is not in the node's tunnels allowlist", target)
	}
	if len(s.GetNarrow()) > 0 && !matchesAny(s.GetNarrow(), t) {
		return fmt.Errorf("target %s is outside the node's own narrowing of its tunnels allowlist", target)
	}
	return nil
}

func matchesAny(rules []*agentv1.TunnelRule, t Target) bool {
	for _, r := range rules {
		if Matches(r, t) {
			return true
		}
	}
	return false
}
