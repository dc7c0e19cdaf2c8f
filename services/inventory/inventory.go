// Package inventory is the inventory controller: the `inventory` reconciler
// derives a node's devices and conditions from the latest inventory report its
// session sent, and adopts a node once its inventory is in; the
// `inventory.hygiene` reconciler re-enqueues nodes whose report was never
// applied (a lost enqueue), as a second line behind resync.
//
// Devices that disappear from a report are marked (missing_since), never
// silently deleted: a booked GPU that vanished must stay visible.
package inventory

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/encoding/protojson"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/migcatalog"

	"github.com/bettercompute/bettercompute/pkg/commands"
	invstore "github.com/bettercompute/bettercompute/pkg/inventory"
	"github.com/bettercompute/bettercompute/pkg/lifecycle"
	nodestore "github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// HygieneKind is the inventory hygiene job's kind in the work queue.
const HygieneKind = "inventory.hygiene"

// Condition is one node condition.
type Condition struct {
	Type   string    `json:"type"`
	Status bool      `json:"status"`
	Reason string    `json:"reason,omitempty"`
	Since  time.Time `json:"since"`
	// Reasons: see nodes.Condition.
	Reasons []string `json:"reasons,omitempty"`
}

// Condition types.
const (
	InventoryReported = "InventoryReported"
	GPUsHealthy       = "GPUsHealthy"
	DevicesPresent    = "DevicesPresent"
)

// AcceptancePassed is the condition of a node in a pool with acceptance
// checks: false (with the reason) while a check runs or after one failed.
const AcceptancePassed = "AcceptancePassed"

// AcceptanceTimeout is how long a node has to pass an acceptance check.
const AcceptanceTimeout = 10 * time.Minute

// Config configures the inventory controller.
type Config struct {
	// Kinds is the command-kind registry acceptance checks are queued
	// through; nil means commands.Builtin().
	Kinds *commands.Registry
}

// Reconcilers returns the inventory controller's reconcilers with the
// built-in command kinds.
func Reconcilers() []reconcile.Reconciler { return New(Config{}) }

// New returns the inventory controller's reconcilers.
func New(cfg Config) []reconcile.Reconciler {
	if cfg.Kinds == nil {
		cfg.Kinds = commands.Builtin()
	}
	c := &controller{cfg: cfg}
	return []reconcile.Reconciler{
		{Name: lifecycle.KindInventory, ShardBy: reconcile.ShardByNode, Run: c.run, Keys: keys},
		{Name: HygieneKind, ShardBy: reconcile.ShardByNone,
			Periodic: []reconcile.Periodic{{Key: "all", Every: time.Minute}}, Run: hygiene},
	}
}

// keys lists the nodes with a report in the given shards, for resync.
func keys(ctx context.Context, q reconcile.Querier, shards []int) ([]string, error) {
	return invstore.NodesInShards(ctx, q, shards)
}

type controller struct{ cfg Config }

