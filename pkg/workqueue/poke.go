package workqueue

import (
	"strconv"
	"strings"

	"github.com/nats-io/nats.go"
)

// PokeSubjectPrefix starts every poke subject: bc.poke.<shard>, whose payload
// is the kind. A poke carries no state; it only wakes the worker that owns
// the shard sooner than its poll would.
const PokeSubjectPrefix = "bc.poke."

// PokeSubject returns the subject of an item's poke.
func PokeSubject(it Item) string { return PokeSubjectPrefix + strconv.Itoa(it.Shard()) }

// ParsePoke returns the shard and kind of a poke message.
func ParsePoke(subject string, data []byte) (shard int, kind string, ok bool) {
	n, err := strconv.Atoi(strings.TrimPrefix(subject, PokeSubjectPrefix))
	if err != nil || !strings.HasPrefix(subject, PokeSubjectPrefix) || len(data) == 0 {
		return 0, "", false
	}
	return n, string(data), true
}

// Poker publishes pokes after the enqueueing transaction commits. A nil
// Poker, or one without a connection, does nothing: pokes are optional.
type Poker struct {
	NC *nats.Conn
}

// Poke publishes one poke per distinct (shard, kind) of items. It never
// blocks on a disconnected bus and never fails: a lost poke only delays work
// until the next poll.
func (p *Poker) Poke(items ...Item) {
	if p == nil || p.NC == nil || !p.NC.IsConnected() {
		return
	}
	type sk struct {
		shard int
		kind  string
	}
	seen := make(map[sk]bool, len(items))
	for _, it := range items {
		k := sk{it.Shard(), it.Kind}
		if seen[k] {
			continue
		}
		seen[k] = true
		_ = p.NC.Publish(PokeSubject(it), []byte(it.Kind))
	}
}
