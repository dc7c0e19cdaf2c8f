package sitespec_test

import (
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/sitespec"
)

// TestValidate: good settings pass; each value that could add a line or
// directive to a config file, or that the daemon could not use, is refused
// naming its field.
func TestValidate(t *testing.T) {
	good := sitespec.Settings{NTPServers: []string{"ntp1.example", "10.0.0.1"}, DNSServers: []string{"10.0.0.53", "fd00::53"},
		SearchDomains: []string{"corp.example"}, HTTPProxy: "http://proxy.example:3128", NoProxy: []string{".corp.example"},
		OTLPEndpoint: "http://collector.example:4317", LogLevel: "debug", TelemetryInterval: ptr(time.Second)}
	if bad := sitespec.Validate(good); len(bad) != 0 {
		t.Fatalf("good settings refused: %v", bad)
	}
	for _, c := range []struct {
		field string
		s     sitespec.Settings
	}{
		{"ntp_servers", sitespec.Settings{NTPServers: []string{"ntp1 server evil"}}},
		{"ntp_servers", sitespec.Settings{NTPServers: make([]string, sitespec.MaxServers+1)}},
		{"dns_servers", sitespec.Settings{DNSServers: []string{"resolver.example"}}},
		{"search_domains", sitespec.Settings{SearchDomains: []string{"10.0.0.1"}}},
		{"search_domains", sitespec.Settings{SearchDomains: []string{"a#b"}}},
		{"http_proxy", sitespec.Settings{HTTPProxy: "socks5://proxy:1080"}},
		{"http_proxy", sitespec.Settings{HTTPProxy: "http://proxy:3128/path"}},
		{"no_proxy", sitespec.Settings{NoProxy: []string{"a,b"}}},
		{"otlp_endpoint", sitespec.Settings{OTLPEndpoint: "collector.example"}},
		{"otlp_endpoint", sitespec.Settings{OTLPEndpoint: "collector.example:99999"}},
		{"log_level", sitespec.Settings{LogLevel: "loud"}},
		{"telemetry_interval", sitespec.Settings{TelemetryInterval: ptr(0)}},
		{"telemetry_interval", sitespec.Settings{TelemetryInterval: ptr(999 * time.Millisecond)}},
		{"telemetry_interval", sitespec.Settings{TelemetryInterval: ptr(time.Hour + time.Second)}},
		{"telemetry_interval", sitespec.Settings{TelemetryInterval: ptr(-time.Minute)}},
	} {
		bad := sitespec.Validate(c.s)
		if len(bad) != 1 || bad[0].Field != c.field {
			t.Errorf("%+v: %v, want one problem on %s", c.s, bad, c.field)
		}
	}
}

func ptr(d time.Duration) *time.Duration { return &d }

// TestFromProtoInterval: telemetry_interval unset reads as nil (the
// daemon's flag), the bounds themselves pass, and a malformed Duration is
// refused, not read as whatever it would convert to.
func TestFromProtoInterval(t *testing.T) {
	if got := sitespec.FromProto(&agentv1.SiteSettings{}).TelemetryInterval; got != nil {
		t.Errorf("unset telemetry_interval read as %v, want nil", *got)
	}
	for _, d := range []time.Duration{sitespec.MinTelemetryInterval, 10 * time.Second, sitespec.MaxTelemetryInterval} {
		s := sitespec.FromProto(&agentv1.SiteSettings{TelemetryInterval: durationpb.New(d)})
		if s.TelemetryInterval == nil || *s.TelemetryInterval != d || len(sitespec.Validate(s)) != 0 {
			t.Errorf("telemetry_interval %s: read %v, problems %v", d, s.TelemetryInterval, sitespec.Validate(s))
		}
	}
	bad := sitespec.FromProto(&agentv1.SiteSettings{TelemetryInterval: &durationpb.Duration{Seconds: 10, Nanos: -1}})
	if p := sitespec.Validate(bad); len(p) != 1 || p[0].Field != "telemetry_interval" {
		t.Errorf("malformed Duration: %v, want a problem on telemetry_interval", p)
	}
}
