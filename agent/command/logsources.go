package command

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandkinds"
)

// LogSources says where logs.collect reads the node's logs besides bcd's
// own (Config.LogFile). Tests point them at fixture files and scripts so
// they run unprivileged.
type LogSources struct {
	// Kmsg is the kernel's ring buffer, read for the kernel and nvidia
	// sources; empty means /dev/kmsg. A regular file of kmsg records
	// ("<pri>,<seq>,<usec>,<flags>;<message>" lines) reads the same.
	Kmsg string
	// Journalctl is the journalctl binary, run for the journal source (and
	// nvidia's when the kernel's ring buffer cannot be read); empty means
	// "journalctl" on PATH.
	Journalctl string
	// Timeout bounds reading one source; 0 means DefaultLogSourceTimeout.
	Timeout time.Duration
}

// DefaultLogSourceTimeout bounds reading one logs.collect source.
const DefaultLogSourceTimeout = 30 * time.Second

// maxLogLine is the longest line logs.collect keeps whole; a longer one is
// cut there (a kmsg record is at most a few KiB).
const maxLogLine = 16 << 10

func (s LogSources) withDefaults() LogSources {
	if s.Kmsg == "" {
		s.Kmsg = "/dev/kmsg"
	}
	if s.Journalctl == "" {
		s.Journalctl = "journalctl"
	}
	if s.Timeout <= 0 {
		s.Timeout = DefaultLogSourceTimeout
	}
	return s
}

// collected is what one source gave: its lines (at most its share of the
// budget), whether older ones were dropped, or why it was unavailable.
type collected struct {
	data        []byte
	truncated   bool
	unavailable string
}

// logsCollect reads each source asked for once, in the order asked, into
// one result bounded by max_bytes: each source gets what is left of the
// budget divided by the sources still to read (so what one leaves unused
// goes to the next), and keeps its newest lines within it. Every source is
// read as a stream through a buffer bounded by its share; a source that
// cannot be read says why ("not available: …") without failing the others.
// Each source's lines are streamed (Output) as soon as it is read, before
// the next source is: the chunks together are the result's data.
func (e *Executor) logsCollect(ctx context.Context, body *agentv1.CommandBody) (*agentv1.CommandResult, error) {
	p := body.GetLogsCollect()
	limit := commandkinds.LogsBudget(p)
	asked := p.GetSources()
	if len(asked) == 0 {
		asked = []string{commandkinds.LogSourceBcd}
	}
	if len(asked) > commandkinds.MaxLogSources {
		return nil, fmt.Errorf("%d log sources, at most %d", len(asked), commandkinds.MaxLogSources)
	}
	var sources []string
	for _, s := range asked {
		name, ok := commandkinds.LogSource(s)
		if !ok {
			return nil, fmt.Errorf("unknown log source %q (known: %s)", s, strings.Join(commandkinds.LogSources, ", "))
		}
		if !slices.Contains(sources, name) {
			sources = append(sources, name) // read once
		}
	}
	units := p.GetUnits()
	if len(units) > commandkinds.MaxLogUnits {
		return nil, fmt.Errorf("%d units, at most %d", len(units), commandkinds.MaxLogUnits)
	}
	for _, u := range units {
		if !commandkinds.ValidUnit(u) {
			return nil, fmt.Errorf("%q is not a systemd unit name", u)
		}
	}
	var cutoff time.Time
	if p.GetSince() != nil {
		cutoff = e.cfg.Now().Add(-p.GetSince().AsDuration())
	}
	out := &agentv1.LogsCollectResult{}
	left := limit
	for i, name := range sources {
		share := left / (len(sources) - i)
		sctx, cancel := context.WithTimeout(ctx, e.cfg.Logs.Timeout)
		c, err := e.collectSource(sctx, name, share, cutoff, units)
		cancel()
		if err != nil {
			return nil, err
		}
		if ctx.Err() != nil {
			return nil, context.Cause(ctx)
		}
		out.Sources = append(out.Sources, &agentv1.LogSourceResult{Name: name, Offset: uint64(len(out.Data)), Length: uint64(len(c.data)),
			Truncated: c.truncated, Unavailable: c.unavailable})
		out.Data = append(out.Data, c.data...)
		e.Output(ctx, c.data) // streamed now: the next source may take long
		out.Truncated = out.Truncated || c.truncated
		left -= len(c.data)
	}
	return &agentv1.CommandResult{Kind: &agentv1.CommandResult_LogsCollect{LogsCollect: out}}, nil
}

