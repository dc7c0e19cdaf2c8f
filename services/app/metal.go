package app

import (
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/services/metal"
)

// registerMetal registers the metal role's workflow (services/metal): the
// BMC credentials open with secrets.keyFile's keyring and destructive
// commands are signed (admitKinds); the runtime's waker wakes the site and
// node gateways.
func (a *App) registerMetal(rt *reconcile.Runtime) error {
	keyring, err := a.secretsKeyring()
	if err != nil {
		return err
	}
	r, err := metal.Reconciler(metal.Config{
		Metal: a.cfg.Metal, Keyring: keyring, Kinds: a.admitKinds,
		TrustDomain: a.cfg.JoinService.TrustDomain, Logger: a.logger.With("role", "metal"),
		TamperResult: a.opts.MetalTamper,
	})
	if err != nil {
		return err
	}
	return rt.Register(r)
}
