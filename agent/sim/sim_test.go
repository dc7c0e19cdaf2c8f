package sim_test

import (
	"context"
	"crypto/ed25519"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	collectorpb "go.opentelemetry.io/proto/otlp/collector/metrics/v1"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/bettercompute/bettercompute/agent/command"
	"github.com/bettercompute/bettercompute/agent/internal/otlptest"
	"github.com/bettercompute/bettercompute/agent/internal/testcontrol"
	"github.com/bettercompute/bettercompute/agent/sim"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandsig"
)

const wait = 20 * time.Second

func recv[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(wait):
		t.Fatalf("no %s within %s", what, wait)
		panic("unreachable")
	}
}

func newCommand(nodeID string, seq int64, kind string, body *agentv1.CommandBody) *agentv1.Command {
	b, _ := proto.Marshal(body)
	return &agentv1.Command{Id: "cmd_" + kind, NodeId: nodeID, Seq: seq, Kind: kind, Body: b,
		NotAfter: timestamppb.New(time.Now().Add(10 * time.Minute)), Timeout: durationpb.New(time.Minute)}
}

// deliver sends c until the daemon answers it with outcome, as a gateway
// delivers an unanswered command again on its resync: a command sent as a
// session opens or closes (the old one still registered, the new one not
// yet reading) may be lost, and a daemon answers a command it already
// journaled with its state. An ACCEPTED of c while waiting for its end,
// and an earlier command's answer delivered again, are skipped; any other
// update fails the test.
func deliver(t *testing.T, cp *testcontrol.Server, c *agentv1.Command, outcome agentv1.CommandOutcome) *agentv1.CommandUpdate {
	t.Helper()
	deadline := time.Now().Add(wait)
	for {
		cp.SendCommand(c)
		again := time.After(2 * time.Second)
	read:
		for {
			select {
			case u := <-cp.Updates:
				switch {
				case u.GetSeq() == c.GetSeq() && u.GetOutcome() == outcome:
					return u
				case u.GetSeq() == c.GetSeq() && u.GetOutcome() == agentv1.CommandOutcome_COMMAND_OUTCOME_ACCEPTED:
				case u.GetSeq() < c.GetSeq():
					// An earlier command's answer to its own delivery again.
				default:
					t.Fatalf("update %v, want seq %d %v", u, c.GetSeq(), outcome)
				}
			case <-again:
				break read
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %v for seq %d within %s", outcome, c.GetSeq(), wait)
		}
	}
}

// TestFleet_RebootAndJournalLoss: a simulated daemon reboots on a signed
// node.reboot (new boot id, same journal), collects its own log, and
// reports a new journal id once its journal is wiped.
func TestFleet_RebootAndJournalLoss(t *testing.T) {
	t.Parallel()
	cp := testcontrol.New(t)
	pub, priv, err := ed25519.GenerateKey(nil)
	if err != nil {
		t.Fatal(err)
	}
	f, err := sim.Start(context.Background(), sim.Config{
		Gateway: cp.Addr, RootCAs: cp.RootCAs(), Token: cp.Token, JoinserviceKey: cp.PublicKey, JoinserviceKeyID: cp.KeyID,
		Root: t.TempDir(), CommandKey: pub,
	}, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Stop)
	node := f.Nodes()[0]
	h1 := recv(t, cp.Hellos, "Hello")
	if h1.GetBootId() != f.BootID(0) {
		t.Fatalf("hello %v, boot %s", h1.Hello, f.BootID(0))
	}

	logs := newCommand(node, 1, command.KindLogsCollect, &agentv1.CommandBody{Kind: &agentv1.CommandBody_LogsCollect{LogsCollect: &agentv1.LogsCollect{}}})
	deliver(t, cp, logs, agentv1.CommandOutcome_COMMAND_OUTCOME_ACCEPTED)
	u := deliver(t, cp, logs, agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED)
	if !strings.Contains(string(u.GetResult().GetLogsCollect().GetData()), "session established") {
		t.Errorf("collected log %q", u.GetResult().GetLogsCollect().GetData())
	}

	r := newCommand(node, 2, command.KindNodeReboot, &agentv1.CommandBody{Kind: &agentv1.CommandBody_NodeReboot{NodeReboot: &agentv1.NodeReboot{Reason: "test"}}})
	commandsig.Sign(r, testcontrol.TrustDomain, priv)
	// The session is steady here, so one send reaches the daemon. Its
	// ACCEPTED may be lost with the connection the reboot ends; the new
	// boot's SUCCEEDED is what counts.
	cp.SendCommand(r)
	h2 := recv(t, cp.Hellos, "Hello after the reboot")
	if h2.GetBootId() == h1.GetBootId() || h2.GetJournalId() != h1.GetJournalId() {
		t.Fatalf("after the reboot: %v, before: %v", h2.Hello, h1.Hello)
	}
	deliver(t, cp, r, agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED)

	f.WipeJournal(0)
	h3 := recv(t, cp.Hellos, "Hello after the wipe")
	if h3.GetJournalId() == h2.GetJournalId() || h3.GetBootId() != h2.GetBootId() {
		t.Fatalf("after the wipe: %v, before: %v", h3.Hello, h2.Hello)
	}

	f.Restart(0, false)
	if h := recv(t, cp.Hellos, "Hello after a restart"); h.GetBootId() != h3.GetBootId() || h.GetJournalId() != h3.GetJournalId() {
		t.Fatalf("after a restart: %v", h.Hello)
	}
}

// TestFleet_Telemetry: with Telemetry, every simulated daemon exports its
// eight mock GPUs' readings under its own node id to a real OTLP receiver,
// and MetricsHandler serves each one's for a scrape.
func TestFleet_Telemetry(t *testing.T) {
	t.Parallel()
	cp := testcontrol.New(t)
	rcv := otlptest.New(t)
	f, err := sim.Start(context.Background(), sim.Config{
		Gateway: cp.Addr, RootCAs: cp.RootCAs(), Token: cp.Token, JoinserviceKey: cp.PublicKey, JoinserviceKeyID: cp.KeyID,
		Root: t.TempDir(), NoLogFiles: true, Telemetry: true, OTLPEndpoint: "http://" + rcv.Addr, TelemetryInterval: time.Second,
	}, 2)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Stop)
	seen := map[string]bool{}
	rcv.Until(t, func(req *collectorpb.ExportMetricsServiceRequest) bool {
		if len(otlptest.ByName(req)["gpu.temperature"]) == 8 {
			seen[otlptest.Resource(req)["bettercompute.node.id"]] = true
		}
		return len(seen) == 2
	})
	for _, id := range f.Nodes() {
		if !seen[id] {
			t.Errorf("no export from node %s (saw %v)", id, seen)
		}
	}
	srv := httptest.NewServer(f.MetricsHandler())
	defer srv.Close()
	get := func(path string) (int, string) {
		res, err := http.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		return res.StatusCode, string(b)
	}
	if code, body := get("/nodes/1/metrics"); code != http.StatusOK || strings.Count(body, "gpu_temperature_celsius{") != 8 {
		t.Errorf("scrape of node 1: %d\n%s", code, body)
	}
	if code, _ := get("/nodes/2/metrics"); code != http.StatusNotFound {
		t.Errorf("scrape of a node that does not exist: %d, want 404", code)
	}
}
