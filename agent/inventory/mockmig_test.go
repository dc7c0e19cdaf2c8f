package inventory_test

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/mig"
	"github.com/bettercompute/bettercompute/proto/migcatalog"
)

func migCollector(t *testing.T) *inventory.Collector {
	t.Helper()
	c, err := inventory.New(inventory.NewMock(), inventory.Config{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// TestMockMIG_RefusesLikeTheDriver: the mock's GPU instances follow the
// driver's rules: memory-slice placements, no overlap, a profile's count,
// MIG mode on, busy instances, mode changes with instances.
func TestMockMIG_RefusesLikeTheDriver(t *testing.T) {
	t.Parallel()
	c := migCollector(t)
	d, ret := inventory.NVMLOf(c).DeviceGetHandleByIndex(0)
	if ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	info := func(id int) *nvml.GpuInstanceProfileInfo {
		i, ret := d.GetGpuInstanceProfileInfo(id)
		if ret != nvml.SUCCESS {
			t.Fatalf("profile %d: %v", id, ret)
		}
		return &i
	}
	create := func(id int, start, size uint32) nvml.Return {
		_, ret := d.CreateGpuInstanceWithPlacement(info(id), &nvml.GpuInstancePlacement{Start: start, Size: size})
		return ret
	}
	if ret := create(migcatalog.NVMLProfile3Slice, 0, 4); ret != nvml.ERROR_NOT_SUPPORTED {
		t.Fatalf("create with MIG off: %v", ret)
	}
	if ret, _ := d.SetMigMode(nvml.DEVICE_MIG_ENABLE); ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	pl, ret := d.GetGpuInstancePossiblePlacements(info(migcatalog.NVMLProfile3Slice))
	if ret != nvml.SUCCESS || !slices.Equal(pl, []nvml.GpuInstancePlacement{{Start: 0, Size: 4}, {Start: 4, Size: 4}}) {
		t.Fatalf("3g placements %v %v, want memory slices 0 and 4 of 4", pl, ret)
	}
	for _, tc := range []struct {
		name        string
		id          int
		start, size uint32
		want        nvml.Return
	}{
		{"3g at 0", migcatalog.NVMLProfile3Slice, 0, 4, nvml.SUCCESS},
		{"3g at 2: not a start", migcatalog.NVMLProfile3Slice, 2, 4, nvml.ERROR_INVALID_ARGUMENT},
		{"1g at 3 overlaps the 3g", migcatalog.NVMLProfile1Slice, 3, 1, nvml.ERROR_INSUFFICIENT_RESOURCES},
		{"2g at 4", migcatalog.NVMLProfile2Slice, 4, 2, nvml.SUCCESS},
		{"2g at 4 again", migcatalog.NVMLProfile2Slice, 4, 2, nvml.ERROR_INSUFFICIENT_RESOURCES},
		{"1g at 6", migcatalog.NVMLProfile1Slice, 6, 1, nvml.SUCCESS},
		{"1g+me at 7: not a start", migcatalog.NVMLProfile1SliceRev1, 7, 1, nvml.ERROR_INVALID_ARGUMENT},
	} {
		if got := create(tc.id, tc.start, tc.size); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
	// A second 4g would be over its count of one, and over 7 compute slices.
	if ret := create(migcatalog.NVMLProfile4Slice, 0, 4); ret != nvml.ERROR_INSUFFICIENT_RESOURCES {
		t.Fatalf("4g over the others: %v", ret)
	}
	if ret, _ := d.SetMigMode(nvml.DEVICE_MIG_DISABLE); ret != nvml.ERROR_IN_USE {
		t.Fatalf("MIG off with instances: %v", ret)
	}
	gis, _ := d.GetGpuInstances(info(migcatalog.NVMLProfile3Slice))
	if len(gis) != 1 {
		t.Fatalf("3g instances %d", len(gis))
	}
	ciInfo, ret := gis[0].GetComputeInstanceProfileInfo(nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
	if ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	if _, ret := gis[0].CreateComputeInstance(&ciInfo); ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	if ret := gis[0].Destroy(); ret != nvml.ERROR_IN_USE {
		t.Fatalf("destroying a GPU instance with a compute instance: %v", ret)
	}
	// The compute instance is a MIG device with a MIG UUID.
	md, ret := d.GetMigDeviceHandleByIndex(0)
	if ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	u, _ := md.GetUUID()
	gpu, _ := d.GetUUID()
	if !strings.HasPrefix(u, "MIG-") || u != inventory.MockMigUUID(gpu, 0, 0) {
		t.Fatalf("MIG UUID %q", u)
	}
	if _, ret := d.GetMigDeviceHandleByIndex(1); ret != nvml.ERROR_NOT_FOUND {
		t.Fatalf("second MIG device: %v", ret)
	}
}

// TestMockMIG_ResetAndReboot: a mode change that needs a reset stays
// pending until gpu.reset; a simulated reboot loses the instances and
// keeps the mode; the inventory reports each GPU's slices.
func TestMockMIG_ResetAndReboot(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := migCollector(t)
	gpus, err := c.GPUs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	u := gpus[1].GetUuid()
	if err := c.Faults().Inject(1, inventory.Fault{MIGNeedsReset: true}); err != nil {
		t.Fatal(err)
	}
	m, _ := migcatalog.ByName("H200 141GB")
	pl, _ := m.Place([]string{"3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb"}, nil)
	w := mig.Want{GPU: u, Enabled: true, Instances: pl}
	if _, _, err := c.ApplyMIG(w); mig.KindOf(err) != mig.ResetRequired {
		t.Fatalf("apply: %v, want reset-required", err)
	}
	if err := c.Reset(ctx, u); err != nil {
		t.Fatal(err)
	}
	l, _, err := c.ApplyMIG(w)
	if err != nil || !l.Matches(w) {
		t.Fatalf("after the reset: %v %v", l, err)
	}
	gpus, err = c.GPUs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	s := gpus[1].GetMigSlices()
	if !gpus[1].GetMigEnabled() || len(s) != 4 || len(gpus[0].GetMigSlices()) != 0 {
		t.Fatalf("inventory: GPU 1 %v, GPU 0 %v", gpus[1], gpus[0])
	}
	for i, in := range l.Instances {
		if s[i].GetUuid() != in.UUID || s[i].GetProfile() != in.Profile || int(s[i].GetStart()) != in.Start || s[i].GetMemoryBytes() != in.MemoryMiB<<20 {
			t.Fatalf("slice %d: %v, want %+v", i, s[i], in)
		}
	}
	c.SimulateReboot()
	l, err = c.MIGLayout(u)
	if err != nil || !l.Enabled || len(l.Instances) != 0 {
		t.Fatalf("after the reboot: %v %v", l, err)
	}
}
