package converge

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandkinds"
)

// Diagnoser runs diag.nvml's checks on some GPUs, with DCGM's diagnostics
// at a run level above zero (an *inventory.Collector). Its result names
// each GPU it checked; it must return once ctx ends.
type Diagnoser interface {
	DiagnoseAt(ctx context.Context, uuids []string, runLevel int) (*agentv1.DiagNvmlResult, error)
}

// Diagnostics is one periodic diagnostics run of the health section.
type Diagnostics struct {
	// At is when the run started.
	At time.Time
	// Level is the section's diagnostics_level ("quick" when unset) and
	// RunLevel the DCGM run level it runs at (dcgmi diag -r).
	Level    string
	RunLevel int
	// GPUs are the GPUs diagnosed: every GPU of the inventory with no
	// booking. Booked are those left out.
	GPUs, Booked []string
	// Result is what the run found (nil when none ran).
	Result *agentv1.DiagNvmlResult
	// Summary is the run in a line, the health section's status reason.
	Summary string
}

// maxDiagSummary bounds Diagnostics.Summary.
const maxDiagSummary = 1024

// bookings are the GPUs the devices section of the latest desired state
// assigns to a reservation; changed is closed and replaced when they change.
type bookings struct {
	mu      sync.Mutex
	gpus    map[string]bool
	changed chan struct{}
}

// set records the GPUs spec's devices section assigns.
func (b *bookings) set(spec *agentv1.NodeSpec) {
	gpus := map[string]bool{}
	for _, a := range spec.GetDevices().GetAssignments() {
		for _, u := range a.GetGpuUuids() {
			gpus[u] = true
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.changed == nil {
		b.changed = make(chan struct{})
	}
	if maps.Equal(gpus, b.gpus) {
		return
	}
	b.gpus = gpus
	close(b.changed)
	b.changed = make(chan struct{})
}

// get returns the booked GPUs and a channel closed when they next change.
func (b *bookings) get() (map[string]bool, <-chan struct{}) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.changed == nil {
		b.changed = make(chan struct{})
	}
	return maps.Clone(b.gpus), b.changed
}

// Booked returns the UUIDs of the GPUs the devices section of the latest
// desired state assigns to a reservation, sorted.
func (c *Converger) Booked() []string {
	b, _ := c.booked.get()
	return slices.Sorted(maps.Keys(b))
}

// LastDiagnostics returns the last periodic diagnostics run (nil before
// any, and once the section's diagnostics_interval is unset).
func (c *Converger) LastDiagnostics() *Diagnostics { return c.health.last.Load() }

// RunDiagnostics runs the health section's background diagnostics until
// ctx ends: every diagnostics_interval (none while it is unset; a change
// of the section starts the interval over) it runs d at the section's
// diagnostics_level (commandkinds.HealthDiagRunLevel: quick is DCGM run
// level 1, medium 2, long 3) on the GPUs of the inventory (Config.GPUs)
// that no reservation has booked (the devices section). A booked GPU is
// never diagnosed: with every GPU booked nothing runs, and a run is
// stopped when one of its GPUs is booked meanwhile. Each run becomes
// LastDiagnostics, the health section's status reason from the next
// converge, and is passed to after (nil: none).
func (c *Converger) RunDiagnostics(ctx context.Context, d Diagnoser, after func(*Diagnostics)) {
	for {
		h := c.Health()
		changed := c.health.changes()
		var tick <-chan time.Time
		var t *time.Timer
		if h.DiagnosticsInterval > 0 {
			t = time.NewTimer(h.DiagnosticsInterval)
			tick = t.C
		} else {
			c.health.last.Store(nil)
		}
		fired := false
		select {
		case <-ctx.Done():
		case <-changed:
		case <-tick:
			fired = true
		}
		if t != nil {
			t.Stop()
		}
		if ctx.Err() != nil {
			return
		}
		if !fired {
			continue
		}
		run := c.diagnose(ctx, d, h)
		if ctx.Err() != nil {
			return
		}
		c.health.last.Store(run)
		if after != nil {
			after(run)
		}
	}
}

// diagnose runs one round of the background diagnostics.
func (c *Converger) diagnose(ctx context.Context, d Diagnoser, h Health) *Diagnostics {
	run := &Diagnostics{At: time.Now().UTC(), Level: cmp.Or(h.DiagnosticsLevel, commandkinds.DiagLevelQuick)}
	runLevel, ok := commandkinds.HealthDiagRunLevel(h.DiagnosticsLevel)
	run.RunLevel = runLevel
	head := fmt.Sprintf("diagnostics at %s (%s, DCGM level %d)", run.At.Format(time.RFC3339), run.Level, runLevel)
	if !ok { // the section's Plan refuses such a level; never applied
		run.Summary = head + ": unknown level"
		return run
	}
	var all []string
	if c.cfg.GPUs != nil {
		var err error
		if all, err = c.cfg.GPUs(ctx); err != nil {
			run.Summary = clipSummary(head + ": reading the GPU inventory: " + err.Error())
			return run
		}
	}
	booked, bookingChanged := c.booked.get()
	for _, u := range all {
		if booked[u] {
			run.Booked = append(run.Booked, u)
		} else {
			run.GPUs = append(run.GPUs, u)
		}
	}
	if len(run.GPUs) == 0 {
		// Never call d with no GPUs: that means every GPU.
		run.Summary = fmt.Sprintf("%s: none run, every GPU (%d) is booked", head, len(run.Booked))
		return run
	}
	head += fmt.Sprintf(" on %d unbooked GPUs (%d booked left out)", len(run.GPUs), len(run.Booked))
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	var interrupted atomic.Pointer[string]
	go func() {
		ch := bookingChanged
		for {
			select {
			case <-runCtx.Done():
				return
			case <-ch:
			}
			var now map[string]bool
			now, ch = c.booked.get()
			for _, u := range run.GPUs {
				if now[u] {
					interrupted.Store(&u)
					cancel()
					return
				}
			}
		}
	}()
	res, err := d.DiagnoseAt(runCtx, run.GPUs, runLevel)
	cancel()
	run.Result = res
	switch {
	case interrupted.Load() != nil:
		run.Summary = fmt.Sprintf("%s: stopped, %s was booked during the run", head, *interrupted.Load())
	case err != nil:
		run.Summary = head + ": " + err.Error()
	default:
		run.Summary = head + ": " + verdict(res)
	}
	run.Summary = clipSummary(run.Summary)
	return run
}

// verdict says what a run found: "passed", or what failed.
func verdict(res *agentv1.DiagNvmlResult) string {
	var bad []string
	for _, g := range res.GetGpus() {
		if !g.GetHealthy() {
			bad = append(bad, fmt.Sprintf("%s: %s", g.GetUuid(), g.GetReason()))
		}
	}
	dc := res.GetDcgm()
	switch dc.GetStatus() {
	case agentv1.DcgmStatus_DCGM_STATUS_NOT_INSTALLED:
		bad = append(bad, "DCGM not installed")
	case agentv1.DcgmStatus_DCGM_STATUS_ERROR, agentv1.DcgmStatus_DCGM_STATUS_FAILED:
		bad = append(bad, "DCGM "+dc.GetReason())
	}
	if len(bad) == 0 {
		return "passed"
	}
	return "failed: " + strings.Join(bad, "; ")
}

func clipSummary(s string) string {
	if r := []rune(s); len(r) > maxDiagSummary {
		return string(r[:maxDiagSummary-1]) + "…"
	}
	return s
}
