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
	if err := vps.Validate([]vps.Spec{good("inst_a"), good("inst_b")}); err != nil {
		t.Fatal(err)
	}
	bad := good("inst_c")
	bad.Power, bad.Size.VCPUs, bad.Image, bad.Hostname = "paused", 0, "../etc/passwd", "a_b"
	bad.GPUUUIDs = []string{"GPU-1"}
	other := good("inst_d")
	other.GPUUUIDs = []string{"GPU-1"}
	err := vps.Validate([]vps.Spec{bad, other, good("inst_c"), good("not-an-id")})
	for _, f := range []string{"instances[inst_c].state", "instances[inst_c].vcpus", "instances[inst_c].image", "instances[inst_c].hostname",
		"instances[inst_d].gpu_uuids", "instances[inst_c].id", "instances[3].id"} {
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
	a, b, c, d := good("inst_a"), good("inst_b"), good("inst_c"), good("inst_d")
	b.Power = vps.Stopped
	c.Size.VCPUs = 4
	d.Generation = 2
	obs := []vps.Observed{
		{ID: "inst_b", State: vps.Running, Size: b.Size},
		{ID: "inst_c", State: vps.Running, Size: good("").Size},
		{ID: "inst_d", State: vps.Running, Size: d.Size, Generation: 1},
		{ID: "inst_e", State: vps.Running},
		{ID: "inst_f", State: vps.Failed, Size: good("").Size},
	}
	f := good("inst_f")
	got := vps.Steps([]vps.Spec{d, c, b, a, f}, obs)
	want := []vps.Step{{"inst_a", vps.OpCreate}, {"inst_b", vps.OpStop}, {"inst_c", vps.OpResize}, {"inst_d", vps.OpUpdate},
		{"inst_e", vps.OpDelete}, {"inst_f", vps.OpStart}}
	if !slices.Equal(got, want) {
		t.Errorf("steps %v, want %v", got, want)
	}
	if s := vps.Steps([]vps.Spec{a}, []vps.Observed{{ID: "inst_a", State: vps.Running, Size: a.Size}}); len(s) != 0 {
		t.Errorf("a matching instance got steps %v", s)
	}
}
