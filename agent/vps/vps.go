// Package vps runs a host's VPS instances: the NodeSpec `instances`
// section, converged by a [Reconciler] through a [Runtime] (a simulated one
// in vps/sim, libvirt/QEMU in vps/libvirt). The reconciler makes the
// runtime run exactly the desired instances, each at its power state, size
// and GPUs, deletes any other instance the runtime manages, and reports
// each instance's observed state: running, stopped or failed (with a
// reason).
//
// Instances outlive the daemon: a restarted daemon lists what the runtime
// runs and applies the spec again, which changes nothing for an instance
// that already matches. A running instance is never re-created; a resize
// stops and starts it with the new size.
//
// The package knows nothing of protobuf: the converge handler translates
// the section into [Spec] values and [Observed] values back.
package vps

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"unicode/utf8"

	"github.com/bettercompute/bettercompute/proto/instancespec"
)

// State is an instance's power state: desired (Running, Stopped) or
// observed (Running, Stopped, Failed).
type State string

// The states.
const (
	// Running means the instance runs.
	Running State = "running"
	// Stopped means the instance exists, powered off.
	Stopped State = "stopped"
	// Failed means the instance is not as desired and the runtime says why.
	Failed State = "failed"
)

// Size is what an instance is given of its host.
type Size struct {
	// VCPUs is the number of virtual CPUs.
	VCPUs uint32
	// MemoryMiB is the guest memory in MiB.
	MemoryMiB uint64
	// DiskGiB is the size of the root disk in GiB.
	DiskGiB uint32
}

// String formats s as "2 vCPUs, 4096 MiB, 20 GiB".
func (s Size) String() string {
	return fmt.Sprintf("%d vCPUs, %d MiB, %d GiB", s.VCPUs, s.MemoryMiB, s.DiskGiB)
}

// Spec is one desired instance.
type Spec struct {
	// ID is the instance, "inst_…".
	ID string
	// Generation is the instance's own spec generation; runtimes keep the
	// one they applied and report it in Observed.
	Generation int64
	// Image is the boot image: a file name the runtime resolves (the
	// libvirt runtime under its image directory).
	Image string
	// Size is the instance's vCPUs, memory and disk.
	Size Size
	// Power is the desired power state: Running or Stopped.
	Power State
	// GPUUUIDs are the booked GPUs, by UUID, as the spec names them.
	GPUUUIDs []string
	// GPUs are the booked GPUs by PCI address ("0000:18:00.0"), sorted:
	// the reconciler resolves them from GPUUUIDs before a runtime sees the
	// spec, and runtimes pass through exactly these.
	GPUs []string
	// Hostname is the guest's host name; empty means from the id.
	Hostname string
	// SSHKeys are the tenant's SSH public keys for the guest.
	SSHKeys []string
	// UserData is the tenant's cloud-init user data.
	UserData string
	// NetworkConfig is an optional cloud-init network-config.
	NetworkConfig string
}

// HostnameOrDefault is s.Hostname, or the id with "_" as "-".
func (s Spec) HostnameOrDefault() string {
	if s.Hostname != "" {
		return s.Hostname
	}
	return strings.ReplaceAll(s.ID, "_", "-")
}

// Observed is how one instance stands in a runtime.
type Observed struct {
	// ID is the instance.
	ID string
	// State is Running, Stopped or Failed.
	State State
	// Reason explains Failed.
	Reason string
	// Generation is the Spec.Generation the runtime last applied.
	Generation int64
	// Image is the image the instance was created from.
	Image string
	// Size is what the instance runs with (or will, once started).
	Size Size
	// GPUs are the GPUs passed through, by PCI address, sorted.
	GPUs []string
}

