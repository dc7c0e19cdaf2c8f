package mig_test

import (
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/mig"
	"github.com/bettercompute/bettercompute/proto/migcatalog"
)

// TestValidate: every instance checked against the model, the problem
// naming the instance.
func TestValidate(t *testing.T) {
	t.Parallel()
	m, _ := migcatalog.ByName("H200 141GB")
	p := func(name string, start int) migcatalog.Placement {
		return migcatalog.Placement{Profile: name, Start: start}
	}
	for _, tc := range []struct {
		w    mig.Want
		want string
	}{
		{mig.Want{Enabled: true, Instances: []migcatalog.Placement{p("3g.71gb", 0), p("3g.71gb", 4)}}, ""},
		{mig.Want{}, ""},
		{mig.Want{Instances: []migcatalog.Placement{p("1g.18gb", 0)}}, "instances: set while MIG is disabled"},
		{mig.Want{Enabled: true, Instances: []migcatalog.Placement{p("1g.10gb", 0)}}, `instances[0].profile: "1g.10gb" is not a MIG profile of H200 141GB`},
		{mig.Want{Enabled: true, Instances: []migcatalog.Placement{p("7g.141gb", 0), p("1g.18gb", 7)}}, "instances[1].start: 7 is not a start of 1g.18gb"},
		{mig.Want{Enabled: true, Instances: []migcatalog.Placement{p("4g.71gb", 0), p("3g.71gb", 4), p("1g.18gb", 3)}}, "instances[2]: the layout needs more than the GPU's 7 compute slices"},
		{mig.Want{Enabled: true, Instances: []migcatalog.Placement{p("2g.35gb", 0), p("2g.35gb", 2), p("2g.35gb", 4), p("1g.35gb", 0)}}, "instances[3].start: 1g.35gb at 0 overlaps instances[0] (memory slice 0)"},
		{mig.Want{Enabled: true, Instances: []migcatalog.Placement{p("1g.18gb+me", 0), p("1g.18gb+me", 1)}}, "instances[1].profile: 2 instances of 1g.18gb+me, at most 1 per GPU"},
	} {
		err := mig.Validate(m, tc.w)
		if (err == nil) != (tc.want == "") || (err != nil && !strings.HasPrefix(err.Error(), tc.want)) {
			t.Errorf("%+v: %v, want %q", tc.w, err, tc.want)
		}
	}
}

// TestApplyReadsBackAndIsIdempotent: Apply on the mock creates the
// placements with a MIG device each and, applied again, changes nothing.
func TestApplyReadsBackAndIsIdempotent(t *testing.T) {
	t.Parallel()
	c, err := inventory.New(inventory.NewMock(), inventory.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close() }()
	gpus, err := c.GPUs(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	w := mig.Want{GPU: gpus[0].GetUuid(), Enabled: true, Instances: []migcatalog.Placement{{Profile: "3g.71gb", Start: 4}, {Profile: "1g.35gb", Start: 0}}}
	l, steps, err := c.ApplyMIG(w)
	if err != nil || !l.Matches(w) {
		t.Fatalf("apply: %v %v", l, err)
	}
	if want := []string{"set MIG mode on", "create 1g.35gb@0", "create 3g.71gb@4"}; strings.Join(steps, "|") != strings.Join(want, "|") {
		t.Fatalf("steps %q, want %q", steps, want)
	}
	if l.Instances[0].MemoryMiB != 35840 || !strings.HasPrefix(l.Instances[1].UUID, "MIG-") || l.Instances[0].UUID == l.Instances[1].UUID {
		t.Fatalf("layout %+v", l)
	}
	again, steps, err := c.ApplyMIG(w)
	if err != nil || len(steps) > 0 || again.String() != l.String() {
		t.Fatalf("second apply: %v %q %v", again, steps, err)
	}
}
