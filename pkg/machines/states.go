package machines

import "slices"

// State is a machine's step in the flow (machines.state).
type State string

// The states. Commissioning: enrolled → inspecting → booting-ramdisk →
// diagnosing → wiping → ready. metal.deploy: ready → deploying → rebooting
// → joined. metal.release: → booting-ramdisk → wiping → ready. metal.rescue:
// → booting-ramdisk → rescue. Any step can end in failed; metal.retry goes
// back to the failed step.
const (
	StateEnrolled       State = "enrolled"
	StateInspecting     State = "inspecting"
	StateBootingRamdisk State = "booting-ramdisk"
	StateDiagnosing     State = "diagnosing"
	StateWiping         State = "wiping"
	StateReady          State = "ready"
	StateDeploying      State = "deploying"
	StateRebooting      State = "rebooting"
	StateJoined         State = "joined"
	StateFailed         State = "failed"
	StateRescue         State = "rescue"
)

// States lists every state in flow order.
func States() []State {
	return []State{StateEnrolled, StateInspecting, StateBootingRamdisk, StateDiagnosing, StateWiping, StateReady,
		StateDeploying, StateRebooting, StateJoined, StateFailed, StateRescue}
}

// Valid reports whether s is a state.
func (s State) Valid() bool { return slices.Contains(States(), s) }

// Steps are the states a machine can fail in and metal.retry can resume:
// those with work of the flow's to do.
func Steps() []State {
	return []State{StateEnrolled, StateInspecting, StateBootingRamdisk, StateDiagnosing, StateWiping, StateDeploying, StateRebooting}
}

// Purpose is why the machine is in the flow (machines.purpose): it decides
// where booting-ramdisk leads.
type Purpose string

// The purposes.
const (
	// PurposeCommission: booting-ramdisk → diagnosing → wiping → ready.
	PurposeCommission Purpose = "commission"
	// PurposeDeploy: ready → deploying → rebooting → joined.
	PurposeDeploy Purpose = "deploy"
	// PurposeRelease: booting-ramdisk → wiping → ready.
	PurposeRelease Purpose = "release"
	// PurposeRescue: booting-ramdisk → rescue.
	PurposeRescue Purpose = "rescue"
)

// Boot is what the site's boot server does when the machine PXE-boots
// (machines.boot).
type Boot string

// The boot modes.
const (
	// BootNone: ignore its PXE requests.
	BootNone Boot = "none"
	// BootRamdisk: boot bcd ramdisk with a one-time boot token.
	BootRamdisk Boot = "ramdisk"
	// BootLocal: boot its disk.
	BootLocal Boot = "local"
)

// transitions is the table of legal state changes (besides staying in a
// state, which is a new attempt, not a transition). Every step may fail.
var transitions = map[State][]State{
	StateEnrolled:       {StateInspecting, StateFailed},
	StateInspecting:     {StateBootingRamdisk, StateFailed},
	StateBootingRamdisk: {StateDiagnosing, StateWiping, StateRescue, StateFailed},
	StateDiagnosing:     {StateWiping, StateFailed},
	StateWiping:         {StateReady, StateFailed},
	// ready: metal.deploy, metal.rescue; failed when the ramdisk is lost.
	StateReady:     {StateDeploying, StateBootingRamdisk, StateFailed},
	StateDeploying: {StateRebooting, StateFailed},
	StateRebooting: {StateJoined, StateFailed},
	// joined: metal.release and metal.rescue boot the ramdisk again.
	StateJoined: {StateBootingRamdisk, StateFailed},
	// failed: metal.retry resumes any step; metal.release and metal.rescue
	// boot the ramdisk.
	StateFailed: {StateEnrolled, StateInspecting, StateBootingRamdisk, StateDiagnosing, StateWiping, StateDeploying, StateRebooting},
	// rescue: metal.release wipes it back to ready.
	StateRescue: {StateBootingRamdisk, StateFailed},
}

// Transitions returns the table of legal state changes: for each state,
// where it may go. The map is the caller's.
func Transitions() map[State][]State {
	out := make(map[State][]State, len(transitions))
	for k, v := range transitions {
		out[k] = slices.Clone(v)
	}
	return out
}

// CanTransition reports whether from → to is in the table.
func CanTransition(from, to State) bool { return slices.Contains(transitions[from], to) }

// From returns the states from which to is legal: the from set of a
// [SetState] that must not skip a step.
func From(to State) []State {
	var out []State
	for _, s := range States() {
		if CanTransition(s, to) {
			out = append(out, s)
		}
	}
	return out
}
