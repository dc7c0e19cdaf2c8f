package events

import (
	"fmt"
	"strings"
)

// Reference renders the event types reference (docs/events.md) from the
// catalog: the envelope, how events are delivered, then every type with its
// subject and its payload's fields.
func Reference() string {
	var b strings.Builder
	b.WriteString("# Event types\n\n")
	b.WriteString("<!-- Generated from the pkg/events catalog by `go test ./events -run TestEventsReference -update` (in pkg/). Do not edit. -->\n\n")
	b.WriteString("Every state change others may care about writes an event in the transaction that makes it. The outbox\n")
	b.WriteString("relay gives committed events their place in the log, in commit order, and publishes them. Every type the\n")
	b.WriteString("control plane writes is listed here: writing a type missing from the catalog (`pkg/events`) fails.\n\n")

	b.WriteString("## The envelope\n\n")
	b.WriteString("Readers get each event as a `bettercompute.compute.v1.Event`:\n\n")
	b.WriteString("- `id`: `evt_<n>`, what webhooks send as `webhook-id` and what a receiver dedupes by.\n")
	b.WriteString("- `cursor`: the event's place in commit order (its seq), which only grows; pass it as `after` to resume.\n")
	b.WriteString("- `tenantId`: the tenant the event belongs to.\n")
	b.WriteString("- `type`: one of the types below.\n")
	b.WriteString("- `subject`: the id of the resource the event is about, when it has one; the Subject column says what kind\n")
	b.WriteString("  of resource.\n")
	b.WriteString("- `time`: when the change committed.\n")
	b.WriteString("- `data`: the payload, shaped as its type says below. A payload that is a message is in proto3 JSON:\n")
	b.WriteString("  camelCase names, fields at their zero value left out.\n\n")

	b.WriteString("## Delivery\n\n")
	b.WriteString("- JetStream: the stream `BC_EVENTS`, subject `bc.events.<tenant>.<type>`, with the event id as `Nats-Msg-Id`.\n")
	b.WriteString("- Webhooks: every enabled webhook of the tenant (or of an ancestor, with `includeDescendants`) whose\n")
	b.WriteString("  event types match, signed as Standard Webhooks.\n")
	b.WriteString("- `events.list` pages through the log; `events.watch` streams it (also as Server-Sent Events).\n\n")
	b.WriteString("Webhooks' event types and the `types` of `events.list` and `events.watch` take exact names, patterns\n")
	b.WriteString("ending in `.*` such as `node.*` (the `node.` types), or `*` (every type).\n\n")

	b.WriteString("| Type | Subject | Payload |\n")
	b.WriteString("|---|---|---|\n")
	ts := Catalog()
	for _, t := range ts {
		fmt.Fprintf(&b, "| `%s` | %s | %s |\n", t.Name, subject(t), payload(t))
	}
	b.WriteString("\n")
	for _, t := range ts {
		fmt.Fprintf(&b, "## `%s`\n\n%s\n\n", t.Name, t.Doc)
		if t.Subject != "" {
			fmt.Fprintf(&b, "Subject: the %s's id.\n\n", t.Subject)
		}
		if t.Payload != nil {
			fmt.Fprintf(&b, "Payload `%s`, fields (proto3 JSON names):\n\n", t.Payload.ProtoReflect().Descriptor().FullName())
			fields := t.Payload.ProtoReflect().Descriptor().Fields()
			if fields.Len() == 0 {
				b.WriteString("- none\n")
			}
			for i := range fields.Len() {
				f := fields.Get(i)
				typ := f.Kind().String()
				if f.Message() != nil {
					typ = string(f.Message().FullName())
				}
				if f.IsList() {
					typ = "repeated " + typ
				}
				fmt.Fprintf(&b, "- `%s` (%s)\n", f.JSONName(), typ)
			}
		} else {
			b.WriteString("Payload fields (JSON):\n\n")
			for _, f := range t.Fields {
				fmt.Fprintf(&b, "- `%s` (%s): %s\n", f.Name, f.Type, f.Doc)
			}
		}
		b.WriteString("\n")
	}
	return strings.TrimSuffix(b.String(), "\n")
}

func subject(t Type) string {
	if t.Subject == "" {
		return "none"
	}
	return "`" + t.Subject + "`"
}

func payload(t Type) string {
	if t.Payload == nil {
		return "JSON object"
	}
	return "`" + string(t.Payload.ProtoReflect().Descriptor().FullName()) + "`"
}
