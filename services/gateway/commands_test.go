package gateway_test

import (
	"context"
	"crypto"
	"crypto/ed25519"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandsig"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/wake"
	"github.com/bettercompute/bettercompute/services/gateway"
)

// daemon is a raw session holding a node certificate, standing in for bcd.
type daemon struct {
	t      testing.TB
	stream agentv1.NodeService_SessionClient
	msgs   chan *agentv1.SessionResponse
	// err is the error that ended the stream, once msgs is closed.
	err error
}

func (f *harness) connect(t testing.TB, id, boot, journal string) *daemon {
	t.Helper()
	return f.connectTo(t, f.gw, f.addr, id, boot, journal)
}

// connectTo opens a session on gateway gw listening at addr.
func (f *harness) connectTo(t testing.TB, gw *gateway.Gateway, addr, id, boot, journal string) *daemon {
	t.Helper()
	cert := f.ca.node(t, id)
	c := f.client(t, addr, &cert)
	stream, err := c.Session(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&agentv1.SessionRequest{Body: &agentv1.SessionRequest_Hello{Hello: &agentv1.Hello{NodeId: id, BootId: boot, JournalId: journal, AgentVersion: "test"}}}); err != nil {
		t.Fatal(err)
	}
	d := &daemon{t: t, stream: stream, msgs: make(chan *agentv1.SessionResponse, 64)}
	go func() {
		defer close(d.msgs)
		for {
			m, err := stream.Recv()
			if err != nil {
				d.err = err
				return
			}
			d.msgs <- m
		}
	}()
	if m := d.next(); m.GetWelcome() == nil {
		t.Fatalf("first message %v", m)
	}
	// The session's own start-up dispatch must be over before the test
	// dispatches, or it re-sends what the test just claimed.
	poll.Until(t, 10*time.Second, "the session of "+id+" to be ready", func() bool { return gw.Ready(id) })
	return d
}

// next returns the next message, skipping inventory requests.
func (d *daemon) next() *agentv1.SessionResponse {
	d.t.Helper()
	for {
		select {
		case m, ok := <-d.msgs:
			if !ok {
				d.t.Fatal("session ended")
			}
			if m.GetInventoryRequest() != nil {
				continue
			}
			return m
		case <-time.After(15 * time.Second):
			d.t.Fatal("no message from the gateway")
		}
	}
}

func (d *daemon) command() *agentv1.Command {
	d.t.Helper()
	m := d.next()
	if m.GetCommand() == nil {
		d.t.Fatalf("want a Command, got %v", m)
	}
	return m.GetCommand()
}

func (d *daemon) update(c *agentv1.Command, o agentv1.CommandOutcome, rc agentv1.RejectCode, result *agentv1.CommandResult) {
	d.t.Helper()
	if err := d.stream.Send(&agentv1.SessionRequest{Body: &agentv1.SessionRequest_CommandUpdate{CommandUpdate: &agentv1.CommandUpdate{
		Id: c.GetId(), Seq: c.GetSeq(), Outcome: o, Reject: rc, Result: result,
	}}}); err != nil {
		d.t.Fatal(err)
	}
}

