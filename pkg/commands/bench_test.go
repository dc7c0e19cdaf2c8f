package commands_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// BenchmarkEnqueueSettle is the command queue's database path per command:
// enqueue (one transaction), claim (the gateway's dispatch statement) and
// apply SUCCEEDED (one transaction, with its event). It reports
// commands/s.
func BenchmarkEnqueueSettle(b *testing.B) {
	db := pgtest.New(b)
	fixture.Node(b, db, fixture.NodeOpts{ID: "node_a", State: nodes.StateAdopted, Gateway: "gw-1"})
	b.ResetTimer()
	start := time.Now()
	for i := 0; i < b.N; i++ {
		err := reconcile.InTx(b.Context(), db, nil, func(tx pgx.Tx, _ *reconcile.Queue) error {
			_, _, err := kinds.Enqueue(b.Context(), tx, commands.Request{NodeID: "node_a", Kind: "inventory.refresh", Payload: `{"sections":["gpus"]}`, NotAfter: time.Now().Add(time.Minute)})
			return err
		})
		if err != nil {
			b.Fatal(err)
		}
		cs, err := commands.Claim(b.Context(), db, "node_a", 1)
		if err != nil || len(cs) != 1 {
			b.Fatalf("claimed %d: %v", len(cs), err)
		}
		err = reconcile.InTx(b.Context(), db, nil, func(tx pgx.Tx, q *reconcile.Queue) error {
			_, err := kinds.Apply(b.Context(), tx, q, "node_a", 1, &agentv1.CommandUpdate{Id: cs[0].ID, Seq: cs[0].Seq, Outcome: agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED})
			return err
		})
		if err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "commands/s")
}
