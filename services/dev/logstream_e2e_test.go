package dev_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/agent/command"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/dev"
)

// outputJSON is commands.getOutput's answer over REST.
type outputJSON struct {
	Data                                     []byte
	Offset, NextPageToken, State, TotalBytes string
}

// getOutput reads one page of a command's output through commands.getOutput.
func getOutput(t testing.TB, env *dev.Env, node, id, token string, maxBytes int) outputJSON {
	t.Helper()
	var out outputJSON
	call(t, env, "commands/getOutput", map[string]any{"tenantId": "root", "nodeId": node, "commandId": id, "pageToken": token, "maxBytes": maxBytes}, &out)
	return out
}

// outputRows is the command's streamed chunks the control plane keeps, and
// their bytes.
func outputRows(t testing.TB, db *pgxpool.Pool, id string) (rows, size int) {
	t.Helper()
	if err := db.QueryRow(context.Background(), `SELECT count(*), coalesce(sum(length(data)), 0) FROM command_output WHERE command_id = $1`,
		id).Scan(&rows, &size); err != nil {
		t.Fatal(err)
	}
	return rows, size
}

// TestLogsCollectStreamedEndToEnd: a logs.collect of a large source (the
// daemon's own log, 300 KB) and one that blocks (a journalctl that waits
// for a file) through commands.run to a real (simulated) daemon over mTLS:
// the first source's chunks are readable through commands.getOutput, paged,
// while the command still runs; the gateway restarts mid-stream and the
// daemon, delivered the command again, re-sends its chunks, none kept
// twice; with the bus stopped, the journal released, the command settles
// through the database and the output read on from where it stopped is,
// with what came before, the result's data, within maxBytes. Bad input
// stays INVALID_INPUT naming the field.
func TestLogsCollectStreamedEndToEnd(t *testing.T) {
	t.Parallel()
	dbURL := pgtest.NewDB(t)
	db, err := pgxpool.New(context.Background(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ns := natstest.New(t)
	dataDir, gw := t.TempDir(), freePort(t)
	env := commandEnvOn(t, dbURL, dataDir, gw, ns.URL(), 100*time.Millisecond, 100*time.Millisecond)
	defer func() { env.Stop(context.Background()) }() // env is replaced below
	fleet := simFleet(t, env, db, "logstream", 1, nil)
	node, root := fleet.Nodes()[0], fleet.Root(0)

	// 300 KB of the daemon's own log (its rotated file) and a journal that
	// answers only once released.
	var log bytes.Buffer
	for i := 0; log.Len() < 300_000; i++ {
		fmt.Fprintf(&log, "time=2026-12-02T08:00:00Z level=INFO msg=\"old line %06d\" %s\n", i, bytes.Repeat([]byte{'x'}, 60))
	}
	if err := os.WriteFile(command.LogPath(root)+".1", log.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	release := filepath.Join(root, "release")
	script := "#!/bin/sh\nwhile [ ! -e '" + release + "' ]; do sleep 0.02; done\necho 'Dec 02 06:00:00 host containerd[1]: the journal line'\n"
	if err := os.WriteFile(filepath.Join(root, "journalctl"), []byte(script), 0o700); err != nil {
		t.Fatal(err)
	}

	const budget = 1 << 20
	c := runCmd(t, env, node, "logs.collect", map[string]any{"sources": []any{"bcd", "journal"}, "maxBytes": budget}, "logstream")

	// Read while it runs, 100 KB a page, until the bcd source is all there.
	var streamed []byte
	token := ""
	poll.Until(t, 30*time.Second, "the bcd source streamed", func() bool {
		o := getOutput(t, env, node, c.ID, token, 100_000)
		if o.NextPageToken == "" {
			t.Fatalf("the output ended while the command runs: %+v", o)
		}
		if off, _ := strconv.Atoi(orZero(o.Offset)); off != len(streamed) {
			t.Fatalf("a page at %d after %d bytes", off, len(streamed))
		}
		streamed = append(streamed, o.Data...)
		token = o.NextPageToken
		return len(streamed) > log.Len()
	})
	if got := getCmd(t, env, node, c.ID); got.State != "in_flight" || !bytes.HasPrefix(streamed, log.Bytes()) {
		t.Fatalf("state %s, streamed %d bytes (the rotated log first: %v)", got.State, len(streamed), bytes.HasPrefix(streamed, log.Bytes()))
	}
	rows, size := outputRows(t, db, c.ID)
	if rows < 5 || size != len(streamed) {
		t.Fatalf("%d chunks of %d bytes kept, %d streamed", rows, size, len(streamed))
	}

	// The gateway restarts mid-stream, a chunk lost with it (deleted
	// here): the daemon is sent the command again and re-sends its
	// chunks; the lost one is back, none is kept twice.
	var epoch int64
	_ = db.QueryRow(context.Background(), `SELECT session_epoch FROM nodes WHERE id = $1`, node).Scan(&epoch)
	env.Stop(context.Background())
	if _, err := db.Exec(context.Background(), `DELETE FROM command_output WHERE command_id = $1 AND seq = 2`, c.ID); err != nil {
		t.Fatal(err)
	}
	env = commandEnvOn(t, dbURL, dataDir, gw, ns.URL(), 100*time.Millisecond, 100*time.Millisecond)
	poll.Until(t, 30*time.Second, "the node reconnecting", func() bool {
		var now int64
		_ = db.QueryRow(context.Background(), `SELECT session_epoch FROM nodes WHERE id = $1`, node).Scan(&now)
		return now > epoch
	})
	poll.Until(t, 30*time.Second, "the lost chunk sent again", func() bool {
		r, _ := outputRows(t, db, c.ID)
		return r == rows
	})
	if r, s := outputRows(t, db, c.ID); r != rows || s != size {
		t.Fatalf("after the reconnect %d chunks of %d bytes, before %d of %d", r, s, rows, size)
	}
	again := getOutput(t, env, node, c.ID, "", 1<<20)
	if !bytes.Equal(again.Data, streamed) || again.State != "in_flight" {
		t.Fatalf("read again from the start: %d bytes, state %s", len(again.Data), again.State)
	}

	// The bus stops; the journal answers; the command settles through
	// the database and the rest of the output is read on.
	ns.Stop()
	if err := os.WriteFile(release, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	got := wantFinal(t, env, node, c.ID, "succeeded", "")
	for token != "" {
		o := getOutput(t, env, node, c.ID, token, 100_000)
		streamed = append(streamed, o.Data...)
		token = o.NextPageToken
	}
	data, err := base64.StdEncoding.DecodeString(fmt.Sprint(got.Result["data"]))
	if err != nil || !bytes.Equal(streamed, data) || len(data) > budget || !bytes.HasSuffix(data, []byte("the journal line\n")) {
		t.Fatalf("streamed %d bytes, result %d of a %d budget: %v", len(streamed), len(data), budget, err)
	}
	if r, _ := outputRows(t, db, c.ID); r != 0 {
		t.Fatalf("%d chunks kept besides the result", r)
	}
	if all := getOutput(t, env, node, c.ID, "", 0); !bytes.Equal(all.Data, data[:min(len(data), 256<<10)]) || all.State != "succeeded" || all.TotalBytes != strconv.Itoa(len(data)) {
		t.Fatalf("from the start: %d bytes, state %s, total %s", len(all.Data), all.State, all.TotalBytes)
	}

	// Bad input: a field named, the same code as ever.
	for body, field := range map[string]string{
		`{"tenantId": "root", "nodeId": "` + node + `", "commandId": "` + c.ID + `", "maxBytes": 2000000}`: "maxBytes",
		`{"tenantId": "root", "nodeId": "` + node + `", "commandId": "` + c.ID + `", "pageToken": "nope"}`: "pageToken",
		`{"tenantId": "root", "nodeId": "` + node + `"}`:                                                   "commandId",
	} {
		status, raw := post(t, env, "commands/getOutput", json.RawMessage(body))
		var e struct{ Code, Field string }
		_ = json.Unmarshal(raw, &e)
		if status != http.StatusBadRequest || e.Code != "INVALID_INPUT" || e.Field != field {
			t.Errorf("%s: %d %s", body, status, raw)
		}
	}
	status, raw := post(t, env, "commands/run", runReq(node, "logs.collect", map[string]any{"sources": []any{"bcd", "syslog"}}, "logstream-bad"))
	var e struct{ Code, Field, Message string }
	_ = json.Unmarshal(raw, &e)
	if status != http.StatusBadRequest || e.Code != "INVALID_INPUT" || e.Field != "payload.sources" || !bytes.Contains([]byte(e.Message), []byte(`"syslog"`)) {
		t.Fatalf("unknown source: %d %s", status, raw)
	}
}
