package command_test

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandkinds"

	"github.com/bettercompute/bettercompute/agent/command"
)

// raw returns the next update as sent, output chunks included.
func (f *fixture) raw(t *testing.T) *agentv1.CommandUpdate {
	t.Helper()
	select {
	case u := <-f.updates:
		return u
	case <-time.After(wait):
		t.Fatalf("no CommandUpdate within %s", wait)
		return nil
	}
}

// chunks reads n updates that must each be an ACCEPTED output chunk of seq.
func (f *fixture) chunks(t *testing.T, seq int64, n int) []*agentv1.CommandOutput {
	t.Helper()
	var out []*agentv1.CommandOutput
	for range n {
		u := f.raw(t)
		if u.GetSeq() != seq || u.GetOutcome() != accepted || u.GetOutput() == nil {
			t.Fatalf("want an output chunk of seq %d, got %v", seq, u)
		}
		out = append(out, u.GetOutput())
	}
	return out
}

// bigLog writes about size bytes of numbered lines to the daemon's own log.
func bigLog(t *testing.T, root string, size int) []byte {
	t.Helper()
	var b bytes.Buffer
	for i := 0; b.Len() < size; i++ {
		fmt.Fprintf(&b, "time=2026-12-02T08:00:00Z level=INFO msg=\"line %06d\" %s\n", i, bytes.Repeat([]byte{'x'}, 60))
	}
	path := command.LogPath(root)
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// logs.collect streams each source once read, before the next: the bcd
// log (300 KB) arrives in chunks of at most 64 KiB, numbered and contiguous,
// while the journal source still blocks; delivered again meanwhile (a new
// session), the daemon sends the same chunks again; and the chunks
// together are the result's data, within max_bytes.
func TestLogsCollectStreamsEachSourceAsRead(t *testing.T) {
	t.Parallel()
	s := setupLogSources(t, "")
	release := filepath.Join(s.dir, "release")
	journalScript(t, s.journalctl, s.args, "while [ ! -e '"+release+"' ]; do sleep 0.02; done\necho 'Dec 02 06:00:00 host containerd[1]: the journal line'")
	s.updates = make(chan *agentv1.CommandUpdate, 1000)
	log := bigLog(t, s.root, 300_000)

	c := cmd(1, command.KindLogsCollect, &agentv1.CommandBody{Kind: &agentv1.CommandBody_LogsCollect{LogsCollect: &agentv1.LogsCollect{
		Sources: []string{"bcd", "journal"}, MaxBytes: 1 << 20}}})
	s.e.Handle(c)
	expect(t, s.raw(t), 1, accepted, noReject)
	want := (len(log) + commandkinds.MaxOutputChunk - 1) / commandkinds.MaxOutputChunk
	first := s.chunks(t, 1, want)
	var got []byte
	for i, o := range first {
		if o.GetSeq() != uint32(i) || o.GetOffset() != uint64(len(got)) || len(o.GetData()) > commandkinds.MaxOutputChunk {
			t.Fatalf("chunk %d: seq %d offset %d, %d bytes", i, o.GetSeq(), o.GetOffset(), len(o.GetData()))
		}
		got = append(got, o.GetData()...)
	}
	if !bytes.Equal(got, log) {
		t.Fatalf("the streamed bcd log (%d bytes) is not the log (%d bytes)", len(got), len(log))
	}
	s.none(t) // the journal still blocks: nothing more, no outcome

	s.e.Handle(c) // delivered again under a new session
	expect(t, s.raw(t), 1, accepted, noReject)
	for i, o := range s.chunks(t, 1, want) {
		if o.GetSeq() != first[i].GetSeq() || o.GetOffset() != first[i].GetOffset() || !bytes.Equal(o.GetData(), first[i].GetData()) {
			t.Fatalf("re-sent chunk %d differs", i)
		}
	}

	if err := os.WriteFile(release, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	last := s.chunks(t, 1, 1)[0]
	if last.GetSeq() != uint32(want) || last.GetOffset() != uint64(len(got)) {
		t.Fatalf("journal chunk: seq %d offset %d", last.GetSeq(), last.GetOffset())
	}
	got = append(got, last.GetData()...)
	u := s.raw(t)
	expect(t, u, 1, succeeded, noReject)
	data := u.GetResult().GetLogsCollect().GetData()
	if !bytes.Equal(got, data) || len(data) > 1<<20 || part(t, u.GetResult().GetLogsCollect(), 1) != "Dec 02 06:00:00 host containerd[1]: the journal line\n" {
		t.Fatalf("streamed %d bytes, result %d bytes", len(got), len(data))
	}

	// Delivered after it finished: the journal answers, no chunk again.
	s.e.Handle(c)
	expect(t, s.raw(t), 1, succeeded, noReject)
	s.none(t)
	if len(s.outputs) != 0 {
		t.Fatalf("%d chunks after the outcome", len(s.outputs))
	}
}

// The chunks of a collection bounded by max_bytes stay within it.
func TestLogsCollectStreamWithinBudget(t *testing.T) {
	t.Parallel()
	f := setup(t, nil)
	bigLog(t, f.root, 300_000)
	f.e.Handle(cmd(1, command.KindLogsCollect, logs(100_000, "bcd")))
	expect(t, f.next(t), 1, accepted, noReject)
	u := f.next(t)
	expect(t, u, 1, succeeded, noReject)
	var total int
	for _, o := range f.outputs {
		if len(o.GetOutput().GetData()) > commandkinds.MaxOutputChunk {
			t.Fatalf("a chunk of %d bytes", len(o.GetOutput().GetData()))
		}
		total += len(o.GetOutput().GetData())
	}
	if total > 100_000 || total != len(u.GetResult().GetLogsCollect().GetData()) || len(f.outputs) != 2 {
		t.Fatalf("%d chunks, %d bytes streamed, %d in the result", len(f.outputs), total, len(u.GetResult().GetLogsCollect().GetData()))
	}
}
