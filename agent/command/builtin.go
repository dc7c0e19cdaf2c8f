package command

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"time"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// Bounds of logs.collect.
const (
	// DefaultLogsBytes is what logs.collect returns at most when
	// max_bytes is 0.
	DefaultLogsBytes = 1 << 20
	// MaxLogsBytes caps max_bytes.
	MaxLogsBytes = 4 << 20
)

// LogSourceAgent is logs.collect's source for the daemon's own log.
const LogSourceAgent = "agent"

// diagNvml checks every GPU asked for through NVML; it fails, with the
// result attached, when any GPU is unhealthy.
func (e *Executor) diagNvml(ctx context.Context, body *agentv1.CommandBody) (*agentv1.CommandResult, error) {
	p := body.GetDiagNvml()
	switch p.GetLevel() {
	case "", "quick", "full":
	default:
		return nil, fmt.Errorf("unknown diag level %q (quick or full)", p.GetLevel())
	}
	d, ok := e.cfg.Inventory.(interface {
		Diagnose(ctx context.Context, uuids []string) (*agentv1.DiagNvmlResult, error)
	})
	if !ok {
		return nil, errors.New("NVML diagnostics are not available on this daemon")
	}
	res, err := d.Diagnose(ctx, p.GetGpuUuids())
	if err != nil {
		return nil, err
	}
	out := &agentv1.CommandResult{Kind: &agentv1.CommandResult_DiagNvml{DiagNvml: res}}
	var bad []string
	for _, g := range res.GetGpus() {
		if !g.GetHealthy() {
			bad = append(bad, fmt.Sprintf("gpu %d (%s): %s", g.GetIndex(), g.GetUuid(), g.GetReason()))
		}
	}
	if len(bad) > 0 {
		return out, fmt.Errorf("%d of %d GPUs unhealthy: %s", len(bad), len(res.GetGpus()), strings.Join(bad, "; "))
	}
	return out, nil
}

// inventoryRefresh re-collects the sections (rescanning first when asked)
// and hands the report to OnInventory.
func (e *Executor) inventoryRefresh(ctx context.Context, body *agentv1.CommandBody) (*agentv1.CommandResult, error) {
	p := body.GetInventoryRefresh()
	if e.cfg.Inventory == nil {
		return nil, errors.New("inventory is not available on this daemon")
	}
	if p.GetRescan() {
		r, ok := e.cfg.Inventory.(interface {
			Rescan(ctx context.Context) error
		})
		if !ok {
			return nil, errors.New("rescan is not available on this daemon")
		}
		if err := r.Rescan(ctx); err != nil {
			return nil, err
		}
	}
	rep, err := e.cfg.Inventory.Report(ctx, p.GetSections())
	if err != nil {
		return nil, err
	}
	if e.cfg.OnInventory != nil {
		e.cfg.OnInventory(rep)
	}
	return &agentv1.CommandResult{Kind: &agentv1.CommandResult_InventoryRefresh{InventoryRefresh: &agentv1.InventoryRefreshResult{
		Sections: rep.GetSections(), GpuCount: uint32(len(rep.GetGpus())),
	}}}, nil
}

// logsCollect returns the tail of the daemon's log, bounded by max_bytes.
func (e *Executor) logsCollect(_ context.Context, body *agentv1.CommandBody) (*agentv1.CommandResult, error) {
	p := body.GetLogsCollect()
	limit := int(min(p.GetMaxBytes(), MaxLogsBytes))
	if limit == 0 {
		limit = DefaultLogsBytes
	}
	sources := p.GetSources()
	if len(sources) == 0 {
		sources = []string{LogSourceAgent}
	}
	var data []byte
	for _, s := range sources {
		switch s {
		case LogSourceAgent:
			b, err := readLog(e.cfg.LogFile)
			if err != nil {
				return nil, err
			}
			data = append(data, b...)
		default:
			return nil, fmt.Errorf("unknown log source %q (this daemon collects only %q)", s, LogSourceAgent)
		}
	}
	if p.GetSince() != nil {
		data = since(data, e.cfg.Now().Add(-p.GetSince().AsDuration()))
	}
	truncated := false
	if len(data) > limit {
		data, truncated = data[len(data)-limit:], true
		// Start at a whole line when one begins within the tail.
		if i := bytes.IndexByte(data, '\n'); i >= 0 && i+1 < len(data) {
			data = data[i+1:]
		}
	}
	return &agentv1.CommandResult{Kind: &agentv1.CommandResult_LogsCollect{LogsCollect: &agentv1.LogsCollectResult{
		Data: bytes.Clone(data), Truncated: truncated,
	}}}, nil
}

// readLog reads the rotated log (path.1) and the current one, oldest first.
func readLog(path string) ([]byte, error) {
	var out []byte
	for _, p := range []string{path + ".1", path} {
		b, err := os.ReadFile(p)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("read log: %w", err)
		}
		out = append(out, b...)
	}
	return out, nil
}

// since drops the lines logged before cutoff: lines that start with
// slog's "time=<RFC 3339>"; lines without a time go with the line before.
func since(data []byte, cutoff time.Time) []byte {
	var out []byte
	keep := false
	for line := range bytes.Lines(data) {
		if rest, ok := bytes.CutPrefix(line, []byte("time=")); ok {
			ts, _, _ := bytes.Cut(rest, []byte(" "))
			if t, err := time.Parse(time.RFC3339Nano, string(ts)); err == nil {
				keep = !t.Before(cutoff)
			}
		}
		if keep {
			out = append(out, line...)
		}
	}
	return out
}
