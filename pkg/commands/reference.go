package commands

import (
	"fmt"
	"strings"
)

// Reference renders the command kinds reference (docs/command-kinds.md)
// from r: every kind with its flags, lane, timeout and payload message.
func (r *Registry) Reference() string {
	var b strings.Builder
	b.WriteString("# Command kinds\n\n")
	b.WriteString("<!-- Generated from the pkg/commands registry by `go test ./commands -run TestKindsReference -update` (in pkg/). Do not edit. -->\n\n")
	b.WriteString("Every command has a kind, registered by the server or a module; the kind carries the rules for\n")
	b.WriteString("delivering it. See [commands](commands.md) for the lifecycle.\n\n")
	b.WriteString("| Kind | API | Retry-safe | Self-terminating | Destructive (signed) | Lane (credits) | Timeout | Payload |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|\n")
	yes := func(v bool) string {
		if v {
			return "yes"
		}
		return ""
	}
	for _, k := range r.Kinds() {
		fmt.Fprintf(&b, "| `%s` | %s | %s | %s | %s | `%s` (%d) | %s | `%s` |\n",
			k.Name, yes(k.API), yes(k.RetrySafe), yes(k.SelfTerminating), yes(k.Destructive), k.Lane, Credits[k.Lane],
			k.Timeout, k.Message().Descriptor().FullName())
	}
	b.WriteString("\n")
	for _, k := range r.Kinds() {
		fmt.Fprintf(&b, "## `%s`\n\n%s\n\nPayload fields (proto3 JSON names):\n\n", k.Name, k.Doc)
		fields := k.Message().Descriptor().Fields()
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
		b.WriteString("\n")
	}
	b.WriteString("## Not registered yet\n\n")
	b.WriteString("`agent.upgrade` (self-terminating, `exclusive`, 15 min) is in the design but has no payload message\n")
	b.WriteString("in `bettercompute.agent.v1.CommandBody` yet, so it is not registered: enqueueing it is `UNSUPPORTED`\n")
	b.WriteString("on `kind`.\n")
	return b.String()
}
