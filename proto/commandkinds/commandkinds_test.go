package commandkinds

import (
	"maps"
	"reflect"
	"strings"
	"testing"

	"google.golang.org/protobuf/reflect/protoreflect"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// TestDeclared pins the declarations: changing a kind's lane or flags, or a
// lane's credits, changes what both the control plane and every daemon do
// with it, so it must be a deliberate edit of this table too.
func TestDeclared(t *testing.T) {
	t.Parallel()
	want := []Kind{
		{Name: "agent.upgrade", Field: "agent_upgrade", Lane: "exclusive", Destructive: true},
		{Name: "diag.nvml", Field: "diag_nvml", Lane: "diag", Ramdisk: true},
		{Name: "disk.wipe", Field: "disk_wipe", Lane: "exclusive", Destructive: true, RamdiskOnly: true},
		{Name: "gpu.reset", Field: "gpu_reset", Lane: "exclusive", Destructive: true},
		{Name: "image.deploy", Field: "image_deploy", Lane: "exclusive", Destructive: true, RamdiskOnly: true},
		{Name: "instance.reboot", Field: "instance_reboot", Lane: "default"},
		{Name: "inventory.refresh", Field: "inventory_refresh", Lane: "default"},
		{Name: "logs.collect", Field: "logs_collect", Lane: "default"},
		{Name: "node.kexec", Field: "node_kexec", Lane: "exclusive", Destructive: true, SelfTerminating: true, RamdiskOnly: true},
		{Name: "node.reboot", Field: "node_reboot", Lane: "exclusive", Destructive: true, SelfTerminating: true},
	}
	if got := All(); !reflect.DeepEqual(got, want) {
		t.Errorf("All() =\n%+v\nwant\n%+v", got, want)
	}
	if got, want := Credits(), map[string]int{"diag": 1, "default": 4, "exclusive": 1}; !maps.Equal(got, want) {
		t.Errorf("Credits() = %v, want %v", got, want)
	}
	for _, k := range want {
		if got, ok := Lookup(k.Name); !ok || got != k {
			t.Errorf("Lookup(%q) = %+v, %v", k.Name, got, ok)
		}
	}
	if _, ok := Lookup("agent.rollback"); ok {
		t.Error("Lookup found a kind no payload message declares")
	}
}

// TestOf finds the kind of every payload CommandBody can hold, and none in
// an empty body.
func TestOf(t *testing.T) {
	t.Parallel()
	body := (&agentv1.CommandBody{}).ProtoReflect()
	for _, k := range All() {
		b := &agentv1.CommandBody{}
		m := b.ProtoReflect()
		fd := m.Descriptor().Fields().ByName(k.Field)
		m.Set(fd, protoreflect.ValueOfMessage(body.NewField(fd).Message()))
		if got, ok := Of(b); !ok || got.Name != k.Name {
			t.Errorf("Of(a %s body) = %q, %v", k.Field, got.Name, ok)
		}
	}
	if got, ok := Of(&agentv1.CommandBody{}); ok {
		t.Errorf("Of(an empty body) = %q", got.Name)
	}
}

// TestRead_RefusesAnUndeclaredPayload: a oneof of messages without the
// (command_kind) option (CommandResult's) is no table of kinds.
func TestRead_RefusesAnUndeclaredPayload(t *testing.T) {
	t.Parallel()
	_, err := read((&agentv1.CommandResult{}).ProtoReflect().Descriptor(), agentv1.Lane(0).Descriptor())
	if err == nil || !strings.Contains(err.Error(), "declares no (command_kind)") {
		t.Fatalf("read(CommandResult) = %v, want an undeclared payload refused", err)
	}
}

func TestLaneName(t *testing.T) {
	t.Parallel()
	for l, want := range map[agentv1.Lane]string{
		agentv1.Lane_LANE_DIAG: "diag", agentv1.Lane_LANE_DEFAULT: "default", agentv1.Lane_LANE_EXCLUSIVE: "exclusive", agentv1.Lane(42): "",
	} {
		if got := LaneName(l); got != want {
			t.Errorf("LaneName(%v) = %q, want %q", l, got, want)
		}
	}
}

// TestNames: the name constants are exactly the declared kinds' names.
func TestNames(t *testing.T) {
	t.Parallel()
	names := []string{DiagNVML, InventoryRefresh, LogsCollect, NodeReboot, GPUReset, DiskWipe, ImageDeploy, NodeKexec, InstanceReboot, AgentUpgrade}
	declared := map[string]bool{}
	for _, k := range All() {
		declared[k.Name] = true
	}
	for _, n := range names {
		if !declared[n] {
			t.Errorf("constant %q names no declared kind", n)
		}
		delete(declared, n)
	}
	for n := range declared {
		t.Errorf("declared kind %q has no name constant", n)
	}
}
