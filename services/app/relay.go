package app

import (
	"context"
	"slices"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/services/relay"
)

// relayHosted reports whether the process runs the outbox relay: the
// outbox-relay deployable, or the spec's sinks role that hosts it.
func (a *App) relayHosted() bool {
	return slices.Contains(a.roles, config.RoleOutboxRelay) || slices.Contains(a.roles, config.RoleSinks)
}

// startRelay runs the outbox relay (outbox-dispatch, events.fanout,
// events.deliver, events.prune) when the process hosts it.
func (a *App) startRelay(ctx context.Context) error {
	if !a.relayHosted() {
		return nil
	}
	rc := a.cfg.Runtime
	r, err := relay.New(relay.Config{
		DB: a.pool, NATS: a.nc, Events: a.cfg.Events, Webhooks: a.cfg.Webhooks,
		Heartbeat: rc.Heartbeat.Std(), LeaseTTL: rc.LeaseTTL.Std(),
		Logger: a.logger.With("role", "outbox-relay"), Registerer: a.reg,
	})
	if err != nil {
		return err
	}
	if err := r.Start(ctx); err != nil {
		return err
	}
	a.relay = r
	return nil
}
