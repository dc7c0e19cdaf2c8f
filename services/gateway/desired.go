package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/encoding/protojson"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/instances"
	"github.com/bettercompute/bettercompute/pkg/lifecycle"
	nodestore "github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
)

// Deliver sends their desired state to the nodes of nodeIDs whose session
// this gateway holds and that have not been sent their current generation,
// reading every spec in one statement. The nodespec controller's
// desired-state wake calls it with the nodes of a batch (in process, or through a poke
// over the bus); the liveness tick resyncs every session, so a lost call
// only delays delivery.
func (g *Gateway) Deliver(ctx context.Context, nodeIDs ...string) error {
	g.mu.Lock()
	held := make([]*session, 0, len(nodeIDs))
	for _, id := range nodeIDs {
		if s, ok := g.sessions[id]; ok {
			held = append(held, s)
		}
	}
	g.mu.Unlock()
	return g.deliver(ctx, held)
}

// Resync sends their desired state to every session whose node is ahead of
// what was sent: delivery without the bus. The liveness loop calls it every
// interval.
func (g *Gateway) Resync(ctx context.Context) error {
	g.mu.Lock()
	all := make([]*session, 0, len(g.sessions))
	for _, s := range g.sessions {
		all = append(all, s)
	}
	g.mu.Unlock()
	return g.deliver(ctx, all)
}

// deliverers bounds the sends of one delivery in flight, so a node slow to
// read holds back no other.
const deliverers = 16

