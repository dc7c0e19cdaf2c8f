package config

import (
	"cmp"
	"math"
	"time"

	"github.com/bettercompute/bettercompute/pkg/brakes"
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
	// EvictionRate is how many lost nodes per second, fleet-wide, the
	// placer's replace and fail and the remediation ladder may act on (the
	// eviction brakes' token bucket); default 0.1.
	EvictionRate float64 `yaml:"evictionRate"`
	// EvictionBurst is how many lost nodes may be acted on at once above
	// the rate; default 1.
	EvictionBurst int `yaml:"evictionBurst"`
	// UnhealthyThreshold: while more than this fraction of a pool's nodes,
	// or of the nodes one gateway last held, are not ready, nothing acts on
	// that scope's lost nodes (fleet.eviction_paused); more than 0, at most
	// 1; default 0.55.
	UnhealthyThreshold float64 `yaml:"unhealthyThreshold"`
	// TenantEvictionRate is how many of one tenant's lost nodes per second
	// may be acted on (a bucket per tenant under evictionRate, so one
	// tenant cannot spend the fleet's); more than 0, at most evictionRate;
	// default half of evictionRate.
	TenantEvictionRate float64 `yaml:"tenantEvictionRate"`
	// TenantEvictionBurst is how many of one tenant's at once; at least 1,
	// at most evictionBurst; default half of evictionBurst, at least 1.
	TenantEvictionBurst int `yaml:"tenantEvictionBurst"`
	// LongLostAfter: a node Lost for longer than this leaves the eviction
	// breakers' counts, so nodes that never return cannot hold a breaker
	// open for ever; more than lostAfter; default 1h.
	LongLostAfter Duration `yaml:"longLostAfter"`
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
	n.EvictionRate = cmp.Or(n.EvictionRate, brakes.DefaultRate)
	n.EvictionBurst = cmp.Or(n.EvictionBurst, brakes.DefaultBurst)
	n.UnhealthyThreshold = cmp.Or(n.UnhealthyThreshold, brakes.DefaultUnhealthyThreshold)
	if n.TenantEvictionRate == 0 && n.EvictionRate > 0 {
		n.TenantEvictionRate = n.EvictionRate / 2
	}
	if n.TenantEvictionBurst == 0 && n.EvictionBurst > 0 {
		n.TenantEvictionBurst = max(1, n.EvictionBurst/2)
	}
	n.LongLostAfter = cmp.Or(n.LongLostAfter, Duration(brakes.DefaultLongLostAfter))
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
	// Zero is "the default" until defaults fill it; NaN fails every test.
	if !(n.EvictionRate >= 0) || math.IsInf(n.EvictionRate, 0) {
		bad("nodes.evictionRate", "expected more than 0 nodes per second, got %g", n.EvictionRate)
	}
	if n.EvictionBurst < 0 {
		bad("nodes.evictionBurst", "expected at least 1 node, got %d", n.EvictionBurst)
	}
	if !(n.UnhealthyThreshold >= 0 && n.UnhealthyThreshold <= 1) {
		bad("nodes.unhealthyThreshold", "expected a fraction of nodes more than 0 and at most 1 (0.55 is 55 %%), got %g", n.UnhealthyThreshold)
	}
	if !(n.TenantEvictionRate >= 0) || (n.EvictionRate > 0 && n.TenantEvictionRate > n.EvictionRate) {
		bad("nodes.tenantEvictionRate", "expected more than 0 and at most nodes.evictionRate (%g) nodes per second, got %g", n.EvictionRate, n.TenantEvictionRate)
	}
	if n.TenantEvictionBurst < 0 || (n.EvictionBurst > 0 && n.TenantEvictionBurst > n.EvictionBurst) {
		bad("nodes.tenantEvictionBurst", "expected at least 1 and at most nodes.evictionBurst (%d) nodes, got %d", n.EvictionBurst, n.TenantEvictionBurst)
	}
	if n.LongLostAfter < 0 || (n.LongLostAfter > 0 && n.LostAfter > 0 && n.LongLostAfter <= n.LostAfter) {
		bad("nodes.longLostAfter", "expected more than nodes.lostAfter (%s), got %s", n.LostAfter.Std(), n.LongLostAfter.Std())
	}
	if c.LostAfter > 0 && n.LostAfter > 0 && c.LostAfter != n.LostAfter {
		bad("capacity.lostAfter", "is a deprecated alias of nodes.lostAfter (%s); set only nodes.lostAfter, got %s", n.LostAfter.Std(), c.LostAfter.Std())
	}
	return errs
}

// Brakes is the eviction brakes' configuration (pkg/brakes) from
// nodes.evictionRate, nodes.evictionBurst, nodes.unhealthyThreshold,
// nodes.tenantEvictionRate, nodes.tenantEvictionBurst and
// nodes.longLostAfter:
// what every actor on lost nodes passes to [brakes.Allow].
func (n Nodes) Brakes() brakes.Config {
	return brakes.Config{Rate: n.EvictionRate, Burst: n.EvictionBurst, UnhealthyThreshold: n.UnhealthyThreshold,
		TenantRate: n.TenantEvictionRate, TenantBurst: n.TenantEvictionBurst, LongLostAfter: n.LongLostAfter.Std()}
}
