package sitespec_test

import (
	"testing"

	"github.com/bettercompute/bettercompute/proto/sitespec"
)

// TestValidate: good settings pass; each value that could add a line or
// directive to a config file, or that the daemon could not use, is refused
// naming its field.
func TestValidate(t *testing.T) {
	good := sitespec.Settings{NTPServers: []string{"ntp1.example", "10.0.0.1"}, DNSServers: []string{"10.0.0.53", "fd00::53"},
		SearchDomains: []string{"corp.example"}, HTTPProxy: "http://proxy.example:3128", NoProxy: []string{".corp.example"},
		OTLPEndpoint: "http://collector.example:4317", LogLevel: "debug"}
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
	} {
		bad := sitespec.Validate(c.s)
		if len(bad) != 1 || bad[0].Field != c.field {
			t.Errorf("%+v: %v, want one problem on %s", c.s, bad, c.field)
		}
	}
}
