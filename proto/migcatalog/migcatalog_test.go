package migcatalog

import (
	"errors"
	"slices"
	"testing"
)

func TestEveryModelPlacesItsLayouts(t *testing.T) {
	for _, m := range Models {
		n := func(i int) string { return m.Profiles[i].Name } // 0:1g 1:1g+me 2:1g rev2 3:2g 4:3g 5:4g 6:7g
		good := [][]string{
			{n(6)},
			{n(0), n(0), n(0), n(0), n(0), n(0), n(0)},
			{n(4), n(4)},
			{n(5), n(4)},
			{n(4), n(3), n(0), n(0)},
			{n(5), n(3), n(0)},
			{n(3), n(3), n(3), n(0)},
			{n(2), n(2), n(2), n(2)},
			{n(1), n(0), n(0), n(0), n(0), n(0), n(0)},
			{},
		}
		for _, l := range good {
			ps, err := m.Place(l, nil)
			if err != nil {
				t.Errorf("%s %v: %v", m.Name, l, err)
				continue
			}
			checkNoOverlap(t, &m, ps)
		}
		bad := []struct {
			layout  []string
			profile string // "" for a whole-layout refusal
		}{
			{[]string{"9g.1tb"}, "9g.1tb"},
			{[]string{n(6), n(0)}, ""},
			{[]string{n(4), n(4), n(0)}, ""},
			{[]string{n(5), n(5)}, n(5)},
			{[]string{n(1), n(1)}, n(1)},
			{[]string{n(0), n(0), n(0), n(0), n(0), n(0), n(0), n(0)}, n(0)},
			{[]string{n(3), n(3), n(3), n(3)}, n(3)},
			{[]string{n(2), n(2), n(2), n(2), n(0)}, ""},
		}
		for _, c := range bad {
			_, err := m.Place(c.layout, nil)
			var e *Error
			if !errors.As(err, &e) || e.Profile != c.profile || e.Model != m.Name {
				t.Errorf("%s %v: got %v, want an error naming profile %q", m.Name, c.layout, err, c.profile)
			}
		}
	}
}

// The re-lay: 7×1g.18gb to 3g.71gb+2g.35gb+2×1g.18gb keeps two of
// the seven 1g instances where they are.
func TestPlaceKeepsInstancesThatStay(t *testing.T) {
	m, ok := ByName("H200 141GB")
	if !ok {
		t.Fatal("no H200 in the catalog")
	}
	var now []Placement
	for s := range 7 {
		now = append(now, Placement{Profile: "1g.18gb", Start: s})
	}
	ps, err := m.Place([]string{"3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb"}, now)
	if err != nil {
		t.Fatal(err)
	}
	checkNoOverlap(t, m, ps)
	kept := 0
	for _, p := range ps {
		if slices.Contains(now, p) {
			kept++
		}
	}
	if kept != 2 {
		t.Fatalf("placements %v keep %d of the current instances, want 2", ps, kept)
	}
	// The same layout again moves nothing.
	again, err := m.Place([]string{"1g.18gb", "3g.71gb", "1g.18gb", "2g.35gb"}, ps)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range again {
		if !slices.Contains(ps, p) {
			t.Fatalf("re-placing the same layout moved %v (was %v)", p, ps)
		}
	}
}

func TestByPCIDeviceID(t *testing.T) {
	for _, c := range []struct {
		id   uint32
		want string
	}{
		{0x233510DE, "H200 141GB"},
		{0x2335, "H200 141GB"},
		{0x233310DE, "H200 141GB"}, // go-nvml's dgxh200 mock
		{0x233010DE, "H100 80GB"},
		{0x20B210DE, "A100 80GB"},
		{0x20F110DE, "A100 40GB"},
		{0x232110DE, "H100 NVL"},
		{0x290110DE, "B200"},
	} {
		m, ok := ByPCIDeviceID(c.id)
		if !ok || m.Name != c.want {
			t.Errorf("ByPCIDeviceID(%#x) = %v, want %s", c.id, m, c.want)
		}
	}
	if m, ok := ByPCIDeviceID(0x20B710DE); ok { // A30: MIG, not in the catalog
		t.Errorf("A30 found as %s", m.Name)
	}
}

func TestCatalogShape(t *testing.T) {
	seen := map[uint16]string{}
	for _, m := range Models {
		for _, id := range m.DeviceIDs {
			if other, dup := seen[id]; dup {
				t.Errorf("device id %#x in %s and %s", id, other, m.Name)
			}
			seen[id] = m.Name
		}
		for _, p := range m.Profiles {
			if len(p.Starts) < p.MaxInstances {
				t.Errorf("%s %s: %d starts for %d instances", m.Name, p.Name, len(p.Starts), p.MaxInstances)
			}
			for _, s := range p.Starts {
				if s+p.Size > MemorySlices {
					t.Errorf("%s %s: start %d overruns the GPU", m.Name, p.Name, s)
				}
			}
		}
	}
	h200, _ := ByName("H200 141GB")
	want := []string{"1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"}
	if got := h200.ProfileNames(); !slices.Equal(got, want) {
		t.Fatalf("H200 profiles %v, want %v", got, want)
	}
}

func checkNoOverlap(t *testing.T, m *Model, ps []Placement) {
	t.Helper()
	var used [MemorySlices]bool
	compute := 0
	for _, pl := range ps {
		p, ok := m.Profile(pl.Profile)
		if !ok || !slices.Contains(p.Starts, pl.Start) {
			t.Fatalf("%s: %v is not a legal placement", m.Name, pl)
		}
		compute += p.ComputeSlices
		for s := pl.Start; s < pl.Start+p.Size; s++ {
			if used[s] {
				t.Fatalf("%s: placements %v overlap at memory slice %d", m.Name, ps, s)
			}
			used[s] = true
		}
	}
	if compute > 7 {
		t.Fatalf("%s: placements %v use %d compute slices", m.Name, ps, compute)
	}
}

func TestByProductName(t *testing.T) {
	for _, c := range []struct {
		name string
		mem  uint64
		want string
	}{
		{"NVIDIA H200 141GB HBM3e", 144384 << 20, "H200 141GB"}, // go-nvml's dgxh200 mock
		{"NVIDIA H200", 150_000_000_000, "H200 141GB"},
		{"NVIDIA H100 80GB HBM3", 80 << 30, "H100 80GB"},
		{"NVIDIA H100 NVL", 94 << 30, "H100 NVL"},
		{"NVIDIA A100-SXM4-40GB", 40 << 30, "A100 40GB"},
		{"NVIDIA A100-SXM4-80GB", 80 << 30, "A100 80GB"},
		{"NVIDIA A100 PCIe", 80 << 30, "A100 80GB"},
		{"NVIDIA A100 PCIe", 40 << 30, "A100 40GB"},
		{"NVIDIA B200", 180 << 30, "B200"},
	} {
		m, ok := ByProductName(c.name, c.mem)
		if !ok || m.Name != c.want {
			t.Errorf("ByProductName(%q, %d) = %v, %v; want %s", c.name, c.mem, m, ok, c.want)
		}
	}
	for _, name := range []string{"NVIDIA L40S", "Tesla V100-SXM2-32GB", "", "NVIDIA A100"} {
		if m, ok := ByProductName(name, 0); ok {
			t.Errorf("ByProductName(%q) = %s; want no MIG model", name, m.Name)
		}
	}
}
