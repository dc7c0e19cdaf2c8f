package commands_test

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandkinds"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

func chunk(c commands.Command, seq uint32, offset int, data []byte) *agentv1.CommandUpdate {
	return &agentv1.CommandUpdate{Id: c.ID, Seq: c.Seq, Outcome: agentv1.CommandOutcome_COMMAND_OUTCOME_ACCEPTED,
		Output: &agentv1.CommandOutput{Seq: seq, Offset: uint64(offset), Data: data}}
}

func applyErr(t *testing.T, db *pgxpool.Pool, u *agentv1.CommandUpdate) error {
	t.Helper()
	_, err := inTx(t, db, func(tx pgx.Tx, q *reconcile.Queue) (commands.Applied, error) {
		return kinds.Apply(t.Context(), tx, q, "node_o", 1, u)
	})
	return err
}

func readOut(t *testing.T, db *pgxpool.Pool, id string, offset int64, limit int) commands.Output {
	t.Helper()
	c := get(t, db, "node_o", id)
	o, err := commands.ReadOutput(t.Context(), db, c, offset, limit)
	if err != nil {
		t.Fatal(err)
	}
	return o
}

// Streamed chunks are kept once per (command, seq), read in order up to
// the first one missing, bounded by the kind's budget; the finishing
// result, which holds the whole output, replaces them.
func TestOutputChunks(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	addNode(t, db, "node_o")
	r := req("node_o", "logs.collect", "out")
	r.Payload = json.RawMessage(`{"sources": ["bcd"], "maxBytes": 100000}`)
	c, _ := enqueue(t, db, r)
	diag, _ := enqueue(t, db, req("node_o", "diag.nvml", "diag"))
	claim(t, db, "node_o")
	apply(t, db, "node_o", 1, &agentv1.CommandUpdate{Id: c.ID, Seq: c.Seq, Outcome: agentv1.CommandOutcome_COMMAND_OUTCOME_ACCEPTED})

	whole := bytes.Repeat([]byte("0123456789"), 10_000) // exactly the budget
	parts := [][]byte{whole[:65536], whole[65536:90000], whole[90000:]}
	offsets := []int{0, 65536, 90000}
	apply(t, db, "node_o", 1, chunk(c, 0, offsets[0], parts[0]))
	apply(t, db, "node_o", 1, chunk(c, 2, offsets[2], parts[2])) // ahead of chunk 1
	if o := readOut(t, db, c.ID, 0, 1<<20); !bytes.Equal(o.Data, parts[0]) || o.Done || o.Total != int64(len(parts[0])+len(parts[2])) {
		t.Fatalf("before chunk 1: %d bytes, total %d, done %v", len(o.Data), o.Total, o.Done)
	}
	apply(t, db, "node_o", 1, chunk(c, 1, offsets[1], parts[1]))
	apply(t, db, "node_o", 1, chunk(c, 1, offsets[1], parts[1])) // re-sent after a reconnect
	if o := readOut(t, db, c.ID, 0, 1<<20); !bytes.Equal(o.Data, whole) || o.Done || o.Total != int64(len(whole)) {
		t.Fatalf("all chunks: %d bytes, total %d, done %v", len(o.Data), o.Total, o.Done)
	}
	if o := readOut(t, db, c.ID, 60000, 10000); !bytes.Equal(o.Data, whole[60000:70000]) || o.Offset != 60000 {
		t.Fatalf("a page across chunks: %d bytes at %d", len(o.Data), o.Offset)
	}

	for name, u := range map[string]*agentv1.CommandUpdate{
		"past the budget":       chunk(c, 3, len(whole), []byte("x")),
		"an empty chunk":        chunk(c, 3, len(whole), nil),
		"a chunk over 64 KiB":   chunk(c, 3, 0, make([]byte, commandkinds.MaxOutputChunk+1)),
		"seq past the most":     chunk(c, commandkinds.MaxOutputChunks, 0, []byte("x")),
		"a kind without output": chunk(diag, 0, 0, []byte("x")),
	} {
		err := applyErr(t, db, u)
		if fe, ok := fault.As(err); !ok || fe.Code != fault.InvalidInput || fe.Field != "output" {
			t.Errorf("%s: %v", name, err)
		}
	}
	var rows int
	_ = db.QueryRow(t.Context(), `SELECT count(*) FROM command_output`).Scan(&rows)
	if rows != 3 {
		t.Fatalf("%d chunks kept, want 3", rows)
	}

	res, _ := proto.Marshal(&agentv1.CommandResult{Kind: &agentv1.CommandResult_LogsCollect{LogsCollect: &agentv1.LogsCollectResult{Data: whole}}})
	r2 := &agentv1.CommandResult{}
	_ = proto.Unmarshal(res, r2)
	apply(t, db, "node_o", 1, &agentv1.CommandUpdate{Id: c.ID, Seq: c.Seq, Outcome: agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED, Result: r2})
	_ = db.QueryRow(t.Context(), `SELECT count(*) FROM command_output`).Scan(&rows)
	o := readOut(t, db, c.ID, 90000, 1<<20)
	if rows != 0 || !bytes.Equal(o.Data, whole[90000:]) || !o.Done || o.Total != int64(len(whole)) {
		t.Fatalf("finished: %d chunks left, %d bytes, done %v", rows, len(o.Data), o.Done)
	}
	// A chunk after the outcome is ignored.
	if a := apply(t, db, "node_o", 1, chunk(c, 3, 0, []byte("x"))); !a.Ignored {
		t.Fatalf("a chunk after the outcome: %+v", a)
	}
}