// collectSource reads one source within share bytes.
func (e *Executor) collectSource(ctx context.Context, name string, share int, cutoff time.Time, units []string) (collected, error) {
	switch name {
	case commandkinds.LogSourceBcd:
		data, truncated, err := tailLogs([]string{e.cfg.LogFile + ".1", e.cfg.LogFile}, share)
		if err != nil {
			return collected{}, err
		}
		if !cutoff.IsZero() {
			var older bool
			data, older = since(data, cutoff)
			// What was left unread is older still: nothing asked for was cut.
			truncated = truncated && !older
		}
		return collected{data: data, truncated: truncated}, nil
	case commandkinds.LogSourceKernel:
		return readKmsg(ctx, e.cfg.Logs.Kmsg, share, nil), nil
	case commandkinds.LogSourceJournal:
		return e.readJournal(ctx, share, cutoff, false, units, nil), nil
	case commandkinds.LogSourceNvidia:
		c := readKmsg(ctx, e.cfg.Logs.Kmsg, share, isNvidia)
		if c.unavailable == "" {
			return c, nil
		}
		j := e.readJournal(ctx, share, cutoff, true, nil, isNvidia)
		if j.unavailable != "" {
			j.unavailable = c.unavailable + "; " + strings.TrimPrefix(j.unavailable, "not available: ")
		}
		return j, nil
	}
	return collected{}, fmt.Errorf("unknown log source %q", name)
}

// isNvidia reports whether a kernel line is the NVIDIA driver's: NVRM (the
// resource manager, e.g. "NVRM: Xid …") or an nvidia module's.
func isNvidia(line []byte) bool {
	return bytes.Contains(line, []byte("NVRM")) || bytes.Contains(bytes.ToLower(line), []byte("nvidia"))
}

// eachLine calls f with each line of r (with its newline; a line longer
// than maxLogLine is cut there), until f returns false, r ends or fails.
// f must not keep line. A read that fails with EPIPE (a kmsg record
// overwritten while we read) is skipped; EAGAIN (kmsg has no more) ends.
func eachLine(r io.Reader, f func(line []byte) bool) error {
	br := bufio.NewReaderSize(r, maxLogLine)
	for {
		line, err := br.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			cut := append(slices.Clip(line), '\n')
			for errors.Is(err, bufio.ErrBufferFull) {
				_, err = br.ReadSlice('\n') // skip the rest of it
			}
			if !f(cut) {
				return nil
			}
		} else if len(line) > 0 {
			if line[len(line)-1] != '\n' {
				line = append(slices.Clip(line), '\n')
			}
			if !f(line) {
				return nil
			}
		}
		switch {
		case err == nil:
		case errors.Is(err, syscall.EPIPE):
		case errors.Is(err, io.EOF), errors.Is(err, syscall.EAGAIN):
			return nil
		default:
			return err
		}
	}
}

// tailLines keeps the newest whole lines that fit in max bytes.
type tailLines struct {
	max, size int
	lines     [][]byte
	dropped   bool
}

func (t *tailLines) add(line []byte) {
	if len(line) > t.max {
		t.dropped = true
		return
	}
	t.lines = append(t.lines, bytes.Clone(line))
	t.size += len(line)
	for t.size > t.max {
		t.size -= len(t.lines[0])
		t.lines[0] = nil
		t.lines = t.lines[1:]
		t.dropped = true
	}
}

func (t *tailLines) bytes() []byte { return bytes.Join(t.lines, nil) }

