package config

import (
	"cmp"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Health configures the health job's remediation ladder (controllers
// role): gpu.reset, then node.reboot of the drained node, then failed with
// NeedsRepair.
type Health struct {
	// MaxRemediationsPerNode is how many ladders may start on one node in 7
	// days; the next one latches NeedsRepair instead, until
	// nodes.clearRepair. Default 2, 1 to 100.
	MaxRemediationsPerNode int `yaml:"maxRemediationsPerNode"`
	// MaxConcurrentRemediations is how many ladder steps may run at once in
	// one pool; others wait. Default 1, 1 to 10000.
	MaxConcurrentRemediations int `yaml:"maxConcurrentRemediations"`
	// MaxRepairClearsPerNode is how many times nodes.clearRepair may clear
	// one node in 7 days (each clear resets the node's remediation budget,
	// never this one); the next is RATE_LIMITED. Default 3, 1 to 100.
	MaxRepairClearsPerNode int `yaml:"maxRepairClearsPerNode"`
}

func (h *Health) defaults() {
	h.MaxRemediationsPerNode = cmp.Or(h.MaxRemediationsPerNode, 2)
	h.MaxConcurrentRemediations = cmp.Or(h.MaxConcurrentRemediations, 1)
	h.MaxRepairClearsPerNode = cmp.Or(h.MaxRepairClearsPerNode, 3)
}

func (h *Health) validate() []error {
	var errs []error
	if n := h.MaxRemediationsPerNode; n < 0 || n > 100 {
		errs = append(errs, fault.New(fault.InvalidConfig, "health.maxRemediationsPerNode", "expected 1 to 100, got %d", n))
	}
	if n := h.MaxConcurrentRemediations; n < 0 || n > 10000 {
		errs = append(errs, fault.New(fault.InvalidConfig, "health.maxConcurrentRemediations", "expected 1 to 10000, got %d", n))
	}
	if n := h.MaxRepairClearsPerNode; n < 0 || n > 100 {
		errs = append(errs, fault.New(fault.InvalidConfig, "health.maxRepairClearsPerNode", "expected 1 to 100, got %d", n))
	}
	return errs
}
