// Package siteconf turns a node's site settings (the NodeSpec's site
// section) into the files the node's own services read, all under a
// configurable root ("/" on a real node, a temp dir in tests):
//
//	etc/systemd/timesyncd.conf.d/50-bettercompute.conf  NTP, systemd-timesyncd
//	etc/chrony/conf.d/bettercompute.conf                NTP, when chrony is the one
//	                                                    present (etc/chrony/chrony.conf)
//	                                                    (timesyncd: etc/systemd/timesyncd.conf)
//	etc/systemd/resolved.conf.d/50-bettercompute.conf   DNS servers and search domains,
//	                                                    systemd-resolved
//	                                                    (etc/systemd/resolved.conf)
//	etc/bettercompute/proxy.env                         HTTP(S) proxy, an environment
//	                                                    file (KEY=value lines)
//
// A field unset removes its file: every path above is either wanted with
// exact content or absent, so applying twice is a no-op and removing a field
// reverts it. bcd never restarts or reloads the services that read these
// files: a field's status says which service picks the change up at its next
// restart. resolv.conf is never written: a node without systemd-resolved
// reports the DNS field failed, one with neither chrony nor timesyncd the
// NTP field (see [Plan]).
//
// The daemon's own fields (log level, OTLP endpoint, telemetry interval, and
// the proxy for its outbound HTTP) live in memory: see [Settings].
package siteconf

import (
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/net/http/httpproxy"

	"github.com/bettercompute/bettercompute/proto/sitespec"
)

// Paths under the root.
const (
	// TimesyncdDropIn holds the NTP servers for systemd-timesyncd.
	TimesyncdDropIn = "etc/systemd/timesyncd.conf.d/50-bettercompute.conf"
	// TimesyncdConf is systemd-timesyncd's main file: NTP is applied
	// through TimesyncdDropIn where it exists and chrony is absent.
	TimesyncdConf = "etc/systemd/timesyncd.conf"
	// ChronyDropIn holds the NTP servers for chrony.
	ChronyDropIn = "etc/chrony/conf.d/bettercompute.conf"
	// ChronyConf is chrony's main file: when it exists, chrony is the NTP
	// daemon and ChronyDropIn is written instead of TimesyncdDropIn.
	ChronyConf = "etc/chrony/chrony.conf"
	// ResolvedDropIn holds the DNS servers for systemd-resolved.
	ResolvedDropIn = "etc/systemd/resolved.conf.d/50-bettercompute.conf"
	// ResolvedConf is systemd-resolved's main file: DNS is applied only
	// where it exists.
	ResolvedConf = "etc/systemd/resolved.conf"
	// ProxyEnv is the proxy environment file (HTTP_PROXY, HTTPS_PROXY,
	// NO_PROXY and their lower-case forms); container engines read it
	// through their units' EnvironmentFile=.
	ProxyEnv = "etc/bettercompute/proxy.env"
)

// Bounds of the section's fields.
const (
	// MaxServers bounds ntp_servers, dns_servers and no_proxy each.
	MaxServers = sitespec.MaxServers
	// MaxValue bounds one value (a host name, a URL).
	MaxValue = sitespec.MaxValue
)

// Log levels the section takes.
var LogLevels = sitespec.LogLevels

// header starts every file this package writes.
const header = "# Written by bcd from this node's site settings; edits are overwritten.\n"

// Settings are a node's site settings as the daemon uses them. The zero
// value is "nothing set".
type Settings struct {
	NTPServers []string
	DNSServers []string
	// SearchDomains go with DNSServers into the resolved drop-in
	// (Domains=).
	SearchDomains []string
	HTTPProxy     string
	NoProxy       []string
	OTLPEndpoint  string // host:port or https://host:port (TLS), http://host:port (plain); OTLP over gRPC; "" means no export
	LogLevel      string // one of LogLevels; "" means the daemon's default
	// TelemetryInterval is how often the daemon exports its metrics
	// (sitespec.MinTelemetryInterval to MaxTelemetryInterval); 0 means
	// unset: the daemon's --telemetry-interval.
	TelemetryInterval time.Duration
}

