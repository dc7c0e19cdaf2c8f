// Package migcatalog is the one table of MIG (Multi-Instance GPU) profiles
// per GPU model, read by both sides of the wire: pools.update and
// nodes.update validate a layout against it at admission, the capacity.mig
// job places a layout's instances with it, and the node's daemon applies
// exactly the placements it chose. A layout the catalog cannot place is
// refused before it reaches a node.
//
// Placements are in memory slices, as NVML reports them
// (nvmlDeviceGetGpuInstancePossiblePlacements): a GPU has 8 memory slices
// and 7 compute slices; a 3g profile takes 4 memory slices starting at 0 or
// 4, a 7g profile all 8. The figures are NVIDIA's MIG user guide's; a test
// on a GPU machine compares them with what the driver reports
// (docs/mig.md).
package migcatalog

import (
	"fmt"
	"slices"
	"sort"
	"strings"
)

// MemorySlices is the number of memory slices of every catalog GPU.
const MemorySlices = 8

// NVML GPU instance profile ids (nvml.GPU_INSTANCE_PROFILE_*), which the
// daemon passes to GetGpuInstanceProfileInfo.
const (
	NVMLProfile1Slice     = 0x0
	NVMLProfile2Slice     = 0x1
	NVMLProfile3Slice     = 0x2
	NVMLProfile4Slice     = 0x3
	NVMLProfile7Slice     = 0x4
	NVMLProfile1SliceRev1 = 0x7 // +me: the media extensions
	NVMLProfile1SliceRev2 = 0x9 // one compute slice, two memory slices
)

// Profile is one GPU instance profile of a model.
type Profile struct {
	// Name is the profile's name, "3g.71gb".
	Name string
	// NVMLID is the NVML GPU instance profile id.
	NVMLID int
	// ComputeSlices is what the profile weighs in placement and
	// GPU-hours: a 7g costs seven 1g.
	ComputeSlices int
	// Size is the number of memory slices an instance takes.
	Size int
	// MemoryMiB is an instance's memory.
	MemoryMiB uint64
	// MaxInstances is how many instances of the profile one GPU holds.
	MaxInstances int
	// Starts are the memory slices an instance may start at, in the order
	// the driver prefers them.
	Starts []int
}

// Model is one GPU model's MIG profiles.
type Model struct {
	// Name is the model's name, "H200 141GB".
	Name string
	// DeviceIDs are the PCI device ids (the high 16 bits of NVML's
	// pciDeviceId) the model is known by.
	DeviceIDs []uint16
	// Profiles are the model's profiles, smallest first.
	Profiles []Profile
}

// family builds a model's profiles from its 1g memory size in GiB: every
// catalog model (A100, H100, H200, B200) has the same seven profiles and
// placements, scaled.
func family(name string, ids []uint16, gib1, gib1rev2, gib2, gib3, gib7 int) Model {
	p := func(name string, id, compute, size, gib, most int, starts ...int) Profile {
		return Profile{Name: name, NVMLID: id, ComputeSlices: compute, Size: size, MemoryMiB: uint64(gib) * 1024, MaxInstances: most, Starts: starts}
	}
	g := func(n int) string { return fmt.Sprintf("%dgb", n) }
	return Model{Name: name, DeviceIDs: ids, Profiles: []Profile{
		p("1g."+g(gib1), NVMLProfile1Slice, 1, 1, gib1, 7, 0, 1, 2, 3, 4, 5, 6),
		p("1g."+g(gib1)+"+me", NVMLProfile1SliceRev1, 1, 1, gib1, 1, 0, 1, 2, 3, 4, 5, 6),
		p("1g."+g(gib1rev2), NVMLProfile1SliceRev2, 1, 2, gib1rev2, 4, 0, 2, 4, 6),
		p("2g."+g(gib2), NVMLProfile2Slice, 2, 2, gib2, 3, 0, 2, 4),
		p("3g."+g(gib3), NVMLProfile3Slice, 3, 4, gib3, 2, 0, 4),
		p("4g."+g(gib3), NVMLProfile4Slice, 4, 4, gib3, 1, 0),
		p("7g."+g(gib7), NVMLProfile7Slice, 7, 8, gib7, 1, 0),
	}}
}

