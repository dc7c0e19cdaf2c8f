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
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/encoding/protojson"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/commands"
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
	// Commands wakes the gateway holding a node after an acceptance check
	// was queued; nil leaves delivery to the gateway's resync.
	Commands *commands.Poker
	// Kinds is the command-kind registry acceptance checks are queued
	// through; nil means commands.Builtin().
	Kinds *commands.Registry
}

// Reconcilers returns the inventory controller's reconcilers without
// command pokes.
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
	rows, err := q.Query(ctx, `SELECT n.id FROM nodes n JOIN node_inventory i ON i.node_id = n.id WHERE n.shard = ANY($1)`, shards)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

type controller struct{ cfg Config }

func (c *controller) run(ctx context.Context, rc *reconcile.RunContext, nodeID string) (reconcile.Result, error) {
	var queued bool
	err := rc.InTx(ctx, func(tx pgx.Tx, q *reconcile.Queue) error {
		queued = false
		var raw []byte
		var state, bootID string
		var prev []Condition
		var received time.Time
		var acceptance []string
		err := tx.QueryRow(ctx, `
			SELECT i.report, i.received_at, n.state, n.conditions, n.boot_id, p.acceptance
			  FROM node_inventory i JOIN nodes n ON n.id = i.node_id JOIN pools p ON p.id = n.pool_id
			 WHERE i.node_id = $1
			   FOR UPDATE OF n`, nodeID).Scan(&raw, &received, &state, &prev, &bootID, &acceptance)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil // no report (yet), or the node is gone
		}
		if err != nil {
			return fmt.Errorf("read report: %w", err)
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
			queued = acc.queued
			if acc.cond != nil {
				conds = append(conds, *acc.cond)
			}
			next = acc.state
		} else if i := slices.IndexFunc(prev, func(c Condition) bool { return c.Type == AcceptancePassed }); i >= 0 {
			conds = append(conds, prev[i]) // keep the verdict
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
		_, err = tx.Exec(ctx, `UPDATE node_inventory SET applied_at = clock_timestamp() WHERE node_id = $1 AND received_at = $2`, nodeID, received)
		return err
	})
	if err == nil && queued && c.cfg.Commands != nil {
		c.cfg.Commands.Poke(nodeID)
	}
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
			NotAfter: time.Now().Add(AcceptanceTimeout), OwnerKind: lifecycle.KindInventory, OwnerKey: nodeID,
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

// applyGPUs upserts the reported GPUs and marks the ones not reported.
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
	var (
		ids, models, serials, buses, reasons []string
		indexes                              []int32
		memory                               []int64
		mig, healthy                         []bool
	)
	for _, id := range order {
		g := last[id]
		ids, models, serials, buses, reasons = append(ids, id), append(models, g.GetModel()), append(serials, g.GetSerial()), append(buses, g.GetPciBusId()), append(reasons, g.GetHealthReason())
		indexes, memory = append(indexes, int32(g.GetIndex())), append(memory, int64(g.GetMemoryBytes()))
		mig, healthy = append(mig, g.GetMigEnabled()), append(healthy, g.GetHealthy())
	}
	if len(ids) > 0 {
		_, err := tx.Exec(ctx, `
			INSERT INTO devices (node_id, id, kind, index, model, serial, memory_bytes, pci_bus_id, mig_enabled, healthy, health_reason)
			SELECT $1, g.id, 'gpu', g.index, g.model, g.serial, g.memory_bytes, g.pci_bus_id, g.mig_enabled, g.healthy, g.health_reason
			  FROM unnest($2::text[], $3::int[], $4::text[], $5::text[], $6::bigint[], $7::text[], $8::bool[], $9::bool[], $10::text[])
			       AS g(id, index, model, serial, memory_bytes, pci_bus_id, mig_enabled, healthy, health_reason)
			ON CONFLICT (node_id, id) DO UPDATE SET
			    index = EXCLUDED.index, model = EXCLUDED.model, serial = EXCLUDED.serial,
			    memory_bytes = EXCLUDED.memory_bytes, pci_bus_id = EXCLUDED.pci_bus_id,
			    mig_enabled = EXCLUDED.mig_enabled, healthy = EXCLUDED.healthy,
			    health_reason = EXCLUDED.health_reason, missing_since = NULL, updated_at = now()`,
			nodeID, ids, indexes, models, serials, memory, buses, mig, healthy, reasons)
		if err != nil {
			return fmt.Errorf("upsert %d devices: %w", len(ids), err)
		}
	}
	_, err := tx.Exec(ctx, `
		UPDATE devices SET missing_since = now(), updated_at = now()
		 WHERE node_id = $1 AND kind = 'gpu' AND missing_since IS NULL AND NOT (id = ANY($2))`, nodeID, ids)
	if err != nil {
		return fmt.Errorf("mark missing devices: %w", err)
	}
	return nil
}

// conditions derives the node's conditions from its devices, and whether
// the health job has anything to look at (a GPU unhealthy, missing or
// quarantined).
func conditions(ctx context.Context, tx pgx.Tx, nodeID string) ([]Condition, bool, error) {
	var unhealthy, missing []string
	quarantined := false
	rows, err := tx.Query(ctx, `SELECT id, healthy, missing_since IS NOT NULL, quarantined_at IS NOT NULL
		FROM devices WHERE node_id = $1 ORDER BY index, id`, nodeID)
	if err != nil {
		return nil, false, err
	}
	for rows.Next() {
		var id string
		var healthy, gone, q bool
		if err := rows.Scan(&id, &healthy, &gone, &q); err != nil {
			rows.Close()
			return nil, false, err
		}
		quarantined = quarantined || q
		switch {
		case gone:
			missing = append(missing, id)
		case !healthy:
			unhealthy = append(unhealthy, id)
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, false, err
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
		rows, err := tx.Query(ctx, `SELECT node_id FROM node_inventory WHERE applied_at IS NULL OR applied_at < received_at LIMIT 10000`)
		if err != nil {
			return err
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
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