// Runtime runs instances on one host. Every method is idempotent and
// safe to call concurrently; a runtime manages only instances it created.
type Runtime interface {
	// Ensure makes the instance exist as spec says — created from its
	// image when missing, its definition matching spec's size and GPUs —
	// and at spec.Power. An instance that already matches is left alone
	// (never re-created); a running one whose size or GPUs change is
	// stopped and started again. It returns the instance as it now is.
	Ensure(ctx context.Context, spec Spec) (Observed, error)
	// Stop powers the instance off, keeping its disk.
	Stop(ctx context.Context, id string) error
	// Delete powers the instance off and removes it with its disk and
	// seed; deleting a missing instance is not an error.
	Delete(ctx context.Context, id string) error
	// Reboot restarts a running instance with its current definition.
	Reboot(ctx context.Context, id string) error
	// List returns every instance the runtime manages, sorted by id.
	List(ctx context.Context) ([]Observed, error)
}

// ErrNotFound is returned (wrapped) by Stop and Reboot for an instance the
// runtime does not have.
var ErrNotFound = errors.New("no such instance")

// ErrNotRunning is returned (wrapped) by Reboot for an instance that is not
// running.
var ErrNotRunning = errors.New("instance is not running")

// Bounds of the instances section.
const (
	// MaxInstances is the most instances one host runs.
	MaxInstances = 256
	// MaxVCPUs is the most vCPUs of one instance.
	MaxVCPUs = 1024
	// MaxMemoryMiB is the most memory of one instance (16 TiB).
	MaxMemoryMiB = 16 << 20
	// MaxDiskGiB is the largest root disk (64 TiB).
	MaxDiskGiB = 65536
	// MaxGPUs is the most GPUs passed through to one instance.
	MaxGPUs = 16
	// MaxSSHKeys is the most SSH keys of one instance (instancespec's).
	MaxSSHKeys = instancespec.MaxSSHKeys
	// MaxSSHKeyBytes is the longest SSH key.
	MaxSSHKeyBytes = instancespec.MaxSSHKeyBytes
	// MaxUserDataBytes is the largest tenant user data.
	MaxUserDataBytes = instancespec.MaxUserDataBytes
	// MaxNetworkConfigBytes is the largest network-config.
	MaxNetworkConfigBytes = instancespec.MaxNetworkConfigBytes
	// MaxImageBytes is the longest image reference.
	MaxImageBytes = instancespec.MaxImageBytes
	// MaxReasonBytes is the longest reason an Observed carries.
	MaxReasonBytes = 1024
)

var (
	idRE  = regexp.MustCompile(`^inst_[A-Za-z0-9]{1,60}$`)
	pciRE = regexp.MustCompile(`^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$`)
)

// FieldError is one invalid field of one instance.
type FieldError struct {
	// Field names the field, e.g. "instances[inst_a].vcpus".
	Field string
	// Problem says what is wrong.
	Problem string
}

func (e FieldError) Error() string { return e.Field + ": " + e.Problem }

// Validate checks the desired instances against the section's bounds and
// returns every problem (a FieldError each, joined), or nil.
func Validate(specs []Spec) error {
	_, errs := check(specs)
	return errors.Join(errs...)
}

// ValidateEach sorts the desired instances into the valid ones, in order,
// and the invalid ones by id with what is wrong (the instance id's shape
// is checked first; one named twice is invalid as a whole). An invalid
// instance fails alone: the others stay valid. err is a problem of the
// section itself (more than MaxInstances), which fails every instance.
// Specs whose id is malformed cannot be reported by id: they are in
// neither result, and their count is dropped.
func ValidateEach(specs []Spec) (valid []Spec, invalid map[string]string, dropped int, err error) {
	bad, errs := check(specs)
	if len(specs) > MaxInstances {
		return nil, nil, 0, errors.Join(errs...)
	}
	invalid = map[string]string{}
	for i, s := range specs {
		if !idRE.MatchString(s.ID) {
			dropped++
			continue
		}
		if p := bad[i]; len(p) > 0 {
			invalid[s.ID] = truncate(strings.Join(p, "; "), MaxReasonBytes)
		}
	}
	for _, s := range specs {
		if idRE.MatchString(s.ID) && invalid[s.ID] == "" {
			valid = append(valid, s)
		}
	}
	return valid, invalid, dropped, nil
}

