package commands_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandsig"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// addNode adds adopted node id in a session (epoch 1, boot-1, journal-1)
// on gateway gw-1.
func addNode(t *testing.T, db *pgxpool.Pool, id string) {
	t.Helper()
	fixture.Node(t, db, fixture.NodeOpts{ID: id, State: nodes.StateAdopted, Gateway: "gw-1"})
}

func inTx[T any](t *testing.T, db *pgxpool.Pool, fn func(tx pgx.Tx, q *reconcile.Queue) (T, error)) (T, error) {
	t.Helper()
	var out T
	err := reconcile.InTx(t.Context(), db, nil, func(tx pgx.Tx, q *reconcile.Queue) error {
		var err error
		out, err = fn(tx, q)
		return err
	})
	return out, err
}

func enqueue(t *testing.T, db *pgxpool.Pool, req commands.Request) (commands.Command, bool) {
	t.Helper()
	type res struct {
		c       commands.Command
		created bool
	}
	r, err := inTx(t, db, func(tx pgx.Tx, _ *reconcile.Queue) (res, error) {
		c, created, err := kinds.Enqueue(t.Context(), tx, req)
		return res{c, created}, err
	})
	if err != nil {
		t.Fatal(err)
	}
	return r.c, r.created
}

func req(node, kind, key string) commands.Request {
	return commands.Request{NodeID: node, Kind: kind, IdempotencyKey: key, NotAfter: time.Now().Add(10 * time.Minute)}
}

