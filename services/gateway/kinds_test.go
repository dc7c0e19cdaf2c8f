package gateway_test

import (
	"testing"

	"github.com/bettercompute/bettercompute/agent/command"
	"github.com/bettercompute/bettercompute/proto/commandkinds"

	"github.com/bettercompute/bettercompute/pkg/commands"
)

// TestKinds_BothSidesAgree compares, kind by kind, what the control plane
// (pkg/commands, whose commands the gateway delivers) and bcd
// (agent/command, which runs them) hold of every kind declared in the wire
// contract (proto/commandkinds): the payload field, the lane and its
// credits, destructive, self-terminating and ramdisk-only. Each side reads
// them from that one declaration, so this fails only when a side stops
// doing so.
func TestKinds_BothSidesAgree(t *testing.T) {
	t.Parallel()
	server := commands.Builtin()
	daemon := map[string]commandkinds.Kind{}
	for _, k := range command.Kinds() {
		daemon[k.Name] = k
	}
	for _, d := range commandkinds.All() {
		s, ok := server.Lookup(d.Name)
		if !ok {
			t.Errorf("%s: the control plane does not know it", d.Name)
			continue
		}
		a, ok := daemon[d.Name]
		if !ok {
			t.Errorf("%s: bcd does not run it", d.Name)
			continue
		}
		for _, p := range []struct {
			what           string
			server, daemon any
		}{
			{"payload field", s.Field, a.Field},
			{"lane", string(s.Lane), a.Lane},
			{"lane credits", commands.Credits[s.Lane], command.Credits[a.Lane]},
			{"destructive", s.Destructive, command.Destructive(d.Name)},
			{"self-terminating", s.SelfTerminating, a.SelfTerminating},
			{"ramdisk-only", s.RamdiskOnly, a.RamdiskOnly},
		} {
			if p.server != p.daemon {
				t.Errorf("%s: %s: control plane %v, bcd %v", d.Name, p.what, p.server, p.daemon)
			}
		}
	}
}
