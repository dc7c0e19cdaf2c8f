package converge_test

import (
	"context"
	"reflect"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/bettercompute/bettercompute/agent/converge"
	"github.com/bettercompute/bettercompute/agent/inventory"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// TestHealth_ChecksSettingsSurviveARestart: the section's checks settings
// reach Health (and the inventory's HealthConfig), persist in HealthFile
// and are read again by a new Converger; defaults apply when unset.
func TestHealth_ChecksSettingsSurviveARestart(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	c := newConverger(t, root)
	if got := c.Health().Interval(); got != inventory.DefaultCheckInterval {
		t.Fatalf("default interval %s", got)
	}
	spec := &agentv1.NodeSpec{Health: &agentv1.HealthSettings{
		CheckInterval: durationpb.New(5 * time.Second), MaxUncorrectableEccErrors: 2, MaxRetiredPages: 7,
		CriticalXids: []uint32{13, 79}, DisabledChecks: []string{"pcie_link", "power"},
	}}
	if ss, _ := c.Converge(context.Background(), &agentv1.DesiredState{Generation: 1, Spec: spec}); states(ss)["health"].GetState() != agentv1.SectionState_SECTION_STATE_CONVERGED {
		t.Fatalf("health %v", states(ss)["health"])
	}
	want := inventory.HealthConfig{MaxUncorrectableECCErrors: 2, MaxRetiredPages: 7, CriticalXIDs: []uint32{13, 79}, DisabledChecks: []string{"pcie_link", "power"}}
	for _, cv := range []*converge.Converger{c, newConverger(t, root)} {
		h := cv.Health()
		if h.Interval() != 5*time.Second || !reflect.DeepEqual(h.Checks(), want) {
			t.Fatalf("health %+v → %+v", h, h.Checks())
		}
	}
}

// TestHealth_InvalidChecksAreTerminal: unknown or undisableable checks, too
// many or impossible XIDs and a too-short interval fail the section
// terminally, naming the field.
func TestHealth_InvalidChecksAreTerminal(t *testing.T) {
	t.Parallel()
	many := make([]uint32, converge.MaxCriticalXIDs+1)
	for i := range many {
		many[i] = uint32(i + 1)
	}
	for _, tc := range []struct {
		h    *agentv1.HealthSettings
		want string
	}{
		{&agentv1.HealthSettings{DisabledChecks: []string{"fallen_off_bus"}}, "fallen_off_bus cannot be turned off"},
		{&agentv1.HealthSettings{DisabledChecks: []string{"vibes"}}, `unknown check "vibes"`},
		{&agentv1.HealthSettings{CriticalXids: many}, "critical_xids: 65, at most 64"},
		{&agentv1.HealthSettings{CriticalXids: []uint32{0}}, "critical_xids: 0 is not an XID"},
		{&agentv1.HealthSettings{CheckInterval: durationpb.New(time.Millisecond)}, "check_interval 1ms is below 1s"},
	} {
		c := newConverger(t, t.TempDir())
		ss, _ := c.Converge(context.Background(), &agentv1.DesiredState{Generation: 1, Spec: &agentv1.NodeSpec{Health: tc.h}})
		st := states(ss)["health"]
		if st.GetState() != agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL || !strings.Contains(st.GetReason(), tc.want) {
			t.Errorf("%v: %v, want terminal with %q", tc.h, st, tc.want)
		}
		if h := c.Health(); !reflect.DeepEqual(h, converge.Health{}) {
			t.Errorf("%v applied: %+v", tc.h, h)
		}
	}
}
