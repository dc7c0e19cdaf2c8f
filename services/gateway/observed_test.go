package gateway_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/lifecycle"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/services/gateway"
)

// TestObservedReportsOfManySessionsAreStoredOnceEach: 40 nodes converge at
// once; the batch writer stores every report (the observed generation, one
// node.converged each) and none twice.
func TestObservedReportsOfManySessionsAreStoredOnceEach(t *testing.T) {
	t.Parallel()
	f := setup(t)
	converge(t, f, 40)
}

// TestObservedWakesOnlyTheNodesAKindWaitsOn: the kinds that wait on
// convergence are enqueued, in the reports' transaction, for the nodes
// their Waiting says wait (here the even ones) and none else; a kind with
// no Waiting for every node.
func TestObservedWakesOnlyTheNodesAKindWaitsOn(t *testing.T) {
	t.Parallel()
	f := &harness{ca: newCA(t), db: pgtest.New(t), joiner: &joiner{}, revoked: map[string]bool{}}
	var asked sync.Map
	kinds := []gateway.ObservedKind{
		{Kind: "test.even", Waiting: func(ctx context.Context, tx pgx.Tx, ids []string) ([]string, error) {
			var even []string
			for _, id := range ids {
				asked.Store(id, true)
				var i int
				if _, err := fmt.Sscanf(id, "node_%d", &i); err != nil {
					return nil, err
				}
				if i%2 == 0 {
					even = append(even, id)
				}
			}
			// Read in the reports' transaction: the node is stored.
			var observed int64
			if err := tx.QueryRow(ctx, `SELECT observed_generation FROM nodes WHERE id = $1`, ids[0]).Scan(&observed); err != nil || observed != 1 {
				return nil, fmt.Errorf("node %s observed %d in the transaction (%v), want 1", ids[0], observed, err)
			}
			return even, nil
		}},
		{Kind: "test.all"},
	}
	f.tune = func(c *gateway.Config) { c.ObservedKinds = kinds }
	f.gw, f.addr = f.serve(t, "gw-1")
	ids := converge(t, f, 10)
	for _, kind := range []string{"test.even", "test.all"} {
		rows, err := f.db.Query(t.Context(), `SELECT key FROM work_queue WHERE kind = $1 ORDER BY key`, kind)
		if err != nil {
			t.Fatal(err)
		}
		got, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		want := ids
		if kind == "test.even" {
			want = slices.DeleteFunc(slices.Clone(ids), func(id string) bool { return (id[len(id)-1]-'0')%2 == 1 })
		}
		if !slices.Equal(got, want) {
			t.Errorf("%s enqueued for %v, want %v", kind, got, want)
		}
	}
	for _, id := range ids {
		if _, ok := asked.Load(id); !ok {
			t.Errorf("Waiting was not asked about %s", id)
		}
	}
}

