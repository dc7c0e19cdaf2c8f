// Package health evaluates a process's health checks, once, for both /readyz
// and the System.Health API method.
package health

import (
	"context"
	"sync"
	"time"
)

// Check is one named probe. A failing Required check makes the process not
// ready; an optional one (the bus, say) only degrades it.
type Check struct {
	Name     string
	Required bool
	Run      func(ctx context.Context) error
}

// Result is the outcome of one check.
type Result struct {
	Name     string `json:"name"`
	OK       bool   `json:"ok"`
	Required bool   `json:"required"`
	Message  string `json:"message,omitempty"`
}

// Report is the outcome of every check.
type Report struct {
	// Ready is false when a required check failed.
	Ready bool `json:"ready"`
	// Degraded is true when an optional check failed.
	Degraded bool     `json:"degraded"`
	Checks   []Result `json:"checks"`
}

// Timeout bounds each check.
const Timeout = 2 * time.Second

// Run runs the checks concurrently, each under [Timeout], and reports in the
// checks' order.
func Run(ctx context.Context, checks []Check) Report {
	rep := Report{Ready: true, Checks: make([]Result, len(checks))}
	var wg sync.WaitGroup
	for i, c := range checks {
		wg.Go(func() {
			cctx, cancel := context.WithTimeout(ctx, Timeout)
			defer cancel()
			r := Result{Name: c.Name, OK: true, Required: c.Required}
			if err := c.Run(cctx); err != nil {
				r.OK, r.Message = false, err.Error()
			}
			rep.Checks[i] = r
		})
	}
	wg.Wait()
	for _, r := range rep.Checks {
		switch {
		case !r.OK && r.Required:
			rep.Ready = false
		case !r.OK:
			rep.Degraded = true
		}
	}
	return rep
}

// Cached returns c whose result is reused for every caller within every of
// its last run: /readyz and System.Health answer anyone, and without it each
// request would be a database probe. Concurrent callers of a stale result
// wait for one run and share it; a run takes its own timeout ([Timeout]),
// not the first caller's context, so one impatient caller does not fail the
// others.
func Cached(c Check, every time.Duration) Check {
	var (
		mu   sync.Mutex
		at   time.Time
		last error
	)
	run := c.Run
	c.Run = func(ctx context.Context) error {
		mu.Lock()
		defer mu.Unlock()
		if !at.IsZero() && time.Since(at) < every {
			return last
		}
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), Timeout)
		defer cancel()
		last, at = run(rctx), time.Now()
		return last
	}
	return c
}
