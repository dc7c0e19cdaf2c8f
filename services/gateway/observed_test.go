package gateway_test

import (
	"fmt"
	"sync"
	"testing"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// TestObservedReportsOfManySessionsAreStoredOnceEach: 40 nodes converge at
// once; the batch writer stores every report (the observed generation, one
// node.converged each) and none twice.
func TestObservedReportsOfManySessionsAreStoredOnceEach(t *testing.T) {
	t.Parallel()
	f := setup(t)
	const n = 40
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
	eventually(t, "every node observed at generation 1", func() bool {
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
}
