package lifecycle

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/lifecycle"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/shard"
)

// DriftSweepKind is the singleton that enqueues fleet.drift for every pool
// on its period.
const DriftSweepKind = "fleet.drift.sweep"

// Defaults of [DriftConfig] (config fleet.*).
const (
	DefaultStuckAfter = 15 * time.Minute
	DefaultDriftEvery = time.Minute
)

// MaxDriftReason bounds one section's reported reason as a Drifted reason
// quotes it.
const MaxDriftReason = 512

// DriftConfig configures fleet.drift.
type DriftConfig struct {
	// StuckAfter is fleet.stuckAfter: how long a section may stay not
	// converged before its node is Drifted; 0 means 15m.
	StuckAfter time.Duration
	// Every is fleet.driftEvery, the sweep's period; 0 means 1m.
	Every time.Duration
	// Now is the clock of the stuck sections and the conditions' times;
	// nil means time.Now.
	Now func() time.Time
}

// Drift returns the fleet.drift job's reconcilers:
//
//   - fleet.drift (ShardByPool, controllers role): one pool per run. It
//     reads every node of the pool from the database (no lock: its one
//     write, of the nodes whose Drifted changed, locks them in id order)
//     and computes each node's Drifted condition with its reasons (see
//     [driftReasons]); node.drifted when it is raised or its reasons
//     change, node.drift_cleared when it clears.
//   - fleet.drift.sweep (singleton, periodic, fleet.driftEvery): enqueues
//     fleet.drift for every pool with nodes, so a section passing
//     fleet.stuckAfter, and a report back to normal, are seen within one
//     period. The gateway also enqueues a node's pool when its report has
//     a section reason starting "drifted:", and resync lists the pools.
func Drift(cfg DriftConfig) []reconcile.Reconciler {
	cfg.StuckAfter = cmp.Or(cfg.StuckAfter, DefaultStuckAfter)
	cfg.Every = cmp.Or(cfg.Every, DefaultDriftEvery)
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	d := &drift{cfg: cfg}
	return []reconcile.Reconciler{
		{Name: lifecycle.KindDrift, ShardBy: reconcile.ShardByPool, Role: reconcile.RoleControllers, Run: d.run, Keys: driftKeys},
		{Name: DriftSweepKind, ShardBy: reconcile.ShardByNone, Role: reconcile.RoleControllers, Run: d.sweep,
			Periodic: []reconcile.Periodic{{Key: "all", Every: cfg.Every}}},
	}
}

// driftKeys lists the pools with nodes in shards.
func driftKeys(ctx context.Context, q reconcile.Querier, shards []int) ([]string, error) {
	ids, err := nodes.PoolsWithNodes(ctx, q)
	if err != nil {
		return nil, err
	}
	return slices.DeleteFunc(ids, func(id string) bool { return !slices.Contains(shards, shard.Of(id)) }), nil
}

type drift struct{ cfg DriftConfig }

func (d *drift) sweep(ctx context.Context, rc *reconcile.RunContext, _ string) (reconcile.Result, error) {
	return reconcile.Done, rc.InTx(ctx, func(tx pgx.Tx, q *reconcile.Queue) error {
		ids, err := nodes.PoolsWithNodes(ctx, tx)
		if err != nil {
			return err
		}
		for _, id := range ids {
			if err := q.Enqueue(ctx, lifecycle.KindDrift, id); err != nil {
				return err
			}
		}
		return nil
	})
}

func (d *drift) run(ctx context.Context, rc *reconcile.RunContext, pool string) (reconcile.Result, error) {
	return reconcile.Done, rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
		facts, err := nodes.DriftFactsOfPool(ctx, tx, pool)
		if err != nil {
			return err
		}
		now := d.cfg.Now().UTC()
		base := baselineOf(facts)
		var us []nodes.DriftUpdate
		var es []outbox.Event
		for _, f := range facts {
			u, e, changed := d.judge(f, base, now)
			if changed {
				us = append(us, u)
			}
			if e != nil {
				es = append(es, *e)
			}
		}
		if err := nodes.SetDrift(ctx, tx, us); err != nil {
			return err
		}
		return outbox.WriteMany(ctx, tx, es)
	})
}

// judged reports whether fleet.drift judges a node in state: adopted,
// draining, drained and failed nodes; an adopting or commissioning node
// (no desired state yet) and a retired one are never Drifted.
func judged(state string) bool {
	switch state {
	case nodes.StateAdopted, nodes.StateDraining, nodes.StateDrained, nodes.StateFailed:
		return true
	}
	return false
}

