package lifecycle

import (
	"testing"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/miglayouts"
)

// TestMigHolds: a node's mig section holds a change's layouts only when
// every GPU a layout picked has its mode and profiles, and no other GPU
// has an entry.
func TestMigHolds(t *testing.T) {
	halves := miglayouts.Layout{Name: "halves", Profiles: []string{"3g.71gb", "3g.71gb"}}
	off := miglayouts.Layout{Name: "off", Disabled: true}
	entry := func(uuid string, on bool, profiles ...string) *agentv1.GpuMigLayout {
		return &agentv1.GpuMigLayout{GpuUuid: uuid, MigEnabled: on, Profiles: profiles}
	}
	chosen := map[string]miglayouts.Layout{"GPU-0": halves, "GPU-1": off}
	for _, c := range []struct {
		name string
		sec  *agentv1.MigLayout
		want bool
	}{
		{"holds", &agentv1.MigLayout{Gpus: []*agentv1.GpuMigLayout{entry("GPU-0", true, "3g.71gb", "3g.71gb"), entry("GPU-1", false)}}, true},
		{"old profiles", &agentv1.MigLayout{Gpus: []*agentv1.GpuMigLayout{entry("GPU-0", true, "7g.141gb"), entry("GPU-1", false)}}, false},
		{"MIG still on", &agentv1.MigLayout{Gpus: []*agentv1.GpuMigLayout{entry("GPU-0", true, "3g.71gb", "3g.71gb"), entry("GPU-1", true, "7g.141gb")}}, false},
		{"a GPU missing", &agentv1.MigLayout{Gpus: []*agentv1.GpuMigLayout{entry("GPU-0", true, "3g.71gb", "3g.71gb")}}, false},
		{"a GPU no layout picks", &agentv1.MigLayout{Gpus: []*agentv1.GpuMigLayout{entry("GPU-0", true, "3g.71gb", "3g.71gb"), entry("GPU-2", false)}}, false},
		{"none", nil, false},
	} {
		if got := migHolds(c.sec, chosen); got != c.want {
			t.Errorf("%s: migHolds = %v, want %v", c.name, got, c.want)
		}
	}
	if !migHolds(nil, map[string]miglayouts.Layout{}) {
		t.Error("no layout and no section: holds")
	}
}
