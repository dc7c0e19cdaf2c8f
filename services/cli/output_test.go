package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/poll"
)

// applyUpdate settles u on node in a transaction, as the gateway does.
func applyUpdate(t *testing.T, db *pgxpool.Pool, node string, u *agentv1.CommandUpdate) {
	t.Helper()
	err := pgx.BeginFunc(t.Context(), db, func(tx pgx.Tx) error {
		_, err := commands.Builtin().Apply(t.Context(), tx, commands.TxWaker(tx), node, 1, u)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

// commands output prints what a logs.collect streamed so far and stops;
// with --follow it prints on as chunks arrive until the command finished,
// and the whole is the result's data.
func TestCommandsOutputPrintsAndFollows(t *testing.T) {
	t.Parallel()
	base, token, db, _ := startAuditServer(t)
	n := fixture.Node(t, db, fixture.NodeOpts{State: nodes.StateAdopted, Gateway: "gw-elsewhere"})
	if err := authz.Put(t.Context(), db, authz.Resource{Type: authz.TypeNode, ID: n.ID, TenantID: n.TenantID, PoolID: n.PoolID}); err != nil {
		t.Fatal(err)
	}
	var c commands.Command
	err := pgx.BeginFunc(t.Context(), db, func(tx pgx.Tx) error {
		var err error
		c, _, err = commands.Builtin().Enqueue(t.Context(), tx, commands.Request{NodeID: n.ID, Kind: "logs.collect",
			Payload: json.RawMessage(`{"sources": ["bcd"]}`), NotAfter: time.Now().Add(10 * time.Minute)})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if cs, err := commands.Claim(t.Context(), db, n.ID, 1); err != nil || len(cs) != 1 {
		t.Fatalf("claimed %d: %v", len(cs), err)
	}
	parts := [][]byte{bytes.Repeat([]byte("first\n"), 10000), []byte("second\n"), []byte("third\n")}
	chunk := func(i int) *agentv1.CommandUpdate {
		off := 0
		for _, p := range parts[:i] {
			off += len(p)
		}
		return &agentv1.CommandUpdate{Id: c.ID, Seq: c.Seq, Outcome: agentv1.CommandOutcome_COMMAND_OUTCOME_ACCEPTED,
			Output: &agentv1.CommandOutput{Seq: uint32(i), Offset: uint64(off), Data: parts[i]}}
	}
	applyUpdate(t, db, n.ID, chunk(0))
	applyUpdate(t, db, n.ID, chunk(1))

	f := &apiFlags{url: base, token: token, clientConfig: emptyClientConfig(t), timeout: 10 * time.Second}
	args := []string{"tenantId=root", "nodeId=" + n.ID, "commandId=" + c.ID}
	var out, errb bytes.Buffer
	if err := runCommandsOutput(t.Context(), f, args, false, time.Second, &out, &errb); err != nil {
		t.Fatal(err, errb.String())
	}
	if want := string(parts[0]) + string(parts[1]); out.String() != want || !strings.Contains(errb.String(), "in_flight: more may come") {
		t.Fatalf("printed %d bytes (want %d), stderr %q", out.Len(), len(want), errb.String())
	}

	var follow, ferr syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- runCommandsOutput(context.Background(), f, args, true, 20*time.Millisecond, &follow, &ferr)
	}()
	poll.Until(t, 20*time.Second, "the streamed chunks printed", func() bool { return follow.String() == out.String() })
	applyUpdate(t, db, n.ID, chunk(2))
	whole := bytes.Join(parts, nil)
	applyUpdate(t, db, n.ID, &agentv1.CommandUpdate{Id: c.ID, Seq: c.Seq, Outcome: agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED,
		Result: &agentv1.CommandResult{Kind: &agentv1.CommandResult_LogsCollect{LogsCollect: &agentv1.LogsCollectResult{Data: whole}}}})
	select {
	case err := <-done:
		if err != nil || follow.String() != string(whole) {
			t.Fatalf("--follow ended with %v after %d bytes (want %d)", err, len(follow.String()), len(whole))
		}
	case <-time.After(20 * time.Second):
		t.Fatal("--follow did not end with the command")
	}

	if err := runCommandsOutput(t.Context(), f, []string{"tenantId=root", "nodeId=" + n.ID, "commandId=cmd_nope"}, false, time.Second, &out, &errb); err == nil ||
		!strings.Contains(err.Error(), "NOT_FOUND") {
		t.Fatalf("an unknown command: %v", err)
	}
	if err := runCommandsOutput(t.Context(), f, []string{"tenantId=root", "nodeId=" + n.ID}, false, time.Second, &out, &errb); err == nil {
		t.Fatal("no commandId accepted")
	}
}
