package config

import (
	"cmp"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Tunnels bounds port forwards (docs/tunnels.md).
type Tunnels struct {
	// PerNode and PerTenant bound the tunnels not yet closed, per node and
	// per tenant: tunnels.open answers RATE_LIMITED above them; defaults
	// 16 and 256.
	PerNode   int `yaml:"perNode"`
	PerTenant int `yaml:"perTenant"`
	// NodeBytesPerSecond and TenantBytesPerSecond shape the bytes an API
	// process relays for one node's tunnels, and one tenant's, each
	// direction apart; 0 (the default) shapes nothing. Each API process
	// shapes its own relays.
	NodeBytesPerSecond   int64 `yaml:"nodeBytesPerSecond"`
	TenantBytesPerSecond int64 `yaml:"tenantBytesPerSecond"`
}

// maxTunnelLimit bounds tunnels.perNode and tunnels.perTenant.
const maxTunnelLimit = 100_000

func (t *Tunnels) defaults() {
	t.PerNode = cmp.Or(t.PerNode, 16)
	t.PerTenant = cmp.Or(t.PerTenant, 256)
}

func (t *Tunnels) validate() []error {
	var errs []error
	for _, f := range []struct {
		field string
		v     int
	}{{"tunnels.perNode", t.PerNode}, {"tunnels.perTenant", t.PerTenant}} {
		if f.v < 1 || f.v > maxTunnelLimit {
			errs = append(errs, fault.New(fault.InvalidConfig, f.field, "expected 1 to %d, got %d", maxTunnelLimit, f.v))
		}
	}
	for _, f := range []struct {
		field string
		v     int64
	}{{"tunnels.nodeBytesPerSecond", t.NodeBytesPerSecond}, {"tunnels.tenantBytesPerSecond", t.TenantBytesPerSecond}} {
		if f.v < 0 {
			errs = append(errs, fault.New(fault.InvalidConfig, f.field, "expected 0 (none) or more, got %d", f.v))
		}
	}
	return errs
}
