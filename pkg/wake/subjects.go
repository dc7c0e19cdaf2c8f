package wake

import (
	"strconv"
	"strings"
)

// The bus's subjects, every one defined here and used by publishers and
// subscribers alike. A wake carries no state: it only makes a loop look at
// the database sooner than its resync would.
const (
	// WorkPrefix starts a work-key wake: bc.poke.<shard>, payload the kind.
	// The runtime owning the shard's lease runs the kind's due keys.
	WorkPrefix = "bc.poke."
	// CommandsPrefix starts a command wake: bc.commands.<gateway id>,
	// payload the node ids, one per line, whose commands the gateway
	// holding their sessions should dispatch.
	CommandsPrefix = "bc.commands."
	// NodeSpecPrefix starts a desired-state wake: bc.nodespec.<gateway id>,
	// payload the node ids, one per line, whose NodeSpec the gateway holding
	// their sessions should deliver.
	NodeSpecPrefix = "bc.nodespec."
	// SiteTasksPrefix starts a site task wake: bc.sitetasks.<site id>. Only
	// a gateway holding a session of the site's agents subscribes to it.
	SiteTasksPrefix = "bc.sitetasks."
	// WebhooksDue wakes the relays' webhook deliverers.
	WebhooksDue = "bc.webhooks.due"
	// Policies carries a tenant whose authorization policies changed, for
	// every process's policy cache.
	Policies = "bc.authz.policies"
	// EventsPrefix starts the JetStream subject of an event:
	// bc.events.<tenant>.<type>.
	EventsPrefix = "bc.events."
	// Events matches every event subject.
	Events = EventsPrefix + ">"
)

// WorkSubject is the subject of a work wake for shard.
func WorkSubject(shard int) string { return WorkPrefix + strconv.Itoa(shard) }

// ParseWork returns the shard and kind of a work wake.
func ParseWork(subject string, data []byte) (shard int, kind string, ok bool) {
	n, err := strconv.Atoi(strings.TrimPrefix(subject, WorkPrefix))
	if err != nil || !strings.HasPrefix(subject, WorkPrefix) || len(data) == 0 {
		return 0, "", false
	}
	return n, string(data), true
}

// CommandsSubject is the subject of the command wakes for gateway.
func CommandsSubject(gatewayID string) string { return CommandsPrefix + gatewayID }

// NodeSpecSubject is the subject of the desired-state wakes for gateway.
func NodeSpecSubject(gatewayID string) string { return NodeSpecPrefix + gatewayID }

// SiteTasksSubject is the subject of the site task wakes for site.
func SiteTasksSubject(siteID string) string { return SiteTasksPrefix + siteID }

// EventSubject is the JetStream subject of an event of typ for tenant.
func EventSubject(tenant, typ string) string { return EventsPrefix + tenant + "." + typ }
