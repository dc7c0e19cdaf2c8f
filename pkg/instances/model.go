// Package instances is the control plane's store of VPS instances (DESIGN
// §14): instances, the capacity of the hosts of hosted pools (class
// "vps-host") they are placed on, their GPUs, quotas and usage.
//
// An instance is desired state: its power state, size and presence change
// in the database (bumping its generation), and the host it is placed on
// runs what its NodeSpec "instances" section says; the caller invalidates
// that host's spec in the same transaction.
//
// No host is ever oversubscribed. Each host has one host_capacity row with
// its totals (what its inventory or the pool says it has, minus the pool's
// reserve) and what its instances use; [Place], [Resize] and [Delete]
// change the used counters in the caller's transaction, and CHECK
// constraints make a counter above its total impossible (migration 00026).
// A GPU is claimed per device, with a partial unique index holding at most
// one active claim per device, as GPU bookings do (pkg/capacity) — a table
// of its own rather than bookings, because bookings belong to reservations
// (the placer re-places and expires them, the devices section exposes them)
// and a vps-host node is never in a gpu pool, so the two never compete for
// one device.
package instances

import (
	"strings"
	"time"

	"github.com/bettercompute/bettercompute/proto/instancespec"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// States of an instance.
const (
	// StatePending: not placed yet (a provider pool's instance before the
	// provider made it).
	StatePending = "pending"
	// StatePlaced: its capacity is claimed on a host that has not yet
	// reported it running or stopped.
	StatePlaced  = "placed"
	StateRunning = "running"
	StateStopped = "stopped"
	// StateFailed: the host reported it failed (Reason says why); it keeps
	// its capacity until deleted.
	StateFailed = "failed"
	// StateDeleting: deleted, its capacity released, the host not yet done
	// removing it.
	StateDeleting = "deleting"
	StateDeleted  = "deleted"
)

// States lists every state.
var States = []string{StatePending, StatePlaced, StateRunning, StateStopped, StateFailed, StateDeleting, StateDeleted}

// Live reports whether an instance in state s holds (or waits for)
// capacity and counts against quotas.
func Live(s string) bool { return s != StateDeleting && s != StateDeleted }

// Desired power states.
const (
	PowerRunning = "running"
	PowerStopped = "stopped"
)

// Bounds of an instance's size and settings.
const (
	MaxVCPUs       = 1024
	MaxMemoryMiB   = 16 << 20 // 16 TiB
	MaxDiskGiB     = 64 << 10 // 64 TiB, what the agent's runtime takes
	MaxGPUs        = 16
	MaxModelLength = 128
	// The image, SSH keys and user data go to the host verbatim: their
	// bounds and shape are the host daemon's own (proto/instancespec).
	MaxImageLength   = instancespec.MaxImageBytes
	MaxSSHKeys       = instancespec.MaxSSHKeys
	MaxSSHKeyLength  = instancespec.MaxSSHKeyBytes
	MaxUserDataBytes = instancespec.MaxUserDataBytes
)

// DefaultLostAfter is how long a host may go unseen before placement stops
// choosing it (capacity.DefaultLostAfter).
const DefaultLostAfter = 2 * time.Minute

// DefaultRetention is how long a deleted instance's row is kept before
// [Prune] removes it.
const DefaultRetention = 30 * 24 * time.Hour

// Size is what an instance holds on its host.
type Size struct {
	VCPUs     int
	MemoryMiB int64
	DiskGiB   int64
	GPUs      int
}

// Instance is one VPS instance.
type Instance struct {
	ID       string
	TenantID string
	PoolID   string
	// NodeID is the host it is placed on; "" before placement and in
	// provider pools.
	NodeID string
	Size
	// GPUModel narrows the GPUs to a model ("NVIDIA H200" matches "NVIDIA
	// H200 141GB HBM3e"); any when empty.
	GPUModel string
	Image    string
	SSHKeys  []string
	UserData string
	// Power is the desired power state, PowerRunning or PowerStopped.
	Power  string
	State  string
	Reason string
	// Generation is bumped by every change of desired state.
	Generation         int64
	ObservedGeneration int64
	ObservedState      string
	ObservedReason     string
	ObservedAt         *time.Time
	ProviderMachineID  string
	IdempotencyKey     string
	// Hours of held capacity per dimension, up to now.
	Usage     Usage
	CreatedAt time.Time
	UpdatedAt time.Time
	PlacedAt  *time.Time
	DeletedAt *time.Time
	// GPUs are the devices it holds (or held last, once deleted).
	GPUDevices []GPU
}

// GPU is one device an instance holds.
type GPU struct {
	NodeID   string
	DeviceID string
	Model    string
	PCIBusID string
}

// Usage is instance-hours of held capacity per dimension: vCPU-hours,
// MiB-hours, GiB-hours and GPU-hours.
type Usage struct {
	VCPUHours, MemoryMiBHours, DiskGiBHours, GPUHours float64
}

// ValidSize checks a size, naming the field of the first bad dimension
// (vcpus, memoryMiB, diskGiB, gpuCount).
func ValidSize(s Size) error {
	switch {
	case s.VCPUs < 1 || s.VCPUs > MaxVCPUs:
		return fault.New(fault.InvalidInput, "vcpus", "expected 1 to %d, got %d", MaxVCPUs, s.VCPUs)
	case s.MemoryMiB < 1 || s.MemoryMiB > MaxMemoryMiB:
		return fault.New(fault.InvalidInput, "memoryMiB", "expected 1 to %d, got %d", MaxMemoryMiB, s.MemoryMiB)
	case s.DiskGiB < 1 || s.DiskGiB > MaxDiskGiB:
		return fault.New(fault.InvalidInput, "diskGiB", "expected 1 to %d, got %d", MaxDiskGiB, s.DiskGiB)
	case s.GPUs < 0 || s.GPUs > MaxGPUs:
		return fault.New(fault.InvalidInput, "gpuCount", "expected 0 to %d, got %d", MaxGPUs, s.GPUs)
	}
	return nil
}

// Validate checks a new instance's size and settings, naming the field of
// the first bad one (vcpus, memoryMiB, diskGiB, gpuCount, gpuModel, image,
// sshKeys, userData). The image, SSH keys and user data are held to the
// host daemon's own rule (proto/instancespec), so an instance the API
// accepts is one its host accepts.
func Validate(in Instance) error {
	if err := ValidSize(in.Size); err != nil {
		return err
	}
	switch {
	case len(in.GPUModel) > MaxModelLength:
		return fault.New(fault.InvalidInput, "gpuModel", "at most %d characters", MaxModelLength)
	case in.GPUModel != "" && in.GPUs == 0:
		return fault.New(fault.InvalidInput, "gpuModel", "set only with gpuCount above 0")
	case strings.TrimSpace(in.Image) == "":
		return fault.New(fault.InvalidInput, "image", "required: the image to boot")
	}
	if err := instancespec.CheckImage(in.Image); err != nil {
		return fault.New(fault.InvalidInput, "image", "%v", err)
	}
	if err := instancespec.CheckSSHKeys(in.SSHKeys); err != nil {
		return fault.New(fault.InvalidInput, "sshKeys", "%v", err)
	}
	if err := instancespec.CheckUserData(in.UserData); err != nil {
		return fault.New(fault.InvalidInput, "userData", "%v", err)
	}
	return nil
}

// dimension names, as API fields and in messages.
type dim struct {
	field, unit string
}

var dims = [4]dim{{"vcpus", "vCPUs"}, {"memoryMiB", "MiB of memory"}, {"diskGiB", "GiB of disk"}, {"gpuCount", "GPUs"}}

func (s Size) vec() [4]int64 {
	return [4]int64{int64(s.VCPUs), s.MemoryMiB, s.DiskGiB, int64(s.GPUs)}
}