func (f *harness) enqueue(t testing.TB, node, kind, key string, payload any) commands.Command {
	t.Helper()
	var c commands.Command
	err := reconcile.InTx(t.Context(), f.db, nil, func(tx pgx.Tx, _ *reconcile.Queue) error {
		var err error
		c, _, err = commands.Builtin().Signing(f.signer, trustDomain).Enqueue(t.Context(), tx, commands.Request{NodeID: node, Kind: kind, IdempotencyKey: key, Payload: payload, NotAfter: time.Now().Add(10 * time.Minute)})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// waker wakes over nc, finding each node's gateway in the database.
func (f *harness) waker(nc *nats.Conn) *wake.Waker {
	return wake.New(nc, func(ctx context.Context, ids []string) (map[string]string, error) {
		return nodes.Gateways(ctx, f.db, ids)
	}, nil)
}

// TestCommandWakeReachesOnlyTheNodesGateway: with two gateways subscribed
// to command wakes, a command queued for a node wakes the gateway holding
// its session, which sends it at once (liveness resync is an hour away),
// and the other gateway hears nothing of it.
func TestCommandWakeReachesOnlyTheNodesGateway(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.addNode(t, "node_a")
	f.addNode(t, "node_b")
	other, _ := f.serve(t, "gw-2")
	ns := natstest.New(t)
	nc, err := nats.Connect(ns.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	heard := map[string]chan []string{"gw-1": make(chan []string, 8), "gw-2": make(chan []string, 8)}
	for _, g := range []*gateway.Gateway{f.gw, other} {
		listening(t, nc)(g.SubscribeCommands(nc))
	}
	for id, ch := range heard {
		listening(t, nc)(wake.SubscribeCommands(nc, id, func(ids []string) { ch <- ids }))
	}
	d := f.connect(t, "node_a", "boot-1", "journal-1")
	w := f.waker(nc)

	var c commands.Command
	err = reconcile.InTx(t.Context(), f.db, w, func(tx pgx.Tx, q *reconcile.Queue) error {
		var err error
		c, _, err = commands.Builtin().Enqueue(t.Context(), tx, commands.Request{NodeID: "node_a", Kind: "diag.nvml", NotAfter: time.Now().Add(time.Minute)})
		q.WakeCommands("node_a")
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := d.command(); got.GetId() != c.ID {
		t.Fatalf("node_a got %v, want %s", got, c.ID)
	}
	if ids := hear(t, heard["gw-1"]); !slices.Equal(ids, []string{"node_a"}) {
		t.Fatalf("gw-1 heard %v, want [node_a]", ids)
	}
	// node_b's wake goes to gw-2 after node_a's went out: had node_a's
	// reached gw-2, gw-2 would hear it first.
	if _, err := f.db.Exec(t.Context(), `UPDATE nodes SET gateway_id = 'gw-2' WHERE id = 'node_b'`); err != nil {
		t.Fatal(err)
	}
	w.Wake(wake.Set{Nodes: []string{"node_b"}})
	if ids := hear(t, heard["gw-2"]); !slices.Equal(ids, []string{"node_b"}) {
		t.Fatalf("gw-2 heard %v first, want [node_b]: a wake of node_a reached the gateway not holding it", ids)
	}
}

// listening fails t unless the subscription was made and has reached the
// server; it ends with t.
func listening(t *testing.T, nc *nats.Conn) func(*nats.Subscription, error) {
	return func(sub *nats.Subscription, err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = sub.Unsubscribe() })
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
	}
}

func hear(t *testing.T, ch chan []string) []string {
	t.Helper()
	select {
	case ids := <-ch:
		return ids
	case <-time.After(15 * time.Second):
		t.Fatal("no command wake")
		return nil
	}
}

func (f *harness) state(t testing.TB, id string) (commands.State, string) {
	t.Helper()
	var s, reason string
	if err := f.db.QueryRow(t.Context(), `SELECT state, reason FROM commands WHERE id = $1`, id).Scan(&s, &reason); err != nil {
		t.Fatal(err)
	}
	return commands.State(s), reason
}

func (f *harness) waitState(t testing.TB, id string, want commands.State) {
	t.Helper()
	poll.Until(t, 15*time.Second, "command "+id+" to be "+string(want), func() bool {
		s, _ := f.state(t, id)
		return s == want
	})
}

func TestCommandPokeDeliversAndSettles(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.addNode(t, "node_a")
	ns := natstest.New(t)
	nc, err := nats.Connect(ns.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	listening(t, nc)(f.gw.SubscribeCommands(nc))
	d := f.connect(t, "node_a", "boot-1", "journal-1")

	c := f.enqueue(t, "node_a", "inventory.refresh", "refresh-1", `{"sections": ["gpus"], "rescan": true}`)
	f.waker(nc).Wake(wake.Set{Nodes: []string{"node_a"}})
	got := d.command()
	var body agentv1.CommandBody
	if err := protoUnmarshal(got.GetBody(), &body); err != nil || !body.GetInventoryRefresh().GetRescan() {
		t.Fatalf("body %v %v", &body, err)
	}
	if got.GetId() != c.ID || got.GetSeq() != 1 || got.GetNodeId() != "node_a" || got.GetTimeout().AsDuration() != 2*time.Minute || len(got.GetSignature()) != 0 {
		t.Fatalf("command %v", got)
	}
	if s, _ := f.state(t, c.ID); s != commands.InFlight {
		t.Fatalf("state after send %s, want in_flight", s)
	}
	d.update(got, agentv1.CommandOutcome_COMMAND_OUTCOME_ACCEPTED, 0, nil)
	d.update(got, agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED, 0, &agentv1.CommandResult{Kind: &agentv1.CommandResult_InventoryRefresh{InventoryRefresh: &agentv1.InventoryRefreshResult{GpuCount: 8}}})
	f.waitState(t, c.ID, commands.Succeeded)
	cmd, err := commands.Lookup(t.Context(), f.db, "node_a", c.ID)
	if err != nil || cmd.AcceptedAt == nil || cmd.Attempts != 1 {
		t.Fatalf("settled %+v %v", cmd, err)
	}
	if js, _ := cmd.ResultJSON(); string(js) != `{"gpuCount":8}` {
		t.Fatalf("result %s", js)
	}
}

func TestCommandResyncWithoutBusAndDuplicateDelivery(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.addNode(t, "node_a")
	d := f.connect(t, "node_a", "boot-1", "journal-1")
	c := f.enqueue(t, "node_a", "diag.nvml", "diag-1", nil)
	// No bus, no poke: the resync finds it.
	if err := f.gw.ResyncCommands(t.Context()); err != nil {
		t.Fatal(err)
	}
	first := d.command()
	if first.GetId() != c.ID {
		t.Fatalf("resync sent %v", first)
	}
	d.update(first, agentv1.CommandOutcome_COMMAND_OUTCOME_ACCEPTED, 0, nil)
	poll.Until(t, 15*time.Second, "accepted", func() bool {
		cmd, _ := commands.Lookup(t.Context(), f.db, "node_a", c.ID)
		return cmd.AcceptedAt != nil
	})
	// A second resync sends nothing new: the next message is the next command.
	if err := f.gw.ResyncCommands(t.Context()); err != nil {
		t.Fatal(err)
	}
	// A new session (same boot and journal) re-sends the in-flight command
	// with the same seq: the journal dedupes it.
	d2 := f.connect(t, "node_a", "boot-1", "journal-1")
	again := d2.command()
	if again.GetId() != c.ID || again.GetSeq() != first.GetSeq() {
		t.Fatalf("re-sent %v, want %s seq %d", again, c.ID, first.GetSeq())
	}
	// The superseded session can no longer settle it (the gateway closed
	// it; a late update is ignored, see pkg/commands).
	_ = d.stream.Send(&agentv1.SessionRequest{Body: &agentv1.SessionRequest_CommandUpdate{CommandUpdate: &agentv1.CommandUpdate{
		Id: first.GetId(), Seq: first.GetSeq(), Outcome: agentv1.CommandOutcome_COMMAND_OUTCOME_FAILED}}})
	d2.update(again, agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED, 0, nil)
	f.waitState(t, c.ID, commands.Succeeded)
	var attempts int
	_ = f.db.QueryRow(t.Context(), `SELECT attempts FROM commands WHERE id = $1`, c.ID).Scan(&attempts)
	if attempts != 1 {
		t.Fatalf("attempts %d, want 1 (a re-send is not a new attempt)", attempts)
	}
}

func TestCommandBusyIsRetried(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.addNode(t, "node_a")
	d := f.connect(t, "node_a", "boot-1", "journal-1")
	c := f.enqueue(t, "node_a", "diag.nvml", "diag-1", nil)
	_ = f.gw.Dispatch(t.Context(), "node_a")
	got := d.command()
	d.update(got, agentv1.CommandOutcome_COMMAND_OUTCOME_REJECTED, agentv1.RejectCode_REJECT_CODE_BUSY, nil)
	// Back to pending, then sent again after the back-off without a poke.
	again := d.command()
	if again.GetId() != c.ID || again.GetSeq() != got.GetSeq() {
		t.Fatalf("re-dispatched %v", again)
	}
	cmd, _ := commands.Lookup(t.Context(), f.db, "node_a", c.ID)
	if cmd.Attempts != 2 || cmd.BusyCount != 1 || cmd.State != commands.InFlight {
		t.Fatalf("after BUSY: %+v", cmd)
	}
	d.update(again, agentv1.CommandOutcome_COMMAND_OUTCOME_REJECTED, agentv1.RejectCode_REJECT_CODE_EXPIRED, nil)
	f.waitState(t, c.ID, commands.Expired)
	if _, reason := f.state(t, c.ID); reason != "EXPIRED" {
		t.Fatalf("reason %q", reason)
	}
}

func TestCommandRebootSignedAndNewBoot(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.addNode(t, "node_a")
	d := f.connect(t, "node_a", "boot-1", "journal-1")
	c := f.enqueue(t, "node_a", "node.reboot", "reboot-1", `{"reason": "maintenance"}`)
	_ = f.gw.Dispatch(t.Context(), "node_a")
	got := d.command()
	if err := commandsig.Verify(got, trustDomain, f.signer.Public()); err != nil || got.GetKeyId() != f.signer.KeyID {
		t.Fatalf("reboot not signed with the command key: %v", err)
	}
	d.update(got, agentv1.CommandOutcome_COMMAND_OUTCOME_ACCEPTED, 0, nil)
	poll.Until(t, 15*time.Second, "accepted", func() bool {
		cmd, _ := commands.Lookup(t.Context(), f.db, "node_a", c.ID)
		return cmd.AcceptedAt != nil
	})
	// The node comes back with a new boot id: the reboot succeeded and is
	// not sent again; the next thing the new session gets is a new command.
	d2 := f.connect(t, "node_a", "boot-2", "journal-1")
	if s, reason := f.state(t, c.ID); s != commands.Succeeded {
		t.Fatalf("reboot after a new boot: %s %q", s, reason)
	}
	next := f.enqueue(t, "node_a", "diag.nvml", "diag-1", nil)
	_ = f.gw.Dispatch(t.Context(), "node_a")
	if got := d2.command(); got.GetId() != next.ID {
		t.Fatalf("new session got %v, want %s", got, next.ID)
	}
}

func TestCommandNewJournal(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.addNode(t, "node_a")
	d := f.connect(t, "node_a", "boot-1", "journal-1")
	reboot := f.enqueue(t, "node_a", "node.reboot", "reboot-1", nil)
	diag := f.enqueue(t, "node_a", "diag.nvml", "diag-1", nil)
	_ = f.gw.Dispatch(t.Context(), "node_a")
	d.command()
	d.command()
	// Same boot, a new journal: the reboot (not retry-safe) fails
	// journal-lost; diag (retry-safe) is sent again.
	d2 := f.connect(t, "node_a", "boot-1", "journal-2")
	if s, reason := f.state(t, reboot.ID); s != commands.Failed || reason != "journal-lost" {
		t.Fatalf("reboot: %s %q", s, reason)
	}
	if got := d2.command(); got.GetId() != diag.ID {
		t.Fatalf("re-sent %v, want %s", got, diag.ID)
	}
	cmd, _ := commands.Lookup(t.Context(), f.db, "node_a", diag.ID)
	if cmd.State != commands.InFlight || cmd.Attempts != 2 {
		t.Fatalf("diag %+v", cmd)
	}
}

func TestCommandCancel(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.addNode(t, "node_a")
	d := f.connect(t, "node_a", "boot-1", "journal-1")
	cancel := func(id string) commands.Command {
		var c commands.Command
		err := reconcile.InTx(t.Context(), f.db, nil, func(tx pgx.Tx, q *reconcile.Queue) error {
			var err error
			c, err = commands.Cancel(t.Context(), tx, q, "node_a", id)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	running := f.enqueue(t, "node_a", "logs.collect", "logs-1", nil)
	_ = f.gw.Dispatch(t.Context(), "node_a")
	got := d.command()
	d.update(got, agentv1.CommandOutcome_COMMAND_OUTCOME_ACCEPTED, 0, nil)

	// Pending: cancelled and never sent; the next command goes instead.
	pending := f.enqueue(t, "node_a", "diag.nvml", "diag-1", nil)
	if c := cancel(pending.ID); c.State != commands.Cancelled {
		t.Fatalf("pending cancel: %s", c.State)
	}
	// In flight: Cancel is sent (again on every resync) until it settles.
	if c := cancel(running.ID); c.State != commands.InFlight {
		t.Fatalf("in-flight cancel: %s", c.State)
	}
	_ = f.gw.Dispatch(t.Context(), "node_a")
	m := d.next()
	if m.GetCancel().GetId() != running.ID || m.GetCancel().GetSeq() != running.Seq {
		t.Fatalf("want Cancel for %s, got %v", running.ID, m)
	}
	_ = f.gw.ResyncCommands(t.Context())
	if m := d.next(); m.GetCancel().GetId() != running.ID {
		t.Fatalf("resync: want Cancel again, got %v", m)
	}
	d.update(got, agentv1.CommandOutcome_COMMAND_OUTCOME_CANCELLED, 0, nil)
	f.waitState(t, running.ID, commands.Cancelled)
	// Finished: unchanged.
	if c := cancel(running.ID); c.State != commands.Cancelled {
		t.Fatalf("finished cancel: %s", c.State)
	}
	last := f.enqueue(t, "node_a", "diag.nvml", "diag-2", nil)
	_ = f.gw.ResyncCommands(t.Context())
	if m := d.next(); m.GetCommand().GetId() != last.ID {
		t.Fatalf("after settling, want only %s, got %v", last.ID, m)
	}
}

// TestGatewayCannotForgeDestructiveCommands: the gateway holds no
// command-signing key (nothing in its Config can carry one) and signs
// nothing: a destructive command written straight into commands, as a
// compromised gateway or database writer would, goes out exactly as stored,
// with no signature the daemon's pinned key verifies.
func TestGatewayCannotForgeDestructiveCommands(t *testing.T) {
	t.Parallel()
	keyTypes := []reflect.Type{reflect.TypeFor[*commands.Signer](), reflect.TypeFor[commands.Signer](),
		reflect.TypeFor[ed25519.PrivateKey](), reflect.TypeFor[crypto.Signer](), reflect.TypeFor[crypto.PrivateKey]()}
	cfg := reflect.TypeFor[gateway.Config]()
	for i := range cfg.NumField() {
		f := cfg.Field(i)
		if slices.Contains(keyTypes, f.Type) {
			t.Errorf("gateway.Config.%s (%s) can hold a signing key", f.Name, f.Type)
		}
	}

	f := setup(t)
	f.addNode(t, "node_a")
	d := f.connect(t, "node_a", "boot-1", "journal-1")
	body, err := (commands.Kind{Name: "node.reboot", Field: "node_reboot"}).Encode(`{"reason": "forged"}`)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.db.Exec(t.Context(), `
		INSERT INTO commands (id, tenant_id, node_id, seq, kind, payload, idempotency_key, not_after)
		VALUES ('cmd_forged', 'root', 'node_a', 1, 'node.reboot', $1, 'cmd_forged', now() + interval '10 minutes')`, body); err != nil {
		t.Fatal(err)
	}
	_ = f.gw.Dispatch(t.Context(), "node_a")
	got := d.command()
	if got.GetId() != "cmd_forged" || len(got.GetSignature()) != 0 || got.GetKeyId() != "" {
		t.Fatalf("the gateway sent %v: it signed a row", got)
	}
	if err := commandsig.Verify(got, trustDomain, f.signer.Public()); err == nil {
		t.Fatal("a forged row verifies")
	}
	d.update(got, agentv1.CommandOutcome_COMMAND_OUTCOME_REJECTED, agentv1.RejectCode_REJECT_CODE_BAD_SIGNATURE, nil)
	f.waitState(t, "cmd_forged", commands.Failed)
	if _, reason := f.state(t, "cmd_forged"); reason != "BAD_SIGNATURE" {
		t.Fatalf("reason %q", reason)
	}
}
