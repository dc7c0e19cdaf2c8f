// Package mig applies one GPU's MIG (Multi-Instance GPU) layout through
// NVML and reads back what the GPU has: the NodeSpec mig section's node
// side. A layout is the GPU instances the control plane placed
// (proto/migcatalog: profile and first memory slice); Apply turns MIG mode
// on or off, destroys every GPU instance (with its compute instances) that
// is not one of the placements, and creates the missing ones with
// CreateGpuInstanceWithPlacement at their start, each with one compute
// instance of the GPU instance's full size. An instance already at its
// placement is left alone (its MIG device and UUID stay), so applying the
// same layout twice changes nothing, and Apply touches only the GPU it is
// given.
//
// Failures are typed (*Error): Busy (the driver answers IN_USE: processes
// run on an instance; retried), ResetRequired (the MIG mode change waits
// for a GPU reset), Unsupported (the driver does not offer a profile, or
// MIG, on this GPU; terminal), Invalid (the layout does not fit the GPU's
// catalog model; terminal, nothing changed) and Failed (anything else;
// retried).
//
// The functions take an nvml.Interface and are not safe for concurrent use
// on one GPU: the caller serialises NVML calls (inventory.Collector does).
package mig

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/bettercompute/bettercompute/proto/migcatalog"
)

// Kind is a typed failure's kind, the word the section's status reason
// starts the GPU's entry with.
type Kind string

// Failure kinds.
const (
	// Busy: the driver refused with IN_USE (processes run on a GPU
	// instance that must go, or on the GPU whose mode must change).
	// Retried.
	Busy Kind = "busy"
	// ResetRequired: the MIG mode change is pending until the GPU is
	// reset (gpu.reset, or a reboot). Retried after the reset.
	ResetRequired Kind = "reset-required"
	// Unsupported: the driver does not support a profile of the layout
	// (or MIG) on this GPU. Terminal: the layout must change.
	Unsupported Kind = "profile-unsupported"
	// Invalid: the layout does not fit this GPU's model (a profile it
	// lacks, a start the profile does not have, overlapping instances).
	// Terminal; nothing was changed.
	Invalid Kind = "invalid-layout"
	// Failed is any other failure. Retried.
	Failed Kind = "failed"
)

// Error is a typed failure applying one GPU's layout.
type Error struct {
	Kind Kind
	// GPU is the GPU's UUID.
	GPU string
	// Profile is the profile at fault, when one is.
	Profile string
	// Msg says what failed.
	Msg string
}

func (e *Error) Error() string {
	if e.Profile != "" {
		return fmt.Sprintf("%s: profile %s: %s", e.Kind, e.Profile, e.Msg)
	}
	return fmt.Sprintf("%s: %s", e.Kind, e.Msg)
}

// Terminal reports whether retrying cannot help.
func (e *Error) Terminal() bool { return e.Kind == Unsupported || e.Kind == Invalid }

// KindOf is err's kind (Failed for an error that is not an *Error).
func KindOf(err error) Kind {
	var e *Error
	if errors.As(err, &e) {
		return e.Kind
	}
	return Failed
}

// Want is one GPU's desired layout.
type Want struct {
	// GPU is the GPU's UUID.
	GPU string
	// Enabled says whether MIG mode is on; without it Instances is empty.
	Enabled bool
	// Instances are the GPU instances, at their placements.
	Instances []migcatalog.Placement
}

// Instance is one GPU instance a GPU has.
type Instance struct {
	// Profile is its profile's name ("" when the catalog does not know
	// the driver's profile).
	Profile string
	// Start is its first memory slice.
	Start int
	// GI is the driver's GPU instance id; CI its compute instance's id
	// (-1 when it has none).
	GI, CI int
	// UUID is its MIG device's UUID (MIG-…); empty without a compute
	// instance.
	UUID string
	// MemoryMiB is the instance's memory.
	MemoryMiB uint64
}

