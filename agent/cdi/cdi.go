// Package cdi generates and keeps the node's Container Device Interface
// spec: the file container engines (containerd, CRI-O, Docker, Podman) read
// from their CDI directory to give a container the devices it asks for by
// name.
//
// The spec is generated from the NVML view the way `nvidia-ctk cdi
// generate` does it, but offers only booked GPUs (exclusive semantics):
//
//   - kind bettercompute.io/gpu (Kind);
//   - one device per booked GPU, named by its UUID
//     (bettercompute.io/gpu=GPU-…), with its device node /dev/nvidiaN (N is
//     the GPU's minor number);
//   - one device per booked MIG slice, named by its MIG device's UUID
//     (bettercompute.io/gpu=MIG-…), with its parent GPU's /dev/nvidiaN and
//     its GPU and compute instances' capability nodes
//     /dev/nvidia-caps/nvidia-cap<minor> (minors from MigMinorsFile), as
//     nvidia-ctk gives a MIG device;
//   - one device per reservation, named by the reservation id
//     (bettercompute.io/gpu=rsv_…), with exactly its GPUs' (and slices')
//     device nodes;
//   - container edits common to every device: /dev/nvidiactl,
//     /dev/nvidia-uvm, /dev/nvidia-uvm-tools and /dev/nvidia-modeset (those
//     present), the driver's libraries and binaries as read-only bind mounts
//     (those found), and nvidia-ctk's update-ldcache createContainer hook
//     over the mounted libraries' folders when nvidia-ctk is installed.
//
// Device nodes are looked up under Config.DevRoot and the driver under
// Config.DriverRoot ("/" on a real node), so tests and simulated nodes run
// unprivileged with fake files. The spec is validated and written with the
// CDI reference library (tags.cncf.io/container-device-interface): its
// Cache.WriteSpec writes a temporary file and renames it into place. With
// no booked GPU there is no spec file at all (the library refuses a spec
// without devices, and no file resolves no name).
package cdi

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"tags.cncf.io/container-device-interface/pkg/cdi"
	"tags.cncf.io/container-device-interface/pkg/parser"
	specs "tags.cncf.io/container-device-interface/specs-go"
)

// Names of the spec.
const (
	// Vendor is the CDI vendor of the spec's devices.
	Vendor = "bettercompute.io"
	// Class is their CDI class.
	Class = "gpu"
	// Kind is Vendor/Class: a workload asks for Kind=<GPU UUID> or
	// Kind=<reservation id>.
	Kind = Vendor + "/" + Class
	// SpecFile is the spec's file name in the CDI directory.
	SpecFile = Vendor + "-" + Class + ".json"
	// DefaultDir is the CDI directory engines read by default.
	DefaultDir = "/var/run/cdi"
)

// GPU is one GPU, or one MIG device, as NVML reports it.
type GPU struct {
	// UUID is the GPU's UUID (GPU-…), or the MIG device's (MIG-…).
	UUID string
	// Minor is its minor number: its device node is /dev/nvidia<Minor>.
	// A MIG device's is its parent GPU's.
	Minor int
	// MIG, for a MIG device, are its GPU and compute instance ids on the
	// parent GPU; nil for a whole GPU.
	MIG *MIGInstance
}

// MIGInstance is a MIG device's place on its GPU.
type MIGInstance struct {
	GI, CI int
}

// MigMinorsFile is where the driver lists the MIG capabilities' device
// minors (under Config.DriverRoot): lines "gpu<minor>/gi<id>/access <n>"
// and "gpu<minor>/gi<id>/ci<id>/access <n>", each the minor of
// /dev/nvidia-caps/nvidia-cap<n> (what nvidia-ctk reads too).
const MigMinorsFile = "/proc/driver/nvidia-caps/mig-minors"

// ValidName says why CDI does not take name (a reservation id or GPU UUID)
// as a device name, or nil when it does.
func ValidName(name string) error { return parser.ValidateDeviceName(name) }

// Reservation is one booking: the GPUs (UUIDs) a reservation holds.
type Reservation struct {
	ID   string
	GPUs []string
}

// Config says where the spec goes and where the host's files are.
type Config struct {
	// Dir is the CDI directory the spec is written to (DefaultDir when
	// empty).
	Dir string
	// DevRoot is the root the device nodes are under ("/" when empty).
	DevRoot string
	// DriverRoot is the root the driver's libraries and binaries are under
	// ("/" when empty).
	DriverRoot string
	// NvidiaCTK is the nvidia-ctk binary of the update-ldcache hook; empty
	// looks it up on PATH, and without one the spec has no hook.
	NvidiaCTK string
}