// Equal reports whether s and o are the same settings.
func (s Settings) Equal(o Settings) bool {
	return slices.Equal(s.NTPServers, o.NTPServers) && slices.Equal(s.DNSServers, o.DNSServers) &&
		slices.Equal(s.SearchDomains, o.SearchDomains) &&
		s.HTTPProxy == o.HTTPProxy && slices.Equal(s.NoProxy, o.NoProxy) &&
		s.OTLPEndpoint == o.OTLPEndpoint && s.LogLevel == o.LogLevel && s.TelemetryInterval == o.TelemetryInterval
}

// Proxy is the proxy function for the daemon's own outbound HTTP
// (http.Transport.Proxy): HTTPProxy for http and https requests, except
// to the NoProxy hosts; no proxy when HTTPProxy is unset.
func (s Settings) Proxy() func(*http.Request) (*url.URL, error) {
	f := (&httpproxy.Config{HTTPProxy: s.HTTPProxy, HTTPSProxy: s.HTTPProxy, NoProxy: strings.Join(s.NoProxy, ",")}).ProxyFunc()
	return func(r *http.Request) (*url.URL, error) { return f(r.URL) }
}

// Level is the slog level LogLevel names, or def when it is unset.
func (s Settings) Level(def slog.Level) slog.Level {
	switch s.LogLevel {
	case "debug":
		return slog.LevelDebug
	case "info":
		return slog.LevelInfo
	case "warn":
		return slog.LevelWarn
	case "error":
		return slog.LevelError
	}
	return def
}

// Validate returns what is wrong with s, each problem naming its field
// ("ntp_servers: ..."): proto/sitespec's rule, the one pools.update
// applies too.
func Validate(s Settings) []string {
	spec := sitespec.Settings{NTPServers: s.NTPServers, DNSServers: s.DNSServers, SearchDomains: s.SearchDomains,
		HTTPProxy: s.HTTPProxy, NoProxy: s.NoProxy, OTLPEndpoint: s.OTLPEndpoint, LogLevel: s.LogLevel}
	if s.TelemetryInterval != 0 {
		spec.TelemetryInterval = &s.TelemetryInterval
	}
	ps := sitespec.Validate(spec)
	bad := make([]string, len(ps))
	for i, p := range ps {
		bad[i] = p.String()
	}
	return bad
}

// File is one path under the root and what it should hold: Data, or
// absent when Data is nil.
type File struct {
	Path string
	Data []byte
}

// Field states.
const (
	// Applied: the field is set and its file written (or, for the daemon's
	// own fields, in effect).
	Applied = "applied"
	// Unset: the field is not set; its file is absent.
	Unset = "unset"
	// Failed: the field is set but cannot be applied on this node.
	Failed = "failed"
)

// Field is one field's status.
type Field struct {
	Name   string // the section's field: ntp_servers, dns_servers, …
	State  string // Applied, Unset or Failed
	Detail string // where it went and who picks it up
}

// String is "name: state (detail)".
func (f Field) String() string {
	if f.Detail == "" {
		return f.Name + ": " + f.State
	}
	return f.Name + ": " + f.State + " (" + f.Detail + ")"
}

// exists reports whether rel exists under root.
func exists(root, rel string) bool {
	_, err := os.Stat(filepath.Join(root, rel))
	return err == nil
}

