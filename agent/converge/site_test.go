package converge_test

import (
	"bytes"
	"context"
	"io/fs"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/bettercompute/bettercompute/agent/converge"
	"github.com/bettercompute/bettercompute/agent/siteconf"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// siteNode is a converger whose site files go under a temp system root.
type siteNode struct {
	t     *testing.T
	state string // the daemon's state root
	sys   string // the site root ("/" on a real node)
	level *slog.LevelVar
	live  *siteconf.Live
	c     *converge.Converger
	gen   int64
}

func newSiteNode(t *testing.T, prepare ...string) *siteNode {
	t.Helper()
	n := &siteNode{t: t, state: t.TempDir(), sys: t.TempDir(), level: new(slog.LevelVar), live: new(siteconf.Live)}
	for _, rel := range prepare { // files that make a service present
		n.write(rel, "# the distribution's file\n")
	}
	n.start()
	return n
}

// start makes a new converger on the same roots, as a restarted daemon.
func (n *siteNode) start() {
	n.t.Helper()
	c, err := converge.New(converge.Config{Root: n.state, NodeID: "node_1", Site: converge.Site{
		Root: n.sys, LogLevel: n.level, DefaultLogLevel: slog.LevelInfo, OnChange: n.live.Set}})
	if err != nil {
		n.t.Fatal(err)
	}
	n.c = c
}

func (n *siteNode) write(rel, data string) {
	n.t.Helper()
	p := filepath.Join(n.sys, rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		n.t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
		n.t.Fatal(err)
	}
}

// converge applies site (nil: no site section) at the next generation and
// returns the site section's status.
func (n *siteNode) converge(site *agentv1.SiteSettings) *agentv1.SectionStatus {
	n.t.Helper()
	n.gen++
	ss, _ := n.c.Converge(context.Background(), &agentv1.DesiredState{Generation: n.gen,
		Spec: &agentv1.NodeSpec{Identity: &agentv1.NodeIdentity{NodeId: "node_1"}, Site: site}})
	return states(ss)["site"]
}

// file returns rel's content under the site root, or "<absent>".
func (n *siteNode) file(rel string) string {
	n.t.Helper()
	b, err := os.ReadFile(filepath.Join(n.sys, rel))
	if os.IsNotExist(err) {
		return "<absent>"
	}
	if err != nil {
		n.t.Fatal(err)
	}
	return string(b)
}

// absent fails the test when rel exists under the site root.
func (n *siteNode) absent(rel, what string) {
	n.t.Helper()
	if got := n.file(rel); got != "<absent>" {
		n.t.Errorf("%s: %q", what, got)
	}
}

func strs(v ...string) *agentv1.StringList { return &agentv1.StringList{Values: v} }

const hdr = "# Written by bcd from this node's site settings; edits are overwritten.\n"

func wantConverged(t *testing.T, st *agentv1.SectionStatus, reason ...string) {
	t.Helper()
	if st.GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED {
		t.Errorf("site %v, want converged", st)
	}
	for _, r := range reason {
		if !strings.Contains(st.GetReason(), r) {
			t.Errorf("site reason %q, want %q in it", st.GetReason(), r)
		}
	}
}

func TestSiteNTPAppliedAndReverted(t *testing.T) {
	t.Parallel()
	t.Run("timesyncd", func(t *testing.T) {
		t.Parallel()
		n := newSiteNode(t, siteconf.TimesyncdConf)
		st := n.converge(&agentv1.SiteSettings{NtpServers: strs("ntp1.example", "192.0.2.1")})
		wantConverged(t, st, "ntp_servers: applied ("+siteconf.TimesyncdDropIn, "bcd does not restart it", "dns_servers: unset")
		if got, want := n.file(siteconf.TimesyncdDropIn), hdr+"[Time]\nNTP=ntp1.example 192.0.2.1\n"; got != want {
			t.Errorf("timesyncd drop-in %q, want %q", got, want)
		}
		n.absent(siteconf.ChronyDropIn, "chrony drop-in written without chrony")
		// A hand edit is put back; removing the field removes the drop-in.
		n.write(siteconf.TimesyncdDropIn, "[Time]\nNTP=evil.example\n")
		n.converge(&agentv1.SiteSettings{NtpServers: strs("ntp1.example", "192.0.2.1")})
		if got := n.file(siteconf.TimesyncdDropIn); !strings.Contains(got, "NTP=ntp1.example 192.0.2.1") {
			t.Errorf("edited drop-in not restored: %q", got)
		}
		st = n.converge(&agentv1.SiteSettings{LogLevel: ptr("info")})
		wantConverged(t, st, "ntp_servers: unset")
		n.absent(siteconf.TimesyncdDropIn, "drop-in left after the field was removed")
	})
	t.Run("chrony", func(t *testing.T) {
		t.Parallel()
		n := newSiteNode(t, siteconf.ChronyConf, siteconf.TimesyncdConf)
		st := n.converge(&agentv1.SiteSettings{NtpServers: strs("ntp1.example", "ntp2.example")})
		wantConverged(t, st, "ntp_servers: applied ("+siteconf.ChronyDropIn, "chronyd")
		if got, want := n.file(siteconf.ChronyDropIn), hdr+"server ntp1.example iburst\nserver ntp2.example iburst\n"; got != want {
			t.Errorf("chrony drop-in %q, want %q", got, want)
		}
		n.absent(siteconf.TimesyncdDropIn, "timesyncd drop-in written where chrony is the NTP daemon")
		wantConverged(t, n.converge(nil), "")
		n.absent(siteconf.ChronyDropIn, "chrony drop-in left after the section was removed")
		if got := n.file(siteconf.ChronyConf); got != "# the distribution's file\n" {
			t.Errorf("chrony.conf touched: %q", got)
		}
	})
	t.Run("neither chrony nor timesyncd: failed, nothing written", func(t *testing.T) {
		t.Parallel()
		n := newSiteNode(t)
		st := n.converge(&agentv1.SiteSettings{NtpServers: strs("ntp1.example")})
		if st.GetState() != agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL || !strings.Contains(st.GetReason(), "not applied: ntp_servers") {
			t.Errorf("site %v, want FAILED_TERMINAL naming ntp_servers", st)
		}
		if got := snapshot(t, n.sys); len(got) != 0 {
			t.Errorf("files written: %v", got)
		}
	})
}

func TestSiteDNSAppliedAndReverted(t *testing.T) {
	t.Parallel()
	t.Run("resolved", func(t *testing.T) {
		t.Parallel()
		n := newSiteNode(t, siteconf.ResolvedConf)
		st := n.converge(&agentv1.SiteSettings{DnsServers: strs("192.0.2.53", "2001:db8::53"), SearchDomains: strs("corp.example", "lab.corp.example")})
		wantConverged(t, st, "dns_servers: applied ("+siteconf.ResolvedDropIn, "systemd-resolved reads it at its next restart",
			"search_domains: applied ("+siteconf.ResolvedDropIn)
		if got, want := n.file(siteconf.ResolvedDropIn), hdr+"[Resolve]\nDNS=192.0.2.53 2001:db8::53\nDomains=corp.example lab.corp.example\n"; got != want {
			t.Errorf("resolved drop-in %q, want %q", got, want)
		}
		// Each field reverts on its own.
		wantConverged(t, n.converge(&agentv1.SiteSettings{SearchDomains: strs("corp.example")}), "dns_servers: unset", "search_domains: applied")
		if got, want := n.file(siteconf.ResolvedDropIn), hdr+"[Resolve]\nDomains=corp.example\n"; got != want {
			t.Errorf("resolved drop-in %q, want %q", got, want)
		}
		wantConverged(t, n.converge(&agentv1.SiteSettings{}), "dns_servers: unset", "search_domains: unset")
		n.absent(siteconf.ResolvedDropIn, "drop-in left after the field was removed")
	})
	t.Run("no resolved: failed, resolv.conf untouched, other fields applied", func(t *testing.T) {
		t.Parallel()
		n := newSiteNode(t, "etc/resolv.conf", siteconf.TimesyncdConf)
		st := n.converge(&agentv1.SiteSettings{DnsServers: strs("192.0.2.53"), NtpServers: strs("ntp1.example")})
		if st.GetState() != agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL ||
			!strings.Contains(st.GetReason(), "not applied: dns_servers") || !strings.Contains(st.GetReason(), "systemd-resolved is not installed") ||
			!strings.Contains(st.GetReason(), "ntp_servers: applied") {
			t.Errorf("site %v, want FAILED_TERMINAL naming dns_servers", st)
		}
		if got := n.file("etc/resolv.conf"); got != "# the distribution's file\n" {
			t.Errorf("resolv.conf touched: %q", got)
		}
		if got := n.file(siteconf.TimesyncdDropIn); got == "<absent>" {
			t.Error("NTP not applied next to a DNS failure")
		}
	})
}

func TestSiteProxyAppliedAndReverted(t *testing.T) {
	t.Parallel()
	n := newSiteNode(t)
	st := n.converge(&agentv1.SiteSettings{HttpProxy: ptr("http://proxy.example:3128"), NoProxy: strs("10.0.0.0/8", ".internal.example")})
	wantConverged(t, st, "http_proxy: applied (bcd's own HTTP and "+siteconf.ProxyEnv)
	want := hdr + "HTTP_PROXY=http://proxy.example:3128\nHTTPS_PROXY=http://proxy.example:3128\n" +
		"http_proxy=http://proxy.example:3128\nhttps_proxy=http://proxy.example:3128\n" +
		"NO_PROXY=10.0.0.0/8,.internal.example\nno_proxy=10.0.0.0/8,.internal.example\n"
	if got := n.file(siteconf.ProxyEnv); got != want {
		t.Errorf("proxy.env %q, want %q", got, want)
	}
	// bcd's own HTTP follows the settings (the proxy function only; nothing
	// is dialled).
	proxyFor := func(u string) string {
		r, err := http.NewRequest(http.MethodGet, u, nil)
		if err != nil {
			t.Fatal(err)
		}
		p, err := n.live.Proxy(r)
		if err != nil {
			t.Fatal(err)
		}
		if p == nil {
			return ""
		}
		return p.String()
	}
	if got := proxyFor("https://registry.example/v2/"); got != "http://proxy.example:3128" {
		t.Errorf("proxy for an outside host %q", got)
	}
	if got := proxyFor("https://api.internal.example/"); got != "" {
		t.Errorf("proxy for a no_proxy host %q", got)
	}
	wantConverged(t, n.converge(nil), "")
	n.absent(siteconf.ProxyEnv, "proxy.env left after the field was removed")
	if got := proxyFor("https://registry.example/v2/"); got != "" {
		t.Errorf("proxy after removal %q", got)
	}
}

// lockedBuffer is a log sink the test reads while the logger writes.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func TestSiteLogLevelAppliedLive(t *testing.T) {
	t.Parallel()
	n := newSiteNode(t, siteconf.TimesyncdConf)
	var sink lockedBuffer
	log := slog.New(slog.NewTextHandler(&sink, &slog.HandlerOptions{Level: n.level}))
	var endpoints []string
	n.live.Subscribe(func(s siteconf.Settings) { endpoints = append(endpoints, s.OTLPEndpoint) })

	log.Debug("before")
	st := n.converge(&agentv1.SiteSettings{LogLevel: ptr("debug"), OtlpEndpoint: ptr("otel.example:4317")})
	wantConverged(t, st, "log_level: applied (debug, live)", "otlp_endpoint: applied (otel.example:4317)")
	log.Debug("after")
	if got := sink.String(); strings.Contains(got, "msg=before") || !strings.Contains(got, "msg=after") {
		t.Errorf("log %q: want only the debug line logged after the switch", got)
	}
	if got := n.c.Site(); got.LogLevel != "debug" || got.OTLPEndpoint != "otel.example:4317" {
		t.Errorf("Site() %+v", got)
	}

	// A restarted daemon starts at the applied level, before any spec.
	n.level.Set(slog.LevelInfo)
	n.start()
	if n.level.Level() != slog.LevelDebug {
		t.Errorf("restarted at level %s, want DEBUG", n.level.Level())
	}

	// Removed: back to the default, and the exporter hears "no endpoint".
	wantConverged(t, n.converge(&agentv1.SiteSettings{NtpServers: strs("ntp1.example")}), "log_level: unset", "otlp_endpoint: unset")
	log.Debug("removed")
	if n.level.Level() != slog.LevelInfo || strings.Contains(sink.String(), "msg=removed") {
		t.Errorf("level %s after removal, want INFO", n.level.Level())
	}
	if got, want := strings.Join(endpoints, ","), ",otel.example:4317,otel.example:4317,"; got != want {
		t.Errorf("endpoints subscribers saw %q, want %q (initial, applied, restart, removed)", got, want)
	}
}

