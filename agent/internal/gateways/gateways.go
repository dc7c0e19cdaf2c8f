// Package gateways is the list of gateways a daemon may dial: the
// --gateway flag's comma-separated host:port entries, each of which may be a
// DNS name with several address records. A daemon spreads over the entries
// (each starts at a random one) and, when a dial or a session fails, moves
// to the next, so a node whose gateway died reconnects to a live one at its
// next attempt, after the usual jittered back-off. Within a DNS name gRPC's
// pick_first shuffles the addresses (ServiceConfig): nodes spread over the
// records and a dead address is passed over in the same dial.
package gateways

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"slices"
	"strings"
	"sync"
)

// MaxEntries bounds the list.
const MaxEntries = 64

// Target is one address to dial and the name its certificate must carry.
type Target struct {
	// Addr is host:port (an IP where a DNS name was resolved).
	Addr string
	// ServerName is the configured server name, else the entry's host.
	ServerName string
}

// List hands out the next gateway to try.
type List struct {
	entries    []string
	serverName string

	mu   sync.Mutex
	next int // the entry last handed out; -1 before the first
}

// Parse parses a comma-separated list of host:port entries (blanks
// ignored, duplicates dropped). serverName, when set, is the name every
// gateway's certificate must carry; else each entry's host.
func Parse(list, serverName string) (*List, error) {
	var entries []string
	for e := range strings.SplitSeq(list, ",") {
		e = strings.TrimSpace(e)
		if e == "" || slices.Contains(entries, e) {
			continue
		}
		host, port, err := net.SplitHostPort(e)
		if err != nil || host == "" || port == "" {
			return nil, fmt.Errorf("gateway %q: expected host:port", e)
		}
		entries = append(entries, e)
	}
	switch {
	case len(entries) == 0:
		return nil, errors.New("no gateway address")
	case len(entries) > MaxEntries:
		return nil, fmt.Errorf("%d gateway addresses, at most %d", len(entries), MaxEntries)
	}
	return &List{entries: entries, serverName: serverName, next: -1}, nil
}

// Entries are the configured entries.
func (l *List) Entries() []string { return slices.Clone(l.entries) }

// String is the configured list.
func (l *List) String() string { return strings.Join(l.entries, ",") }

// Next returns the gateway to dial now: the entry after the last one
// handed out; the first call starts at a random entry, so nodes configured
// alike spread over the list.
func (l *List) Next() Target {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.next < 0 {
		l.next = rand.IntN(len(l.entries))
	} else {
		l.next = (l.next + 1) % len(l.entries)
	}
	e := l.entries[l.next]
	name := l.serverName
	if name == "" {
		name, _, _ = net.SplitHostPort(e)
	}
	return Target{Addr: e, ServerName: name}
}

// ServiceConfig is the gRPC service configuration a daemon dials an entry
// with: pick_first over the name's addresses in an order of its own, so a
// DNS name with several records spreads the nodes over them and a dead
// address is passed over within the same dial.
const ServiceConfig = `{"loadBalancingConfig":[{"pick_first":{"shuffleAddressList":true}}]}`