// Control device nodes every device needs, in nvidia-ctk's order.
var controlNodes = []string{"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"}

// Library folders searched under DriverRoot, and the driver's libraries
// (glob patterns) as nvidia-ctk mounts them for the compute and utility
// capabilities.
var (
	libDirs = []string{"/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib/x86_64-linux-gnu", "/lib64"}
	libs    = []string{
		"libcuda.so.*", "libcudadebugger.so.*", "libnvidia-ml.so.*", "libnvidia-ptxjitcompiler.so.*",
		"libnvidia-nvvm.so.*", "libnvidia-gpucomp.so.*", "libnvidia-allocator.so.*", "libnvidia-cfg.so.*",
		"libnvidia-opencl.so.*", "libnvidia-pkcs11.so.*", "libnvidia-pkcs11-openssl3.so.*",
	}
	binDirs = []string{"/usr/bin", "/usr/local/bin"}
	bins    = []string{"nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server"}
)

// mountOptions are nvidia-ctk's options for the driver's files.
var mountOptions = []string{"ro", "nosuid", "nodev", "bind"}

// Writer generates, checks and writes the spec in one CDI directory.
type Writer struct {
	cfg   Config
	cache *cdi.Cache
	hook  string // nvidia-ctk's path, or "" for no hook
}

// New returns a Writer for cfg.
func New(cfg Config) (*Writer, error) {
	if cfg.Dir == "" {
		cfg.Dir = DefaultDir
	}
	if cfg.DevRoot == "" {
		cfg.DevRoot = "/"
	}
	if cfg.DriverRoot == "" {
		cfg.DriverRoot = "/"
	}
	w := &Writer{cfg: cfg}
	var err error
	if w.cache, err = cdi.NewCache(cdi.WithSpecDirs(cfg.Dir), cdi.WithAutoRefresh(false)); err != nil {
		return nil, fmt.Errorf("cdi: %w", err)
	}
	switch {
	case cfg.NvidiaCTK != "":
		if _, err := os.Stat(cfg.NvidiaCTK); err == nil {
			w.hook = cfg.NvidiaCTK
		}
	default:
		if p, err := exec.LookPath("nvidia-ctk"); err == nil {
			w.hook = p
		}
	}
	return w, nil
}

// Dir is the CDI directory.
func (w *Writer) Dir() string { return w.cfg.Dir }

// In returns a Writer like w for another CDI directory (the same device and
// driver roots and hook).
func (w *Writer) In(dir string) (*Writer, error) {
	if dir == w.cfg.Dir {
		return w, nil
	}
	o := &Writer{cfg: w.cfg, hook: w.hook}
	o.cfg.Dir = dir
	var err error
	if o.cache, err = cdi.NewCache(cdi.WithSpecDirs(dir), cdi.WithAutoRefresh(false)); err != nil {
		return nil, fmt.Errorf("cdi: %w", err)
	}
	return o, nil
}

// Path is the spec file's path.
func (w *Writer) Path() string { return filepath.Join(w.cfg.Dir, SpecFile) }

// Hook is the nvidia-ctk binary of the spec's update-ldcache hook, or ""
// when nvidia-ctk is not installed (the spec has no hook).
func (w *Writer) Hook() string { return w.hook }

// MissingNodesNote starts the note of a spec whose device nodes are not all
// on the host.
const MissingNodesNote = "device nodes missing on the host: "

// Spec is a generated spec and what was left out of it.
type Spec struct {
	// Raw is the spec; nil when nothing is booked.
	Raw *specs.Spec
	// Data is Raw as the library writes it (nil when Raw is nil).
	Data []byte
	// Notes say what the node lacks: a missing GPU device node, no
	// nvidia-ctk.
	Notes []string
}

