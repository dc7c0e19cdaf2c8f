package command_test

import (
	"maps"
	"reflect"
	"testing"

	"github.com/bettercompute/bettercompute/agent/command"
	"github.com/bettercompute/bettercompute/proto/commandkinds"
)

// TestKinds_MatchDeclared: the daemon runs exactly the kinds the wire
// contract declares (proto/commandkinds), each with the declared lane and
// flags, its Kind constants name declared kinds, and the lanes' credits
// and the destructive kinds are the declared ones — what the control plane
// reads from the same declarations.
func TestKinds_MatchDeclared(t *testing.T) {
	t.Parallel()
	if got, want := command.Kinds(), commandkinds.All(); !reflect.DeepEqual(got, want) {
		t.Errorf("the daemon's kinds\n%+v\nthe declared ones\n%+v", got, want)
	}
	for _, name := range []string{
		command.KindDiagNvml, command.KindInventoryRefresh, command.KindLogsCollect, command.KindNodeReboot, command.KindGPUReset,
		command.KindDiskWipe, command.KindImageDeploy, command.KindNodeKexec, command.KindInstanceReboot,
	} {
		if _, ok := commandkinds.Lookup(name); !ok {
			t.Errorf("kind %s is declared on no payload message", name)
		}
	}
	if want := commandkinds.Credits(); !maps.Equal(command.Credits, want) {
		t.Errorf("Credits = %v, declared %v", command.Credits, want)
	}
	for _, k := range commandkinds.All() {
		if command.Destructive(k.Name) != k.Destructive {
			t.Errorf("Destructive(%s) = %v, declared %v", k.Name, !k.Destructive, k.Destructive)
		}
	}
	if command.Destructive("agent.rollback") {
		t.Error("an undeclared kind is destructive")
	}
}