// Models is the catalog. PCI device ids from the PCI ID database; 0x2333
// is the id go-nvml's dgxh200 mock gives its H200s.
var Models = []Model{
	family("A100 40GB", []uint16{0x20B0, 0x20F1}, 5, 10, 10, 20, 40),
	family("A100 80GB", []uint16{0x20B2, 0x20B5}, 10, 20, 20, 40, 80),
	family("H100 80GB", []uint16{0x2330, 0x2331}, 10, 20, 20, 40, 80),
	family("H100 NVL", []uint16{0x2321}, 12, 24, 24, 47, 94),
	family("H200 141GB", []uint16{0x2335, 0x233B, 0x2333}, 18, 35, 35, 71, 141),
	family("B200", []uint16{0x2901, 0x2B00}, 23, 45, 45, 90, 180),
}

// ByPCIDeviceID finds the model of an NVML pciDeviceId (device id in the
// high 16 bits, vendor 0x10DE in the low) or of a bare 16-bit device id.
func ByPCIDeviceID(id uint32) (*Model, bool) {
	dev := uint16(id)
	if id > 0xFFFF {
		dev = uint16(id >> 16)
	}
	for i := range Models {
		if slices.Contains(Models[i].DeviceIDs, dev) {
			return &Models[i], true
		}
	}
	return nil, false
}

// ByProductName finds the model of a GPU by the product name NVML reports
// ("NVIDIA H200 141GB HBM3e", "NVIDIA A100-SXM4-40GB") and its memory: what
// the control plane's inventory stores, which has no PCI device id. An A100
// whose name does not say its size is told by its memory (80 GB models have
// more than 60 GiB).
func ByProductName(name string, memoryBytes uint64) (*Model, bool) {
	n := strings.ToUpper(name)
	pick := func(model string) (*Model, bool) { return ByName(model) }
	switch {
	case strings.Contains(n, "B200"):
		return pick("B200")
	case strings.Contains(n, "H200"):
		return pick("H200 141GB")
	case strings.Contains(n, "H100") && strings.Contains(n, "NVL"):
		return pick("H100 NVL")
	case strings.Contains(n, "H100"):
		return pick("H100 80GB")
	case strings.Contains(n, "A100") && strings.Contains(n, "80GB"):
		return pick("A100 80GB")
	case strings.Contains(n, "A100") && strings.Contains(n, "40GB"):
		return pick("A100 40GB")
	case strings.Contains(n, "A100") && memoryBytes > 60<<30:
		return pick("A100 80GB")
	case strings.Contains(n, "A100") && memoryBytes > 0:
		return pick("A100 40GB")
	}
	return nil, false
}

// ModelNames are the catalog's models' names, in catalog order.
func ModelNames() []string {
	out := make([]string, len(Models))
	for i, m := range Models {
		out[i] = m.Name
	}
	return out
}

// ByName finds a model by its catalog name (case-insensitive).
func ByName(name string) (*Model, bool) {
	for i := range Models {
		if strings.EqualFold(Models[i].Name, name) {
			return &Models[i], true
		}
	}
	return nil, false
}

// Profile finds a profile of m by name.
func (m *Model) Profile(name string) (Profile, bool) {
	for _, p := range m.Profiles {
		if p.Name == name {
			return p, true
		}
	}
	return Profile{}, false
}

// ProfileNames are m's profiles' names, smallest first.
func (m *Model) ProfileNames() []string {
	out := make([]string, len(m.Profiles))
	for i, p := range m.Profiles {
		out[i] = p.Name
	}
	return out
}

// Placement is one GPU instance of a layout.
type Placement struct {
	// Profile is the profile's name.
	Profile string
	// Start is the first memory slice; the instance takes the profile's
	// Size slices from it.
	Start int
}

// Error says why a layout cannot be placed; Profile names the profile at
// fault ("" when the layout as a whole does not fit).
type Error struct {
	Model, Profile, Msg string
}