// check returns the problems of each spec by index (for an id named twice,
// under both indexes) and all of them as FieldErrors.
func check(specs []Spec) (map[int][]string, []error) {
	var errs []error
	byIndex := map[int][]string{}
	if len(specs) > MaxInstances {
		errs = append(errs, FieldError{Field: "instances", Problem: fmt.Sprintf("%d instances, at most %d", len(specs), MaxInstances)})
		return byIndex, errs
	}
	var i int
	var id string
	bad := func(field, format string, a ...any) {
		e := FieldError{Field: fmt.Sprintf("instances[%s].%s", id, field), Problem: fmt.Sprintf(format, a...)}
		errs = append(errs, e)
		byIndex[i] = append(byIndex[i], e.Error())
	}
	seen := map[string]int{}
	gpuOwner := map[string]string{}
	for i = range specs {
		s := specs[i]
		id = s.ID
		if !idRE.MatchString(id) {
			id = fmt.Sprint(i)
			bad("id", "%q is not an instance id (inst_ and 1 to 60 letters or digits)", truncate(s.ID, 80))
			continue
		}
		if first, ok := seen[id]; ok {
			bad("id", "named twice")
			byIndex[first] = append(byIndex[first], fmt.Sprintf("instances[%s].id: named twice", id))
			continue
		}
		seen[id] = i
		if s.Power != Running && s.Power != Stopped {
			bad("state", "%q: want running or stopped", truncate(string(s.Power), 40))
		}
		if err := instancespec.CheckImage(s.Image); err != nil {
			bad("image", "%v", err)
		}
		if s.Size.VCPUs < 1 || s.Size.VCPUs > MaxVCPUs {
			bad("vcpus", "%d, want 1 to %d", s.Size.VCPUs, MaxVCPUs)
		}
		if s.Size.MemoryMiB < 1 || s.Size.MemoryMiB > MaxMemoryMiB {
			bad("memory", "%d MiB, want 1 MiB to %d MiB", s.Size.MemoryMiB, MaxMemoryMiB)
		}
		if s.Size.DiskGiB < 1 || s.Size.DiskGiB > MaxDiskGiB {
			bad("disk_gib", "%d, want 1 to %d", s.Size.DiskGiB, MaxDiskGiB)
		}
		if len(s.GPUUUIDs) > MaxGPUs {
			bad("gpu_uuids", "%d GPUs, at most %d", len(s.GPUUUIDs), MaxGPUs)
		}
		for _, u := range s.GPUUUIDs {
			if other, ok := gpuOwner[u]; ok {
				bad("gpu_uuids", "GPU %s is also booked by %s", truncate(u, 80), other)
				continue
			}
			gpuOwner[u] = id
		}
		for _, a := range s.GPUs {
			if !pciRE.MatchString(a) {
				bad("gpus", "%q is not a PCI address (dddd:bb:ss.f)", truncate(a, 40))
			}
		}
		if err := instancespec.CheckHostname(s.Hostname); err != nil {
			bad("hostname", "%v", err)
		}
		if len(s.SSHKeys) > MaxSSHKeys {
			bad("ssh_authorized_keys", "%d keys, at most %d", len(s.SSHKeys), MaxSSHKeys)
		}
		for k, key := range s.SSHKeys {
			if err := instancespec.CheckSSHKey(key); err != nil {
				bad(fmt.Sprintf("ssh_authorized_keys[%d]", k), "%v", err)
			}
		}
		if err := instancespec.CheckUserData(s.UserData); err != nil {
			bad("user_data", "%v", err)
		}
		if err := instancespec.CheckNetworkConfig(s.NetworkConfig); err != nil {
			bad("network_config", "%v", err)
		}
	}
	return byIndex, errs
}

// truncate cuts s to at most n bytes (on a rune boundary) for messages.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + "…"
}

// Reason bounds a failure's text to MaxReasonBytes.
func Reason(err error) string { return truncate(err.Error(), MaxReasonBytes) }

// Matches reports whether o is what s asks for: the same power state, size,
// GPUs and generation.
func Matches(o Observed, s Spec) bool {
	return o.State == s.Power && o.Size == s.Size && slices.Equal(o.GPUs, s.GPUs) && o.Generation == s.Generation
}
