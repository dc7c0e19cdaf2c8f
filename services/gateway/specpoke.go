package gateway

import (
	"context"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/bettercompute/bettercompute/pkg/wake"
)

// SubscribeSpecPokes delivers their desired state to the nodes named by
// every desired-state wake to this gateway (wake.SubscribeNodeSpecs). A
// lost wake only delays delivery: the liveness tick resyncs every session
// from the database.
func (g *Gateway) SubscribeSpecPokes(nc *nats.Conn) (*nats.Subscription, error) {
	return wake.SubscribeNodeSpecs(nc, g.cfg.ID, func(ids []string) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := g.Deliver(ctx, ids...); err != nil {
			g.log.Warn("deliver desired state", "nodes", len(ids), "err", err)
		}
	})
}

// SubscribeCommands dispatches the commands of the nodes named by every
// command wake to this gateway (wake.SubscribeCommands): those whose
// sessions it holds. A lost wake only delays dispatch: the liveness tick
// resyncs every session from the database.
func (g *Gateway) SubscribeCommands(nc *nats.Conn) (*nats.Subscription, error) {
	return wake.SubscribeCommands(nc, g.cfg.ID, func(ids []string) {
		for _, id := range ids {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			if err := g.Dispatch(ctx, id); err != nil {
				g.log.Warn("dispatch commands", "node", id, "err", err)
			}
			cancel()
		}
	})
}
