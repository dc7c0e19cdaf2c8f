package config

import (
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/outbound"
)

// Providers configures the requests to provider pools' APIs (the vps
// role's provider workflow and the endpoint check of pools.update): the
// outbound rules of pkg/outbound.
type Providers struct {
	// AllowInsecure permits http:// endpoints on loopback addresses; dev
	// sets it. Every other endpoint must be https://.
	AllowInsecure bool `yaml:"allowInsecure"`
	// AllowPrivateNetworks permits endpoints in private, loopback,
	// link-local and reserved ranges, checked on the address actually
	// dialled (cloud metadata addresses stay refused); dev sets it. A
	// provider on the operator's own network wants it together with
	// AllowedHosts.
	AllowPrivateNetworks bool `yaml:"allowPrivateNetworks"`
	// AllowedHosts, when set, are the only hosts a provider endpoint may
	// name: host names, "*.example.com" for subdomains, or IP addresses.
	AllowedHosts []string `yaml:"allowedHosts"`
}

func (c *Providers) validate() []error {
	var errs []error
	if len(c.AllowedHosts) > 256 {
		errs = append(errs, fault.New(fault.InvalidConfig, "providers.allowedHosts", "expected at most 256 hosts, got %d", len(c.AllowedHosts)))
	}
	for _, h := range c.AllowedHosts {
		if err := outbound.CheckAllowedHost(h); err != nil {
			errs = append(errs, fault.New(fault.InvalidConfig, "providers.allowedHosts", "%v", err))
		}
	}
	return errs
}

// Outbound returns the outbound rules of requests to providers.
func (c Providers) Outbound() outbound.Options {
	return outbound.Options{Setting: "providers", AllowInsecure: c.AllowInsecure,
		AllowPrivateNetworks: c.AllowPrivateNetworks, AllowedHosts: c.AllowedHosts}
}

// Outbound returns the outbound rules of webhook deliveries.
func (c Webhooks) Outbound() outbound.Options {
	return outbound.Options{Setting: "webhooks", AllowInsecure: c.AllowInsecure,
		AllowPrivateNetworks: c.AllowPrivateNetworks, Timeout: c.Timeout.Std()}
}