// deliver sends each session whose node's stored generation is ahead of
// what it was sent (or, after Welcome, of what the node reported) that
// spec, in one statement for all of them; a superseded session (its epoch
// no longer its node's) and a node not adopted yet get nothing.
func (g *Gateway) deliver(ctx context.Context, sessions []*session) error {
	if len(sessions) == 0 {
		return nil
	}
	ids := make([]string, len(sessions))
	epochs := make([]int64, len(sessions))
	sent := make([]int64, len(sessions))
	byNode := make(map[string]*session, len(sessions))
	g.mu.Lock()
	for i, s := range sessions {
		ids[i], epochs[i], sent[i] = s.nodeID, s.epoch, s.delivered
		byNode[s.nodeID] = s
	}
	g.mu.Unlock()
	due, err := nodestore.DesiredToDeliver(ctx, g.cfg.DB, ids, epochs, sent)
	if err != nil {
		return err
	}
	type pending struct {
		s   *session
		gen int64
		raw []byte
	}
	todo := make([]pending, 0, len(due))
	for _, d := range due {
		todo = append(todo, pending{s: byNode[d.ID], gen: d.Generation, raw: d.Spec})
	}
	errs := make([]error, len(todo))
	sem := make(chan struct{}, deliverers)
	var wg sync.WaitGroup
	for i, p := range todo {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			errs[i] = g.send(p.s, p.gen, p.raw)
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// send sends session s the spec raw of generation gen, unless it was sent
// that generation meanwhile.
func (g *Gateway) send(s *session, gen int64, raw []byte) error {
	g.mu.Lock()
	behind := gen > s.delivered
	g.mu.Unlock()
	if !behind {
		return nil
	}
	var spec agentv1.NodeSpec
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(raw, &spec); err != nil {
		return fmt.Errorf("decode desired state of %s: %w", s.nodeID, err)
	}
	if err := s.send(&agentv1.SessionResponse{Body: &agentv1.SessionResponse_DesiredState{
		DesiredState: &agentv1.DesiredState{Generation: gen, Spec: &spec},
	}}); err != nil {
		return fmt.Errorf("send desired state to %s: %w", s.nodeID, err)
	}
	g.mu.Lock()
	s.delivered = max(s.delivered, gen)
	g.mu.Unlock()
	return nil
}

// report is one session's report (Observed, an inventory) waiting for the
// batch writer. An Observed (observed set) is stored with the batch's other
// Observed reports in one statement ([nodestore.RecordObserved]); any other
// report's store writes it in the batch's transaction.
type report struct {
	nodeID   string
	observed *observedReport
	store    func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) error
	done     chan error
}

// maxReportBatch bounds the reports one transaction stores.
const maxReportBatch = 256

// observedReport is an Observed, prepared for storing.
type observedReport struct {
	s        *session
	obs      *agentv1.Observed
	sections []map[string]any
	status   []byte
	failed   bool
	// instances is the instances section's per-instance report, when the
	// node sent one (see hostObservation).
	instances *instances.HostObservation
}

// Bounds of an Observed report's instances section (the NodeSpec's own:
// 256 instances), beyond which the rest is ignored.
const (
	maxReportedInstances = 256
	maxInstanceID        = 64
	maxInstanceReason    = 1024
)

// hostObservation reads the instances section of a node's report: each
// instance's state (running, stopped or failed; anything else is
// ignored), reason and applied generation, and whether the section
// converged (then an instance it leaves out is not on the node). Nil when
// the report has no instances section.
func hostObservation(nodeID string, obs *agentv1.Observed) *instances.HostObservation {
	for _, st := range obs.GetSections() {
		if st.GetSection() != "instances" {
			continue
		}
		h := &instances.HostObservation{NodeID: nodeID, Complete: st.GetState() == agentv1.SectionState_SECTION_STATE_CONVERGED}
		for i, in := range st.GetInstances() {
			if i == maxReportedInstances {
				h.Complete = false
				break
			}
			switch in.GetState() {
			case instances.StateRunning, instances.StateStopped, instances.StateFailed:
			default:
				continue
			}
			if id := in.GetId(); id == "" || len(id) > maxInstanceID {
				continue
			}
			reason := in.GetReason()
			if len(reason) > maxInstanceReason {
				reason = strings.ToValidUTF8(reason[:maxInstanceReason], "")
			}
			h.Reports = append(h.Reports, instances.HostReport{ID: in.GetId(),
				Observation: instances.Observation{Generation: in.GetGeneration(), State: in.GetState(), Reason: reason}})
		}
		return h
	}
	return nil
}

// drifted reports whether a section of the report says it drifted (its
// reason starts [nodestore.DriftedReasonPrefix]).
func (r *observedReport) drifted() bool {
	for _, st := range r.obs.GetSections() {
		if strings.HasPrefix(st.GetReason(), nodestore.DriftedReasonPrefix) {
			return true
		}
	}
	return false
}

// storeObserved records how far the node converged: the database keeps the
// highest observed generation reported, so a late report cannot lower it;
// section status is the latest report's. A report that reaches the current
// generation is a node.converged event; one with a failed section is
// node.convergence_failed.
//
// It goes through the batch writer ([Gateway.submit]).
func (g *Gateway) storeObserved(ctx context.Context, s *session, obs *agentv1.Observed) error {
	r := &observedReport{s: s, obs: obs, instances: hostObservation(s.nodeID, obs)}
	for _, st := range obs.GetSections() {
		state := st.GetState().String()
		if st.GetState() == agentv1.SectionState_SECTION_STATE_FAILED || st.GetState() == agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL {
			r.failed = true
		}
		r.sections = append(r.sections, map[string]any{
			"section": st.GetSection(), "state": state, "reason": st.GetReason(), "generation": st.GetGeneration(),
		})
	}
	if r.sections == nil {
		r.sections = []map[string]any{}
	}
	var err error
	if r.status, err = json.Marshal(r.sections); err != nil {
		return err
	}
	return g.submitReport(ctx, &report{nodeID: s.nodeID, observed: r})
}

// submit stores a session's report through the batch writer: reports from
// every session go through one writer that stores whatever has queued up in
// one transaction (with the wake-ups and events they write), so a fleet
// converging or reconnecting costs a commit per batch, not per node, and a
// lone report waits for no one. The session waits for its report's commit,
// so its messages keep their order; a batch that fails is stored again
// report by report. Before Start, reports are stored one by one.
func (g *Gateway) submit(ctx context.Context, nodeID string, store func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) error) error {
	return g.submitReport(ctx, &report{nodeID: nodeID, store: store})
}

// submitReport is [Gateway.submit] for a prepared report.
func (g *Gateway) submitReport(ctx context.Context, r *report) error {
	r.done = make(chan error, 1)
	g.mu.Lock()
	batching := g.started
	g.mu.Unlock()
	if !batching {
		return g.storeReports(ctx, []*report{r})
	}
	select {
	case g.reports <- r:
	case <-g.stop:
		return errors.New("gateway stopping")
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case err := <-r.done:
		return err
	case <-ctx.Done():
		return ctx.Err() // the writer still stores it
	}
}

