package app

import (
	"context"

	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/sitetasks"
	"github.com/bettercompute/bettercompute/services/metal"
)

// registerMetal registers the metal role's workflow (services/metal): the
// BMC credentials open with secrets.keyFile's keyring, destructive
// commands are signed (admitKinds), and the site and node gateways are
// poked over the bus and, in process, directly.
func (a *App) registerMetal(rt *reconcile.Runtime) error {
	keyring, err := a.secretsKeyring()
	if err != nil {
		return err
	}
	sites := &sitetasks.Poker{NC: a.nc, Local: func(siteID string) {
		if gw := a.localGW.Load(); gw != nil {
			go func() { _ = gw.DispatchSite(context.Background(), siteID) }()
		}
	}}
	r, err := metal.Reconciler(metal.Config{
		Metal: a.cfg.Metal, Keyring: keyring, Kinds: a.admitKinds, Commands: a.commandPoker(), Sites: sites,
		TrustDomain: a.cfg.JoinService.TrustDomain, Logger: a.logger.With("role", "metal"),
		TamperResult: a.opts.MetalTamper,
	})
	if err != nil {
		return err
	}
	return rt.Register(r)
}