// Layout is what one GPU has.
type Layout struct {
	// GPU is the GPU's UUID.
	GPU string
	// Enabled is the current MIG mode; Pending the mode after the next
	// reset (differs from Enabled while a change waits for one).
	Enabled, Pending bool
	// Instances are the GPU instances, by start.
	Instances []Instance
}

// Placements are l's instances as placements, by start.
func (l Layout) Placements() []migcatalog.Placement {
	out := make([]migcatalog.Placement, len(l.Instances))
	for i, in := range l.Instances {
		out[i] = migcatalog.Placement{Profile: in.Profile, Start: in.Start}
	}
	return out
}

// Matches reports whether the GPU has exactly w: the mode, the instances
// at their placements, each with its compute instance.
func (l Layout) Matches(w Want) bool {
	if l.Enabled != w.Enabled || l.Pending != w.Enabled {
		return false
	}
	if !w.Enabled {
		return true
	}
	if len(l.Instances) != len(w.Instances) {
		return false
	}
	want := sorted(w.Instances)
	for i, in := range l.Instances {
		if in.Profile != want[i].Profile || in.Start != want[i].Start || in.CI < 0 {
			return false
		}
	}
	return true
}

// String is the layout for a status reason: "MIG disabled", or
// "3g.71gb@0 MIG-…, 1g.18gb@4 MIG-…".
func (l Layout) String() string {
	if !l.Enabled {
		return "MIG disabled"
	}
	if len(l.Instances) == 0 {
		return "MIG enabled, no instances"
	}
	parts := make([]string, len(l.Instances))
	for i, in := range l.Instances {
		parts[i] = fmt.Sprintf("%s@%d %s", cmp.Or(in.Profile, "unknown"), in.Start, cmp.Or(in.UUID, "(no compute instance)"))
	}
	return strings.Join(parts, ", ")
}

func sorted(p []migcatalog.Placement) []migcatalog.Placement {
	out := slices.Clone(p)
	slices.SortFunc(out, func(a, b migcatalog.Placement) int { return cmp.Compare(a.Start, b.Start) })
	return out
}

// Model is the catalog model of dev, by its PCI device id, else its name.
func Model(dev nvml.Device) (*migcatalog.Model, error) {
	if pci, ret := dev.GetPciInfo(); ret == nvml.SUCCESS {
		if m, ok := migcatalog.ByPCIDeviceID(pci.PciDeviceId); ok {
			return m, nil
		}
	}
	name, ret := dev.GetName()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("name: %s", nvml.ErrorString(ret))
	}
	mem, _ := dev.GetMemoryInfo()
	if m, ok := migcatalog.ByProductName(name, mem.Total); ok {
		return m, nil
	}
	return nil, fmt.Errorf("%s is not a MIG-capable model of the catalog", name)
}

// Validate checks w against the catalog model m: known profiles at legal
// starts, not overlapping, within each profile's count and the GPU's
// compute slices. It returns the problem with the offending instance's
// index ("instances[2].start: …"), or nil.
func Validate(m *migcatalog.Model, w Want) error {
	if !w.Enabled {
		if len(w.Instances) > 0 {
			return errors.New("instances: set while MIG is disabled")
		}
		return nil
	}
	var used [migcatalog.MemorySlices]int // instance index + 1 per slice
	count := map[string]int{}
	compute := 0
	for i, in := range w.Instances {
		p, ok := m.Profile(in.Profile)
		if !ok {
			return fmt.Errorf("instances[%d].profile: %q is not a MIG profile of %s (%s)", i, in.Profile, m.Name, strings.Join(m.ProfileNames(), ", "))
		}
		if !slices.Contains(p.Starts, in.Start) {
			return fmt.Errorf("instances[%d].start: %d is not a start of %s on %s (%s)", i, in.Start, p.Name, m.Name, ints(p.Starts))
		}
		if count[p.Name]++; count[p.Name] > p.MaxInstances {
			return fmt.Errorf("instances[%d].profile: %d instances of %s, at most %d per GPU", i, count[p.Name], p.Name, p.MaxInstances)
		}
		if compute += p.ComputeSlices; compute > 7 {
			return fmt.Errorf("instances[%d]: the layout needs more than the GPU's 7 compute slices", i)
		}
		for s := in.Start; s < in.Start+p.Size && s < len(used); s++ {
			if used[s] != 0 {
				return fmt.Errorf("instances[%d].start: %s at %d overlaps instances[%d] (memory slice %d)", i, p.Name, in.Start, used[s]-1, s)
			}
			used[s] = i + 1
		}
	}
	return nil
}

