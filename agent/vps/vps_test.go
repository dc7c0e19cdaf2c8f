package vps_test

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/agent/vps"
)

func good(id string) vps.Spec {
	return vps.Spec{ID: id, Image: "ubuntu.qcow2", Power: vps.Running, Size: vps.Size{VCPUs: 2, MemoryMiB: 2048, DiskGiB: 20}}
}

func TestValidate_NamesEachBadField(t *testing.T) {
	t.Parallel()
	if err := vps.Validate([]vps.Spec{good("vps_a"), good("vps_b")}); err != nil {
		t.Fatal(err)
	}
	bad := good("vps_c")
	bad.Power, bad.Size.VCPUs, bad.Image, bad.Hostname = "paused", 0, "../etc/passwd", "a_b"
	bad.GPUUUIDs = []string{"GPU-1"}
	other := good("vps_d")
	other.GPUUUIDs = []string{"GPU-1"}
	err := vps.Validate([]vps.Spec{bad, other, good("vps_c"), good("not-an-id")})
	for _, f := range []string{"instances[vps_c].state", "instances[vps_c].vcpus", "instances[vps_c].image", "instances[vps_c].hostname",
		"instances[vps_d].gpu_uuids", "instances[vps_c].id", "instances[3].id"} {
		if err == nil || !strings.Contains(err.Error(), f+":") {
			t.Errorf("no error for %s in %v", f, err)
		}
	}
	var fe vps.FieldError
	if !errors.As(err, &fe) {
		t.Errorf("%T is not a FieldError", err)
	}
	many := make([]vps.Spec, vps.MaxInstances+1)
	if err := vps.Validate(many); err == nil || !strings.Contains(err.Error(), "at most 256") {
		t.Errorf("%v", err)
	}
}

func TestSteps(t *testing.T) {
	t.Parallel()
	a, b, c, d := good("vps_a"), good("vps_b"), good("vps_c"), good("vps_d")
	b.Power = vps.Stopped
	c.Size.VCPUs = 4
	d.Generation = 2
	obs := []vps.Observed{
		{ID: "vps_b", State: vps.Running, Size: b.Size},
		{ID: "vps_c", State: vps.Running, Size: good("").Size},
		{ID: "vps_d", State: vps.Running, Size: d.Size, Generation: 1},
		{ID: "vps_e", State: vps.Running},
		{ID: "vps_f", State: vps.Failed, Size: good("").Size},
	}
	f := good("vps_f")
	got := vps.Steps([]vps.Spec{d, c, b, a, f}, obs)
	want := []vps.Step{{"vps_a", vps.OpCreate}, {"vps_b", vps.OpStop}, {"vps_c", vps.OpResize}, {"vps_d", vps.OpUpdate},
		{"vps_e", vps.OpDelete}, {"vps_f", vps.OpStart}}
	if !slices.Equal(got, want) {
		t.Errorf("steps %v, want %v", got, want)
	}
	if s := vps.Steps([]vps.Spec{a}, []vps.Observed{{ID: "vps_a", State: vps.Running, Size: a.Size}}); len(s) != 0 {
		t.Errorf("a matching instance got steps %v", s)
	}
}