func claim(t *testing.T, db *pgxpool.Pool, node string) []commands.Command {
	t.Helper()
	cs, err := commands.Claim(t.Context(), db, node, 1)
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

func apply(t *testing.T, db *pgxpool.Pool, node string, epoch int64, u *agentv1.CommandUpdate) commands.Applied {
	t.Helper()
	a, err := inTx(t, db, func(tx pgx.Tx, q *reconcile.Queue) (commands.Applied, error) {
		return kinds.Apply(t.Context(), tx, q, node, epoch, u)
	})
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func get(t *testing.T, db *pgxpool.Pool, node, id string) commands.Command {
	t.Helper()
	c, err := commands.Lookup(t.Context(), db, node, id)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func events(t *testing.T, db *pgxpool.Pool, typ string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(t.Context(), `SELECT count(*) FROM outbox WHERE type = $1`, typ).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestEnqueueSeqAndIdempotency(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	addNode(t, db, "node_a")
	addNode(t, db, "node_b")

	a1, created := enqueue(t, db, commands.Request{NodeID: "node_a", Kind: "inventory.refresh", IdempotencyKey: "k1",
		Payload: `{"sections": ["gpus"], "rescan": true}`, NotAfter: time.Now().Add(time.Minute)})
	if !created || a1.Seq != 1 || a1.State != commands.Pending || a1.TenantID != "root" {
		t.Fatalf("first command %+v created %v", a1, created)
	}
	body, err := a1.Body()
	if err != nil || !body.GetInventoryRefresh().GetRescan() || body.GetInventoryRefresh().GetSections()[0] != "gpus" {
		t.Fatalf("payload not encoded into CommandBody: %v %v", body, err)
	}
	a2, _ := enqueue(t, db, commands.Request{NodeID: "node_a", Kind: "diag.nvml", IdempotencyKey: "k2",
		Payload: &agentv1.DiagNvml{Level: "full"}, NotAfter: time.Now().Add(time.Minute)})
	b1, _ := enqueue(t, db, req("node_b", "logs.collect", "k1"))
	if a2.Seq != 2 || b1.Seq != 1 {
		t.Fatalf("seqs: a2 %d (want 2), b1 %d (want 1: per node)", a2.Seq, b1.Seq)
	}
	// A repeat under the key returns the existing command and takes no seq.
	again, created := enqueue(t, db, req("node_a", "logs.collect", "k1"))
	if created || again.ID != a1.ID || again.Kind != "inventory.refresh" {
		t.Fatalf("repeat: %+v created %v, want %s unchanged", again, created, a1.ID)
	}
	var next int64
	_ = db.QueryRow(t.Context(), `SELECT next_cmd_seq FROM nodes WHERE id = 'node_a'`).Scan(&next)
	if next != 3 {
		t.Fatalf("next_cmd_seq %d, want 3", next)
	}
	if n := events(t, db, "command.pending"); n != 3 {
		t.Fatalf("%d command.pending events, want 3", n)
	}
	// Without a key, each enqueue is a new command.
	c1, _ := enqueue(t, db, req("node_a", "diag.nvml", ""))
	c2, _ := enqueue(t, db, req("node_a", "diag.nvml", ""))
	if c1.ID == c2.ID || c1.IdempotencyKey != c1.ID {
		t.Fatalf("keyless commands %s and %s", c1.ID, c2.ID)
	}
}

func TestEnqueueBadInput(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	addNode(t, db, "node_a")
	soon := time.Now().Add(time.Minute)
	for _, tc := range []struct {
		name  string
		req   commands.Request
		code  fault.Code
		field string
	}{
		{"unknown kind is UNSUPPORTED", commands.Request{NodeID: "node_a", Kind: "agent.rollback", NotAfter: soon}, fault.Unsupported, "kind"},
		{"agent.upgrade without a manifest", commands.Request{NodeID: "node_a", Kind: "agent.upgrade", Payload: `{}`, NotAfter: soon}, fault.InvalidInput, "payload.releaseManifest"},
		{"agent.upgrade of a manifest that is not one", commands.Request{NodeID: "node_a", Kind: "agent.upgrade", Payload: `{"releaseManifest": "bm90IGpzb24="}`, NotAfter: soon}, fault.InvalidInput, "payload.releaseManifest"},
		{"gpu.reset without GPUs", commands.Request{NodeID: "node_a", Kind: "gpu.reset", Payload: `{}`, NotAfter: soon}, fault.InvalidInput, "payload.gpuUuids"},
		{"gpu.reset of a non-UUID", commands.Request{NodeID: "node_a", Kind: "gpu.reset", Payload: `{"gpuUuids": ["0"]}`, NotAfter: soon}, fault.InvalidInput, "payload.gpuUuids"},
		{"gpu.reset reason too long", commands.Request{NodeID: "node_a", Kind: "gpu.reset", Payload: `{"gpuUuids": ["GPU-a"], "reason": "` + strings.Repeat("x", 1025) + `"}`, NotAfter: soon}, fault.InvalidInput, "payload.reason"},
		{"diag.nvml of an unknown level", commands.Request{NodeID: "node_a", Kind: "diag.nvml", Payload: `{"level": "extreme"}`, NotAfter: soon}, fault.InvalidInput, "payload.level"},
		{"diag.nvml of DCGM's numeric level", commands.Request{NodeID: "node_a", Kind: "diag.nvml", Payload: `{"level": "3"}`, NotAfter: soon}, fault.InvalidInput, "payload.level"},
		{"payload field of another message", commands.Request{NodeID: "node_a", Kind: "inventory.refresh", Payload: `{"level": "full"}`, NotAfter: soon}, fault.InvalidInput, "payload"},
		{"payload wrong type", commands.Request{NodeID: "node_a", Kind: "inventory.refresh", Payload: `{"rescan": "yes"}`, NotAfter: soon}, fault.InvalidInput, "payload"},
		{"payload not an object", commands.Request{NodeID: "node_a", Kind: "inventory.refresh", Payload: `["gpus"]`, NotAfter: soon}, fault.InvalidInput, "payload"},
		{"payload another kind's message", commands.Request{NodeID: "node_a", Kind: "inventory.refresh", Payload: &agentv1.NodeReboot{}, NotAfter: soon}, fault.InvalidInput, "payload"},
		{"no deadline", commands.Request{NodeID: "node_a", Kind: "diag.nvml"}, fault.InvalidInput, "notAfter"},
		{"past deadline", commands.Request{NodeID: "node_a", Kind: "diag.nvml", NotAfter: time.Now().Add(-time.Second)}, fault.InvalidInput, "notAfter"},
		{"negative generation", commands.Request{NodeID: "node_a", Kind: "diag.nvml", NotAfter: soon, MinGeneration: -1}, fault.InvalidInput, "minGeneration"},
		{"unknown node", commands.Request{NodeID: "node_nope", Kind: "diag.nvml", NotAfter: soon}, fault.NotFound, "nodeId"},
		{"half an owner", commands.Request{NodeID: "node_a", Kind: "diag.nvml", NotAfter: soon, OwnerKind: "x"}, fault.InvalidInput, "owner"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := inTx(t, db, func(tx pgx.Tx, _ *reconcile.Queue) (commands.Command, error) {
				c, _, err := kinds.Enqueue(t.Context(), tx, tc.req)
				return c, err
			})
			fe, ok := fault.As(err)
			if !ok || fe.Code != tc.code || fe.Field != tc.field {
				t.Fatalf("got %v, want %s on %q", err, tc.code, tc.field)
			}
		})
	}
	var n int
	_ = db.QueryRow(t.Context(), `SELECT count(*) FROM commands`).Scan(&n)
	if n != 0 {
		t.Fatalf("%d commands written by bad input", n)
	}
}

func TestApplyOutcomes(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	addNode(t, db, "node_a")
	ids := map[string]commands.Command{}
	for _, k := range []string{"busy", "expired", "stale", "unsupported", "succeeded", "failed", "cancelled"} {
		c, _ := enqueue(t, db, req("node_a", "diag.nvml", k))
		ids[k] = c
	}
	if cs := claim(t, db, "node_a"); len(cs) != 7 || cs[0].Attempts != 1 || cs[0].Seq != 1 || cs[6].Seq != 7 {
		t.Fatalf("claimed %d commands, want 7 in seq order with attempts 1", len(cs))
	}
	if cs := claim(t, db, "node_a"); len(cs) != 0 {
		t.Fatalf("claimed %d in-flight commands again", len(cs))
	}
	upd := func(k string, o agentv1.CommandOutcome, rc agentv1.RejectCode, reason string) commands.Applied {
		c := ids[k]
		return apply(t, db, "node_a", 1, &agentv1.CommandUpdate{Id: c.ID, Seq: c.Seq, Outcome: o, Reject: rc, Reason: reason})
	}
	// ACCEPTED keeps it in flight.
	if a := upd("succeeded", agentv1.CommandOutcome_COMMAND_OUTCOME_ACCEPTED, 0, ""); a.Command.State != commands.InFlight || a.Command.AcceptedAt == nil {
		t.Fatalf("accepted: %+v", a.Command)
	}
	// BUSY: back to pending, after a back-off, then sent again.
	a := upd("busy", agentv1.CommandOutcome_COMMAND_OUTCOME_REJECTED, agentv1.RejectCode_REJECT_CODE_BUSY, "lane full")
	if a.Command.State != commands.Pending || a.Command.BusyCount != 1 || a.RetryIn < 800*time.Millisecond || a.RetryIn > 1200*time.Millisecond {
		t.Fatalf("busy: %+v retry in %s", a.Command, a.RetryIn)
	}
	if cs := claim(t, db, "node_a"); len(cs) != 0 {
		t.Fatal("a BUSY command was re-sent before its back-off")
	}
	if _, err := db.Exec(t.Context(), `UPDATE commands SET next_attempt_at = now() WHERE id = $1`, ids["busy"].ID); err != nil {
		t.Fatal(err)
	}
	if cs := claim(t, db, "node_a"); len(cs) != 1 || cs[0].ID != ids["busy"].ID || cs[0].Attempts != 2 {
		t.Fatalf("after the back-off: claimed %v", cs)
	}

	for _, tc := range []struct {
		key    string
		o      agentv1.CommandOutcome
		rc     agentv1.RejectCode
		reason string
		state  commands.State
		want   string
	}{
		{"expired", agentv1.CommandOutcome_COMMAND_OUTCOME_REJECTED, agentv1.RejectCode_REJECT_CODE_EXPIRED, "late", commands.Expired, "EXPIRED"},
		{"stale", agentv1.CommandOutcome_COMMAND_OUTCOME_REJECTED, agentv1.RejectCode_REJECT_CODE_STALE_GENERATION, "", commands.Failed, "STALE_GENERATION"},
		{"unsupported", agentv1.CommandOutcome_COMMAND_OUTCOME_REJECTED, agentv1.RejectCode_REJECT_CODE_UNSUPPORTED, "", commands.Failed, "UNSUPPORTED"},
		{"failed", agentv1.CommandOutcome_COMMAND_OUTCOME_FAILED, 0, "nvml: no device", commands.Failed, "nvml: no device"},
		{"cancelled", agentv1.CommandOutcome_COMMAND_OUTCOME_CANCELLED, 0, "", commands.Cancelled, "cancelled"},
	} {
		a := upd(tc.key, tc.o, tc.rc, tc.reason)
		if a.Command.State != tc.state || a.Command.Reason != tc.want || a.Command.FinishedAt == nil {
			t.Errorf("%s: state %s reason %q, want %s %q", tc.key, a.Command.State, a.Command.Reason, tc.state, tc.want)
		}
	}
	// SUCCEEDED keeps the result.
	c := ids["succeeded"]
	res := &agentv1.CommandResult{Kind: &agentv1.CommandResult_DiagNvml{DiagNvml: &agentv1.DiagNvmlResult{DriverVersion: "570.1"}}}
	a = apply(t, db, "node_a", 1, &agentv1.CommandUpdate{Id: c.ID, Seq: c.Seq, Outcome: agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED, Result: res})
	js, err := a.Command.ResultJSON()
	if a.Command.State != commands.Succeeded || err != nil || string(js) != `{"driverVersion":"570.1"}` {
		t.Fatalf("succeeded: %s result %s %v", a.Command.State, js, err)
	}
	// A late update for a finished command, another session or a wrong seq is ignored.
	for _, u := range []struct {
		epoch int64
		upd   *agentv1.CommandUpdate
	}{
		{1, &agentv1.CommandUpdate{Id: c.ID, Seq: c.Seq, Outcome: agentv1.CommandOutcome_COMMAND_OUTCOME_FAILED}},
		{2, &agentv1.CommandUpdate{Id: ids["busy"].ID, Seq: ids["busy"].Seq, Outcome: agentv1.CommandOutcome_COMMAND_OUTCOME_FAILED}},
		{1, &agentv1.CommandUpdate{Id: ids["busy"].ID, Seq: 99, Outcome: agentv1.CommandOutcome_COMMAND_OUTCOME_FAILED}},
	} {
		if a := apply(t, db, "node_a", u.epoch, u.upd); !a.Ignored {
			t.Errorf("update %v under epoch %d applied", u.upd, u.epoch)
		}
	}
	if got := get(t, db, "node_a", ids["busy"].ID); got.State != commands.InFlight {
		t.Fatalf("ignored update changed the command: %s", got.State)
	}
	if n := events(t, db, "command.failed"); n != 3 {
		t.Fatalf("%d command.failed events, want 3", n)
	}
	if n := events(t, db, "command.succeeded"); n != 1 {
		t.Fatalf("%d command.succeeded events, want 1", n)
	}
}

func TestBusyBackoff(t *testing.T) {
	t.Parallel()
	for n, want := range map[int]time.Duration{1: time.Second, 2: 2 * time.Second, 3: 4 * time.Second, 5: 16 * time.Second, 6: 30 * time.Second, 40: 30 * time.Second} {
		if got := commands.BusyBackoff(n, 0.5); got != want {
			t.Errorf("back-off %d: %s, want %s", n, got, want)
		}
		if got := commands.BusyBackoff(n, 0.999); got > 30*time.Second || got < want {
			t.Errorf("back-off %d with jitter: %s", n, got)
		}
	}
}

func TestSweeper(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	addNode(t, db, "node_a")
	owned := func(k string) commands.Request {
		r := req("node_a", "inventory.refresh", k)
		r.OwnerKind, r.OwnerKey = "capacity.reservations", "res_"+k
		return r
	}
	late, _ := enqueue(t, db, owned("late"))                        // pending past not_after → expired
	running, _ := enqueue(t, db, owned("running"))                  // in flight past not_after + 2 min → timeout
	young, _ := enqueue(t, db, owned("young"))                      // in flight past not_after, within the timeout
	fresh, _ := enqueue(t, db, req("node_a", "diag.nvml", "fresh")) // untouched
	claim(t, db, "node_a")
	for _, x := range []struct {
		stmt string
		id   string
	}{
		{`UPDATE commands SET state = 'pending' WHERE id = $1`, late.ID},
		{`UPDATE commands SET state = 'pending' WHERE id = $1`, fresh.ID},
		{`UPDATE commands SET not_after = now() - interval '1 minute' WHERE id = $1`, late.ID},
		{`UPDATE commands SET not_after = now() - interval '1 minute' WHERE id = $1`, young.ID},
		{`UPDATE commands SET not_after = now() - interval '3 minutes' WHERE id = $1`, running.ID},
	} {
		if _, err := db.Exec(t.Context(), x.stmt, x.id); err != nil {
			t.Fatal(err)
		}
	}
	rt, err := reconcile.New(db, nil, reconcile.Config{Roles: []string{reconcile.RoleCommandSweeper}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rt.Stop)
	if err := rt.Register(kinds.Sweeper(0)); err != nil {
		t.Fatal(err)
	}
	if err := workqueue.Enqueue(t.Context(), db, commands.SweeperName, "all"); err != nil {
		t.Fatal(err)
	}
	if tr, err := rt.Jobs()[commands.SweeperName].Tick(t.Context()); err != nil || tr.Done != 1 {
		t.Fatalf("tick: %+v %v", tr, err)
	}
	for _, tc := range []struct {
		c      commands.Command
		state  commands.State
		reason string
	}{
		{late, commands.Expired, "EXPIRED"}, {running, commands.Failed, "timeout"},
		{young, commands.InFlight, ""}, {fresh, commands.Pending, ""},
	} {
		if got := get(t, db, "node_a", tc.c.ID); got.State != tc.state || got.Reason != tc.reason {
			t.Errorf("%s: %s %q, want %s %q", tc.c.IdempotencyKey, got.State, got.Reason, tc.state, tc.reason)
		}
	}
	var woken []string
	rows, _ := db.Query(t.Context(), `SELECT key FROM work_queue WHERE kind = 'capacity.reservations' ORDER BY key`)
	woken, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(woken) != 2 || woken[0] != "res_late" || woken[1] != "res_running" {
		t.Fatalf("owners woken: %v %v, want res_late and res_running", woken, err)
	}
	if events(t, db, "command.expired") != 1 || events(t, db, "command.failed") != 1 {
		t.Fatal("sweeper wrote no events")
	}
}

func TestReconnect(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	addNode(t, db, "node_a")
	reboot, _ := enqueue(t, db, commands.Request{NodeID: "node_a", Kind: "node.reboot", IdempotencyKey: "reboot", NotAfter: time.Now().Add(time.Hour), OwnerKind: "metal", OwnerKey: "node_a"})
	diag, _ := enqueue(t, db, req("node_a", "diag.nvml", "diag"))
	claim(t, db, "node_a")
	reconnect := func(oldBoot, oldJournal, newBoot, newJournal string) {
		t.Helper()
		if _, err := inTx(t, db, func(tx pgx.Tx, q *reconcile.Queue) (int, error) {
			return 0, kinds.Reconnect(t.Context(), tx, q, "node_a", oldBoot, oldJournal, newBoot, newJournal)
		}); err != nil {
			t.Fatal(err)
		}
	}
	// Same boot and journal: nothing changes.
	reconnect("boot-1", "journal-1", "boot-1", "journal-1")
	if get(t, db, "node_a", reboot.ID).State != commands.InFlight {
		t.Fatal("a plain reconnect settled the reboot")
	}
	// New boot: the reboot succeeded (its owner woken); diag stays in flight.
	reconnect("boot-1", "journal-1", "boot-2", "journal-1")
	if got := get(t, db, "node_a", reboot.ID); got.State != commands.Succeeded {
		t.Fatalf("reboot after a new boot: %s", got.State)
	}
	if got := get(t, db, "node_a", diag.ID); got.State != commands.InFlight {
		t.Fatalf("diag after a new boot: %s", got.State)
	}
	var n int
	_ = db.QueryRow(t.Context(), `SELECT count(*) FROM work_queue WHERE kind = 'metal' AND key = 'node_a'`).Scan(&n)
	if n != 1 {
		t.Fatal("the reboot's owner was not woken")
	}

	// New journal: a non-retry-safe command fails journal-lost, a
	// retry-safe one goes back to pending and is claimed again.
	reboot2, _ := enqueue(t, db, commands.Request{NodeID: "node_a", Kind: "node.reboot", IdempotencyKey: "reboot-2", NotAfter: time.Now().Add(time.Hour)})
	claim(t, db, "node_a")
	reconnect("boot-2", "journal-1", "boot-2", "journal-2")
	if got := get(t, db, "node_a", reboot2.ID); got.State != commands.Failed || got.Reason != "journal-lost" {
		t.Fatalf("reboot after a lost journal: %s %q", got.State, got.Reason)
	}
	if got := get(t, db, "node_a", diag.ID); got.State != commands.Pending {
		t.Fatalf("diag after a lost journal: %s", got.State)
	}
	if cs := claim(t, db, "node_a"); len(cs) != 1 || cs[0].ID != diag.ID || cs[0].Attempts != 2 {
		t.Fatalf("re-sent after a lost journal: %v", cs)
	}
}

func TestCancel(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	addNode(t, db, "node_a")
	cancel := func(id string) (commands.Command, error) {
		return inTx(t, db, func(tx pgx.Tx, q *reconcile.Queue) (commands.Command, error) {
			return commands.Cancel(t.Context(), tx, q, "node_a", id)
		})
	}
	running, _ := enqueue(t, db, req("node_a", "diag.nvml", "running"))
	claim(t, db, "node_a")
	pending, _ := enqueue(t, db, req("node_a", "diag.nvml", "pending"))

	c, err := cancel(pending.ID)
	if err != nil || c.State != commands.Cancelled {
		t.Fatalf("pending: %s %v", c.State, err)
	}
	if cs := claim(t, db, "node_a"); len(cs) != 0 {
		t.Fatal("a cancelled command was sent")
	}
	c, err = cancel(running.ID)
	if err != nil || c.State != commands.InFlight || c.CancelRequestedAt == nil {
		t.Fatalf("in flight: %s cancel %v %v", c.State, c.CancelRequestedAt, err)
	}
	if cs, _ := commands.ListInFlight(t.Context(), db, "node_a", true); len(cs) != 1 {
		t.Fatal("the cancel request is not listed for the gateway")
	}
	if ids, _ := commands.NodesWithWork(t.Context(), db, []string{"node_a"}, []int64{1}); len(ids) != 1 {
		t.Fatal("resync does not find the cancel request")
	}
	apply(t, db, "node_a", 1, &agentv1.CommandUpdate{Id: running.ID, Seq: running.Seq, Outcome: agentv1.CommandOutcome_COMMAND_OUTCOME_CANCELLED})
	finished := get(t, db, "node_a", running.ID)
	c, err = cancel(running.ID)
	if err != nil || c.State != commands.Cancelled || !c.UpdatedAt.Equal(finished.UpdatedAt) {
		t.Fatalf("finished: %s %v", c.State, err)
	}
	if _, err := cancel("cmd_nope"); fault.CodeOf(err) != fault.NotFound {
		t.Fatalf("unknown command: %v, want NOT_FOUND", err)
	}
}

func TestSignerAndWire(t *testing.T) {
	t.Parallel()
	path := t.TempDir() + "/keys/command.key"
	s, err := commands.EnsureSigner(path)
	if err != nil {
		t.Fatal(err)
	}
	again, err := commands.LoadSigner(path)
	if err != nil || again.KeyID != s.KeyID || len(s.KeyID) != 16 || s.KeyID != commandsig.KeyID(s.Public()) {
		t.Fatalf("reloaded key id %q vs %q: %v", again.KeyID, s.KeyID, err)
	}
	body, _ := (commands.Kind{Name: "node.reboot", Field: "node_reboot"}).Encode(`{"reason": "test"}`)
	c := commands.Command{ID: "cmd_1", NodeID: "node_a", Seq: 3, Kind: "node.reboot", Payload: body, NotAfter: time.Now().Add(time.Minute)}
	w := kinds.Wire(c)
	if len(w.GetSignature()) != 0 || w.GetTimeout().AsDuration() != 15*time.Minute {
		t.Fatalf("Wire signed a row (%x) or lost the kind's timeout (%s)", w.GetSignature(), w.GetTimeout().AsDuration())
	}
	var b agentv1.CommandBody
	if err := proto.Unmarshal(w.GetBody(), &b); err != nil || b.GetNodeReboot().GetReason() != "test" {
		t.Fatalf("body %v %v", &b, err)
	}
	for _, bad := range []string{t.TempDir() + "/missing.key", writeFile(t, "not pem")} {
		if _, err := commands.LoadSigner(bad); fault.CodeOf(err) != fault.InvalidConfig {
			t.Errorf("LoadSigner(%s): %v, want INVALID_CONFIG", bad, err)
		}
	}
}

const trustDomain = "test.bettercompute"

func newSigner(t *testing.T) *commands.Signer {
	t.Helper()
	s, err := commands.EnsureSigner(t.TempDir() + "/command.key")
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestSignedAtEnqueue: a signing registry signs a destructive command in
// the enqueue transaction and stores the signature; the dispatch path sends
// it as stored and it verifies for the installation's trust domain. Other
// kinds, and a registry without the key, store none.
func TestSignedAtEnqueue(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	addNode(t, db, "node_a")
	s := newSigner(t)
	signing := kinds.Signing(s, trustDomain)
	if !signing.Signs() || kinds.Signs() {
		t.Fatal("Signs")
	}
	if _, ok := signing.Lookup("node.reboot"); !ok {
		t.Fatal("a signing view lost the kinds")
	}
	put := func(reg *commands.Registry, kind string) commands.Command {
		c, err := inTx(t, db, func(tx pgx.Tx, _ *reconcile.Queue) (commands.Command, error) {
			c, _, err := reg.Enqueue(t.Context(), tx, commands.Request{NodeID: "node_a", Kind: kind, Payload: map[string]any{},
				NotAfter: time.Now().Add(10*time.Minute + 123456789), MinGeneration: 0})
			return c, err
		})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	reboot := put(signing, "node.reboot")
	diag := put(signing, "diag.nvml")
	unsigned := put(kinds, "node.reboot")
	if len(reboot.Signature) == 0 || reboot.KeyID != s.KeyID || reboot.Timeout != 15*time.Minute {
		t.Fatalf("reboot stored signature %x key %q timeout %s", reboot.Signature, reboot.KeyID, reboot.Timeout)
	}
	if len(diag.Signature) != 0 || len(unsigned.Signature) != 0 {
		t.Fatal("a non-destructive command, or one queued without the key, was signed")
	}
	sent := map[string]*agentv1.Command{}
	for _, c := range claim(t, db, "node_a") {
		sent[c.ID] = kinds.Wire(c)
	}
	if err := commandsig.Verify(sent[reboot.ID], trustDomain, s.Public()); err != nil {
		t.Fatalf("the stored signature does not verify as sent: %v", err)
	}
	if sent[reboot.ID].GetTimeout().AsDuration() != 15*time.Minute {
		t.Fatalf("timeout %s", sent[reboot.ID].GetTimeout().AsDuration())
	}
	if err := commandsig.Verify(sent[unsigned.ID], trustDomain, s.Public()); err == nil {
		t.Fatal("a command queued without the key verifies")
	}
}

// TestForgedCommandRowIsNotSigned: a destructive command written straight
// into commands — by a compromised gateway or anything else that can write
// the table — goes out with no valid signature: without one, or with a
// valid one copied from another command (another id, a longer timeout).
func TestForgedCommandRowIsNotSigned(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	addNode(t, db, "node_a")
	s := newSigner(t)
	genuine, err := inTx(t, db, func(tx pgx.Tx, _ *reconcile.Queue) (commands.Command, error) {
		c, _, err := kinds.Signing(s, trustDomain).Enqueue(t.Context(), tx, commands.Request{NodeID: "node_a", Kind: "node.reboot", NotAfter: time.Now().Add(10 * time.Minute)})
		return c, err
	})
	if err != nil {
		t.Fatal(err)
	}
	forge := func(id string, seq int64, timeoutMS int64, sig []byte, keyID string) {
		t.Helper()
		if _, err := db.Exec(t.Context(), `
			INSERT INTO commands (id, tenant_id, node_id, seq, kind, payload, idempotency_key, not_after, timeout_ms, signature, key_id)
			VALUES ($1, 'root', 'node_a', $2, 'node.reboot', $3, $1, $4, $5, $6, $7)`,
			id, seq, genuine.Payload, genuine.NotAfter, timeoutMS, sig, keyID); err != nil {
			t.Fatal(err)
		}
	}
	forge("cmd_forged", 100, 0, nil, "")
	forge("cmd_replayed_id", 101, genuine.Timeout.Milliseconds(), genuine.Signature, genuine.KeyID)
	forge("cmd_replayed_timeout", 102, (time.Hour).Milliseconds(), genuine.Signature, genuine.KeyID)
	for _, c := range claim(t, db, "node_a") {
		err := commandsig.Verify(kinds.Wire(c), trustDomain, s.Public())
		if c.ID == genuine.ID {
			if err != nil {
				t.Fatalf("the admitted command: %v", err)
			}
			continue
		}
		if err == nil {
			t.Errorf("forged row %s goes out with a valid signature", c.ID)
		}
	}
}

func writeFile(t *testing.T, s string) string {
	t.Helper()
	p := t.TempDir() + "/f"
	if err := writeAll(p, s); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestRegistry(t *testing.T) {
	t.Parallel()
	r := commands.NewRegistry()
	for _, k := range []commands.Kind{
		{Name: "Bad", Field: "diag_nvml", Lane: commands.LaneDiag, Timeout: time.Minute},
		{Name: "x.y", Field: "nope", Lane: commands.LaneDiag, Timeout: time.Minute},
		{Name: "x.y", Field: "diag_nvml", Lane: "fast", Timeout: time.Minute},
		{Name: "x.y", Field: "diag_nvml", Lane: commands.LaneDiag},
	} {
		if err := r.Register(k); err == nil {
			t.Errorf("registered %+v", k)
		}
	}
	if err := r.Register(commands.Kind{Name: "x.y", Field: "diag_nvml", Lane: commands.LaneDiag, Timeout: time.Minute}); err != nil {
		t.Fatal(err)
	}
	if err := r.Register(commands.Kind{Name: "x.y", Field: "diag_nvml", Lane: commands.LaneDiag, Timeout: time.Minute}); err == nil {
		t.Fatal("registered x.y twice")
	}
	var names []string
	for _, k := range commands.Builtin().Kinds() {
		names = append(names, k.Name)
	}
	if !slices.Equal(names, []string{"agent.upgrade", "diag.nvml", "disk.wipe", "gpu.reset", "image.deploy", "instance.reboot", "inventory.refresh", "logs.collect", "node.kexec", "node.reboot"}) {
		t.Fatalf("built-in kinds %v", names)
	}
}

// TestPendingCommandsPerNodeAreCapped: a caller queueing without end for a
// node that never takes them is RATE_LIMITED on nodeId at MaxOpenPerNode -
// ReservedForSystem open commands — nothing more is stored — and may queue
// again once some settle; another node is not affected.
func TestPendingCommandsPerNodeAreCapped(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	addNode(t, db, "node_a")
	addNode(t, db, "node_b")
	soon := time.Now().Add(time.Hour)
	callers := commands.MaxOpenPerNode - commands.ReservedForSystem
	for range callers {
		enqueue(t, db, commands.Request{NodeID: "node_a", Kind: "diag.nvml", NotAfter: soon})
	}
	_, err := inTx(t, db, func(tx pgx.Tx, _ *reconcile.Queue) (commands.Command, error) {
		c, _, err := kinds.Enqueue(t.Context(), tx, commands.Request{NodeID: "node_a", Kind: "diag.nvml", NotAfter: soon})
		return c, err
	})
	if fe, ok := fault.As(err); !ok || fe.Code != fault.RateLimited || fe.Field != "nodeId" {
		t.Fatalf("command %d: %v, want RATE_LIMITED on nodeId", callers+1, err)
	}
	enqueue(t, db, commands.Request{NodeID: "node_b", Kind: "diag.nvml", NotAfter: soon})
	if _, err := db.Exec(t.Context(), `UPDATE commands SET state = 'succeeded' WHERE id IN (SELECT id FROM commands WHERE node_id = 'node_a' LIMIT 1)`); err != nil {
		t.Fatal(err)
	}
	enqueue(t, db, commands.Request{NodeID: "node_a", Kind: "diag.nvml", NotAfter: soon})
	var n int
	_ = db.QueryRow(t.Context(), `SELECT count(*) FROM commands WHERE node_id = 'node_a'`).Scan(&n)
	if n != callers+1 {
		t.Fatalf("%d commands of node_a stored, want %d", n, callers+1)
	}
}

// TestCallersCannotFillTheSlotsRemediationNeeds: callers who fill a node
// with commands that wait (minGeneration far ahead, an hour's deadline) stop
// at MaxOpenPerNode - ReservedForSystem; system-owned commands (the
// remediation ladder's) still queue, up to MaxOpenPerNode.
func TestCallersCannotFillTheSlotsRemediationNeeds(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	addNode(t, db, "node_a")
	soon := time.Now().Add(time.Hour)
	held := commands.Request{NodeID: "node_a", Kind: "diag.nvml", NotAfter: soon, MinGeneration: 1 << 40}
	for range commands.MaxOpenPerNode - commands.ReservedForSystem {
		enqueue(t, db, held)
	}
	_, err := inTx(t, db, func(tx pgx.Tx, _ *reconcile.Queue) (commands.Command, error) {
		c, _, err := kinds.Enqueue(t.Context(), tx, held)
		return c, err
	})
	if fe, ok := fault.As(err); !ok || fe.Code != fault.RateLimited || fe.Field != "nodeId" {
		t.Fatalf("a caller's command past the callers' share: %v, want RATE_LIMITED on nodeId", err)
	}
	for i := range commands.ReservedForSystem {
		enqueue(t, db, commands.Request{NodeID: "node_a", Kind: "diag.nvml", NotAfter: soon,
			OwnerKind: "remediation", OwnerKey: fmt.Sprintf("rem_%d", i), System: true})
	}
	_, err = inTx(t, db, func(tx pgx.Tx, _ *reconcile.Queue) (commands.Command, error) {
		c, _, err := kinds.Enqueue(t.Context(), tx, commands.Request{NodeID: "node_a", Kind: "diag.nvml", NotAfter: soon,
			OwnerKind: "remediation", OwnerKey: "rem_last", System: true})
		return c, err
	})
	if fe, ok := fault.As(err); !ok || fe.Code != fault.RateLimited {
		t.Fatalf("a system command past MaxOpenPerNode: %v, want RATE_LIMITED", err)
	}
}
