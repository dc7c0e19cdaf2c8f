// Package wake is the one way a committed change wakes the loops that act
// on it: a transaction collects its wakes (on reconcile.Queue, which holds
// a [Set]) and a [Waker] sends them after the commit, each where it
// matters: work keys to the runtime owning their shard, a node's commands
// and a node's new desired state to the gateway holding the node, a site's
// tasks to the gateway holding
// its agent, webhook deliveries to the relays, a tenant's policies to every
// policy cache. Every subject is defined in this package.
//
// A wake is only a hint: every loop also resyncs from the database, so a
// lost wake, or no bus at all, only delays the work.
package wake

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
)

// Work is a work-key wake: the kind has due keys in shard.
type Work struct {
	Shard int
	Kind  string
}

// Set is what one transaction wakes once it commits.
type Set struct {
	// Work holds the shards and kinds of the keys it enqueued.
	Work []Work
	// Nodes holds the nodes whose commands it queued or cancelled.
	Nodes []string
	// Specs holds the nodes whose desired state it moved to a new
	// generation.
	Specs []Spec
	// Sites holds the sites whose tasks it queued or resealed.
	Sites []string
	// Deliveries is set when it made webhook deliveries due.
	Deliveries bool
	// Policies holds the tenants whose policies it changed.
	Policies []string
}

// Spec is a desired-state wake: the node's NodeSpec moved to a new
// generation, and GatewayID held its session when it did (empty: none).
type Spec struct {
	NodeID, GatewayID string
}

// Gateway is the gateway of this process: woken directly, without the bus.
type Gateway interface {
	// Holds reports whether the gateway holds the node's session.
	Holds(nodeID string) bool
	// Dispatch sends the node's due commands.
	Dispatch(ctx context.Context, nodeID string) error
	// Deliver sends the nodes whose sessions it holds their desired state,
	// if they are behind it.
	Deliver(ctx context.Context, nodeIDs ...string) error
	// DispatchSite sends the site's due tasks, if it holds the session of
	// the site's lease holder.
	DispatchSite(ctx context.Context, siteID string) error
}

// GatewaysOf returns the gateway holding each node's session (nodes
// without one are left out): how a node's wake finds its gateway.
type GatewaysOf func(ctx context.Context, nodeIDs []string) (map[string]string, error)

// Waker sends committed wakes. A nil Waker does nothing; one without a
// connection wakes only this process's own gateway and policy caches.
type Waker struct {
	nc       *nats.Conn
	gateways GatewaysOf
	log      *slog.Logger
	local    atomic.Pointer[localGateway]
	// specSlots bounds the in-process desired-state deliveries in flight.
	specSlots chan struct{}

	mu       sync.Mutex
	policies []func(tenant string)
}

type localGateway struct{ Gateway }

// dispatchTimeout bounds an in-process dispatch, and the look-up of the
// gateways holding the woken nodes.
const dispatchTimeout = 10 * time.Second

// deliverTimeout bounds an in-process desired-state delivery; specSlots
// how many are in flight at once, so a fleet-wide change holds the
// transaction's sender (the nodespec controller) back only when delivery
// cannot keep up.
const (
	deliverTimeout = 30 * time.Second
	specSlots      = 32
)

// New returns a waker publishing on nc (nil: in process only) that finds
// the gateway holding a node with gateways (nil: a node's wake reaches only
// this process's gateway).
func New(nc *nats.Conn, gateways GatewaysOf, log *slog.Logger) *Waker {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Waker{nc: nc, gateways: gateways, log: log, specSlots: make(chan struct{}, specSlots)}
}

// SetGateway names the gateway of this process (nil: none).
func (w *Waker) SetGateway(g Gateway) {
	if g == nil {
		w.local.Store(nil)
		return
	}
	w.local.Store(&localGateway{g})
}

// OnPolicies calls f with every tenant whose policies a transaction of
// this process changed, after its commit: the process's own policy cache,
// which does not wait for the bus.
func (w *Waker) OnPolicies(f func(tenant string)) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.policies = append(w.policies, f)
}

