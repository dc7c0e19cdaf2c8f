package capacity

import "slices"

// The capacity reconcilers' kinds in the work queue.
const (
	// KindBind (node-sharded) moves placed reservations to bound once every
	// booked node has observed a generation that exposes them.
	KindBind = "capacity.bind"
	// KindReservations (pool-sharded, the pool-lease placer) expires, places
	// and applies the lost-node policy to a pool's reservations.
	KindReservations = "capacity.reservations"
	// KindTick (singleton, periodic) finds pools with due placer work.
	KindTick = "capacity.tick"
	// KindRollup (singleton, periodic) counts free, booked and unavailable
	// atoms per pool and model.
	KindRollup = "capacity.rollup"
	// KindUsage (singleton, periodic) counts booked GPUs and GPU-hours per
	// tenant and reservation.
	KindUsage = "capacity.usage"
)

// Lost-node policies (config capacity.lostNode): what the placer does with
// bookings on a node that is lost (failed, retired, or unseen for
// nodes.lostAfter).
const (
	// LostNodeWait keeps the bookings and says so in the reservation's
	// reason (the default).
	LostNodeWait = "wait"
	// LostNodeReplace books the same count elsewhere.
	LostNodeReplace = "replace"
	// LostNodeFail fails the reservation.
	LostNodeFail = "fail"
)

// LostNodePolicies lists the lost-node policies.
var LostNodePolicies = []string{LostNodeWait, LostNodeReplace, LostNodeFail}

// ValidLostNode reports whether p is a lost-node policy.
func ValidLostNode(p string) bool { return slices.Contains(LostNodePolicies, p) }