// reportLoop is the batch writer of sessions' reports.
func (g *Gateway) reportLoop() {
	defer close(g.reportsDone)
	for {
		var first *report
		select {
		case <-g.stop:
			return
		case first = <-g.reports:
		}
		batch := []*report{first}
	fill:
		for len(batch) < maxReportBatch {
			select {
			case r := <-g.reports:
				batch = append(batch, r)
			default:
				break fill
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err := g.storeReports(ctx, batch)
		if err != nil && len(batch) > 1 {
			g.log.Warn("store a batch of reports; storing them one by one", "reports", len(batch), "err", err)
			for _, r := range batch {
				r.done <- g.storeReports(ctx, []*report{r})
			}
		} else {
			for _, r := range batch {
				r.done <- err
			}
		}
		cancel()
	}
}

// storeReports stores reports in one transaction: the Observed ones first,
// in one statement (which locks their nodes in id order), then, in node
// order (reports of one node in the order they came), the rest of each.
func (g *Gateway) storeReports(ctx context.Context, reports []*report) error {
	sorted := slices.Clone(reports)
	slices.SortStableFunc(sorted, func(a, b *report) int { return strings.Compare(a.nodeID, b.nodeID) })
	var obs []nodestore.Observation
	for _, r := range sorted {
		if o := r.observed; o != nil {
			obs = append(obs, nodestore.Observation{NodeID: o.s.nodeID, Epoch: o.s.epoch,
				Generation: o.obs.GetObservedGeneration(), SectionStatus: o.status})
		}
	}
	return reconcile.InTx(ctx, g.cfg.DB, g.cfg.Waker, func(tx pgx.Tx, q *reconcile.Queue) error {
		stored, err := nodestore.RecordObserved(ctx, tx, obs)
		if err != nil {
			return err
		}
		var converged, drifted []string
		var events []outbox.Event
		var hosts []instances.HostObservation
		next := 0
		for _, r := range sorted {
			if r.observed != nil {
				if st := stored[next]; st.Stored {
					converged = append(converged, r.nodeID)
					if h := r.observed.instances; h != nil {
						hosts = append(hosts, *h)
					}
					if e, ok := observedEvent(r.observed, st); ok {
						events = append(events, e)
					}
					if st.NewUpgradeFailed {
						events = append(events, outbox.Event{TenantID: st.TenantID, Type: "node.upgrade_failed", Resource: r.nodeID,
							Payload: map[string]any{"nodeId": r.nodeID, "agentVersion": r.observed.s.agentVersion, "reason": st.UpgradeFailed}})
					}
					if st.PrevDrifted || r.observed.drifted() {
						drifted = append(drifted, st.PoolID)
					}
				}
				next++
				continue
			}
			if err := r.store(ctx, tx, q); err != nil {
				return fmt.Errorf("node %s: %w", r.nodeID, err)
			}
		}
		// What each host runs of its instances, in the same transaction:
		// only a stored (current-session) report speaks for the node.
		if _, err := instances.ObserveHosts(ctx, tx, hosts); err != nil {
			return err
		}
		if err := g.wakeObserved(ctx, tx, q, slices.Compact(converged)); err != nil {
			return err
		}
		// A section reported drifted (or no longer): fleet.drift judges
		// the node's pool now, not at its next sweep (the daemon's next
		// pass reports the plain reason again).
		slices.Sort(drifted)
		for _, pool := range slices.Compact(drifted) {
			if err := q.Enqueue(ctx, lifecycle.KindDrift, pool); err != nil {
				return err
			}
		}
		return outbox.WriteMany(ctx, tx, events)
	})
}

// wakeObserved enqueues, for the nodes whose reports were stored, the kinds
// that wait on their convergence (capacity's bind check), in one statement
// per kind, poked after the commit.
func (g *Gateway) wakeObserved(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, nodeIDs []string) error {
	if len(nodeIDs) == 0 {
		return nil
	}
	var items []workqueue.Item
	for _, k := range g.cfg.ObservedKinds {
		ids := nodeIDs
		if k.Waiting != nil {
			var err error
			if ids, err = k.Waiting(ctx, tx, nodeIDs); err != nil {
				return fmt.Errorf("nodes waiting on %s: %w", k.Kind, err)
			}
		}
		for _, id := range ids {
			items = append(items, workqueue.Item{Kind: k.Kind, Key: id})
		}
	}
	return q.EnqueueMany(ctx, items)
}

// observedEvent is the event of one stored Observed: node.converged when it
// reached the node's current generation, node.convergence_failed when a
// section failed, none otherwise.
func observedEvent(r *observedReport, st nodestore.Observed) (outbox.Event, bool) {
	s, obs := r.s, r.obs
	gen, observed := st.Generation, st.ObservedGeneration
	event := ""
	switch {
	case r.failed:
		event = "node.convergence_failed"
	case observed >= gen && obs.GetObservedGeneration() == gen:
		event = "node.converged"
	}
	if event == "" {
		return outbox.Event{}, false
	}
	payload := map[string]any{"nodeId": s.nodeID, "generation": gen, "observedGeneration": observed, "sections": r.sections}
	return outbox.Event{TenantID: st.TenantID, Type: event, Resource: s.nodeID, Payload: payload}, true
}
