// Package events is the event log: the catalog of event types, and reading
// the log.
//
// Every state change others may care about writes an event in its
// transaction with outbox.Write (package outbox). The catalog ([Catalog],
// [Lookup]) lists every type the code writes, what its subject is and the
// shape of its payload; outbox.Write refuses a type the catalog does not
// list, and docs/events.md is generated from it ([Reference]).
//
// Events are outbox rows sequenced by the outbox relay: an event's place in
// the log is its seq, assigned in commit order, and every cursor (a
// watcher's, events.list's after, the webhook fan-out's) is a seq.
package events
