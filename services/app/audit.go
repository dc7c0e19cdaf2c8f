package app

import (
	"crypto/ed25519"
	"slices"

	"github.com/bettercompute/bettercompute/pkg/audit"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// registerAudit registers the audit chain's reconcilers (audit.chain and
// audit.checkpoint, singletons of the controllers membership) when this
// process hosts that membership. Checkpoints are signed with
// audit.signingKeyFile; an unreadable key fails the start.
func (a *App) registerAudit(rt *reconcile.Runtime, roles []string) error {
	if !slices.Contains(roles, reconcile.RoleControllers) {
		return nil
	}
	signer, err := a.auditSigner()
	if err != nil {
		return err
	}
	c := a.cfg.Audit
	for _, r := range audit.Reconcilers(audit.Config{
		ChainEvery: c.ChainEvery.Std(), CheckpointEvery: c.CheckpointEvery.Std(), Signer: signer, Retention: c.KeepFor(),
	}) {
		if err := rt.Register(r); err != nil {
			return err
		}
	}
	return nil
}

// auditSigner loads the audit key, or returns nil when none is configured
// (checkpoints are then written unsigned).
func (a *App) auditSigner() (*audit.Signer, error) {
	path := a.cfg.Audit.SigningKeyFile
	if path == "" {
		a.logger.Warn("no audit.signingKeyFile: audit checkpoints are written unsigned, and audit.verify cannot check signatures")
		return nil, nil
	}
	return audit.LoadSigner(path)
}

// auditKey is the public half of the audit key, with which audit.verify
// checks checkpoint signatures; nil when none is configured. A key that
// cannot be read is logged and gives nil (audit.verify then says it did not
// check signatures): a process that also hosts controllers fails its start
// on it first.
func (a *App) auditKey() ed25519.PublicKey {
	path := a.cfg.Audit.SigningKeyFile
	if path == "" {
		return nil
	}
	s, err := audit.LoadSigner(path)
	if err != nil {
		a.logger.Error("audit key: audit.verify will not check checkpoint signatures", "err", err)
		return nil
	}
	return s.Public()
}