// readKmsg reads the kernel's ring buffer at path without blocking (every
// record there now, then EAGAIN ends it), as "[seconds.micros] message"
// lines (the records' continuation lines left out), only those keep
// accepts when set, keeping the newest within share bytes.
func readKmsg(ctx context.Context, path string, share int, keep func([]byte) bool) collected {
	// Not an *os.File: Go's poller would wait on /dev/kmsg's EAGAIN for
	// the next kernel message; a plain non-blocking read ends there.
	fd, err := syscall.Open(path, syscall.O_RDONLY|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if err != nil {
		return collected{unavailable: "not available: " + (&os.PathError{Op: "open", Path: path, Err: err}).Error()}
	}
	defer func() { _ = syscall.Close(fd) }()
	f := fdReader(fd)
	t := &tailLines{max: share}
	var buf []byte
	err = eachLine(f, func(line []byte) bool {
		if ctx.Err() != nil {
			return false
		}
		if len(line) > 0 && line[0] == ' ' {
			return true // a record's KEY=value continuation
		}
		buf = kmsgLine(buf[:0], line)
		if keep == nil || keep(buf) {
			t.add(buf)
		}
		return true
	})
	c := collected{data: t.bytes(), truncated: t.dropped}
	if err != nil {
		c.unavailable = "read " + path + ": " + err.Error()
	} else if ctx.Err() != nil {
		c.truncated = true // stopped at the timeout: what was read is kept
	}
	return c
}

// kmsgLine appends line, a kmsg record "<pri>,<seq>,<usec>,<flags>;<msg>",
// to dst as "[seconds.micros] msg"; a line that is not one is appended as
// it is.
func kmsgLine(dst, line []byte) []byte {
	head, msg, ok := bytes.Cut(line, []byte{';'})
	if !ok {
		return append(dst, line...)
	}
	fields := bytes.SplitN(head, []byte{','}, 4)
	if len(fields) < 3 {
		return append(dst, line...)
	}
	usec, err := strconv.ParseUint(string(fields[2]), 10, 64)
	if err != nil {
		return append(dst, line...)
	}
	dst = fmt.Appendf(dst, "[%5d.%06d] ", usec/1e6, usec%1e6)
	return append(dst, msg...)
}

// readJournal runs journalctl newest first (--reverse) and reads its lines
// until share is full, then stops it: it never reads more of the journal
// than the share needs. dmesg reads the kernel's messages only; units
// filter by unit; keep, when set, filters lines. The lines are returned
// oldest first.
func (e *Executor) readJournal(ctx context.Context, share int, cutoff time.Time, dmesg bool, units []string, keep func([]byte) bool) collected {
	bin, err := exec.LookPath(e.cfg.Logs.Journalctl)
	if err != nil {
		return collected{unavailable: "not available: " + err.Error()}
	}
	args := []string{"--no-pager", "--quiet", "--reverse", "--output=short-iso-precise"}
	if !cutoff.IsZero() {
		args = append(args, "--since=@"+strconv.FormatInt(cutoff.Unix(), 10))
	}
	if dmesg {
		args = append(args, "--dmesg")
	}
	for _, u := range units {
		args = append(args, "--unit="+u)
	}
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.WaitDelay = time.Second
	stderr := &capped{max: 1024}
	cmd.Stderr = stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return collected{unavailable: "not available: " + err.Error()}
	}
	if err := cmd.Start(); err != nil {
		return collected{unavailable: "not available: " + err.Error()}
	}
	var lines [][]byte
	size, full := 0, false
	readErr := eachLine(stdout, func(line []byte) bool {
		if keep != nil && !keep(line) {
			return true
		}
		if size+len(line) > share {
			full = true
			return false
		}
		lines = append(lines, bytes.Clone(line))
		size += len(line)
		return true
	})
	stop() // enough read (or all): journalctl need not run on
	waitErr := cmd.Wait()
	slices.Reverse(lines)
	c := collected{data: bytes.Join(lines, nil), truncated: full}
	switch {
	case full:
	case readErr != nil:
		c.unavailable = "read journalctl: " + readErr.Error()
	case waitErr != nil && ctx.Err() == nil:
		msg := strings.TrimSpace(stderr.String())
		if len(lines) == 0 {
			c.unavailable = "not available: journalctl: " + strings.TrimSpace(waitErr.Error()+": "+msg)
		} else {
			c.unavailable = "journalctl: " + strings.TrimSpace(waitErr.Error()+": "+msg)
		}
	}
	return c
}

// capped keeps the first max bytes written to it.
type capped struct {
	max int
	b   []byte
}

func (c *capped) Write(p []byte) (int, error) {
	if n := c.max - len(c.b); n > 0 {
		c.b = append(c.b, p[:min(n, len(p))]...)
	}
	return len(p), nil
}

func (c *capped) String() string { return string(c.b) }

// fdReader reads a file descriptor with read(2) itself: EAGAIN comes back
// as an error instead of a wait.
type fdReader int

func (r fdReader) Read(p []byte) (int, error) {
	for {
		n, err := syscall.Read(int(r), p)
		switch {
		case errors.Is(err, syscall.EINTR):
			continue
		case err != nil:
			return 0, err
		case n == 0 && len(p) > 0:
			return 0, io.EOF
		}
		return n, nil
	}
}
