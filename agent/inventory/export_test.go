package inventory

import "github.com/NVIDIA/go-nvml/pkg/nvml"

// NVMLOf is c's NVML (the mock wrapper for a mock), for tests that call
// it directly.
func NVMLOf(c *Collector) nvml.Interface { return c.lib }
