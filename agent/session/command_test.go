package session_test

import (
	"context"
	"crypto/ed25519"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/bettercompute/bettercompute/agent/command"
	"github.com/bettercompute/bettercompute/agent/internal/testcontrol"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandsig"
)

func command1(nodeID string, seq int64, kind string, body *agentv1.CommandBody) *agentv1.Command {
	b, err := proto.Marshal(body)
	if err != nil {
		panic(err)
	}
	return &agentv1.Command{Id: "cmd_" + kind, NodeId: nodeID, Seq: seq, Kind: kind, Body: b,
		NotAfter: timestamppb.New(time.Now().Add(10 * time.Minute)), Timeout: durationpb.New(time.Minute)}
}

// update waits for the next CommandUpdate and checks its seq and outcome.
func (f *fixture) update(t *testing.T, seq int64, outcome agentv1.CommandOutcome) *agentv1.CommandUpdate {
	t.Helper()
	u := recv(t, f.cp.Updates, "CommandUpdate")
	if u.GetSeq() != seq || u.GetOutcome() != outcome {
		t.Fatalf("update %v, want seq %d %v", u, seq, outcome)
	}
	return u
}

func (f *fixture) send(t *testing.T, c *agentv1.Command) {
	t.Helper()
	// After a restart the old session may still be open on the server for
	// a moment: wait for the daemon's one session.
	deadline := time.Now().Add(10 * time.Second)
	for f.cp.OpenSessions() != 1 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if n := f.cp.SendCommand(c); n != 1 {
		t.Fatalf("sent on %d open sessions, want the daemon's one", n)
	}
}

func TestCommands(t *testing.T) {
	t.Parallel()
	const (
		accepted  = agentv1.CommandOutcome_COMMAND_OUTCOME_ACCEPTED
		succeeded = agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED
		rejected  = agentv1.CommandOutcome_COMMAND_OUTCOME_REJECTED
		cancelled = agentv1.CommandOutcome_COMMAND_OUTCOME_CANCELLED
	)
	diag := &agentv1.CommandBody{Kind: &agentv1.CommandBody_DiagNvml{DiagNvml: &agentv1.DiagNvml{}}}

	t.Run("run, refresh inventory, answer a re-delivery after reconnect from the journal", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		f.run(t)
		recv(t, f.cp.Hellos, "Hello")
		recv(t, f.cp.Reports, "the session's inventory report")

		f.send(t, command1(f.id.NodeID, 1, command.KindDiagNvml, diag))
		f.update(t, 1, accepted)
		if u := f.update(t, 1, succeeded); len(u.GetResult().GetDiagNvml().GetGpus()) != 8 {
			t.Fatalf("result %v", u.GetResult())
		}
		refresh := &agentv1.CommandBody{Kind: &agentv1.CommandBody_InventoryRefresh{InventoryRefresh: &agentv1.InventoryRefresh{Sections: []string{"gpus"}, Rescan: true}}}
		f.send(t, command1(f.id.NodeID, 2, command.KindInventoryRefresh, refresh))
		f.update(t, 2, accepted)
		f.update(t, 2, succeeded)
		if rep := recv(t, f.cp.Reports, "the refreshed inventory"); len(rep.GetGpus()) != 8 {
			t.Fatalf("report %v", rep)
		}

		if f.cp.KickSessions() != 1 {
			t.Fatal("no session to kick")
		}
		recv(t, f.cp.Hellos, "Hello after reconnect")
		f.send(t, command1(f.id.NodeID, 1, command.KindDiagNvml, diag))
		f.update(t, 1, succeeded) // no ACCEPTED: it did not run again
	})

	t.Run("a command waits for its min_generation, then runs; cancel of an unknown seq", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		f.run(t)
		recv(t, f.cp.Hellos, "Hello")
		c := command1(f.id.NodeID, 1, command.KindDiagNvml, diag)
		c.MinGeneration = 2
		f.send(t, c)
		f.cp.SetDesired(&agentv1.DesiredState{Generation: 2, Spec: &agentv1.NodeSpec{}})
		if o := f.observed(t, 2); o.GetObservedGeneration() != 2 {
			t.Fatalf("observed %v", o)
		}
		f.update(t, 1, accepted)
		f.update(t, 1, succeeded)

		if f.cp.SendCancel(&agentv1.CommandCancel{Id: "cmd_2", Seq: 2}) != 1 {
			t.Fatal("no session")
		}
		f.update(t, 2, cancelled)
		f.send(t, command1(f.id.NodeID, 2, command.KindDiagNvml, diag))
		f.update(t, 2, cancelled)
	})

	t.Run("a signed reboot runs the hook once; after a new boot it reads succeeded", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		pub, priv, err := ed25519.GenerateKey(nil)
		if err != nil {
			t.Fatal(err)
		}
		var reboots atomic.Int64
		rebooted := make(chan struct{}, 1)
		f.cfg.CommandKey = pub
		f.cfg.RebootHook = func(context.Context, string) error {
			reboots.Add(1)
			rebooted <- struct{}{}
			return nil
		}
		stop := f.run(t)
		recv(t, f.cp.Hellos, "Hello")
		unsigned := command1(f.id.NodeID, 1, command.KindNodeReboot, &agentv1.CommandBody{Kind: &agentv1.CommandBody_NodeReboot{NodeReboot: &agentv1.NodeReboot{}}})
		f.send(t, unsigned)
		if u := f.update(t, 1, rejected); u.GetReject() != agentv1.RejectCode_REJECT_CODE_BAD_SIGNATURE {
			t.Fatalf("update %v", u)
		}
		signed := command1(f.id.NodeID, 2, command.KindNodeReboot, &agentv1.CommandBody{Kind: &agentv1.CommandBody_NodeReboot{NodeReboot: &agentv1.NodeReboot{}}})
		commandsig.Sign(signed, testcontrol.TrustDomain, priv)
		f.send(t, signed)
		f.update(t, 2, accepted)
		recv(t, rebooted, "the reboot hook")
		stop() // the machine goes down

		f.cfg.BootID = "boot-2"
		f.run(t)
		if h := recv(t, f.cp.Hellos, "Hello after the reboot"); h.GetBootId() != "boot-2" {
			t.Fatalf("hello %v", h.Hello)
		}
		f.send(t, signed)
		f.update(t, 2, succeeded)
		if n := reboots.Load(); n != 1 {
			t.Fatalf("reboot hook called %d times, want 1", n)
		}
	})

	t.Run("a wiped journal gets a new journal id and forgets its commands", func(t *testing.T) {
		t.Parallel()
		f := setup(t, nil)
		stop := f.run(t)
		h1 := recv(t, f.cp.Hellos, "Hello")
		c := command1(f.id.NodeID, 1, command.KindDiagNvml, diag)
		f.send(t, c)
		f.update(t, 1, accepted)
		f.update(t, 1, succeeded)
		stop()
		if err := os.RemoveAll(filepath.Join(f.store.Root(), command.JournalDir)); err != nil {
			t.Fatal(err)
		}
		f.run(t)
		h2 := recv(t, f.cp.Hellos, "Hello after the wipe")
		if h2.GetJournalId() == h1.GetJournalId() || h2.GetJournalId() == "" {
			t.Fatalf("journal id %q after the wipe, was %q", h2.GetJournalId(), h1.GetJournalId())
		}
		// The control plane must not re-send non-retry-safe commands
		// (journal-lost); a retry-safe one simply runs again.
		f.send(t, c)
		f.update(t, 1, accepted)
		f.update(t, 1, succeeded)
	})
}