func (c *controller) run(ctx context.Context, rc *reconcile.RunContext, nodeID string) (reconcile.Result, error) {
	err := rc.InTx(ctx, func(tx pgx.Tx, q *reconcile.Queue) error {
		latest, ok, err := invstore.LockLatest(ctx, tx, nodeID)
		if err != nil {
			return err
		}
		if !ok {
			return nil // no report (yet), or the node is gone
		}
		raw, received, state, bootID, acceptance := latest.Report, latest.ReceivedAt, latest.State, latest.BootID, latest.Acceptance
		var prev []Condition
		if len(latest.Conditions) > 0 {
			if err := json.Unmarshal(latest.Conditions, &prev); err != nil {
				return fmt.Errorf("decode conditions: %w", err)
			}
		}
		var rep agentv1.InventoryReport
		if err := protojson.Unmarshal(raw, &rep); err != nil {
			return fmt.Errorf("decode report: %w", err)
		}
		if len(rep.GetSections()) == 0 || slices.Contains(rep.GetSections(), "gpus") {
			if err := applyGPUs(ctx, tx, nodeID, rep.GetGpus()); err != nil {
				return err
			}
		}
		conds, needsHealth, err := conditions(ctx, tx, nodeID)
		if err != nil {
			return err
		}
		// A pool with acceptance checks adopts a node only once it passed
		// them; a node that fails one stays out of service (failed) with
		// the reason in its AcceptancePassed condition. Only an adopting
		// node is ever adopted: a commissioning one (its machine's
		// ramdisk) keeps its state, and its devices are still derived.
		next := state
		if state == "adopting" {
			acc, err := accept(ctx, tx, c.cfg.Kinds, nodeID, bootID, acceptance)
			if err != nil {
				return err
			}
			if acc.queued {
				q.WakeCommands(nodeID)
			}
			if acc.cond != nil {
				conds = append(conds, *acc.cond)
			}
			next = acc.state
		} else if i := slices.IndexFunc(prev, func(c Condition) bool { return c.Type == AcceptancePassed }); i >= 0 {
			conds = append(conds, prev[i]) // keep the verdict
		}
		// Drifted is fleet.drift's: kept as it is.
		if i := slices.IndexFunc(prev, func(c Condition) bool { return c.Type == nodestore.ConditionDrifted }); i >= 0 {
			conds = append(conds, prev[i])
		}
		keepSince(conds, prev)
		if state == "adopting" && next == "adopted" {
			// Adoption invalidates the node's desired state in the same
			// transaction: the nodespec controller's first spec is
			// generation 1.
			if err := nodespec.Invalidate(ctx, q, nodeID); err != nil {
				return err
			}
		}
		if rep.GetHost().GetHostname() != "" {
			if err := nodestore.SetHostname(ctx, tx, nodeID, rep.GetHost().GetHostname()); err != nil {
				return err
			}
		}
		stored := make([]nodestore.Condition, len(conds))
		for i, c := range conds {
			stored[i] = nodestore.Condition(c)
		}
		if err := nodestore.SetState(ctx, tx, nodeID, next, stored); err != nil {
			return err
		}
		// The health job quarantines what this report shows unhealthy or
		// missing, lifts quarantines and judges remediation steps by it
		// (a running step's GPUs stay quarantined until it succeeds).
		if needsHealth {
			if err := q.Enqueue(ctx, lifecycle.KindHealth, nodeID); err != nil {
				return err
			}
		}
		return invstore.MarkApplied(ctx, tx, nodeID, received)
	})
	return reconcile.Done, err
}

// acceptance is what the acceptance checks say of an adopting node.
type acceptance struct {
	state  string     // adopting (checks pending), adopted or failed
	cond   *Condition // AcceptancePassed; nil for a pool without checks
	queued bool       // a check was queued in this transaction
}

// accept runs a joining node's acceptance checks: each is a command queued
// once per boot (idempotency key acceptance:<kind>:<boot id>) whose final
// state wakes this controller. All succeeded → adopted; any failed, expired
// or cancelled → failed; otherwise the node waits, adopting.
func accept(ctx context.Context, tx pgx.Tx, kinds *commands.Registry, nodeID, bootID string, checks []string) (acceptance, error) {
	if len(checks) == 0 {
		return acceptance{state: "adopted"}, nil
	}
	out := acceptance{state: "adopted", cond: &Condition{Type: AcceptancePassed, Status: true}}
	var pending []string
	for _, kind := range checks {
		c, created, err := kinds.Enqueue(ctx, tx, commands.Request{
			NodeID: nodeID, Kind: kind, IdempotencyKey: "acceptance:" + kind + ":" + bootID,
			NotAfter: time.Now().Add(AcceptanceTimeout), OwnerKind: lifecycle.KindInventory, OwnerKey: nodeID, System: true,
		})
		if err != nil {
			return acceptance{}, fmt.Errorf("queue acceptance check %s: %w", kind, err)
		}
		out.queued = out.queued || created
		switch c.State {
		case commands.Succeeded:
		case commands.Pending, commands.InFlight:
			pending = append(pending, fmt.Sprintf("%s (%s) is %s", kind, c.ID, c.State))
		default:
			out.state = "failed"
			out.cond.Status = false
			out.cond.Reason = fmt.Sprintf("acceptance check %s (%s) %s: %s", kind, c.ID, c.State, c.Reason)
			return out, nil
		}
	}
	if len(pending) > 0 {
		out.state = "adopting"
		out.cond.Status = false
		out.cond.Reason = "waiting for " + strings.Join(pending, ", ")
	}
	return out, nil
}

