package gateway_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/wake"
)

// BenchmarkEnqueueToDispatched measures one node's command from enqueue
// (its transaction committed) to the Command arriving on the daemon's
// session, through the poke over a real NATS server (the bus up), reported
// as dispatch-ms/op; the daemon then sends SUCCEEDED without waiting for it
// to be applied.
func BenchmarkEnqueueToDispatched(b *testing.B) {
	f := setup(b)
	f.addNode(b, "node_a")
	ns := natstest.New(b)
	nc, err := nats.Connect(ns.URL())
	if err != nil {
		b.Fatal(err)
	}
	defer nc.Close()
	sub, err := f.gw.SubscribeCommands(nc)
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	_ = nc.Flush()
	d := f.connect(b, "node_a", "boot-1", "journal-1")
	waker := f.waker(nc)
	var dispatch time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		err := reconcile.InTx(b.Context(), f.db, nil, func(tx pgx.Tx, _ *reconcile.Queue) error {
			_, _, err := commands.Builtin().Enqueue(b.Context(), tx, commands.Request{NodeID: "node_a", Kind: "diag.nvml", NotAfter: time.Now().Add(time.Minute)})
			return err
		})
		if err != nil {
			b.Fatal(err)
		}
		waker.Wake(wake.Set{Nodes: []string{"node_a"}})
		c := d.command()
		dispatch += time.Since(start)
		d.update(c, agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED, 0, nil)
	}
	b.ReportMetric(float64(dispatch.Microseconds())/1000/float64(b.N), "dispatch-ms/op")
}