// TestSiteTelemetryIntervalAppliedLive: the section's telemetry_interval
// reaches the daemon's subscribers (the exporter) with its status, survives a
// restart, and removed it is 0 again (the daemon's --telemetry-interval).
func TestSiteTelemetryIntervalAppliedLive(t *testing.T) {
	t.Parallel()
	n := newSiteNode(t)
	var mu sync.Mutex
	var seen []time.Duration
	n.live.Subscribe(func(s siteconf.Settings) { mu.Lock(); seen = append(seen, s.TelemetryInterval); mu.Unlock() })

	st := n.converge(&agentv1.SiteSettings{TelemetryInterval: durationpb.New(90 * time.Second)})
	wantConverged(t, st, "telemetry_interval: applied (1m30s, live)")
	if got := n.c.Site().TelemetryInterval; got != 90*time.Second {
		t.Errorf("Site().TelemetryInterval %s, want 1m30s", got)
	}
	n.start() // a restarted daemon reads it back from site.json
	if got := n.c.Site().TelemetryInterval; got != 90*time.Second {
		t.Errorf("after a restart Site().TelemetryInterval %s, want 1m30s", got)
	}
	wantConverged(t, n.converge(&agentv1.SiteSettings{LogLevel: ptr("warn")}), "telemetry_interval: unset (bcd's --telemetry-interval)")
	mu.Lock()
	defer mu.Unlock()
	if want := []time.Duration{0, 90 * time.Second, 90 * time.Second, 0}; !slices.Equal(seen, want) {
		t.Errorf("subscribers saw %v, want %v (initial, applied, restart, removed)", seen, want)
	}
}