// applyGPUs upserts the reported GPUs and marks the ones not reported,
// then the same for their MIG slices (devices of kind mig; a slice whose
// UUID is empty, a GPU instance without a compute instance yet, is not a
// device to book and is left out).
func applyGPUs(ctx context.Context, tx pgx.Tx, nodeID string, gpus []*agentv1.GPU) error {
	// One upsert for the whole report (the capacity counts' triggers then
	// recount the node once, not once per GPU). A UUID reported twice
	// counts once: the last report of it wins.
	last := map[string]*agentv1.GPU{}
	var order []string
	for _, g := range gpus {
		if g.GetUuid() == "" {
			continue
		}
		if _, dup := last[g.GetUuid()]; !dup {
			order = append(order, g.GetUuid())
		}
		last[g.GetUuid()] = g
	}
	report := make([]nodestore.GPU, 0, len(order))
	for _, id := range order {
		g := last[id]
		report = append(report, nodestore.GPU{ID: id, Model: g.GetModel(), Serial: g.GetSerial(), PCIBusID: g.GetPciBusId(),
			Index: int32(g.GetIndex()), MemoryBytes: int64(g.GetMemoryBytes()), MIGEnabled: g.GetMigEnabled(),
			Healthy: g.GetHealthy(), HealthReason: g.GetHealthReason()})
	}
	if err := nodestore.StoreGPUs(ctx, tx, nodeID, report); err != nil {
		return err
	}
	var migs []nodestore.ReportedSlice
	seen := map[string]bool{}
	for _, id := range order {
		g := last[id]
		m, _ := migcatalog.ByProductName(g.GetModel(), g.GetMemoryBytes())
		for _, s := range g.GetMigSlices() {
			if s.GetUuid() == "" || seen[s.GetUuid()] {
				continue
			}
			seen[s.GetUuid()] = true
			cs := 0
			if m != nil {
				if p, ok := m.Profile(s.GetProfile()); ok {
					cs = p.ComputeSlices
				}
			}
			migs = append(migs, nodestore.ReportedSlice{ID: s.GetUuid(), Parent: id, Profile: s.GetProfile(),
				Start: int32(s.GetStart()), MemoryBytes: int64(s.GetMemoryBytes()), ComputeSlices: int32(cs),
				GPUInstanceID: int32(s.GetGpuInstanceId())})
		}
	}
	return nodestore.StoreMigSlices(ctx, tx, nodeID, migs)
}

// conditions derives the node's conditions from its devices, and whether
// the health job has anything to look at (a GPU unhealthy, missing or
// quarantined).
func conditions(ctx context.Context, tx pgx.Tx, nodeID string) ([]Condition, bool, error) {
	var unhealthy, missing []string
	quarantined := false
	devices, err := nodestore.DeviceStates(ctx, tx, nodeID)
	if err != nil {
		return nil, false, err
	}
	for _, d := range devices {
		quarantined = quarantined || d.Quarantined
		switch {
		case d.Missing:
			missing = append(missing, d.ID)
		case !d.Healthy:
			unhealthy = append(unhealthy, d.ID)
		}
	}
	out := []Condition{
		{Type: InventoryReported, Status: true},
		{Type: GPUsHealthy, Status: len(unhealthy) == 0},
		{Type: DevicesPresent, Status: len(missing) == 0},
	}
	if len(unhealthy) > 0 {
		out[1].Reason = fmt.Sprintf("unhealthy: %v", unhealthy)
	}
	if len(missing) > 0 {
		out[2].Reason = fmt.Sprintf("missing: %v", missing)
	}
	return out, quarantined || len(unhealthy) > 0 || len(missing) > 0, nil
}

// keepSince stamps each condition with now, or with its previous Since
// while its status holds.
func keepSince(conds, prev []Condition) {
	now := time.Now().UTC()
	for i := range conds {
		if !conds[i].Since.IsZero() {
			continue // carried over whole
		}
		conds[i].Since = now
		for _, p := range prev {
			if p.Type == conds[i].Type && p.Status == conds[i].Status {
				conds[i].Since = p.Since
			}
		}
	}
}

// hygiene re-enqueues every node whose latest report was never applied.
func hygiene(ctx context.Context, rc *reconcile.RunContext, _ string) (reconcile.Result, error) {
	return reconcile.Done, rc.InTx(ctx, func(tx pgx.Tx, q *reconcile.Queue) error {
		ids, err := invstore.Unapplied(ctx, tx, 10000)
		if err != nil {
			return err
		}
		for _, id := range ids {
			if err := q.Enqueue(ctx, lifecycle.KindInventory, id); err != nil {
				return err
			}
		}
		return nil
	})
}
