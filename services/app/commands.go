package app

import (
	"slices"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// registerCommands registers the command-sweeper on the runtime when this
// process runs the command-sweeper role (its own membership; the reconciler
// is a singleton under the singleton:command-sweeper lease, so any number
// of processes may run the role).
func (a *App) registerCommands(rt *reconcile.Runtime, roles []string) error {
	if !slices.Contains(roles, reconcile.RoleCommandSweeper) {
		return nil
	}
	return rt.Register(a.kinds.Sweeper(a.cfg.Commands.SweepInterval.Std()))
}

// admitsCommands reports whether this process runs a role that queues
// commands: the api (commands.run) and the controllers (acceptance
// checks). Only these hold the command-signing key.
func (a *App) admitsCommands() bool {
	return slices.Contains(a.roles, config.RoleAPI) || slices.Contains(a.roles, config.RoleControllers)
}

// prepareCommandSigning sets the registry the roles that queue commands use:
// a.kinds signing destructive commands at enqueue with the command-signing
// key (commands.signingKeyFile) for the installation's trust domain. A
// process that queues none (a gateway, a sweeper) never reads the key: the
// gateway sends the signature stored with each command. Without a
// configured key destructive commands are queued unsigned and daemons
// reject them BAD_SIGNATURE.
func (a *App) prepareCommandSigning() error {
	a.admitKinds = a.kinds
	if !a.admitsCommands() {
		return nil
	}
	path := a.cfg.Commands.SigningKeyFile
	if path == "" {
		a.logger.Warn("no commands.signingKeyFile: destructive commands (node.reboot) will be rejected BAD_SIGNATURE by daemons")
		return nil
	}
	signer, err := commands.LoadSigner(path)
	if err != nil {
		return err
	}
	a.admitKinds = a.kinds.Signing(signer, a.cfg.JoinService.TrustDomain)
	return nil
}

// CommandKinds returns the registry the process's gateway and sweeper use
// and the one its api and controllers queue commands through (signing when
// the key is configured); the second is nil before Start.
func (a *App) CommandKinds() (dispatch, admit *commands.Registry) { return a.kinds, a.admitKinds }
