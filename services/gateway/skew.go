package gateway

import (
	"fmt"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/proto/agentrelease"
)

// skewWindow is the versions of bcd the gateway opens sessions for
// (gateway.agentVersions); a nil end is open.
type skewWindow struct {
	oldest, newest *agentrelease.Version
}

func newSkewWindow(oldest, newest string) (skewWindow, error) {
	var w skewWindow
	for _, e := range []struct {
		name, v string
		to      **agentrelease.Version
	}{{"oldest", oldest, &w.oldest}, {"newest", newest, &w.newest}} {
		if e.v == "" {
			continue
		}
		v, err := agentrelease.ParseVersion(e.v)
		if err != nil {
			return w, fmt.Errorf("gateway: %s agent version: %w", e.name, err)
		}
		*e.to = &v
	}
	return w, nil
}

// admit refuses a node agent's version outside the window, AGENT_TOO_OLD or
// AGENT_TOO_NEW with the field hello.agent_version; nil admits it.
func (w skewWindow) admit(version string) *fault.Error {
	return w.admitAs(version, "hello.agent_version")
}

// admitAs is admit with the error naming field (a site agent's Hello says
// hello.version).
func (w skewWindow) admitAs(version, field string) *fault.Error {
	if w.oldest == nil && w.newest == nil {
		return nil
	}
	v, err := agentrelease.ParseVersion(version)
	if err != nil {
		return fault.New(fault.AgentTooOld, field, "bcd %q is not a release version; this gateway accepts %s", version, w)
	}
	if w.oldest != nil && v.Compare(*w.oldest) < 0 {
		return fault.New(fault.AgentTooOld, field, "bcd %s is older than this gateway accepts (%s)", v, w)
	}
	if w.newest != nil && v.Compare(*w.newest) > 0 {
		return fault.New(fault.AgentTooNew, field, "bcd %s is newer than this gateway accepts (%s)", v, w)
	}
	return nil
}

func (w skewWindow) String() string {
	lo, hi := "any", "any"
	if w.oldest != nil {
		lo = w.oldest.String()
	}
	if w.newest != nil {
		hi = w.newest.String()
	}
	return lo + " to " + hi
}
