package config

import (
	"cmp"
	"time"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Fleet configures the fleet.drift job (controllers role): the Drifted
// condition of each node.
type Fleet struct {
	// StuckAfter is how long a section of a node's desired state may stay
	// not converged (progressing, or failed and retried) before the node
	// is Drifted. Default 15m, 1m to 168h.
	StuckAfter Duration `yaml:"stuckAfter"`
	// DriftEvery is how often fleet.drift looks at every pool (a stuck
	// section is seen within one period of fleet.stuckAfter). Default
	// 1m, 1s to 1h.
	DriftEvery Duration `yaml:"driftEvery"`
}

func (f *Fleet) defaults() {
	f.StuckAfter = cmp.Or(f.StuckAfter, Duration(15*time.Minute))
	f.DriftEvery = cmp.Or(f.DriftEvery, Duration(time.Minute))
}

func (f *Fleet) validate() []error {
	var errs []error
	if d := f.StuckAfter.Std(); d < time.Minute || d > 168*time.Hour {
		errs = append(errs, fault.New(fault.InvalidConfig, "fleet.stuckAfter", "expected 1m to 168h, got %s", d))
	}
	if d := f.DriftEvery.Std(); d < time.Second || d > time.Hour {
		errs = append(errs, fault.New(fault.InvalidConfig, "fleet.driftEvery", "expected 1s to 1h, got %s", d))
	}
	return errs
}
