package command_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/agent/command"
)

// logSources is a daemon whose kernel ring buffer and journalctl are
// fixtures under a temp root: kmsg a file of kmsg records, journalctl a
// script (its arguments written to args).
type logSources struct {
	*fixture
	dir, kmsg, journalctl, args string
}

// kmsgFixture writes n kmsg records (each followed by a continuation
// line), every tenth an NVIDIA driver line, the last "the last kernel
// line"; about 100 bytes a record.
func kmsgFixture(t *testing.T, path string, n int) {
	t.Helper()
	var b strings.Builder
	for i := range n {
		msg := fmt.Sprintf("kernel line %06d %s", i, strings.Repeat("k", 40))
		if i%10 == 0 {
			msg = fmt.Sprintf("NVRM: Xid (PCI:0000:%02x:00): 79, GPU has fallen off the bus %06d", i%256, i)
		}
		if i == n-1 {
			msg = "the last kernel line"
		}
		fmt.Fprintf(&b, "6,%d,%d,-;%s\n SUBSYSTEM=pci\n", i, 1_000_000+i*1000, msg)
	}
	if err := os.WriteFile(path, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
}

// journalScript writes an executable journalctl at path that records its
// arguments to args and then runs body.
func journalScript(t *testing.T, path, args, body string) {
	t.Helper()
	script := "#!/bin/sh\nprintf '%s\\n' \"$@\" > '" + args + "'\n" + body + "\n"
	if err := os.WriteFile(path, []byte(script), 0o700); err != nil {
		t.Fatal(err)
	}
}

func setupLogSources(t *testing.T, journal string) *logSources {
	t.Helper()
	dir := t.TempDir()
	s := &logSources{dir: dir, kmsg: filepath.Join(dir, "dev", "kmsg"), journalctl: filepath.Join(dir, "bin", "journalctl"), args: filepath.Join(dir, "args")}
	for _, d := range []string{"dev", "bin"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	kmsgFixture(t, s.kmsg, 2000)
	journalScript(t, s.journalctl, s.args, journal)
	s.fixture = setup(t, func(c *command.Config) {
		c.Logs = command.LogSources{Kmsg: s.kmsg, Journalctl: s.journalctl}
	})
	return s
}

// collect runs a logs.collect and returns its result (it must succeed).
func (s *logSources) collect(t *testing.T, seq int64, p *agentv1.LogsCollect) *agentv1.LogsCollectResult {
	t.Helper()
	s.e.Handle(cmd(seq, command.KindLogsCollect, &agentv1.CommandBody{Kind: &agentv1.CommandBody_LogsCollect{LogsCollect: p}}))
	expect(t, s.next(t), seq, accepted, noReject)
	u := s.next(t)
	expect(t, u, seq, succeeded, noReject)
	return u.GetResult().GetLogsCollect()
}

// part is source i's bytes of r's data.
func part(t *testing.T, r *agentv1.LogsCollectResult, i int) string {
	t.Helper()
	src := r.GetSources()[i]
	end := src.GetOffset() + src.GetLength()
	if end > uint64(len(r.GetData())) {
		t.Fatalf("source %s at %d+%d past the data's %d bytes", src.GetName(), src.GetOffset(), src.GetLength(), len(r.GetData()))
	}
	return string(r.GetData()[src.GetOffset():end])
}

// The kernel source reads the ring buffer (200 KB of records here) and
// keeps only its newest whole lines within max_bytes, formatted
// "[seconds.micros] message", without the records' continuation lines.
func TestLogsCollectKernelSourceBounded(t *testing.T) {
	t.Parallel()
	s := setupLogSources(t, "exit 0")
	r := s.collect(t, 1, &agentv1.LogsCollect{Sources: []string{"kernel"}, MaxBytes: 4096})
	data := part(t, r, 0)
	if len(r.GetData()) > 4096 || !r.GetTruncated() || !r.GetSources()[0].GetTruncated() || r.GetSources()[0].GetName() != "kernel" {
		t.Fatalf("%d bytes, truncated %v, sources %v", len(r.GetData()), r.GetTruncated(), r.GetSources())
	}
	if !strings.HasSuffix(data, "[    2.999000] the last kernel line\n") || strings.Contains(data, "SUBSYSTEM") || !strings.HasPrefix(data, "[") {
		t.Fatalf("kernel data %q", data)
	}
}

// The journal source runs journalctl newest first with the unit filter
// and stops reading at its share: here journalctl writes forever (yes),
// and the collection still ends, within max_bytes.
func TestLogsCollectJournalSourceBoundedWithUnitFilter(t *testing.T) {
	t.Parallel()
	s := setupLogSources(t, "exec yes 'Dec 02 06:00:00 host containerd[1]: journal line'")
	r := s.collect(t, 1, &agentv1.LogsCollect{Sources: []string{"journal"}, MaxBytes: 2048, Units: []string{"containerd.service", "kubelet.service"}})
	if len(r.GetData()) > 2048 || len(r.GetData()) < 1900 || !r.GetSources()[0].GetTruncated() || r.GetSources()[0].GetUnavailable() != "" {
		t.Fatalf("%d bytes, sources %v", len(r.GetData()), r.GetSources())
	}
	args, err := os.ReadFile(s.args)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"--reverse", "--unit=containerd.service", "--unit=kubelet.service", "--no-pager"} {
		if !strings.Contains(string(args), want+"\n") {
			t.Fatalf("journalctl args %q lack %s", args, want)
		}
	}
}

// journalctl gives the newest line first; the result is oldest first.
func TestLogsCollectJournalOldestFirst(t *testing.T) {
	t.Parallel()
	s := setupLogSources(t, "printf 'third\\nsecond\\nfirst\\n'")
	r := s.collect(t, 1, &agentv1.LogsCollect{Sources: []string{"journal"}})
	if got := part(t, r, 0); got != "first\nsecond\nthird\n" || r.GetTruncated() {
		t.Fatalf("journal %q truncated %v", got, r.GetTruncated())
	}
}

// The nvidia source keeps only the driver's lines (NVRM, nvidia) of the
// kernel's ring buffer; without one, the journal's kernel messages
// (journalctl --dmesg), filtered the same.
func TestLogsCollectNvidiaSourceDriverLinesOnly(t *testing.T) {
	t.Parallel()
	s := setupLogSources(t, "printf 'kernel: eth0 up\\nkernel: nvidia-modeset: Loading\\nkernel: NVRM: Xid 48\\n'")
	r := s.collect(t, 1, &agentv1.LogsCollect{Sources: []string{"nvidia"}, MaxBytes: 1000})
	data := part(t, r, 0)
	if len(data) > 1000 || len(data) < 800 || !r.GetTruncated() {
		t.Fatalf("%d bytes, truncated %v", len(data), r.GetTruncated())
	}
	for _, line := range strings.Split(strings.TrimSuffix(data, "\n"), "\n") {
		if !strings.Contains(line, "NVRM: Xid") {
			t.Fatalf("a line not the driver's: %q", line)
		}
	}

	if err := os.Remove(s.kmsg); err != nil {
		t.Fatal(err)
	}
	r = s.collect(t, 2, &agentv1.LogsCollect{Sources: []string{"nvidia"}})
	if got := part(t, r, 0); got != "kernel: NVRM: Xid 48\nkernel: nvidia-modeset: Loading\n" {
		t.Fatalf("nvidia from the journal %q", got)
	}
	if args, _ := os.ReadFile(s.args); !strings.Contains(string(args), "--dmesg\n") {
		t.Fatalf("journalctl args %q", args)
	}
}

// A source that cannot be read (no /dev/kmsg, no journalctl) says why in
// its result; the others are still collected and the command succeeds.
func TestLogsCollectMissingSourceNotAvailable(t *testing.T) {
	t.Parallel()
	s := setupLogSources(t, "exit 0")
	writeLog(t, s.root, 1<<10)
	for _, p := range []string{s.kmsg, s.journalctl} {
		if err := os.Remove(p); err != nil {
			t.Fatal(err)
		}
	}
	r := s.collect(t, 1, &agentv1.LogsCollect{Sources: []string{"kernel", "journal", "bcd", "nvidia"}})
	un := map[string]string{}
	for _, src := range r.GetSources() {
		un[src.GetName()] = src.GetUnavailable()
	}
	if !strings.HasPrefix(un["kernel"], "not available: ") || !strings.Contains(un["kernel"], "kmsg") ||
		!strings.HasPrefix(un["journal"], "not available: ") || !strings.Contains(un["journal"], "journalctl") ||
		un["bcd"] != "" || !strings.Contains(un["nvidia"], "kmsg") || !strings.Contains(un["nvidia"], "journalctl") {
		t.Fatalf("unavailable %v", un)
	}
	if got := part(t, r, 2); !strings.HasSuffix(got, "the last line\n") {
		t.Fatalf("bcd's log %q", got)
	}
}

// Every source together stays within one max_bytes: each gets what is left
// divided by the sources still to read, so each is bounded and none is
// starved; the sources' parts tile the data.
func TestLogsCollectSourcesShareOneBudget(t *testing.T) {
	t.Parallel()
	s := setupLogSources(t, "exec yes 'journal line'")
	writeLog(t, s.root, 64<<10)
	const budget = 8192
	r := s.collect(t, 1, &agentv1.LogsCollect{Sources: []string{"bcd", "kernel", "journal", "nvidia"}, MaxBytes: budget})
	if len(r.GetData()) > budget || len(r.GetSources()) != 4 {
		t.Fatalf("%d bytes of a %d budget, sources %v", len(r.GetData()), budget, r.GetSources())
	}
	var at uint64
	for i, src := range r.GetSources() {
		if src.GetOffset() != at || src.GetLength() == 0 || src.GetLength() > budget/4+200 || !src.GetTruncated() || src.GetUnavailable() != "" {
			t.Fatalf("source %d %v (offset expected %d)", i, src, at)
		}
		at += src.GetLength()
	}
	if !strings.Contains(part(t, r, 1), "the last kernel line") || !strings.Contains(part(t, r, 2), "journal line") || !strings.Contains(part(t, r, 3), "NVRM") {
		t.Fatalf("parts %q", r.GetData())
	}
}

// The daemon checks the sources again: an unknown one fails the command
// naming it; "agent" and "bcd" are one source, read once.
func TestLogsCollectDaemonRefusesUnknownSource(t *testing.T) {
	t.Parallel()
	s := setupLogSources(t, "exit 0")
	s.e.Handle(cmd(1, command.KindLogsCollect, logs(4096, "bcd", "syslog")))
	expect(t, s.next(t), 1, accepted, noReject)
	u := s.next(t)
	expect(t, u, 1, failed, noReject)
	if !strings.Contains(u.GetReason(), `unknown log source "syslog"`) {
		t.Fatalf("reason %q", u.GetReason())
	}
	r := s.collect(t, 2, &agentv1.LogsCollect{Sources: []string{"agent", "bcd"}})
	if len(r.GetSources()) != 1 || r.GetSources()[0].GetName() != "bcd" {
		t.Fatalf("sources %v", r.GetSources())
	}
}

// The kernel source reads what the ring buffer holds now and ends: it
// never waits for the next message. A FIFO with a writer still open
// stands in for /dev/kmsg (read(2) answers EAGAIN once it is drained);
// read through Go's *os.File, whose poller waits on EAGAIN, the command
// would hang here.
func TestLogsCollectKernelSourceDoesNotWaitForMoreMessages(t *testing.T) {
	t.Parallel()
	s := setupLogSources(t, "exit 0")
	if err := os.Remove(s.kmsg); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(s.kmsg, 0o600); err != nil {
		t.Fatal(err)
	}
	w, err := os.OpenFile(s.kmsg, os.O_RDWR, 0) // a writer that stays open
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Close() })
	if _, err := w.WriteString("6,1,5000000,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module\n6,2,6000000,-;eth0: up\n"); err != nil {
		t.Fatal(err)
	}
	r := s.collect(t, 1, &agentv1.LogsCollect{Sources: []string{"kernel", "nvidia"}})
	if got := part(t, r, 0); got != "[    5.000000] NVRM: loading NVIDIA UNIX x86_64 Kernel Module\n[    6.000000] eth0: up\n" {
		t.Fatalf("kernel %q (sources %v)", got, r.GetSources())
	}
}