// Generate returns the spec offering exactly the reservations' GPUs. gpus
// is the NVML view; a reservation naming a GPU not in it is an error, as is
// an id or UUID CDI does not accept as a device name. Write validates the
// result with the library before it reaches the disk.
func (w *Writer) Generate(gpus []GPU, rsvs []Reservation) (Spec, error) {
	byUUID := make(map[string]GPU, len(gpus))
	for _, g := range gpus {
		byUUID[g.UUID] = g
	}
	rsvs = slices.Clone(rsvs)
	slices.SortFunc(rsvs, func(a, b Reservation) int { return strings.Compare(a.ID, b.ID) })
	var out Spec
	raw := &specs.Spec{Kind: Kind}
	var missing []string
	seen := map[string]bool{}
	var caps map[string]int // MigMinorsFile, read at the first MIG device
	var nocaps []string     // MIG capabilities it does not list
	for _, r := range rsvs {
		if len(r.GPUs) == 0 {
			continue
		}
		if err := parser.ValidateDeviceName(r.ID); err != nil {
			return Spec{}, fmt.Errorf("cdi: reservation %q: %w", r.ID, err)
		}
		rd := specs.Device{Name: r.ID}
		for _, u := range r.GPUs {
			g, ok := byUUID[u]
			if !ok {
				return Spec{}, fmt.Errorf("cdi: GPU %s of %s is not in the NVML inventory", u, r.ID)
			}
			if err := parser.ValidateDeviceName(u); err != nil {
				return Spec{}, fmt.Errorf("cdi: GPU %q: %w", u, err)
			}
			paths, miss, nc, err := w.paths(g, &caps)
			if err != nil {
				return Spec{}, err
			}
			missing, nocaps = append(missing, miss...), append(nocaps, nc...)
			for _, p := range paths {
				if !slices.ContainsFunc(rd.ContainerEdits.DeviceNodes, func(n *specs.DeviceNode) bool { return n.Path == p }) {
					rd.ContainerEdits.DeviceNodes = append(rd.ContainerEdits.DeviceNodes, w.node(p))
				}
			}
			if !seen[u] {
				seen[u] = true
				d := specs.Device{Name: u}
				for _, p := range paths {
					d.ContainerEdits.DeviceNodes = append(d.ContainerEdits.DeviceNodes, w.node(p))
				}
				raw.Devices = append(raw.Devices, d)
			}
		}
		raw.Devices = append(raw.Devices, rd)
	}
	if len(raw.Devices) == 0 {
		return out, nil
	}
	slices.SortStableFunc(raw.Devices, func(a, b specs.Device) int { return strings.Compare(a.Name, b.Name) })
	if len(missing) > 0 {
		slices.Sort(missing)
		out.Notes = append(out.Notes, MissingNodesNote+strings.Join(slices.Compact(missing), ", "))
	}
	if len(nocaps) > 0 {
		out.Notes = append(out.Notes, "MIG capabilities not in "+MigMinorsFile+": "+strings.Join(nocaps, ", "))
	}
	raw.ContainerEdits = w.common()
	if w.hook == "" {
		out.Notes = append(out.Notes, "nvidia-ctk not installed: the spec has no update-ldcache hook")
	}
	v, err := specs.MinimumRequiredVersion(raw)
	if err != nil {
		return Spec{}, fmt.Errorf("cdi: %w", err)
	}
	raw.Version = v
	if out.Data, err = json.Marshal(raw); err != nil {
		return Spec{}, fmt.Errorf("cdi: %w", err)
	}
	out.Raw = raw
	return out, nil
}

// paths are g's device nodes, and those not on the host: /dev/nvidiaN,
// and for a MIG device its GPU and compute instances' capability nodes
// (/dev/nvidia-caps/nvidia-cap<minor>, minors from MigMinorsFile, read
// into *caps once). A capability the driver does not list is missing.
func (w *Writer) paths(g GPU, caps *map[string]int) (paths, missing, nocaps []string, err error) {
	paths = []string{fmt.Sprintf("/dev/nvidia%d", g.Minor)}
	if g.MIG != nil {
		if *caps == nil {
			if *caps, err = w.migMinors(); err != nil {
				return nil, nil, nil, err
			}
		}
		for _, name := range []string{
			fmt.Sprintf("gpu%d/gi%d/access", g.Minor, g.MIG.GI),
			fmt.Sprintf("gpu%d/gi%d/ci%d/access", g.Minor, g.MIG.GI, g.MIG.CI),
		} {
			n, ok := (*caps)[name]
			if !ok {
				nocaps = append(nocaps, name)
				continue
			}
			paths = append(paths, fmt.Sprintf("/dev/nvidia-caps/nvidia-cap%d", n))
		}
	}
	for _, p := range paths {
		if !w.exists(w.cfg.DevRoot, p) {
			missing = append(missing, p)
		}
	}
	return paths, missing, nocaps, nil
}