// Plan returns every file this package manages under root with what it
// should hold for s (valid: see [Validate]), and each field's status. It
// reads root only to see whether chrony and systemd-resolved are present.
// With root "" it manages no file: the system fields are reported as
// recorded only (a simulated node).
func Plan(root string, s Settings) ([]File, []Field) {
	var files []File
	var fields []Field
	ntp := Field{Name: "ntp_servers", State: Unset}
	dns := Field{Name: "dns_servers", State: Unset}
	proxy := Field{Name: "http_proxy", State: Unset}
	var timesyncd, chrony, resolved, env []byte
	switch {
	case len(s.NTPServers) == 0:
	case root == "":
		ntp = Field{Name: ntp.Name, State: Applied, Detail: "recorded only: no system root"}
	case exists(root, ChronyConf):
		var b strings.Builder
		b.WriteString(header)
		for _, h := range s.NTPServers {
			b.WriteString("server " + h + " iburst\n")
		}
		chrony = []byte(b.String())
		ntp = Field{Name: ntp.Name, State: Applied, Detail: ChronyDropIn + "; chronyd reads it at its next restart, bcd does not restart it"}
	case exists(root, TimesyncdConf):
		timesyncd = []byte(header + "[Time]\nNTP=" + strings.Join(s.NTPServers, " ") + "\n")
		ntp = Field{Name: ntp.Name, State: Applied, Detail: TimesyncdDropIn + "; systemd-timesyncd reads it at its next restart, bcd does not restart it"}
	default:
		ntp = Field{Name: ntp.Name, State: Failed, Detail: "neither chrony (" + ChronyConf + ") nor systemd-timesyncd (" + TimesyncdConf + ") is installed"}
	}
	dnsSet := len(s.DNSServers) > 0 || len(s.SearchDomains) > 0
	switch {
	case !dnsSet:
	case root == "":
		dns = Field{Name: dns.Name, State: Applied, Detail: "recorded only: no system root"}
	case exists(root, ResolvedConf):
		b := header + "[Resolve]\n"
		if len(s.DNSServers) > 0 {
			b += "DNS=" + strings.Join(s.DNSServers, " ") + "\n"
		}
		if len(s.SearchDomains) > 0 {
			b += "Domains=" + strings.Join(s.SearchDomains, " ") + "\n"
		}
		resolved = []byte(b)
		dns = Field{Name: dns.Name, State: Applied, Detail: ResolvedDropIn + "; systemd-resolved reads it at its next restart, bcd does not restart it"}
	default:
		dns = Field{Name: dns.Name, State: Failed, Detail: "systemd-resolved is not installed (no " + ResolvedConf + "); bcd does not write resolv.conf"}
	}
	// dns_servers and search_domains share the drop-in: each field's
	// status is the drop-in's, or unset.
	domains := dns
	domains.Name = "search_domains"
	if len(s.SearchDomains) == 0 {
		domains = Field{Name: "search_domains", State: Unset}
	}
	if len(s.DNSServers) == 0 {
		dns = Field{Name: dns.Name, State: Unset}
	}
	switch {
	case s.HTTPProxy == "" && len(s.NoProxy) == 0:
	case root == "":
		proxy = Field{Name: proxy.Name, State: Applied, Detail: "bcd's own HTTP; recorded only: no system root"}
	default:
		var b strings.Builder
		b.WriteString(header)
		if s.HTTPProxy != "" {
			for _, k := range []string{"HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"} {
				b.WriteString(k + "=" + s.HTTPProxy + "\n")
			}
		}
		if len(s.NoProxy) > 0 {
			for _, k := range []string{"NO_PROXY", "no_proxy"} {
				b.WriteString(k + "=" + strings.Join(s.NoProxy, ",") + "\n")
			}
		}
		env = []byte(b.String())
		proxy = Field{Name: proxy.Name, State: Applied, Detail: "bcd's own HTTP and " + ProxyEnv + "; services read it at their next restart"}
	}
	if root != "" {
		files = []File{{TimesyncdDropIn, timesyncd}, {ChronyDropIn, chrony}, {ResolvedDropIn, resolved}, {ProxyEnv, env}}
	}
	otlp := Field{Name: "otlp_endpoint", State: Unset}
	if s.OTLPEndpoint != "" {
		otlp = Field{Name: otlp.Name, State: Applied, Detail: s.OTLPEndpoint}
	}
	lvl := Field{Name: "log_level", State: Unset, Detail: "bcd's default"}
	if s.LogLevel != "" {
		lvl = Field{Name: "log_level", State: Applied, Detail: s.LogLevel + ", live"}
	}
	interval := Field{Name: "telemetry_interval", State: Unset, Detail: "bcd's --telemetry-interval"}
	if s.TelemetryInterval != 0 {
		interval = Field{Name: interval.Name, State: Applied, Detail: s.TelemetryInterval.String() + ", live"}
	}
	fields = append(fields, ntp, dns, domains, proxy, otlp, lvl, interval)
	return files, fields
}
