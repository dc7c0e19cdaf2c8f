package config

import (
	"cmp"
	"time"

	"github.com/bettercompute/bettercompute/pkg/capacity"
	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Placers a configuration may name; only [PlacerPoolLease] is built.
const (
	PlacerPoolLease = "pool-lease"
)

// Capacity configures GPU reservations: the placer and the capacity
// reconcilers of the scheduler role.
type Capacity struct {
	// Placer places pending reservations; default (and the only one built)
	// "pool-lease": pool-sharded under the scheduler membership's leases.
	Placer string `yaml:"placer"`
	// LostNode is what the placer does with bookings on a lost node: "wait"
	// (the default: keep them, say so in the reservation's reason),
	// "replace" (book the same count elsewhere) or "fail" (fail the
	// reservation).
	LostNode string `yaml:"lostNode"`
	// LostAfter is the deprecated alias of [Nodes.LostAfter]: defaults fill
	// it with nodes.lostAfter, and nodes.lostAfter from it when only it is
	// set; both set and different is INVALID_CONFIG.
	LostAfter Duration `yaml:"lostAfter"`
	// TickEvery is how often the placer looks for due work (starts, end
	// times, lost nodes); default 5s.
	TickEvery Duration `yaml:"tickEvery"`
	// RollupEvery is how often capacity.rollup and capacity.usage recount;
	// default 30s.
	RollupEvery Duration `yaml:"rollupEvery"`
}

func (c *Capacity) defaults() {
	c.Placer = cmp.Or(c.Placer, PlacerPoolLease)
	c.LostNode = cmp.Or(c.LostNode, capacity.LostNodeWait)
	c.TickEvery = cmp.Or(c.TickEvery, Duration(5*time.Second))
	c.RollupEvery = cmp.Or(c.RollupEvery, Duration(30*time.Second))
}

// validate returns an error per bad field: UNSUPPORTED for a placer that
// is not built yet, INVALID_CONFIG for the rest.
func (c *Capacity) validate() []error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, fault.New(fault.InvalidConfig, field, format, args...))
	}
	if c.Placer != "" && c.Placer != PlacerPoolLease {
		errs = append(errs, fault.New(fault.Unsupported, "capacity.placer", "placer %q is not built yet in this release (built: %s)", c.Placer, PlacerPoolLease))
	}
	if c.LostNode != "" && !capacity.ValidLostNode(c.LostNode) {
		bad("capacity.lostNode", "expected wait, replace or fail, got %q", c.LostNode)
	}
	for field, d := range map[string]Duration{"capacity.lostAfter": c.LostAfter, "capacity.tickEvery": c.TickEvery, "capacity.rollupEvery": c.RollupEvery} {
		if d < 0 {
			bad(field, "expected a positive duration, got %s", d.Std())
		}
	}
	return errs
}