func ints(v []int) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = fmt.Sprint(x)
	}
	return strings.Join(s, ", ")
}

// handle is one GPU and its model.
type handle struct {
	uuid  string
	dev   nvml.Device
	model *migcatalog.Model
}

func open(lib nvml.Interface, uuid string) (*handle, error) {
	dev, ret := lib.DeviceGetHandleByUUID(uuid)
	if ret != nvml.SUCCESS {
		return nil, &Error{Kind: Failed, GPU: uuid, Msg: "no such GPU: " + nvml.ErrorString(ret)}
	}
	return &handle{uuid: uuid, dev: dev}, nil
}

// withModel finds h's catalog model (needed to name profiles).
func (h *handle) withModel() error {
	if h.model != nil {
		return nil
	}
	m, err := Model(h.dev)
	if err != nil {
		return &Error{Kind: Unsupported, GPU: h.uuid, Msg: err.Error()}
	}
	h.model = m
	return nil
}

// gi is one GPU instance the GPU has, with its compute instances.
type gi struct {
	Instance
	h   nvml.GpuInstance
	cis []nvml.ComputeInstance
	// info is its profile's.
	info nvml.GpuInstanceProfileInfo
}

// Read returns the layout the GPU with this UUID has.
func Read(lib nvml.Interface, uuid string) (Layout, error) {
	h, err := open(lib, uuid)
	if err != nil {
		return Layout{}, err
	}
	return h.read()
}

func (h *handle) read() (Layout, error) {
	l := Layout{GPU: h.uuid}
	cur, pending, ret := h.dev.GetMigMode()
	switch ret {
	case nvml.SUCCESS:
	case nvml.ERROR_NOT_SUPPORTED:
		return l, nil // not MIG-capable: MIG is off
	default:
		return l, h.fail(Failed, "", "MIG mode", ret)
	}
	l.Enabled, l.Pending = cur == nvml.DEVICE_MIG_ENABLE, pending == nvml.DEVICE_MIG_ENABLE
	if !l.Enabled {
		return l, nil
	}
	gis, err := h.instances()
	if err != nil {
		return l, err
	}
	uuids, err := h.migUUIDs()
	if err != nil {
		return l, err
	}
	for _, g := range gis {
		in := g.Instance
		in.UUID = uuids[[2]int{in.GI, in.CI}]
		l.Instances = append(l.Instances, in)
	}
	return l, nil
}

// fail is a typed error for a failed NVML call: IN_USE is Busy.
func (h *handle) fail(k Kind, profile, what string, ret nvml.Return) *Error {
	if ret == nvml.ERROR_IN_USE {
		k = Busy
	}
	return &Error{Kind: k, GPU: h.uuid, Profile: profile, Msg: what + ": " + nvml.ErrorString(ret)}
}

