package session

import (
	"context"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// offerDesired hands ds to the converge loop, replacing any state it has
// not started on. A state older than one already received or observed is
// ignored (generations only grow).
func (r *runner) offerDesired(ctx context.Context, ds *agentv1.DesiredState) {
	r.slotMu.Lock()
	floor := max(r.highestGen, r.conv.ObservedGeneration())
	if ds.GetGeneration() < floor {
		r.slotMu.Unlock()
		r.log.WarnContext(ctx, "ignoring an older desired state", "generation", ds.GetGeneration(), "have", floor)
		return
	}
	r.highestGen = ds.GetGeneration()
	r.desired = ds
	r.slotMu.Unlock()
	select {
	case r.desiredReady <- struct{}{}:
	default:
	}
}

// kickConverge asks the converge loop for a pass now, as a periodic one
// (published only when its result differs).
func (r *runner) kickConverge() {
	select {
	case r.reconverge <- struct{}{}:
	default:
	}
}

func (r *runner) takeDesired() *agentv1.DesiredState {
	r.slotMu.Lock()
	defer r.slotMu.Unlock()
	ds := r.desired
	r.desired = nil
	return ds
}

// publish makes o the next Observed to send, replacing an unsent one.
func (r *runner) publish(o *agentv1.Observed) {
	r.slotMu.Lock()
	r.result = o
	r.slotMu.Unlock()
	select {
	case r.resultReady <- struct{}{}:
	default:
	}
}

func (r *runner) takeResult() *agentv1.Observed {
	r.slotMu.Lock()
	defer r.slotMu.Unlock()
	o := r.result
	r.result = nil
	return o
}

// putBackResult re-queues o unless a newer result was published meanwhile.
func (r *runner) putBackResult(o *agentv1.Observed) {
	r.slotMu.Lock()
	if r.result == nil {
		r.result = o
	}
	r.slotMu.Unlock()
	select {
	case r.resultReady <- struct{}{}:
	default:
	}
}

// convergeLoop converges the newest desired state whenever one arrives,
// every ReconvergeInterval, after a command's inventory report
// (kickConverge: a gpu.reset), and when a DriftCheckInterval check finds the
// CDI spec edited or removed by hand or the driver changed
// (converge.Converger.DevicesStale), and publishes each result; a periodic
// result identical to the last one is not published again.
func (r *runner) convergeLoop(ctx context.Context) {
	tick := time.NewTicker(r.cfg.ReconvergeInterval)
	defer tick.Stop()
	drift := time.NewTicker(r.cfg.DriftCheckInterval)
	defer drift.Stop()
	var latest *agentv1.DesiredState
	var last *agentv1.Observed
	var lastMig string
	for {
		periodic := false
		select {
		case <-ctx.Done():
			return
		case <-r.desiredReady:
			ds := r.takeDesired()
			if ds == nil {
				continue
			}
			latest = ds
		case <-tick.C:
			if latest == nil {
				continue
			}
			periodic = true
		case <-r.reconverge:
			if latest == nil {
				continue
			}
			periodic = true
		case <-drift.C:
			if latest == nil || !r.conv.DevicesStale(ctx) {
				continue
			}
		}
		sections, observed := r.conv.Converge(ctx, latest)
		r.cmds.SetApplied(observed)
		if mig := migStatus(sections); mig != lastMig {
			// The GPUs' MIG slices changed (the reason names them): the
			// control plane learns them from an inventory report, so send
			// one now rather than at the next refresh.
			lastMig = mig
			if rep, err := r.cfg.Inventory.Report(ctx, nil); err == nil {
				r.health.note(rep)
				r.queue(&agentv1.SessionRequest{Body: &agentv1.SessionRequest_Inventory{Inventory: rep}})
			}
		}
		o := &agentv1.Observed{Generation: latest.GetGeneration(), ObservedGeneration: observed, Sections: sections}
		if periodic && proto.Equal(o, last) {
			continue
		}
		last = o
		r.publish(o)
	}
}

// migStatus is the mig section's state and reason in sections ("" when
// it has no reason: a node without MIG layouts never sends an extra
// report).
func migStatus(sections []*agentv1.SectionStatus) string {
	for _, st := range sections {
		if st.GetSection() == "mig" && st.GetReason() != "" {
			return st.GetState().String() + " " + st.GetReason()
		}
	}
	return ""
}
