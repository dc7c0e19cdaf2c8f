package config

import (
	"cmp"
	"time"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Nodes configures node liveness (the liveness job of the controllers
// role) and the brakes on acting on lost nodes.
type Nodes struct {
	// NotReadyAfter is how long a node may go without a heartbeat through
	// any gateway before its Ready condition becomes Unknown; default 40s.
	NotReadyAfter Duration `yaml:"notReadyAfter"`
	// LostAfter is how long before it becomes Lost: the placer then stops
	// booking it and applies capacity.lostNode to its bookings; default 2m.
	// It is the one setting for both; capacity.lostAfter is its deprecated
	// alias.
	LostAfter Duration `yaml:"lostAfter"`
	// LivenessEvery is how often the liveness job looks for nodes whose
	// Ready condition must change; default 5s.
	LivenessEvery Duration `yaml:"livenessEvery"`
}

// defaults fills Nodes, taking lostAfter from the deprecated
// capacity.lostAfter when only that is set, and setting capacity.lostAfter
// to it, so every reader sees one value. Both set and different is left for
// validate to refuse.
func (n *Nodes) defaults(c *Capacity) {
	n.NotReadyAfter = cmp.Or(n.NotReadyAfter, Duration(40*time.Second))
	n.LostAfter = cmp.Or(n.LostAfter, c.LostAfter, Duration(2*time.Minute))
	c.LostAfter = cmp.Or(c.LostAfter, n.LostAfter)
	n.LivenessEvery = cmp.Or(n.LivenessEvery, Duration(5*time.Second))
}

func (n *Nodes) validate(c *Capacity) []error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, fault.New(fault.InvalidConfig, field, format, args...))
	}
	for _, f := range []struct {
		name string
		d    Duration
	}{{"nodes.notReadyAfter", n.NotReadyAfter}, {"nodes.lostAfter", n.LostAfter}, {"nodes.livenessEvery", n.LivenessEvery}} {
		if f.d < 0 {
			bad(f.name, "expected a positive duration, got %s", f.d.Std())
		}
	}
	if n.NotReadyAfter > 0 && n.LostAfter > 0 && n.LostAfter <= n.NotReadyAfter {
		bad("nodes.lostAfter", "expected more than nodes.notReadyAfter (%s), got %s", n.NotReadyAfter.Std(), n.LostAfter.Std())
	}
	if c.LostAfter > 0 && n.LostAfter > 0 && c.LostAfter != n.LostAfter {
		bad("capacity.lostAfter", "is a deprecated alias of nodes.lostAfter (%s); set only nodes.lostAfter, got %s", n.LostAfter.Std(), c.LostAfter.Std())
	}
	return errs
}