// instances lists the GPU's GPU instances by start, each with its compute
// instances, over the catalog's profiles (the driver lists instances per
// profile).
func (h *handle) instances() ([]gi, error) {
	if err := h.withModel(); err != nil {
		return nil, err
	}
	var out []gi
	for _, p := range h.model.Profiles {
		info, ret := h.dev.GetGpuInstanceProfileInfo(p.NVMLID)
		if ret == nvml.ERROR_NOT_SUPPORTED || ret == nvml.ERROR_INVALID_ARGUMENT {
			continue // this driver has no such profile: no instance of it either
		}
		if ret != nvml.SUCCESS {
			return nil, h.fail(Failed, p.Name, "profile info", ret)
		}
		list, ret := h.dev.GetGpuInstances(&info)
		if ret != nvml.SUCCESS {
			return nil, h.fail(Failed, p.Name, "listing GPU instances", ret)
		}
		for _, g := range list {
			gin, ret := g.GetInfo()
			if ret != nvml.SUCCESS {
				return nil, h.fail(Failed, p.Name, "GPU instance info", ret)
			}
			x := gi{Instance: Instance{Profile: p.Name, Start: int(gin.Placement.Start), GI: int(gin.Id), CI: -1,
				MemoryMiB: info.MemorySizeMB}, h: g, info: info}
			cis, err := h.computeInstances(g, p.Name)
			if err != nil {
				return nil, err
			}
			x.cis = cis
			if len(cis) > 0 {
				cin, ret := cis[0].GetInfo()
				if ret != nvml.SUCCESS {
					return nil, h.fail(Failed, p.Name, "compute instance info", ret)
				}
				x.CI = int(cin.Id)
			}
			out = append(out, x)
		}
	}
	slices.SortFunc(out, func(a, b gi) int { return cmp.Or(cmp.Compare(a.Start, b.Start), cmp.Compare(a.GI, b.GI)) })
	return out, nil
}

// ciProfiles are the compute instance profile ids, smallest first.
var ciProfiles = []int{
	nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, nvml.COMPUTE_INSTANCE_PROFILE_2_SLICE, nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE,
	nvml.COMPUTE_INSTANCE_PROFILE_4_SLICE, nvml.COMPUTE_INSTANCE_PROFILE_6_SLICE, nvml.COMPUTE_INSTANCE_PROFILE_7_SLICE,
	nvml.COMPUTE_INSTANCE_PROFILE_8_SLICE,
}