// migMinors reads MigMinorsFile under the driver root (none when absent).
func (w *Writer) migMinors() (map[string]int, error) {
	out := map[string]int{}
	b, err := os.ReadFile(filepath.Join(w.cfg.DriverRoot, MigMinorsFile))
	if errors.Is(err, fs.ErrNotExist) {
		return out, nil
	}
	if err != nil {
		return nil, fmt.Errorf("cdi: %w", err)
	}
	for line := range strings.Lines(string(b)) {
		f := strings.Fields(line)
		if len(f) != 2 {
			continue
		}
		if n, err := strconv.Atoi(f[1]); err == nil && n >= 0 {
			out[f[0]] = n
		}
	}
	return out, nil
}

// node is the device node at path (a container path), with its host path
// under DevRoot when that is not "/".
func (w *Writer) node(path string) *specs.DeviceNode {
	n := &specs.DeviceNode{Path: path}
	if w.cfg.DevRoot != "/" {
		n.HostPath = filepath.Join(w.cfg.DevRoot, path)
	}
	return n
}

func (w *Writer) exists(root, path string) bool {
	_, err := os.Stat(filepath.Join(root, path))
	return err == nil
}

// common is the edits every device needs: the control nodes present, the
// driver's files found and the ldcache hook.
func (w *Writer) common() specs.ContainerEdits {
	var e specs.ContainerEdits
	for _, p := range controlNodes {
		if w.exists(w.cfg.DevRoot, p) {
			e.DeviceNodes = append(e.DeviceNodes, w.node(p))
		}
	}
	var folders []string
	seen := map[string]bool{}
	for _, d := range libDirs {
		for _, pat := range libs {
			m, _ := filepath.Glob(filepath.Join(w.cfg.DriverRoot, d, pat))
			for _, host := range m {
				if fi, err := os.Stat(host); err != nil || fi.IsDir() {
					continue
				}
				ctr := filepath.Join(d, filepath.Base(host))
				if seen[ctr] {
					continue
				}
				seen[ctr] = true
				e.Mounts = append(e.Mounts, &specs.Mount{HostPath: host, ContainerPath: ctr, Options: mountOptions})
				if !slices.Contains(folders, d) {
					folders = append(folders, d)
				}
			}
		}
	}
	for _, b := range bins {
		for _, d := range binDirs {
			host := filepath.Join(w.cfg.DriverRoot, d, b)
			if fi, err := os.Stat(host); err != nil || fi.IsDir() {
				continue
			}
			e.Mounts = append(e.Mounts, &specs.Mount{HostPath: host, ContainerPath: filepath.Join(d, b), Options: mountOptions})
			break
		}
	}
	if w.hook != "" && len(folders) > 0 {
		args := []string{"nvidia-ctk", "hook", "update-ldcache"}
		for _, f := range folders {
			args = append(args, "--folder", f)
		}
		e.Hooks = append(e.Hooks, &specs.Hook{HookName: "createContainer", Path: w.hook, Args: args})
	}
	return e
}

// State is what is on disk compared with a generated spec.
type State int

// States of the spec file.
const (
	// Current means the file holds the spec (or both are absent).
	Current State = iota
	// Stale means the file is from an older booking or generation.
	Stale
	// Drifted means the file was edited or removed by someone else: it
	// differs from what this Writer last wrote.
	Drifted
)

// Check compares the file with s. A file that differs from s is Drifted
// when it also differs from last (what this Writer last wrote, nil for
// none: the file was edited or removed by hand), else Stale.
func (w *Writer) Check(s Spec, last []byte) (State, error) {
	have, err := os.ReadFile(w.Path())
	switch {
	case errors.Is(err, fs.ErrNotExist):
		have = nil
	case err != nil:
		return Stale, fmt.Errorf("cdi: %w", err)
	}
	switch {
	case string(have) == string(s.Data) && (have == nil) == (s.Data == nil):
		return Current, nil
	case string(have) == string(last) && (have == nil) == (last == nil):
		return Stale, nil
	}
	return Drifted, nil
}

// Write puts s on disk: validated and written atomically by the library
// (a temporary file renamed into the CDI directory), or the file removed
// when s offers nothing.
func (w *Writer) Write(s Spec) error {
	if s.Raw == nil {
		if err := w.cache.RemoveSpec(SpecFile); err != nil {
			return fmt.Errorf("cdi: %w", err)
		}
		return nil
	}
	if err := w.cache.WriteSpec(s.Raw, SpecFile); err != nil {
		return fmt.Errorf("cdi: %w", err)
	}
	// The library's temporary file is private; engines run as root, but a
	// rootless engine reads the spec too.
	if err := os.Chmod(w.Path(), 0o644); err != nil {
		return fmt.Errorf("cdi: %w", err)
	}
	return nil
}
