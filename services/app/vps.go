package app

import (
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/services/vps"
)

// registerVPS registers the vps role's reconcilers (services/vps):
// vps.hosts keeps the hosts' capacity in line with their inventory and
// their pools' settings, vps.usage accrues instance-hours and prunes
// deleted instances, and vps.provider drives provider pools' instances
// through their provider's API (it opens the providers' tokens with the
// secrets key). The instances section of a host's spec is the vps
// contributor's (nodeSpecRegistry), the hosts' reports the gateway's.
func (a *App) registerVPS(rt *reconcile.Runtime) error {
	for _, r := range vps.Reconcilers(vps.Config{}) {
		if err := rt.Register(r); err != nil {
			return err
		}
	}
	keyring, err := a.secretsKeyring()
	if err != nil {
		return err
	}
	if keyring == nil {
		// Provider pools' instances stay pending until a key is configured.
		a.logger.Warn("no secrets.keyFile configured: provider pools' instances are not driven (vps.provider is off)")
		return nil
	}
	return vps.RegisterProvider(rt, vps.Deps{Keyring: keyring, Logger: a.logger.With("role", "vps"), Outbound: a.cfg.Providers.Outbound()})
}
