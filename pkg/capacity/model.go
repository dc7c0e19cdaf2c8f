// Package capacity is the capacity model of Better Compute: reservations of
// GPUs, the bookings that hold their bookable atoms, quotas, and placement.
//
// An atom is what one booking holds: a whole GPU today. MIG slices become
// atoms once the node's mig section defines them (not built yet); a device
// with MIG enabled is not bookable as a whole GPU meanwhile.
//
// Placement ([Plan]) is a pure function over the free atoms of the eligible
// nodes; the store functions ([Place], [Finish], …) run it inside the
// caller's transaction. No atom is ever booked twice: the database holds at
// most one active booking per (node, device) (a partial unique index), and
// [Place] retries against a fresh view when a concurrent transaction took an
// atom first.
package capacity

import (
	"cmp"
	"fmt"
	"slices"
	"time"
)

// States of a reservation.
const (
	StatePending  = "pending"
	StatePlaced   = "placed"
	StateBound    = "bound"
	StateReleased = "released"
	StateExpired  = "expired"
	StateFailed   = "failed"
)

// States lists every state.
var States = []string{StatePending, StatePlaced, StateBound, StateReleased, StateExpired, StateFailed}

// Live reports whether a reservation in state s still holds (or waits for)
// capacity.
func Live(s string) bool { return s == StatePending || s == StatePlaced || s == StateBound }

// MaxGPUs bounds a reservation's GPU count.
const MaxGPUs = 1024

// Constraints narrow which atoms a reservation may book.
type Constraints struct {
	// Model is the GPU model, e.g. "NVIDIA H200"; any when empty.
	Model string
	// MinMemoryBytes is the least memory a GPU must have.
	MinMemoryBytes int64
	// SameNode puts every GPU on one node.
	SameNode bool
	// NodeLabels must all be on the node.
	NodeLabels map[string]string
}

// Reservation is a booking of GPUs for a tenant.
type Reservation struct {
	ID          string
	TenantID    string
	PoolID      string
	GPUCount    int
	Constraints Constraints
	State       string
	Reason      string
	StartTime   *time.Time
	EndTime     *time.Time
	CreatedAt   time.Time
	UpdatedAt   time.Time
	BoundAt     *time.Time
	FinishedAt  *time.Time
	GPUHours    float64
	Bookings    []Booking
}

// Booking is one booked atom.
type Booking struct {
	NodeID   string
	DeviceID string
	Model    string
}

// Atom is one free bookable atom on a node.
type Atom struct {
	NodeID      string
	DeviceID    string
	Model       string
	MemoryBytes int64
	Index       int
}

// NodeFree is a node's free atoms that match a request, in device order.
type NodeFree struct {
	NodeID string
	// Booked is how many of the node's atoms are booked already: a node with
	// bookings is partially used, and packing fills it first.
	Booked int
	Free   []Atom
}

// Shortage says why a request does not fit.
type Shortage struct {
	// Want is the number of atoms asked for; Have the most that would fit
	// (on the best node for SameNode).
	Want, Have int
	SameNode   bool
	Model      string
}

func (s Shortage) Error() string {
	model := cmp.Or(s.Model, "GPU")
	if s.SameNode {
		return fmt.Sprintf("need %d × %s on one node; the best node has %d free", s.Want, model, s.Have)
	}
	return fmt.Sprintf("need %d × %s; %d free on schedulable nodes of the pool", s.Want, model, s.Have)
}

// Plan picks count atoms from nodes, packing: it touches as few nodes as it
// can and, among nodes that fit, takes the one with the fewest free atoms
// (a partially used node before an empty one), so whole nodes stay free for
// whole-node requests. It is deterministic: ties break by node id. It
// returns a [Shortage] when the atoms do not fit.
func Plan(nodes []NodeFree, count int, sameNode bool) ([]Atom, *Shortage) {
	ns := slices.Clone(nodes)
	ns = slices.DeleteFunc(ns, func(n NodeFree) bool { return len(n.Free) == 0 })
	// Fewest free first, then the most used, then id: best fit is the first
	// node with enough.
	slices.SortFunc(ns, func(a, b NodeFree) int {
		return cmp.Or(cmp.Compare(len(a.Free), len(b.Free)), cmp.Compare(b.Booked, a.Booked), cmp.Compare(a.NodeID, b.NodeID))
	})
	total, best := 0, 0
	for _, n := range ns {
		total += len(n.Free)
		best = max(best, len(n.Free))
	}
	if sameNode {
		for _, n := range ns {
			if len(n.Free) >= count {
				return slices.Clone(n.Free[:count]), nil
			}
		}
		return nil, &Shortage{Want: count, Have: best, SameNode: true}
	}
	if total < count {
		return nil, &Shortage{Want: count, Have: total}
	}
	var out []Atom
	left := count
	for left > 0 {
		// A node that holds the rest: the best fit.
		i := slices.IndexFunc(ns, func(n NodeFree) bool { return len(n.Free) >= left })
		if i >= 0 {
			out = append(out, ns[i].Free[:left]...)
			break
		}
		// Otherwise the fullest-free node, whole.
		last := ns[len(ns)-1]
		out = append(out, last.Free...)
		left -= len(last.Free)
		ns = ns[:len(ns)-1]
	}
	return out, nil
}