// snapshot is every file under roots with its content and modification time.
func snapshot(t *testing.T, roots ...string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, root := range roots {
		err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return err
			}
			info, err := d.Info()
			if err != nil {
				return err
			}
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			out[p] = info.ModTime().Format(time.RFC3339Nano) + " " + string(b)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return out
}

func TestSiteApplyIsIdempotent(t *testing.T) {
	t.Parallel()
	n := newSiteNode(t, siteconf.ResolvedConf, siteconf.TimesyncdConf)
	site := &agentv1.SiteSettings{
		Gateways: strs("gw.example:443"), NtpServers: strs("ntp1.example"), DnsServers: strs("192.0.2.53"), SearchDomains: strs("corp.example"),
		HttpProxy: ptr("http://proxy.example:3128"), NoProxy: strs(".internal.example"),
		OtlpEndpoint: ptr("otel.example:4317"), LogLevel: ptr("warn"),
	}
	first := n.converge(site)
	wantConverged(t, first, "ntp_servers: applied", "dns_servers: applied", "search_domains: applied", "http_proxy: applied", "otlp_endpoint: applied", "log_level: applied")
	// The section's own files only: the generation files change every time.
	sysBefore := snapshot(t, n.sys)
	siteBefore := snapshot(t, filepath.Join(n.state, converge.SiteFile))
	if len(sysBefore) != 5 { // resolved.conf, timesyncd.conf and three drop-ins
		t.Fatalf("files under the site root: %v", sysBefore)
	}
	second := n.converge(site)
	if second.GetReason() != first.GetReason() || second.GetState() != first.GetState() {
		t.Errorf("second status %v, first %v", second, first)
	}
	for name, got := range map[string][2]map[string]string{
		"site root": {sysBefore, snapshot(t, n.sys)}, "site.json": {siteBefore, snapshot(t, filepath.Join(n.state, converge.SiteFile))},
	} {
		if len(got[0]) != len(got[1]) {
			t.Errorf("%s: files %d then %d", name, len(got[0]), len(got[1]))
		}
		for p, v := range got[0] {
			if got[1][p] != v {
				t.Errorf("%s: %s changed by the second converge", name, p)
			}
		}
	}
	// And planning finds nothing to do.
	for _, h := range n.c.Handlers() {
		if h.Section() != "site" {
			continue
		}
		p, err := h.Plan(converge.Current{Root: n.state, NodeID: "node_1"}, &agentv1.NodeSpec{Site: site})
		if err != nil || len(p.Actions) > 0 || len(p.Steps) > 0 {
			t.Errorf("plan after converging: %+v, %v", p, err)
		}
	}
}

