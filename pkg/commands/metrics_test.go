package commands_test

import (
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// finishedCount is how many commands of kind reached state by the
// duration histogram.
func finishedCount(t *testing.T, kind, state string) uint64 {
	t.Helper()
	reg := prometheus.NewRegistry()
	reg.MustRegister(commands.Collector())
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != commands.DurationMetric {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["kind"] == kind && labels["state"] == state {
				return m.GetHistogram().GetSampleCount()
			}
		}
	}
	return 0
}

// Not parallel: the histogram is the process's, and parallel tests of this
// package finish commands too.
func TestFinishingObservesTheDuration(t *testing.T) {
	db := pgtest.New(t)
	addNode(t, db, "node_a")
	before := finishedCount(t, "inventory.refresh", "cancelled")
	c, _ := enqueue(t, db, req("node_a", "inventory.refresh", "metrics"))
	if got := finishedCount(t, "inventory.refresh", "cancelled"); got != before {
		t.Fatalf("a pending command was counted: %d → %d", before, got)
	}
	c, err := inTx(t, db, func(tx pgx.Tx, q *reconcile.Queue) (commands.Command, error) {
		return commands.Cancel(t.Context(), tx, q, "node_a", c.ID)
	})
	if err != nil || c.State != commands.Cancelled {
		t.Fatalf("cancel: %s %v", c.State, err)
	}
	if got := finishedCount(t, "inventory.refresh", "cancelled"); got != before+1 {
		t.Fatalf("cancelled commands %d, want %d", got, before+1)
	}
}
