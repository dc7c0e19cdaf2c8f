// Package capacity is the capacity model of Better Compute: reservations of
// GPUs, the bookings that hold their bookable atoms, quotas, and placement.
//
// An atom is what one booking holds: a whole GPU, or a MIG slice (a device
// of kind mig, booked by profile; see [PlaceSlices]). A GPU in MIG mode,
// with slices, or that its node's desired state puts in MIG mode is not
// bookable whole.
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
	// Model is the GPU model, e.g. "NVIDIA H200"; any when empty. It
	// matches a device's model exactly or as its leading words ("NVIDIA
	// H200" matches "NVIDIA H200 141GB HBM3e"). Quotas match models the
	// same way.
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
	// MigProfile books MIG slices of this profile (GPUCount of them)
	// instead of whole GPUs; see [PlaceSlices].
	MigProfile string
}

// Booking is one booked atom.
type Booking struct {
	NodeID   string
	DeviceID string
	Model    string
	// MigProfile and ParentID are a MIG slice's profile and GPU; empty for
	// a whole GPU.
	MigProfile, ParentID string
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

// Plan picks count atoms from nodes, packing: it leaves as few partially
// used nodes as it can, so whole nodes stay free for whole-node requests.
// The rest of the request goes to a node it fills exactly or to a partially
// used node that holds it; failing that, nodes with fewer free atoms than
// the rest are filled whole (the most free first); when every node holds
// the rest, it goes to the one with the fewest free atoms. SameNode picks one node:
// an exact fit, else a partially used one, else the smallest that holds
// it. It is deterministic (ties break by node id) and returns a [Shortage]
// when the atoms do not fit.
func Plan(nodes []NodeFree, count int, sameNode bool) ([]Atom, *Shortage) {
	ns := slices.DeleteFunc(slices.Clone(nodes), func(n NodeFree) bool { return len(n.Free) == 0 })
	total, best := 0, 0
	for _, n := range ns {
		total += len(n.Free)
		best = max(best, len(n.Free))
	}
	if sameNode && best < count {
		return nil, &Shortage{Want: count, Have: best, SameNode: true}
	}
	if total < count {
		return nil, &Shortage{Want: count, Have: total}
	}
	if sameNode {
		i := fit(ns, count)
		return slices.Clone(ns[i].Free[:count]), nil
	}
	var out []Atom
	for left := count; left > 0; {
		// The rest on one node without making a new partially used node.
		if i := fit(ns, left); i >= 0 && (len(ns[i].Free) == left || ns[i].Booked > 0) {
			return append(out, ns[i].Free[:left]...), nil
		}
		// Else fill whole a node smaller than the rest: the most free.
		i := -1
		for j, n := range ns {
			if len(n.Free) < left && (i < 0 || better(n, ns[i], func(a, b NodeFree) int { return cmp.Compare(len(b.Free), len(a.Free)) })) {
				i = j
			}
		}
		if i < 0 {
			// Every node holds the rest: the one with the fewest free.
			i = fit(ns, left)
			return append(out, ns[i].Free[:left]...), nil
		}
		out = append(out, ns[i].Free...)
		left -= len(ns[i].Free)
		ns = slices.Delete(ns, i, i+1)
	}
	return out, nil
}

// fit returns the node to put want atoms on, or -1 when none holds them: an
// exact fit, else a partially used node, else the fewest free.
func fit(ns []NodeFree, want int) int {
	pick := -1
	rank := func(n NodeFree) [3]int {
		exact, unused := 1, 1
		if len(n.Free) == want {
			exact = 0
		}
		if n.Booked > 0 {
			unused = 0
		}
		return [3]int{exact, unused, len(n.Free)}
	}
	for i, n := range ns {
		if len(n.Free) < want {
			continue
		}
		if pick < 0 || better(n, ns[pick], func(a, b NodeFree) int {
			ra, rb := rank(a), rank(b)
			return cmp.Or(cmp.Compare(ra[0], rb[0]), cmp.Compare(ra[1], rb[1]), cmp.Compare(ra[2], rb[2]))
		}) {
			pick = i
		}
	}
	return pick
}

// better reports whether a ranks before b: by less (negative means a
// first), then the more used node, then node id.
func better(a, b NodeFree, less func(a, b NodeFree) int) bool {
	return cmp.Or(less(a, b), cmp.Compare(b.Booked, a.Booked), cmp.Compare(a.NodeID, b.NodeID)) < 0
}
