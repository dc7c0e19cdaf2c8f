package config

import (
	"cmp"
	"time"

	"github.com/bettercompute/bettercompute/pkg/clientaddr"
	"github.com/bettercompute/bettercompute/pkg/fault"
)

// MCP configures the api role's Model Context Protocol server (at /mcp, and
// `better-compute mcp` on stdio).
type MCP struct {
	// ReadOnly offers only the read tools (nodes_list, nodes_get,
	// commands_get, reservations_get, capacity_get, events_list): an agent
	// connected to this server can look but not change anything, whatever
	// its key's policies allow.
	ReadOnly bool `yaml:"readOnly"`
}

// Console configures the web console's server-side sessions: the cookie
// holds only a session id, the session ends at sign-out, after Idle without
// a request, and Lifetime after sign-in, whichever comes first.
type Console struct {
	// SessionIdle ends a session this long after its last request; default
	// 30m.
	SessionIdle Duration `yaml:"sessionIdle"`
	// SessionLifetime ends a session this long after sign-in, however
	// active; default 12h.
	SessionLifetime Duration `yaml:"sessionLifetime"`
}

// Bounds of the console's session settings.
const (
	minConsoleSession = time.Minute
	maxConsoleSession = 30 * 24 * time.Hour
	// maxTrustedProxies bounds server.trustedProxies.
	maxTrustedProxies = 256
)

func (c *Console) defaults() {
	c.SessionIdle = cmp.Or(c.SessionIdle, Duration(30*time.Minute))
	c.SessionLifetime = cmp.Or(c.SessionLifetime, Duration(12*time.Hour))
}

// validateInterfaces checks server.trustedProxies and the console's
// session settings.
func (c *Config) validateInterfaces() []error {
	var errs []error
	if n := len(c.Server.TrustedProxies); n > maxTrustedProxies {
		errs = append(errs, fault.New(fault.InvalidConfig, "server.trustedProxies", "at most %d entries, got %d", maxTrustedProxies, n))
	} else if _, err := clientaddr.Parse(c.Server.TrustedProxies); err != nil {
		errs = append(errs, fault.New(fault.InvalidConfig, "server.trustedProxies", "%v", err))
	}
	for _, d := range []struct {
		field string
		v     Duration
	}{{"console.sessionIdle", c.Console.SessionIdle}, {"console.sessionLifetime", c.Console.SessionLifetime}} {
		if d.v.Std() < minConsoleSession || d.v.Std() > maxConsoleSession {
			errs = append(errs, fault.New(fault.InvalidConfig, d.field, "expected a duration from %s to %s, got %s", minConsoleSession, maxConsoleSession, d.v.Std()))
		}
	}
	if c.Console.SessionIdle > c.Console.SessionLifetime {
		errs = append(errs, fault.New(fault.InvalidConfig, "console.sessionIdle", "at most console.sessionLifetime (%s), got %s", c.Console.SessionLifetime.Std(), c.Console.SessionIdle.Std()))
	}
	return errs
}
