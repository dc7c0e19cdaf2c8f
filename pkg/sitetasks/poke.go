package sitetasks

import (
	"strings"

	"github.com/nats-io/nats.go"

	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// PokePrefix starts the subject of a site task poke: bc.sitetasks.<site
// id>, published after a transaction queued or resealed a site's tasks. The
// gateway holding the site's lease holder dispatches at once; without the
// bus, its resync finds the work within a liveness interval.
const PokePrefix = "bc.sitetasks."

// PokeSubject is the poke subject for site.
func PokeSubject(siteID string) string { return PokePrefix + siteID }

// Poker publishes site task pokes after commit. A nil Poker, or one without
// a connection, does nothing but call Local: pokes are optional.
type Poker struct {
	NC *nats.Conn
	// Local, when set, is called for each site too: the in-process gateway.
	Local func(siteID string)
}

// Poke wakes the gateways of sites. Call it after the commit.
func (p *Poker) Poke(siteIDs ...string) {
	if p == nil {
		return
	}
	for _, id := range siteIDs {
		if p.Local != nil {
			p.Local(id)
		}
		if p.NC != nil && p.NC.IsConnected() {
			_ = p.NC.Publish(PokeSubject(id), nil)
		}
	}
}

// AfterCommit pokes sites once q's transaction commits.
func (p *Poker) AfterCommit(q *reconcile.Queue, siteIDs ...string) {
	if p == nil || len(siteIDs) == 0 {
		return
	}
	q.AfterCommit(func() { p.Poke(siteIDs...) })
}

// Subscribe calls fn with the site id of every site task poke: the
// gateway's subscription.
func Subscribe(nc *nats.Conn, fn func(siteID string)) (*nats.Subscription, error) {
	return nc.Subscribe(PokePrefix+"*", func(m *nats.Msg) {
		fn(strings.TrimPrefix(m.Subject, PokePrefix))
	})
}
