package gateway_test

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/services/gateway"
)

// TestCommandsPolledFastWhileTheBusIsDown: with the bus up the gateway
// leaves commands to the wakes (its resync waits for the liveness
// interval, an hour here); once the bus is down it resyncs every
// CommandPollBusDown, so a command queued with no wake at all reaches the
// node's session without anyone calling ResyncCommands.
func TestCommandsPolledFastWhileTheBusIsDown(t *testing.T) {
	t.Parallel()
	var up atomic.Bool
	up.Store(true)
	f := setup(t)
	f.tune = func(c *gateway.Config) {
		c.BusUp = up.Load
		c.CommandPollBusDown = 50 * time.Millisecond
	}
	gw, addr := f.serve(t, "gw-poll")
	f.addNode(t, "node_a")
	d := f.connectTo(t, gw, addr, "node_a", "boot-1", "journal-1")
	c := f.enqueue(t, "node_a", "diag.nvml", "diag-1", nil)

	// The bus is up and sent no wake: nothing goes out for a while (ten
	// poll periods), the resync being an hour away.
	quiet := time.After(500 * time.Millisecond)
	for waiting := true; waiting; {
		select {
		case m := <-d.msgs:
			if m.GetCommand() != nil {
				t.Fatalf("a command went out with the bus up and no wake: %v", m)
			}
		case <-quiet:
			waiting = false
		}
	}
	up.Store(false)
	if got := d.command(); got.GetId() != c.ID {
		t.Fatalf("with the bus down the gateway sent %v, want %s", got, c.ID)
	}
}