// judge computes node f's Drifted condition and section memory at now:
// the update (changed: it differs from what is stored) and the event to
// write, if any.
func (d *drift) judge(f nodes.DriftFacts, base baseline, now time.Time) (nodes.DriftUpdate, *outbox.Event, bool) {
	var reasons []string
	pending := map[string]time.Time{}
	if judged(f.State) {
		reasons, pending = d.reasons(f, base, now)
	}
	cond := nodes.Condition{Type: nodes.ConditionDrifted, Status: len(reasons) > 0, Reasons: reasons,
		Reason: strings.Join(reasons, "; "), Since: now}
	prev := f.Drifted
	if prev != nil && prev.Status == cond.Status {
		cond.Since = prev.Since
	}
	u := nodes.DriftUpdate{ID: f.ID, Drifted: cond, Pending: pending}
	changed := prev == nil || prev.Status != cond.Status || !slices.Equal(prev.Reasons, cond.Reasons) ||
		!maps.EqualFunc(f.Pending, pending, time.Time.Equal)
	if !changed {
		return u, nil, false
	}
	if !judged(f.State) && prev == nil {
		// Never judged and not to be: nothing to store.
		return u, nil, false
	}
	wasDrifted := prev != nil && prev.Status
	var e *outbox.Event
	switch {
	case cond.Status && (!wasDrifted || !slices.Equal(prev.Reasons, cond.Reasons)):
		e = &outbox.Event{TenantID: f.TenantID, Type: "node.drifted", Resource: f.ID, Payload: map[string]any{
			"nodeId": f.ID, "poolId": f.PoolID, "reasons": reasons, "since": cond.Since.Format(time.RFC3339Nano)}}
	case !cond.Status && wasDrifted:
		e = &outbox.Event{TenantID: f.TenantID, Type: "node.drift_cleared", Resource: f.ID, Payload: map[string]any{
			"nodeId": f.ID, "poolId": f.PoolID, "previousReasons": prev.Reasons}}
	}
	return u, e, true
}

// reasons are node f's Drifted reasons at now, sorted, and its sections'
// memory: since when each section not settled has been seen so.
//
//   - stuck: a section neither CONVERGED nor FAILED_TERMINAL (progressing,
//     or failed and retried) for longer than fleet.stuckAfter, counted
//     from the first pass that saw it so;
//   - reported: a section whose reason starts "drifted:" (the daemon found
//     what it converged changed behind its back, and restored it), until
//     a report without it;
//   - inventory: the node's GPU count, GPU models, driver or CUDA version
//     differs from the pool's baseline (see [baselineOf]); a value the
//     node does not report is not compared.
func (d *drift) reasons(f nodes.DriftFacts, base baseline, now time.Time) ([]string, map[string]time.Time) {
	var out []string
	pending := map[string]time.Time{}
	for _, s := range f.Sections {
		if s.Drifted() {
			r := s.Reason
			if len(r) > MaxDriftReason {
				r = strings.ToValidUTF8(r[:MaxDriftReason], "") + "…"
			}
			out = append(out, fmt.Sprintf("section %s reports %s", s.Section, r))
		}
		if s.Settled() || s.Section == "" {
			continue
		}
		since, ok := f.Pending[s.Section]
		if !ok {
			since = now
		}
		pending[s.Section] = since.UTC()
		if now.Sub(since) >= d.cfg.StuckAfter {
			out = append(out, fmt.Sprintf("section %s not converged for longer than %s (since %s)",
				s.Section, d.cfg.StuckAfter, since.UTC().Format(time.RFC3339)))
		}
	}
	if f.Reported {
		for _, fld := range inventoryFields {
			v, b := fld.of(f), base[fld.name]
			if v != "" && b != "" && v != b {
				out = append(out, fmt.Sprintf("%s %s differs from the pool's baseline %s", fld.name, v, b))
			}
		}
	}
	slices.Sort(out)
	return out, pending
}

// baseline is a pool's inventory baseline: per field, the value most of
// its serving nodes report; a field with no value, or a tie, has none.
type baseline map[string]string

// inventoryField is one inventory field compared with the pool's baseline.
type inventoryField struct {
	name string
	of   func(nodes.DriftFacts) string
}

var inventoryFields = []inventoryField{
	{"GPU count", func(f nodes.DriftFacts) string { return strconv.Itoa(f.GPUs) }},
	{"GPU model", func(f nodes.DriftFacts) string { return strings.Join(f.Models, " + ") }},
	{"driver version", func(f nodes.DriftFacts) string { return f.DriverVersion }},
	{"CUDA version", func(f nodes.DriftFacts) string { return f.CUDAVersion }},
}

// baselineOf is the pool's baseline: the mode of each inventory field over
// the pool's judged nodes with an inventory report (empty values aside).
// A field whose most common value is shared by two values has no
// baseline (nothing differs from it): two nodes that disagree do not say
// which one drifted.
func baselineOf(facts []nodes.DriftFacts) baseline {
	out := baseline{}
	for _, fld := range inventoryFields {
		counts := map[string]int{}
		for _, f := range facts {
			if !f.Reported || !judged(f.State) {
				continue
			}
			if v := fld.of(f); v != "" {
				counts[v]++
			}
		}
		best, n, tie := "", 0, false
		for v, c := range counts {
			switch {
			case c > n:
				best, n, tie = v, c, false
			case c == n:
				tie = true
			}
		}
		if n > 0 && !tie {
			out[fld.name] = best
		}
	}
	return out
}
