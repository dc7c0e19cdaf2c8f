package gateway

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/bettercompute/bettercompute/pkg/nodespec"
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

// SpecRouter hands the nodespec controller's committed changes to the
// gateways holding the nodes' sessions, once each: the nodes whose session
// the gateway of this process holds are delivered directly, off the
// controller's path (at most routerSlots batches in flight, so a fleet-wide
// change holds the controller back only when delivery cannot keep up); for
// the others, the gateway that holds each (nodes.gateway_id) is poked over
// the bus, once per batch. Gateways also resync from the database, so a
// lost poke only delays delivery.
type SpecRouter struct {
	nc    *nats.Conn
	log   *slog.Logger
	local atomic.Pointer[Gateway]
	slots chan struct{}
}

// routerSlots bounds a router's in-process deliveries in flight.
const routerSlots = 32

// NewSpecRouter returns a router that pokes over nc (nil: no bus, the
// gateways' resync delivers).
func NewSpecRouter(nc *nats.Conn, log *slog.Logger) *SpecRouter {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &SpecRouter{nc: nc, log: log, slots: make(chan struct{}, routerSlots)}
}

// SetLocal names the gateway of this process (nil: none).
func (r *SpecRouter) SetLocal(g *Gateway) { r.local.Store(g) }

// Changed is the nodespec controller's hook (services/nodespec
// Config.Changed).
func (r *SpecRouter) Changed(_ context.Context, changes []nodespec.Change) {
	gw := r.local.Load()
	var local []string
	remote := map[string][]string{}
	for _, ch := range changes {
		switch {
		case gw != nil && gw.Holds(ch.NodeID):
			local = append(local, ch.NodeID)
		case ch.GatewayID != "":
			remote[ch.GatewayID] = append(remote[ch.GatewayID], ch.NodeID)
		}
	}
	if len(local) > 0 {
		r.slots <- struct{}{}
		go func() {
			defer func() { <-r.slots }()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if err := gw.Deliver(ctx, local...); err != nil {
				r.log.Warn("deliver desired state", "nodes", len(local), "err", err)
			}
		}()
	}
	for gateway, ids := range remote {
		wake.PublishNodeSpecs(r.nc, gateway, ids)
	}
}