// TestSiteRefusesConfigInjection: a value that would put a second line or
// directive into a configuration file is refused, naming the field, and
// nothing is written.
func TestSiteRefusesConfigInjection(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		site  *agentv1.SiteSettings
		field string
	}{
		"ntp newline":        {&agentv1.SiteSettings{NtpServers: strs("ntp1.example\nserver evil.example")}, "ntp_servers"},
		"ntp space":          {&agentv1.SiteSettings{NtpServers: strs("ntp1.example iburst maxpoll 1")}, "ntp_servers"},
		"dns not an IP":      {&agentv1.SiteSettings{DnsServers: strs("192.0.2.1\nDNSSEC=no")}, "dns_servers"},
		"search newline":     {&agentv1.SiteSettings{SearchDomains: strs("corp.example\nDNSSEC=no")}, "search_domains"},
		"proxy newline":      {&agentv1.SiteSettings{HttpProxy: ptr("http://p.example:3128\nLD_PRELOAD=/tmp/x.so")}, "http_proxy"},
		"proxy scheme":       {&agentv1.SiteSettings{HttpProxy: ptr("file:///etc/passwd")}, "http_proxy"},
		"no_proxy comma":     {&agentv1.SiteSettings{HttpProxy: ptr("http://p.example:3128"), NoProxy: strs("a.example,b.example")}, "no_proxy"},
		"too many servers":   {&agentv1.SiteSettings{NtpServers: strs(strings.Split(strings.Repeat("n.example,", siteconf.MaxServers+1), ",")[:siteconf.MaxServers+1]...)}, "ntp_servers"},
		"otlp not hostport":  {&agentv1.SiteSettings{OtlpEndpoint: ptr("http://otel.example")}, "otlp_endpoint"},
		"interval zero":      {&agentv1.SiteSettings{TelemetryInterval: durationpb.New(0)}, "telemetry_interval"},
		"interval too short": {&agentv1.SiteSettings{TelemetryInterval: durationpb.New(500 * time.Millisecond)}, "telemetry_interval"},
		"interval too long":  {&agentv1.SiteSettings{TelemetryInterval: durationpb.New(2 * time.Hour)}, "telemetry_interval"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			n := newSiteNode(t, siteconf.ResolvedConf)
			st := n.converge(tc.site)
			if st.GetState() != agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL || !strings.Contains(st.GetReason(), "invalid site section: "+tc.field) {
				t.Errorf("site %v, want FAILED_TERMINAL naming %s", st, tc.field)
			}
			if got := snapshot(t, n.sys); len(got) != 1 {
				t.Errorf("files written: %v", got)
			}
		})
	}
}