// converge connects n nodes (node_00, …) adopted at generation 1, has each
// report Observed at 1 at once, and checks every report was stored once,
// with one node.converged each. It returns the node ids.
func converge(t *testing.T, f *harness, n int) []string {
	t.Helper()
	var ids []string
	for i := range n {
		id := fmt.Sprintf("node_%02d", i)
		ids = append(ids, id)
		f.addNode(t, id)
	}
	if _, err := f.db.Exec(t.Context(), `UPDATE nodes SET state = 'adopted', generation = 1, spec = '{"site": {"logLevel": "debug"}}'`); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for _, id := range ids {
		cert := f.ca.node(t, id)
		stream, _ := open(t, f.client(t, f.addr, &cert), id)
		if m, err := stream.Recv(); err != nil || m.GetDesiredState() == nil {
			t.Fatalf("%s: want its DesiredState, got %v %v", id, m, err)
		}
		wg.Go(func() {
			err := stream.Send(&agentv1.SessionRequest{Body: &agentv1.SessionRequest_Observed{Observed: &agentv1.Observed{
				Generation: 1, ObservedGeneration: 1,
				Sections: []*agentv1.SectionStatus{{Section: "site", State: agentv1.SectionState_SECTION_STATE_CONVERGED, Generation: 1}},
			}}})
			if err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	poll.Until(t, 15*time.Second, "every node observed at generation 1", func() bool {
		var done int
		_ = f.db.QueryRow(t.Context(), `SELECT count(*) FROM nodes WHERE observed_generation = 1`).Scan(&done)
		return done == n
	})
	var events, distinct int
	if err := f.db.QueryRow(t.Context(), `SELECT count(*), count(DISTINCT resource_id) FROM outbox WHERE type = 'node.converged'`).Scan(&events, &distinct); err != nil {
		t.Fatal(err)
	}
	if events != n || distinct != n {
		t.Fatalf("%d node.converged events for %d nodes (%d distinct): want one each", events, n, distinct)
	}
	return ids
}

// TestABatchThatFailsIsStoredAgainReportByReport: reports queued behind a
// busy writer are stored in one batch; when one of them fails, the batch
// rolls back and every report is stored again on its own — the others
// land, once each, and only the failing one gets its error.
func TestABatchThatFailsIsStoredAgainReportByReport(t *testing.T) {
	t.Parallel()
	f := setup(t)
	if _, err := f.db.Exec(t.Context(), `CREATE TABLE stored_reports (n int PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	// Hold the writer so the reports after it queue into one batch.
	release, holding := make(chan struct{}), make(chan struct{})
	held := make(chan error, 1)
	go func() {
		held <- f.gw.Submit(t.Context(), "node_hold", func(ctx context.Context, _ pgx.Tx, _ *reconcile.Queue) error {
			close(holding)
			<-release
			return nil
		})
	}()
	<-holding
	const n = 20
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			errs[i] = f.gw.Submit(t.Context(), fmt.Sprintf("node_%02d", i), func(ctx context.Context, tx pgx.Tx, _ *reconcile.Queue) error {
				if i == 7 {
					return errors.New("report 7 cannot be stored")
				}
				_, err := tx.Exec(ctx, `INSERT INTO stored_reports (n) VALUES ($1)`, i)
				return err
			})
		})
	}
	poll.Until(t, 10*time.Second, "the reports to queue behind the held one", func() bool { return f.gw.QueuedReports() == n })
	close(release)
	wg.Wait()
	if err := <-held; err != nil {
		t.Fatal(err)
	}
	for i, err := range errs {
		if (err != nil) != (i == 7) {
			t.Errorf("report %d: %v", i, err)
		}
	}
	var stored int
	if err := f.db.QueryRow(t.Context(), `SELECT count(*) FROM stored_reports`).Scan(&stored); err != nil || stored != n-1 {
		t.Fatalf("%d reports stored (%v), want %d", stored, err, n-1)
	}
}

// TestObservedDriftedWakesFleetDrift: a report with a section reason
// starting "drifted:" enqueues fleet.drift for the node's pool in the
// report's transaction, and so does the next report (the one that may
// clear it); a plain report after a plain one enqueues nothing.
func TestObservedDriftedWakesFleetDrift(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.addNode(t, "node_1")
	if _, err := f.db.Exec(t.Context(), `UPDATE nodes SET state = 'adopted', generation = 1, spec = '{"site": {"logLevel": "debug"}}'`); err != nil {
		t.Fatal(err)
	}
	var pool string
	if err := f.db.QueryRow(t.Context(), `SELECT pool_id FROM nodes WHERE id = 'node_1'`).Scan(&pool); err != nil {
		t.Fatal(err)
	}
	cert := f.ca.node(t, "node_1")
	stream, _ := open(t, f.client(t, f.addr, &cert), "node_1")
	if m, err := stream.Recv(); err != nil || m.GetDesiredState() == nil {
		t.Fatalf("want the DesiredState, got %v %v", m, err)
	}
	queued := func() []string {
		rows, err := f.db.Query(t.Context(), `SELECT key FROM work_queue WHERE kind = $1 ORDER BY key`, lifecycle.KindDrift)
		if err != nil {
			t.Fatal(err)
		}
		keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return keys
	}
	for i, c := range []struct {
		reason string
		want   []string
	}{
		{"8 GPUs", nil},
		{"drifted: /var/run/cdi/bettercompute.io-gpu.json was edited or removed by hand, restored", []string{pool}},
		{"8 GPUs", []string{pool}},
		{"8 GPUs", nil},
	} {
		if _, err := f.db.Exec(t.Context(), `DELETE FROM work_queue WHERE kind = $1`, lifecycle.KindDrift); err != nil {
			t.Fatal(err)
		}
		if err := stream.Send(&agentv1.SessionRequest{Body: &agentv1.SessionRequest_Observed{Observed: &agentv1.Observed{
			Generation: 1, ObservedGeneration: 1,
			Sections: []*agentv1.SectionStatus{{Section: "devices", State: agentv1.SectionState_SECTION_STATE_CONVERGED, Reason: c.reason, Generation: 1}},
		}}}); err != nil {
			t.Fatal(err)
		}
		// The report's commit: node.converged, one per report.
		poll.Until(t, 15*time.Second, "the report stored", func() bool {
			var n int
			_ = f.db.QueryRow(t.Context(), `SELECT count(*) FROM outbox WHERE type = 'node.converged'`).Scan(&n)
			return n == i+1
		})
		if got := queued(); !slices.Equal(got, c.want) {
			t.Fatalf("report %d (%q): fleet.drift queued for %v, want %v", i, c.reason, got, c.want)
		}
	}
}
