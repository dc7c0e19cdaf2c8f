// Package sitespec is the one rule for what a NodeSpec site section's
// fields may hold, read by both sides of the wire: pools.update refuses
// exactly what the node's daemon (bcd's site section, agent/siteconf)
// would refuse, so a bad value never reaches a node. Values end up in
// configuration files (timesyncd, chrony, resolved, an environment file),
// so anything that could carry a second line or directive is refused.
package sitespec

import (
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// Bounds of the section's fields.
const (
	// MaxServers bounds ntp_servers, dns_servers, search_domains and
	// no_proxy each.
	MaxServers = 16
	// MaxValue bounds one value (a host name, a URL).
	MaxValue = 253
)

// Bounds of telemetry_interval: bcd's --telemetry-interval takes the same.
const (
	MinTelemetryInterval = time.Second
	MaxTelemetryInterval = time.Hour
)

// LogLevels are the log levels the section takes.
var LogLevels = []string{"debug", "info", "warn", "error"}

// Settings are the section's fields the daemon applies.
type Settings struct {
	NTPServers    []string
	DNSServers    []string
	SearchDomains []string
	HTTPProxy     string
	NoProxy       []string
	OTLPEndpoint  string
	LogLevel      string
	// TelemetryInterval is nil when unset (the daemon's flag then); a
	// value outside MinTelemetryInterval to MaxTelemetryInterval, zero
	// included, is refused.
	TelemetryInterval *time.Duration
}

// FromProto reads the section's fields.
func FromProto(s *agentv1.SiteSettings) Settings {
	return Settings{
		NTPServers: s.GetNtpServers().GetValues(), DNSServers: s.GetDnsServers().GetValues(),
		SearchDomains: s.GetSearchDomains().GetValues(), HTTPProxy: s.GetHttpProxy(), NoProxy: s.GetNoProxy().GetValues(),
		OTLPEndpoint: s.GetOtlpEndpoint(), LogLevel: s.GetLogLevel(), TelemetryInterval: interval(s),
	}
}

// interval is s's telemetry_interval, nil when unset; a malformed
// Duration (seconds and nanos of different signs, nanos out of range)
// reads as 0, refused.
func interval(s *agentv1.SiteSettings) *time.Duration {
	d := s.GetTelemetryInterval()
	if d == nil {
		return nil
	}
	var v time.Duration
	if d.CheckValid() == nil {
		v = d.AsDuration()
	}
	return &v
}

// Problem is what is wrong with one field: Field is the section's field
// name (ntp_servers, ...).
type Problem struct {
	Field, Msg string
}

// String is "field: message".
func (p Problem) String() string { return p.Field + ": " + p.Msg }

// Validate returns what is wrong with s, each problem naming its field.
// Values end up in configuration files, so anything that could carry a
// second line or directive (whitespace, control characters, '#', ';') is
// refused.
func Validate(s Settings) []Problem {
	var bad []Problem
	list := func(field string, vs []string, check func(string) error) {
		if len(vs) > MaxServers {
			bad = append(bad, Problem{Field: field, Msg: fmt.Sprintf("%d values, at most %d", len(vs), MaxServers)})
			return
		}
		for _, v := range vs {
			if err := check(v); err != nil {
				bad = append(bad, Problem{Field: field, Msg: fmt.Sprintf("%q: %v", clip(v), err)})
				return
			}
		}
	}
	list("ntp_servers", s.NTPServers, host)
	list("dns_servers", s.DNSServers, func(v string) error {
		if _, err := netip.ParseAddr(v); err != nil {
			return fmt.Errorf("not an IP address")
		}
		return nil
	})
	list("search_domains", s.SearchDomains, func(v string) error {
		if _, err := netip.ParseAddr(v); err == nil {
			return fmt.Errorf("an IP address, not a domain")
		}
		return host(v)
	})
	list("no_proxy", s.NoProxy, func(v string) error {
		if err := plain(v); err != nil {
			return err
		}
		if strings.Contains(v, ",") {
			return fmt.Errorf("contains a comma")
		}
		return nil
	})
	if s.HTTPProxy != "" {
		if err := proxyURL(s.HTTPProxy); err != nil {
			bad = append(bad, Problem{Field: "http_proxy", Msg: fmt.Sprintf("%q: %v", clip(s.HTTPProxy), err)})
		}
	}
	if s.OTLPEndpoint != "" {
		// http://host:port is plain gRPC; https://host:port or a bare
		// host:port is TLS (the telemetry exporter's forms).
		hp := s.OTLPEndpoint
		if rest, ok := strings.CutPrefix(hp, "http://"); ok {
			hp = rest
		} else if rest, ok := strings.CutPrefix(hp, "https://"); ok {
			hp = rest
		}
		h, p, err := net.SplitHostPort(hp)
		if n, perr := strconv.Atoi(p); err == nil && (host(h) != nil || perr != nil || n < 1 || n > 65535) {
			err = fmt.Errorf("want host:port")
		}
		if err != nil {
			bad = append(bad, Problem{Field: "otlp_endpoint", Msg: fmt.Sprintf("%q: want host:port, http://host:port or https://host:port", clip(s.OTLPEndpoint))})
		}
	}
	if s.LogLevel != "" && !slices.Contains(LogLevels, s.LogLevel) {
		bad = append(bad, Problem{Field: "log_level", Msg: fmt.Sprintf("%q: want debug, info, warn or error", clip(s.LogLevel))})
	}
	if d := s.TelemetryInterval; d != nil && (*d < MinTelemetryInterval || *d > MaxTelemetryInterval) {
		bad = append(bad, Problem{Field: "telemetry_interval", Msg: fmt.Sprintf("%s: want %s to %s", *d, MinTelemetryInterval, MaxTelemetryInterval)})
	}
	return bad
}

func clip(v string) string {
	if len(v) > 64 {
		return v[:64] + "…"
	}
	return v
}

// plain refuses empty, overlong and multi-token values.
func plain(v string) error {
	switch {
	case v == "":
		return fmt.Errorf("empty")
	case len(v) > MaxValue:
		return fmt.Errorf("longer than %d bytes", MaxValue)
	}
	for _, r := range v {
		if r <= ' ' || r == 0x7f || r == '#' || r == ';' || r == '"' || r == '\'' || r == '\\' || r > 0x7e {
			return fmt.Errorf("contains %q", r)
		}
	}
	return nil
}

// host accepts a host name or an IP address.
func host(v string) error {
	if err := plain(v); err != nil {
		return err
	}
	if _, err := netip.ParseAddr(v); err == nil {
		return nil
	}
	for l := range strings.SplitSeq(v, ".") {
		if l == "" || len(l) > 63 || strings.HasPrefix(l, "-") || strings.HasSuffix(l, "-") {
			return fmt.Errorf("not a host name or IP address")
		}
		for _, r := range l {
			if !hostRune(r) {
				return fmt.Errorf("not a host name or IP address")
			}
		}
	}
	return nil
}

// hostRune reports whether r may stand in a host name's label.
func hostRune(r rune) bool {
	return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-'
}

func proxyURL(v string) error {
	if err := plain(v); err != nil {
		return err
	}
	u, err := url.Parse(v)
	if err != nil || u.Host == "" || u.Hostname() == "" {
		return fmt.Errorf("want a URL such as http://proxy.example:3128")
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return fmt.Errorf("scheme %q: want http or https", u.Scheme)
	}
	if u.Path != "" && u.Path != "/" || u.RawQuery != "" || u.Fragment != "" {
		return fmt.Errorf("want scheme://host:port only")
	}
	return nil
}
