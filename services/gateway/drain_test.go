package gateway_test

import (
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/services/gateway"
)

// TestDrainMovesTheNodesAndLosesNoCommand: a draining gateway ends its
// sessions UNAVAILABLE with a retry delay under DrainJitter, refuses new
// ones the same way, and returns once it holds none; the node's next
// session, on another gateway, gets the command that was in flight on the
// drained one (same id and seq, so the daemon's journal runs it once), and
// the command succeeds with one attempt.
func TestDrainMovesTheNodesAndLosesNoCommand(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.addNode(t, "node_a")
	gw2, addr2 := f.serve(t, "gw-2")
	d := f.connect(t, "node_a", "boot-1", "journal-1")
	c := f.enqueue(t, "node_a", "diag.nvml", "diag-1", nil)
	if err := f.gw.ResyncCommands(t.Context()); err != nil {
		t.Fatal(err)
	}
	first := d.command()
	d.update(first, agentv1.CommandOutcome_COMMAND_OUTCOME_ACCEPTED, 0, nil)

	if n := f.gw.Drain(t.Context()); n != 1 {
		t.Fatalf("Drain ended %d sessions, want 1", n)
	}
	if n := f.gw.Sessions(); n != 0 {
		t.Fatalf("%d sessions after Drain", n)
	}
	for range d.msgs {
	}
	checkDraining(t, d.err, "the session's end")

	// A new session on the drained gateway is refused the same way.
	cert := f.ca.node(t, "node_a")
	stream, err := f.client(t, f.addr, &cert).Session(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	_ = stream.Send(hello("node_a"))
	_, err = stream.Recv()
	checkDraining(t, err, "a new session")

	// The node moves: the command comes again, unchanged, and settles once.
	d2 := f.connectTo(t, gw2, addr2, "node_a", "boot-1", "journal-1")
	if err := gw2.ResyncCommands(t.Context()); err != nil {
		t.Fatal(err)
	}
	again := d2.command()
	if again.GetId() != c.ID || again.GetSeq() != first.GetSeq() {
		t.Fatalf("after the move: %v, want %s seq %d", again, c.ID, first.GetSeq())
	}
	d2.update(again, agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED, 0, nil)
	f.waitState(t, c.ID, commands.Succeeded)
	var attempts int
	if err := f.db.QueryRow(t.Context(), `SELECT attempts FROM commands WHERE id = $1`, c.ID).Scan(&attempts); err != nil || attempts != 1 {
		t.Fatalf("attempts %d (%v), want 1", attempts, err)
	}
}

func checkDraining(t *testing.T, err error, what string) {
	t.Helper()
	st, _ := status.FromError(err)
	if st.Code() != codes.Unavailable || st.Message() != "gateway draining: reconnect to another gateway" {
		t.Fatalf("%s: %v, want UNAVAILABLE gateway draining", what, err)
	}
	var delay time.Duration = -1
	for _, det := range st.Details() {
		if ri, ok := det.(*errdetails.RetryInfo); ok {
			delay = ri.GetRetryDelay().AsDuration()
		}
	}
	if delay < 0 || delay >= gateway.DrainJitter {
		t.Fatalf("%s: retry delay %v, want one under %v", what, delay, gateway.DrainJitter)
	}
}
