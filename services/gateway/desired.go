package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/encoding/protojson"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// Deliver sends node's desired state to it if this gateway holds its
// session and the node has not been sent its current generation. The
// nodespec controller's change hook calls it (in process, or through a poke
// over the bus); the liveness tick calls it for every node behind, so a lost
// call only delays delivery.
func (g *Gateway) Deliver(ctx context.Context, nodeID string) error {
	g.mu.Lock()
	s, ok := g.sessions[nodeID]
	g.mu.Unlock()
	if !ok {
		return nil
	}
	return g.deliver(ctx, s)
}

// deliver sends the stored spec when its generation is ahead of what the
// session was sent (or, after Welcome, of what the node reported).
func (g *Gateway) deliver(ctx context.Context, s *session) error {
	var gen int64
	var raw []byte
	err := g.cfg.DB.QueryRow(ctx, `SELECT generation, spec FROM nodes WHERE id = $1 AND session_epoch = $2`, s.nodeID, s.epoch).Scan(&gen, &raw)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil // superseded
	}
	if err != nil {
		return fmt.Errorf("read desired state: %w", err)
	}
	g.mu.Lock()
	behind := gen > s.delivered
	g.mu.Unlock()
	if gen < 1 || !behind {
		return nil // not adopted yet, or already sent
	}
	var spec agentv1.NodeSpec
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(raw, &spec); err != nil {
		return fmt.Errorf("decode desired state of %s: %w", s.nodeID, err)
	}
	if err := s.send(&agentv1.SessionResponse{Body: &agentv1.SessionResponse_DesiredState{
		DesiredState: &agentv1.DesiredState{Generation: gen, Spec: &spec},
	}}); err != nil {
		return err
	}
	g.mu.Lock()
	s.delivered = max(s.delivered, gen)
	g.mu.Unlock()
	return nil
}

// Resync sends their desired state to every session whose node is ahead of
// what was sent. The liveness loop calls it every interval.
func (g *Gateway) Resync(ctx context.Context) error {
	g.mu.Lock()
	ids := make([]string, 0, len(g.sessions))
	delivered := make([]int64, 0, len(g.sessions))
	for _, s := range g.sessions {
		ids = append(ids, s.nodeID)
		delivered = append(delivered, s.delivered)
	}
	g.mu.Unlock()
	if len(ids) == 0 {
		return nil
	}
	return g.redeliver(ctx, ids, delivered)
}

// redeliver finds, in one statement, every session whose node's generation is
// ahead of what was sent, and sends them their desired state: delivery
// without the bus.
func (g *Gateway) redeliver(ctx context.Context, ids []string, delivered []int64) error {
	rows, err := g.cfg.DB.Query(ctx, `
		SELECT n.id FROM nodes n JOIN unnest($1::text[], $2::bigint[]) AS s(id, delivered) ON s.id = n.id
		 WHERE n.generation > s.delivered`, ids, delivered)
	if err != nil {
		return fmt.Errorf("find nodes behind: %w", err)
	}
	behind, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err
	}
	var errs []error
	for _, id := range behind {
		errs = append(errs, g.Deliver(ctx, id))
	}
	return errors.Join(errs...)
}

// report is one session's report (Observed, an inventory) waiting for the
// batch writer: store writes it in the batch's transaction.
type report struct {
	nodeID string
	store  func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) error
	done   chan error
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
}

// storeObserved records how far the node converged: the database keeps the
// highest observed generation reported, so a late report cannot lower it;
// section status is the latest report's. A report that reaches the current
// generation is a node.converged event; one with a failed section is
// node.convergence_failed.
//
// It goes through the batch writer ([Gateway.submit]).
func (g *Gateway) storeObserved(ctx context.Context, s *session, obs *agentv1.Observed) error {
	r := &observedReport{s: s, obs: obs}
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
	return g.submit(ctx, s.nodeID, func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) error {
		return g.storeReport(ctx, tx, q, r)
	})
}

// submit stores a session's report through the batch writer: reports from
// every session go through one writer that stores whatever has queued up in
// one transaction (with the wake-ups and events they write), so a fleet
// converging or reconnecting costs a commit per batch, not per node, and a
// lone report waits for no one. The session waits for its report's commit,
// so its messages keep their order; a batch that fails is stored again
// report by report. Before Start, reports are stored one by one.
func (g *Gateway) submit(ctx context.Context, nodeID string, store func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) error) error {
	r := &report{nodeID: nodeID, store: store, done: make(chan error, 1)}
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

// storeReports stores reports in one transaction, locking nodes in id
// order (reports of one node in the order they came).
func (g *Gateway) storeReports(ctx context.Context, reports []*report) error {
	sorted := slices.Clone(reports)
	slices.SortStableFunc(sorted, func(a, b *report) int { return strings.Compare(a.nodeID, b.nodeID) })
	return reconcile.InTx(ctx, g.cfg.DB, g.cfg.Poker, func(tx pgx.Tx, q *reconcile.Queue) error {
		for _, r := range sorted {
			if err := r.store(ctx, tx, q); err != nil {
				return fmt.Errorf("node %s: %w", r.nodeID, err)
			}
		}
		return nil
	})
}

// storeReport stores one Observed in tx.
func (g *Gateway) storeReport(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, r *observedReport) error {
	s, obs := r.s, r.obs
	var tenant string
	var gen, observed int64
	err := tx.QueryRow(ctx, `
		UPDATE nodes SET observed_generation = greatest(observed_generation, $2), section_status = $3, updated_at = now()
		 WHERE id = $1 AND session_epoch = $4
		RETURNING tenant_id, generation, observed_generation`,
		s.nodeID, obs.GetObservedGeneration(), r.status, s.epoch).Scan(&tenant, &gen, &observed)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil // a superseded session's late report
	}
	if err != nil {
		return err
	}
	// The kinds that wait on a node's convergence (capacity's bind
	// check) run again, poked after the commit.
	for _, k := range g.cfg.ObservedKinds {
		if err := q.Enqueue(ctx, k, s.nodeID); err != nil {
			return err
		}
	}
	event := ""
	switch {
	case r.failed:
		event = "node.convergence_failed"
	case observed >= gen && obs.GetObservedGeneration() == gen:
		event = "node.converged"
	}
	if event == "" {
		return nil
	}
	payload := map[string]any{"nodeId": s.nodeID, "generation": gen, "observedGeneration": observed, "sections": r.sections}
	_, err = outbox.Write(ctx, tx, outbox.Event{TenantID: tenant, Type: event, Resource: s.nodeID, Payload: payload})
	return err
}
