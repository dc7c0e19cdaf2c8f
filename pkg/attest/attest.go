// Package attest decides whether a joining node is what its join token
// admits. A node presents hardware claims; a [Chain] of attestors checks them
// (the first and, in this release, only one is [HardwareClaims]); the node's
// hardware key, which ties a node id to its hardware across re-joins, is
// derived from the stable claims by [HardwareKey].
//
// Claims are what the node says about itself. Attestors that can check them
// against something the node cannot forge (a TPM quote, a cloud instance
// identity document, the BMC's inventory) plug into the chain later.
package attest

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// GPU is one GPU as the node reports it.
type GPU struct {
	UUID        string
	Model       string
	Serial      string
	MemoryBytes uint64
	PCIBusID    string
}

// Claims are what a joining node says about its hardware.
type Claims struct {
	Hostname     string
	MachineID    string
	SystemSerial string
	GPUs         []GPU
}

// Expect is what a join token requires of a node's claims. The zero value
// requires nothing. It is stored as JSON with the token.
type Expect struct {
	// GPUCount, when above 0, is the exact number of GPUs.
	GPUCount int `json:"gpuCount,omitempty"`
	// GPUModel, when set, must appear (case-insensitively) in the model of
	// every GPU, e.g. "H200" matches "NVIDIA H200"; the node needs at least
	// one GPU.
	GPUModel string `json:"gpuModel,omitempty"`
	// SystemSerial, when set, is the exact system serial number.
	SystemSerial string `json:"systemSerial,omitempty"`
}

// Zero reports whether e requires nothing.
func (e Expect) Zero() bool { return e == Expect{} }

// Check returns ACCESS_DENIED on field "claims" naming the first
// expectation the claims fail.
func (e Expect) Check(c Claims) error {
	if e.GPUCount > 0 && len(c.GPUs) != e.GPUCount {
		return fault.New(fault.AccessDenied, "claims", "the join token expects %d GPUs, the node has %d", e.GPUCount, len(c.GPUs))
	}
	if e.GPUModel != "" {
		if len(c.GPUs) == 0 {
			return fault.New(fault.AccessDenied, "claims", "the join token expects %q GPUs, the node has none", e.GPUModel)
		}
		want := strings.ToLower(e.GPUModel)
		for _, g := range c.GPUs {
			if !strings.Contains(strings.ToLower(g.Model), want) {
				return fault.New(fault.AccessDenied, "claims", "the join token expects %q GPUs, GPU %s is %q", e.GPUModel, g.UUID, g.Model)
			}
		}
	}
	if e.SystemSerial != "" && c.SystemSerial != e.SystemSerial {
		return fault.New(fault.AccessDenied, "claims", "the join token expects system serial %q, the node has %q", e.SystemSerial, c.SystemSerial)
	}
	return nil
}

// Evidence is what an attestor judges: the node's claims and what its join
// token expects.
type Evidence struct {
	Claims Claims
	Expect Expect
}

// Attestor checks one kind of evidence. It returns nil to pass, or an error
// (ACCESS_DENIED or INVALID_INPUT on the field at fault) to refuse the join.
type Attestor interface {
	Name() string
	Attest(ctx context.Context, ev Evidence) error
}

// Chain runs attestors in order; the first refusal ends it.
type Chain []Attestor

// Attest runs every attestor of the chain.
func (c Chain) Attest(ctx context.Context, ev Evidence) error {
	for _, a := range c {
		if err := a.Attest(ctx, ev); err != nil {
			return fmt.Errorf("attestor %s: %w", a.Name(), err)
		}
	}
	return nil
}

// DefaultChain is the chain a joinservice runs when configured with none.
func DefaultChain() Chain { return Chain{HardwareClaims{}} }

// HardwareClaims is the claims attestor: the claims must be well formed (a
// machine id, GPU UUIDs present and distinct) and satisfy the token's
// [Expect]. It trusts what the node says.
type HardwareClaims struct{}

// Name implements [Attestor].
func (HardwareClaims) Name() string { return "hardware-claims" }

// MaxGPUs bounds the GPUs a node may claim.
const MaxGPUs = 64

// Attest implements [Attestor].
func (HardwareClaims) Attest(_ context.Context, ev Evidence) error {
	c := ev.Claims
	if strings.TrimSpace(c.MachineID) == "" {
		return fault.New(fault.InvalidInput, "claims.machineId", "required")
	}
	if len(c.MachineID) > 256 || len(c.SystemSerial) > 256 || len(c.Hostname) > 255 {
		return fault.New(fault.InvalidInput, "claims", "machine id, system serial or hostname too long")
	}
	if len(c.GPUs) > MaxGPUs {
		return fault.New(fault.InvalidInput, "claims.gpus", "at most %d GPUs, got %d", MaxGPUs, len(c.GPUs))
	}
	seen := map[string]bool{}
	for i, g := range c.GPUs {
		if g.UUID == "" || len(g.UUID) > 128 {
			return fault.New(fault.InvalidInput, "claims.gpus", "GPU %d: a UUID of at most 128 characters is required", i)
		}
		if seen[g.UUID] {
			return fault.New(fault.InvalidInput, "claims.gpus", "GPU UUID %s appears twice", g.UUID)
		}
		seen[g.UUID] = true
	}
	return ev.Expect.Check(c)
}

// placeholderSerials are system serials firmware ships unset; they identify
// nothing.
var placeholderSerials = []string{
	"", "0", "none", "n/a", "na", "default string", "to be filled by o.e.m.", "system serial number",
	"not specified", "not applicable", "0123456789", "123456789", "chassis serial number",
}

// UsableSerial reports whether a system serial identifies a machine (it is
// not empty and not a firmware placeholder).
func UsableSerial(s string) bool {
	return !slices.Contains(placeholderSerials, strings.ToLower(strings.TrimSpace(s)))
}

// HardwareKey derives the node's hardware key: "hk_" and the hex SHA-256 of
// the system serial, when it is usable, else the machine id, followed by the
// sorted GPU UUIDs. The serial is preferred because it survives a reinstall
// of the operating system (which gives a new machine id), so a re-installed
// server is recognised; with the GPU UUIDs, a chassis whose GPUs were
// swapped is new hardware.
func HardwareKey(c Claims) string {
	h := sha256.New()
	if UsableSerial(c.SystemSerial) {
		h.Write([]byte("serial\x00" + strings.TrimSpace(c.SystemSerial)))
	} else {
		h.Write([]byte("machine\x00" + strings.TrimSpace(c.MachineID)))
	}
	uuids := make([]string, 0, len(c.GPUs))
	for _, g := range c.GPUs {
		uuids = append(uuids, g.UUID)
	}
	slices.Sort(uuids)
	for _, u := range uuids {
		h.Write([]byte("\x00gpu\x00" + u))
	}
	return "hk_" + hex.EncodeToString(h.Sum(nil))
}
