package nodespec_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	desired "github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/services/nodespec"
)

// TestAPoolChangeIsStoredInBatchesAndKeepsEveryGuarantee: a change to a
// pool of 60 nodes, one of which has a conflicting contribution, bumps every
// other node's generation exactly once with one node.spec.changed each and
// one Changed call each, leaves the conflicting node's spec and generation
// alone with its error, and a second pass bumps nothing.
func TestAPoolChangeIsStoredInBatchesAndKeepsEveryGuarantee(t *testing.T) {
	t.Parallel()
	reg := nodespec.Builtin()
	if err := reg.Register("metal", func(_ context.Context, _ reconcile.Querier, n desired.Node) (*agentv1.NodeSpec, error) {
		if n.ID == "node_bad" {
			return &agentv1.NodeSpec{Site: &agentv1.SiteSettings{LogLevel: proto.String("error")}}, nil
		}
		return nil, nil
	}); err != nil {
		t.Fatal(err)
	}
	e := setup(t, reg, "adopted")
	ids := []string{"node_1", "node_bad"}
	for i := range 58 {
		id := fmt.Sprintf("node_b%02d", i)
		ids = append(ids, id)
	}
	for _, id := range ids[1:] {
		fixture.Node(t, e.pool, fixture.NodeOpts{ID: id, Pool: "pool_a", State: nodes.StateAdopted})
	}
	invalidate := func() {
		err := reconcile.InTx(t.Context(), e.pool, nil, func(tx pgx.Tx, q *reconcile.Queue) error {
			for _, id := range ids {
				if err := desired.Invalidate(t.Context(), q, id); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	invalidate()
	if tr := e.tick(t, desired.Kind); tr.Done != len(ids) || tr.Failed != 0 {
		t.Fatalf("first pass %+v", tr)
	}
	events := func() int {
		var n int
		if err := e.pool.QueryRow(t.Context(), `SELECT count(*) FROM outbox WHERE type = 'node.spec.changed'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	before := events()

	// The pool's site changes: every node but node_bad (whose metal module
	// sets a different log level) moves to its next generation.
	e.exec(t, `UPDATE pools SET site = '{"logLevel": "debug"}' WHERE id = 'pool_a'`)
	invalidate()
	for _, id := range ids { // the first pass's wakes are all in
		e.deliveries(t, id, 1)
	}
	stmts, batches := e.statements.Load(), e.batches.Load()
	if tr := e.tick(t, desired.Kind); tr.Done != len(ids) || tr.Failed != 0 {
		t.Fatalf("change pass %+v", tr)
	}
	// A batch costs a handful of statements whatever its size (the claim's
	// share, the leases, one read per contributor, one store, one events
	// insert, the settle), where a statement per node and contributor
	// would cost five per node.
	got := e.statements.Load() - stmts
	for _, id := range ids { // the change pass's wakes are all in
		if id != "node_bad" {
			e.deliveries(t, id, 2)
		}
	}
	nb := e.batches.Load() - batches
	t.Logf("the change pass of %d nodes: %d statements, %d batches", len(ids), got, nb)
	if nb < 1 || nb >= int64(len(ids)) {
		t.Errorf("%d batches for %d nodes", nb, len(ids))
	}
	if got > 10*nb+5 {
		t.Errorf("the change pass of %d nodes took %d statements in %d batches: more than 10 a batch", len(ids), got, nb)
	}
	if got := events() - before; got != len(ids)-1 {
		t.Fatalf("%d node.spec.changed for %d changed nodes", got, len(ids)-1)
	}
	rows, err := e.pool.Query(t.Context(), `SELECT id, generation, coalesce(spec_error, ''), spec->'site'->>'logLevel' FROM nodes ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var id, specErr string
		var level *string
		var gen int64
		if err := rows.Scan(&id, &gen, &specErr, &level); err != nil {
			t.Fatal(err)
		}
		if id == "node_bad" {
			if gen != 1 || specErr == "" { // no conflict before the change, one after
				t.Errorf("node_bad: generation %d, error %q: want the earlier generation kept with the conflict", gen, specErr)
			}
			continue
		}
		if gen != 2 || specErr != "" || level == nil || *level != "debug" {
			t.Errorf("%s: generation %d, error %q, logLevel %v", id, gen, specErr, level)
		}
		e.deliveries(t, id, 2)
	}
	// Nothing changed since: a second pass bumps nothing.
	invalidate()
	e.tick(t, desired.Kind)
	if got := events() - before; got != len(ids)-1 {
		t.Fatalf("a pass without change wrote %d more events", got-(len(ids)-1))
	}
}