func (e *Error) Error() string {
	if e.Profile == "" {
		return fmt.Sprintf("%s: %s", e.Model, e.Msg)
	}
	return fmt.Sprintf("%s: profile %q: %s", e.Model, e.Profile, e.Msg)
}

// Place finds a legal placement for profiles (one entry per instance) on
// one GPU of model m, returned in the order of profiles. keep are
// instances the GPU holds now: each is kept at its start where the layout
// still has an instance of its profile and the rest still fits, so a
// change moves as few instances as possible (none that a smaller change
// would not). An unknown profile, too many instances of one, or a set
// that fits in no arrangement is an *Error.
func (m *Model) Place(profiles []string, keep []Placement) ([]Placement, error) {
	count := map[string]int{}
	for _, name := range profiles {
		p, ok := m.Profile(name)
		if !ok {
			return nil, &Error{Model: m.Name, Profile: name, Msg: "not a MIG profile of this model (profiles: " + strings.Join(m.ProfileNames(), ", ") + ")"}
		}
		count[name]++
		if count[name] > p.MaxInstances {
			return nil, &Error{Model: m.Name, Profile: name, Msg: fmt.Sprintf("%d instances, at most %d per GPU", count[name], p.MaxInstances)}
		}
	}
	compute, memory := 0, 0
	for _, name := range profiles {
		p, _ := m.Profile(name)
		compute += p.ComputeSlices
		memory += p.Size
	}
	if compute > 7 || memory > MemorySlices {
		return nil, &Error{Model: m.Name, Msg: fmt.Sprintf("the layout needs %d compute and %d memory slices, a GPU has 7 and %d", compute, memory, MemorySlices)}
	}
	// Kept instances first, larger before smaller, then the rest larger
	// first: backtracking over each profile's starts.
	type item struct {
		idx  int
		p    Profile
		keep int // start to try first, -1 none
	}
	items := make([]item, len(profiles))
	left := map[string][]int{} // profile -> kept starts not yet claimed
	for _, k := range keep {
		left[k.Profile] = append(left[k.Profile], k.Start)
	}
	for i, name := range profiles {
		p, _ := m.Profile(name)
		it := item{idx: i, p: p, keep: -1}
		if s := left[name]; len(s) > 0 {
			it.keep, left[name] = s[0], s[1:]
		}
		items[i] = it
	}
	sort.SliceStable(items, func(a, b int) bool {
		ka, kb := items[a].keep >= 0, items[b].keep >= 0
		if ka != kb {
			return ka
		}
		return items[a].p.Size > items[b].p.Size
	})
	var used [MemorySlices]bool
	computeUsed := 0
	out := make([]Placement, len(profiles))
	fits := func(start, size int) bool {
		if start+size > MemorySlices {
			return false
		}
		for s := start; s < start+size; s++ {
			if used[s] {
				return false
			}
		}
		return true
	}
	set := func(start, size int, v bool) {
		for s := start; s < start+size; s++ {
			used[s] = v
		}
	}
	var try func(i int) bool
	try = func(i int) bool {
		if i == len(items) {
			return true
		}
		it := items[i]
		starts := it.p.Starts
		if it.keep >= 0 && slices.Contains(starts, it.keep) {
			starts = append([]int{it.keep}, slices.DeleteFunc(slices.Clone(starts), func(s int) bool { return s == it.keep })...)
		}
		for _, s := range starts {
			// A 1g instance at memory slice 7 has no compute slice
			// of its own; NVML offers 0-6 only, and Starts say so.
			if !fits(s, it.p.Size) || computeUsed+it.p.ComputeSlices > 7 {
				continue
			}
			set(s, it.p.Size, true)
			computeUsed += it.p.ComputeSlices
			out[it.idx] = Placement{Profile: it.p.Name, Start: s}
			if try(i + 1) {
				return true
			}
			set(s, it.p.Size, false)
			computeUsed -= it.p.ComputeSlices
		}
		return false
	}
	if !try(0) {
		return nil, &Error{Model: m.Name, Msg: fmt.Sprintf("no arrangement of [%s] fits one GPU's memory slices", strings.Join(profiles, ", "))}
	}
	return out, nil
}
