package wake

import (
	"fmt"
	"strings"

	"github.com/nats-io/nats.go"
)

// maxNodes bounds the node ids read from one wake.
const maxNodes = 10000

// SubscribeWork calls fn with the shard and kind of every work wake.
func SubscribeWork(nc *nats.Conn, fn func(shard int, kind string)) (*nats.Subscription, error) {
	return subscribe(nc, WorkPrefix+"*", func(m *nats.Msg) {
		if shard, kind, ok := ParseWork(m.Subject, m.Data); ok {
			fn(shard, kind)
		}
	})
}

// SubscribeCommands calls fn with the nodes of every command wake sent to
// gateway: those whose sessions it holds.
func SubscribeCommands(nc *nats.Conn, gatewayID string, fn func(nodeIDs []string)) (*nats.Subscription, error) {
	return subscribe(nc, CommandsSubject(gatewayID), func(m *nats.Msg) { fn(nodeIDs(m.Data)) })
}

// SubscribeNodeSpecs calls fn with the nodes of every desired-state wake
// sent to gateway.
func SubscribeNodeSpecs(nc *nats.Conn, gatewayID string, fn func(nodeIDs []string)) (*nats.Subscription, error) {
	return subscribe(nc, NodeSpecSubject(gatewayID), func(m *nats.Msg) { fn(nodeIDs(m.Data)) })
}

// SubscribeSiteTasks calls fn on every site task wake of site: a gateway
// subscribes while it holds a session of one of the site's agents.
func SubscribeSiteTasks(nc *nats.Conn, siteID string, fn func()) (*nats.Subscription, error) {
	return subscribe(nc, SiteTasksSubject(siteID), func(*nats.Msg) { fn() })
}

// SubscribeDeliveries calls fn on every webhook delivery wake.
func SubscribeDeliveries(nc *nats.Conn, fn func()) (*nats.Subscription, error) {
	return subscribe(nc, WebhooksDue, func(*nats.Msg) { fn() })
}

// SubscribePolicies calls fn with the tenant of every policy wake.
func SubscribePolicies(nc *nats.Conn, fn func(tenant string)) (*nats.Subscription, error) {
	return subscribe(nc, Policies, func(m *nats.Msg) { fn(string(m.Data)) })
}

// SubscribeEvents calls fn on every event published to the events stream.
func SubscribeEvents(nc *nats.Conn, fn func()) (*nats.Subscription, error) {
	return subscribe(nc, Events, func(*nats.Msg) { fn() })
}

func subscribe(nc *nats.Conn, subject string, h nats.MsgHandler) (*nats.Subscription, error) {
	sub, err := nc.Subscribe(subject, h)
	if err != nil {
		return nil, fmt.Errorf("subscribe %s: %w", subject, err)
	}
	return sub, nil
}

func nodeIDs(data []byte) []string {
	ids := strings.Fields(string(data))
	if len(ids) > maxNodes {
		ids = ids[:maxNodes]
	}
	return ids
}
