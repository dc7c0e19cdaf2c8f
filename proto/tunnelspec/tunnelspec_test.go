package tunnelspec_test

import (
	"strings"
	"testing"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/tunnelspec"
)

func TestAllows(t *testing.T) {
	loop := &agentv1.TunnelSettings{Allow: []*agentv1.TunnelRule{
		{Cidr: "127.0.0.1/32", PortMin: 1024, PortMax: 65535},
		{Host: "db.internal", PortMin: 5432},
		{UnixPath: "/run/app.sock"},
	}}
	for _, c := range []struct {
		s      *agentv1.TunnelSettings
		target string
		ok     bool
	}{
		{nil, "127.0.0.1:22", false}, // empty allows nothing
		{loop, "127.0.0.1:2222", true},
		{loop, "127.0.0.1:22", false}, // below the range
		{loop, "127.0.0.2:2222", false},
		{loop, "localhost:2222", false}, // a name never matches a CIDR
		{loop, "DB.internal:5432", true},
		{loop, "db.internal:5433", false},
		{loop, "unix:/run/app.sock", true},
		{loop, "unix:/run/../run/app.sock", false},
		{loop, "unix:/run/other.sock", false},
		{loop, "127.0.0.1", false},
		{loop, "127.0.0.1:0", false},
		{loop, "[::ffff:127.0.0.1]:2222", true},
		{&agentv1.TunnelSettings{Allow: loop.Allow, Narrow: []*agentv1.TunnelRule{{Cidr: "127.0.0.1/32", PortMin: 2222}}}, "127.0.0.1:2222", true},
		{&agentv1.TunnelSettings{Allow: loop.Allow, Narrow: []*agentv1.TunnelRule{{Cidr: "127.0.0.1/32", PortMin: 2222}}}, "127.0.0.1:2223", false},
		// narrowing cannot widen
		{&agentv1.TunnelSettings{Allow: loop.Allow, Narrow: []*agentv1.TunnelRule{{Cidr: "0.0.0.0/0", PortMin: 1, PortMax: 65535}}}, "10.0.0.1:22", false},
		// an invalid section allows nothing
		{&agentv1.TunnelSettings{Allow: []*agentv1.TunnelRule{{Cidr: "127.0.0.1/32", PortMin: 1, PortMax: 65535}, {Host: "x", Cidr: "10.0.0.0/8", PortMin: 1}}}, "127.0.0.1:22", false},
	} {
		err := tunnelspec.Allows(c.s, c.target)
		if (err == nil) != c.ok {
			t.Errorf("Allows(%v, %q) = %v, want ok=%v", c.s, c.target, err, c.ok)
		}
	}
}

func TestValidate(t *testing.T) {
	rules := make([]*agentv1.TunnelRule, tunnelspec.MaxRules+1)
	for i := range rules {
		rules[i] = &agentv1.TunnelRule{Host: "h", PortMin: 1}
	}
	for _, c := range []struct {
		s    *agentv1.TunnelSettings
		want string
	}{
		{&agentv1.TunnelSettings{Allow: rules}, "at most 64"},
		{&agentv1.TunnelSettings{Allow: []*agentv1.TunnelRule{{Host: "h"}}}, "ports"},
		{&agentv1.TunnelSettings{Allow: []*agentv1.TunnelRule{{Host: "h", PortMin: 10, PortMax: 9}}}, "ports"},
		{&agentv1.TunnelSettings{Allow: []*agentv1.TunnelRule{{Cidr: "10.0.0.0/33", PortMin: 1}}}, "cidr"},
		{&agentv1.TunnelSettings{Allow: []*agentv1.TunnelRule{{UnixPath: "relative", PortMin: 1}}}, "unixPath"},
		{&agentv1.TunnelSettings{Narrow: []*agentv1.TunnelRule{{}}}, "exactly one"},
		{&agentv1.TunnelSettings{Allow: []*agentv1.TunnelRule{{Host: "a b", PortMin: 1}}}, "host"},
	} {
		bad := tunnelspec.Validate(c.s)
		if len(bad) == 0 || !strings.Contains(strings.Join(bad, ";"), c.want) {
			t.Errorf("Validate(%v) = %v, want %q", c.s, bad, c.want)
		}
	}
	if bad := tunnelspec.Validate(&agentv1.TunnelSettings{Allow: []*agentv1.TunnelRule{{Cidr: "::1/128", PortMin: 22}, {Host: "::1", PortMin: 22}}}); len(bad) > 0 {
		t.Errorf("valid IPv6 rules refused: %v", bad)
	}
}