// Wake sends s. Call it once the transaction that collected s committed
// (reconcile.Queue does). It never fails: a wake lost on a disconnected bus
// only delays work until the loop's resync.
func (w *Waker) Wake(s Set) {
	if w == nil {
		return
	}
	w.work(s.Work)
	w.nodes(s.Nodes)
	w.specs(s.Specs)
	w.sites(s.Sites)
	if s.Deliveries {
		w.publish(WebhooksDue, nil)
	}
	if len(s.Policies) > 0 {
		w.mu.Lock()
		fs := slices.Clone(w.policies)
		w.mu.Unlock()
		for _, tenant := range s.Policies {
			for _, f := range fs {
				f(tenant)
			}
			w.publish(Policies, []byte(tenant))
		}
	}
}

func (w *Waker) connected() bool { return w.nc != nil && w.nc.IsConnected() }

func (w *Waker) publish(subject string, data []byte) {
	if w.connected() {
		_ = w.nc.Publish(subject, data)
	}
}

// work wakes the runtime owning each shard, once per shard and kind.
func (w *Waker) work(ws []Work) {
	if !w.connected() {
		return
	}
	seen := make(map[Work]bool, len(ws))
	for _, it := range ws {
		if !seen[it] {
			seen[it] = true
			w.publish(WorkSubject(it.Shard), []byte(it.Kind))
		}
	}
}

// nodes wakes the gateway holding each node: this process's own directly,
// the others over the bus, one message per gateway.
func (w *Waker) nodes(ids []string) {
	if len(ids) == 0 {
		return
	}
	var remote []string
	l := w.local.Load()
	for _, id := range ids {
		if l != nil && l.Holds(id) {
			go w.dispatch(l, id)
			continue
		}
		remote = append(remote, id)
	}
	if len(remote) == 0 || w.gateways == nil || !w.connected() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), dispatchTimeout)
	defer cancel()
	at, err := w.gateways(ctx, remote)
	if err != nil {
		w.log.Warn("find the gateways of woken nodes; their resync dispatches", "nodes", len(remote), "err", err)
		return
	}
	byGateway := map[string][]string{}
	for _, id := range remote {
		if gw := at[id]; gw != "" {
			byGateway[gw] = append(byGateway[gw], id)
		}
	}
	for gw, ids := range byGateway {
		w.publish(CommandsSubject(gw), []byte(strings.Join(ids, "\n")))
	}
}

// specs hands nodes' new desired state to the gateways holding their
// sessions, once each: those this process's gateway holds directly, off
// the sender's path (at most specSlots deliveries in flight); each other
// gateway that held some when they moved gets one wake over the bus naming
// them. A node no gateway held is left to its gateway's resync when it
// connects.
func (w *Waker) specs(specs []Spec) {
	if len(specs) == 0 {
		return
	}
	l := w.local.Load()
	var local []string
	remote := map[string][]string{}
	for _, s := range specs {
		switch {
		case l != nil && l.Holds(s.NodeID):
			local = append(local, s.NodeID)
		case s.GatewayID != "":
			remote[s.GatewayID] = append(remote[s.GatewayID], s.NodeID)
		}
	}
	if len(local) > 0 {
		w.specSlots <- struct{}{}
		go func() {
			defer func() { <-w.specSlots }()
			ctx, cancel := context.WithTimeout(context.Background(), deliverTimeout)
			defer cancel()
			if err := l.Deliver(ctx, local...); err != nil {
				w.log.Warn("deliver desired state", "nodes", len(local), "err", err)
			}
		}()
	}
	for gw, ids := range remote {
		w.publish(NodeSpecSubject(gw), []byte(strings.Join(ids, "\n")))
	}
}

func (w *Waker) dispatch(g Gateway, nodeID string) {
	ctx, cancel := context.WithTimeout(context.Background(), dispatchTimeout)
	defer cancel()
	if err := g.Dispatch(ctx, nodeID); err != nil {
		w.log.Warn("dispatch commands", "node", nodeID, "err", err)
	}
}

// sites wakes the gateways holding a session of each site's agents: this
// process's own directly, the others over the bus (only those subscribe).
func (w *Waker) sites(ids []string) {
	l := w.local.Load()
	for _, id := range ids {
		if l != nil {
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), dispatchTimeout)
				defer cancel()
				if err := l.DispatchSite(ctx, id); err != nil {
					w.log.Warn("dispatch site tasks", "site", id, "err", err)
				}
			}()
		}
		w.publish(SiteTasksSubject(id), nil)
	}
}