// computeInstances lists g's compute instances, of every profile.
func (h *handle) computeInstances(g nvml.GpuInstance, profile string) ([]nvml.ComputeInstance, error) {
	var out []nvml.ComputeInstance
	for _, id := range ciProfiles {
		info, ret := g.GetComputeInstanceProfileInfo(id, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		if ret != nvml.SUCCESS {
			continue // not a profile of this GPU instance
		}
		cis, ret := g.GetComputeInstances(&info)
		if ret != nvml.SUCCESS {
			return nil, h.fail(Failed, profile, "listing compute instances", ret)
		}
		out = append(out, cis...)
	}
	return out, nil
}

// migUUIDs maps (GPU instance id, compute instance id) to the MIG
// device's UUID.
func (h *handle) migUUIDs() (map[[2]int]string, error) {
	n, ret := h.dev.GetMaxMigDeviceCount()
	if ret != nvml.SUCCESS {
		return nil, h.fail(Failed, "", "MIG device count", ret)
	}
	out := map[[2]int]string{}
	for i := range n {
		md, ret := h.dev.GetMigDeviceHandleByIndex(i)
		if ret == nvml.ERROR_NOT_FOUND || ret == nvml.ERROR_INVALID_ARGUMENT {
			continue
		}
		if ret != nvml.SUCCESS {
			return nil, h.fail(Failed, "", "MIG device handle", ret)
		}
		g, ret1 := md.GetGpuInstanceId()
		c, ret2 := md.GetComputeInstanceId()
		u, ret3 := md.GetUUID()
		if ret := cmp.Or(ret1, ret2, ret3); ret != nvml.SUCCESS {
			return nil, h.fail(Failed, "", "MIG device", ret)
		}
		out[[2]int{g, c}] = u
	}
	return out, nil
}

// Apply makes the GPU have w and returns the layout it then has. It checks
// w against the GPU's catalog model first (a bad layout touches nothing);
// then it sets the MIG mode, destroys the GPU instances not in w (compute
// instances first) and creates w's missing instances with their compute
// instance. On failure the layout returned is what the GPU has then (as
// far as it could be read). steps are the changes made.
func Apply(lib nvml.Interface, w Want) (l Layout, steps []string, err error) {
	h, err := open(lib, w.GPU)
	if err != nil {
		return Layout{GPU: w.GPU}, nil, err
	}
	if w.Enabled {
		if err := h.withModel(); err != nil {
			return Layout{GPU: w.GPU}, nil, err
		}
		if err := Validate(h.model, w); err != nil {
			return Layout{GPU: w.GPU}, nil, &Error{Kind: Invalid, GPU: w.GPU, Msg: err.Error()}
		}
	}
	steps, err = h.apply(w)
	got, rerr := h.read()
	if err == nil {
		err = rerr
	}
	return got, steps, err
}

func (h *handle) apply(w Want) ([]string, error) {
	var steps []string
	cur, pending, ret := h.dev.GetMigMode()
	if ret == nvml.ERROR_NOT_SUPPORTED {
		if !w.Enabled {
			return nil, nil
		}
		return nil, &Error{Kind: Unsupported, GPU: h.uuid, Msg: "the driver does not support MIG on this GPU"}
	}
	if ret != nvml.SUCCESS {
		return nil, h.fail(Failed, "", "MIG mode", ret)
	}
	mode := nvml.DEVICE_MIG_DISABLE
	if w.Enabled {
		mode = nvml.DEVICE_MIG_ENABLE
	}
	if cur == nvml.DEVICE_MIG_ENABLE {
		// Destroy what w does not keep (everything when MIG goes off).
		s, err := h.destroyOthers(w)
		steps = append(steps, s...)
		if err != nil {
			return steps, err
		}
	}
	if cur != mode {
		if pending != mode {
			ret, activation := h.dev.SetMigMode(mode)
			if ret != nvml.SUCCESS {
				if ret == nvml.ERROR_NOT_SUPPORTED {
					return steps, &Error{Kind: Unsupported, GPU: h.uuid, Msg: "the driver does not support MIG on this GPU"}
				}
				return steps, h.fail(Failed, "", "setting MIG mode", ret)
			}
			steps = append(steps, fmt.Sprintf("set MIG mode %s", onOff(w.Enabled)))
			if activation != nvml.SUCCESS && activation != nvml.ERROR_RESET_REQUIRED {
				// Processes hold the GPU: the mode waits like a reset.
				if activation == nvml.ERROR_IN_USE {
					return steps, h.fail(Busy, "", "MIG mode change", activation)
				}
			}
		}
		if c, p, ret := h.dev.GetMigMode(); ret != nvml.SUCCESS {
			return steps, h.fail(Failed, "", "MIG mode", ret)
		} else if c != mode {
			return steps, &Error{Kind: ResetRequired, GPU: h.uuid,
				Msg: fmt.Sprintf("MIG mode %s is pending (current %s): the GPU must be reset (gpu.reset) or the node rebooted", onOff(p == nvml.DEVICE_MIG_ENABLE), onOff(c == nvml.DEVICE_MIG_ENABLE))}
		}
	}
	if !w.Enabled {
		return steps, nil
	}
	s, err := h.create(w)
	return append(steps, s...), err
}

func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}

