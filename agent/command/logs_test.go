package command_test

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/bettercompute/bettercompute/agent/command"
	"github.com/bettercompute/bettercompute/proto/commandkinds"
)

// writeLog fills the daemon's log (and its rotated log.1) with about
// 2*each bytes of numbered lines, the last one "the last line".
func writeLog(t *testing.T, root string, each int64) {
	t.Helper()
	l, err := command.OpenLog(command.LogPath(root), each)
	if err != nil {
		t.Fatal(err)
	}
	line := strings.Repeat("x", 90)
	for i := 0; int64(i)*100 < 2*each-200; i++ {
		if _, err := fmt.Fprintf(l, "%08d %s\n", i, line); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := l.Write([]byte("the last line\n")); err != nil {
		t.Fatal(err)
	}
	_ = l.Close()
}

// allocated returns the bytes the process allocated while f ran.
func allocated(f func()) uint64 {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

// Security review 13 #5: a 1.4 KB payload naming the agent log many times
// made the daemon read the whole log once per entry before truncating. Now
// sources are read once each, within one byte budget for the result; more
// than MaxLogSources fail the command.
func TestLogsCollectManySourcesCannotAmplifyMemory(t *testing.T) {
	f := setup(t, nil)
	writeLog(t, f.root, 2<<20) // 4 MiB on disk

	many := slices.Repeat([]string{commandkinds.LogSourceAgent}, commandkinds.MaxLogSources)
	var data []byte
	n := allocated(func() {
		f.e.Handle(cmd(1, command.KindLogsCollect, logs(4096, many...)))
		expect(t, f.next(t), 1, accepted, noReject)
		u := f.next(t)
		expect(t, u, 1, succeeded, noReject)
		r := u.GetResult().GetLogsCollect()
		if !r.GetTruncated() {
			t.Errorf("not truncated")
		}
		data = r.GetData()
	})
	if len(data) > 4096 || !strings.HasSuffix(string(data), "the last line\n") || strings.Count(string(data), "the last line") != 1 {
		t.Fatalf("%d bytes: %q", len(data), data)
	}
	// The old code allocated 16 × 4 MiB here.
	if n > 1<<20 {
		t.Fatalf("logs.collect of %d sources with max_bytes 4096 allocated %d bytes", len(many), n)
	}

	f.e.Handle(cmd(2, command.KindLogsCollect, logs(4096, slices.Repeat([]string{commandkinds.LogSourceAgent}, 200_000)...)))
	expect(t, f.next(t), 2, accepted, noReject)
	u := f.next(t)
	expect(t, u, 2, failed, noReject)
	if !strings.Contains(u.GetReason(), "200000 log sources, at most 16") {
		t.Fatalf("reason %q", u.GetReason())
	}
}

// tailLogs holds and reads at most its budget however many files it is
// given: the tail of the stream, newest file last.
func TestLogsTailReadsOneBudgetForAllFiles(t *testing.T) {
	dir := t.TempDir()
	var paths []string
	for i := range 32 {
		p := filepath.Join(dir, fmt.Sprintf("log-%02d", i))
		if err := os.WriteFile(p, []byte(strings.Repeat(fmt.Sprintf("file %02d line\n", i), 1<<16)), 0o600); err != nil { // 896 KiB
			t.Fatal(err)
		}
		paths = append(paths, p)
	}
	paths = append(paths, filepath.Join(dir, "missing"))
	var data []byte
	var cut bool
	n := allocated(func() {
		var err error
		if data, cut, err = command.TailLogs(paths, 4096); err != nil {
			t.Fatal(err)
		}
	})
	if !cut || len(data) > 4096 || len(data) < 4000 || !strings.HasPrefix(string(data), "file 31 line\n") || !strings.HasSuffix(string(data), "file 31 line\n") {
		t.Fatalf("cut %v, %d bytes: %q…", cut, len(data), data[:min(len(data), 40)])
	}
	if n > 64<<10 {
		t.Fatalf("tail of 32 files of 896 KiB within 4096 bytes allocated %d bytes", n)
	}

	// Within budget: every file, oldest first, not cut.
	small := []string{filepath.Join(dir, "a"), filepath.Join(dir, "b")}
	_ = os.WriteFile(small[0], []byte("one\n"), 0o600)
	_ = os.WriteFile(small[1], []byte("two\n"), 0o600)
	if data, cut, err := command.TailLogs(small, 4096); err != nil || cut || string(data) != "one\ntwo\n" {
		t.Fatalf("%q %v %v", data, cut, err)
	}
	// The budget spans files: the newest whole, the tail of the one before.
	if data, cut, err := command.TailLogs(small, 6); err != nil || !cut || string(data) != "two\n" {
		t.Fatalf("%q %v %v", data, cut, err)
	}
}

// since keeps the lines logged within the window; what the byte budget left
// unread is older, so the result is not marked truncated.
func TestLogsCollectSinceWithinBudget(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	f := setup(t, func(c *command.Config) { c.Now = func() time.Time { return now } })
	l, err := command.OpenLog(command.LogPath(f.root), 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	for i := 1000; i >= 0; i-- {
		fmt.Fprintf(l, "time=%s level=INFO msg=%d\n", now.Add(-time.Duration(i)*time.Second).Format(time.RFC3339Nano), i)
	}
	_ = l.Close()
	body := logs(4096)
	body.GetLogsCollect().Since = durationpb.New(10 * time.Second)
	f.e.Handle(cmd(1, command.KindLogsCollect, body))
	expect(t, f.next(t), 1, accepted, noReject)
	u := f.next(t)
	expect(t, u, 1, succeeded, noReject)
	r := u.GetResult().GetLogsCollect()
	if r.GetTruncated() || strings.Count(string(r.GetData()), "\n") != 11 || !strings.HasSuffix(string(r.GetData()), "msg=0\n") {
		t.Fatalf("truncated %v: %q", r.GetTruncated(), r.GetData())
	}
}
