package config_test

import (
	"slices"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/config"
)

func TestTrustedProxiesAndConsoleSessions(t *testing.T) {
	t.Parallel()
	c := &config.Config{}
	c.Defaults()
	if c.Console.SessionIdle.Std() != 30*time.Minute || c.Console.SessionLifetime.Std() != 12*time.Hour {
		t.Fatalf("console defaults %+v", c.Console)
	}
	c.Server.TrustedProxies = []string{"10.0.0.0/8", "192.0.2.1", "2001:db8::/32"}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		mod   func(*config.Config)
		field string
	}{
		{"proxy not a CIDR", func(c *config.Config) { c.Server.TrustedProxies = []string{"ingress.internal"} }, "server.trustedProxies"},
		{"too many proxies", func(c *config.Config) { c.Server.TrustedProxies = make([]string, 257) }, "server.trustedProxies"},
		{"idle too short", func(c *config.Config) { c.Console.SessionIdle = config.Duration(time.Second) }, "console.sessionIdle"},
		{"idle past lifetime", func(c *config.Config) {
			c.Console.SessionIdle = config.Duration(2 * time.Hour)
			c.Console.SessionLifetime = config.Duration(time.Hour)
		}, "console.sessionIdle"},
		{"lifetime too long", func(c *config.Config) { c.Console.SessionLifetime = config.Duration(365 * 24 * time.Hour) }, "console.sessionLifetime"},
	} {
		c := &config.Config{}
		c.Defaults()
		tc.mod(c)
		if got := fields(t, c.Validate()); !slices.Equal(got, []string{tc.field}) {
			t.Errorf("%s: fields %v, want [%s]", tc.name, got, tc.field)
		}
	}
}