// destroyOthers destroys every GPU instance w does not have at its
// placement (all of them when w disables MIG), compute instances first.
func (h *handle) destroyOthers(w Want) ([]string, error) {
	gis, err := h.instances()
	if err != nil {
		return nil, err
	}
	keep := map[migcatalog.Placement]bool{}
	if w.Enabled {
		for _, p := range w.Instances {
			keep[p] = true
		}
	}
	var steps []string
	for _, g := range gis {
		at := migcatalog.Placement{Profile: g.Profile, Start: g.Start}
		if keep[at] {
			delete(keep, at) // kept once; a second instance there goes
			continue
		}
		for _, ci := range g.cis {
			if ret := ci.Destroy(); ret != nvml.SUCCESS {
				return steps, h.fail(Failed, g.Profile, fmt.Sprintf("destroying compute instance of %s@%d", g.Profile, g.Start), ret)
			}
		}
		if ret := g.h.Destroy(); ret != nvml.SUCCESS {
			return steps, h.fail(Failed, g.Profile, fmt.Sprintf("destroying GPU instance %s@%d", g.Profile, g.Start), ret)
		}
		steps = append(steps, fmt.Sprintf("destroy %s@%d", g.Profile, g.Start))
	}
	return steps, nil
}

// create creates w's instances the GPU does not have, and the compute
// instance of any kept instance that lacks one.
func (h *handle) create(w Want) ([]string, error) {
	gis, err := h.instances()
	if err != nil {
		return nil, err
	}
	have := map[migcatalog.Placement]gi{}
	for _, g := range gis {
		have[migcatalog.Placement{Profile: g.Profile, Start: g.Start}] = g
	}
	var steps []string
	for _, p := range sorted(w.Instances) {
		g, ok := have[p]
		if !ok {
			prof, _ := h.model.Profile(p.Profile)
			info, ret := h.dev.GetGpuInstanceProfileInfo(prof.NVMLID)
			if ret == nvml.ERROR_NOT_SUPPORTED || ret == nvml.ERROR_INVALID_ARGUMENT {
				return steps, &Error{Kind: Unsupported, GPU: h.uuid, Profile: p.Profile,
					Msg: fmt.Sprintf("this driver does not offer it on this GPU (NVML profile %d: %s)", prof.NVMLID, nvml.ErrorString(ret))}
			}
			if ret != nvml.SUCCESS {
				return steps, h.fail(Failed, p.Profile, "profile info", ret)
			}
			size := uint32(prof.Size)
			if pl, ret := h.dev.GetGpuInstancePossiblePlacements(&info); ret == nvml.SUCCESS {
				for _, x := range pl {
					if int(x.Start) == p.Start {
						size = x.Size
					}
				}
			}
			gh, ret := h.dev.CreateGpuInstanceWithPlacement(&info, &nvml.GpuInstancePlacement{Start: uint32(p.Start), Size: size})
			if ret != nvml.SUCCESS {
				return steps, h.fail(Failed, p.Profile, fmt.Sprintf("creating GPU instance at memory slice %d", p.Start), ret)
			}
			steps = append(steps, fmt.Sprintf("create %s@%d", p.Profile, p.Start))
			g = gi{h: gh, info: info, Instance: Instance{Profile: p.Profile, Start: p.Start}}
		}
		if len(g.cis) > 0 {
			continue
		}
		if err := h.createCI(g); err != nil {
			return steps, err
		}
	}
	return steps, nil
}

// createCI creates g's compute instance of g's full size: the compute
// profile with as many slices as the GPU instance.
func (h *handle) createCI(g gi) error {
	for _, id := range slices.Backward(ciProfiles) {
		info, ret := g.h.GetComputeInstanceProfileInfo(id, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		if ret != nvml.SUCCESS || info.SliceCount != g.info.SliceCount {
			continue
		}
		if _, ret := g.h.CreateComputeInstance(&info); ret != nvml.SUCCESS {
			return h.fail(Failed, g.Profile, fmt.Sprintf("creating the compute instance of %s@%d", g.Profile, g.Start), ret)
		}
		return nil
	}
	return &Error{Kind: Unsupported, GPU: h.uuid, Profile: g.Profile,
		Msg: fmt.Sprintf("no compute instance profile of %d slices", g.info.SliceCount)}
}
