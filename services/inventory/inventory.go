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
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/encoding/protojson"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// Kinds of the reconcilers.
const (
	Kind        = "inventory"
	HygieneKind = "inventory.hygiene"
)

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

// Reconcilers returns the inventory controller's reconcilers.
func Reconcilers() []reconcile.Reconciler {
	return []reconcile.Reconciler{
		{Name: Kind, ShardBy: reconcile.ShardByNode, Run: run, Keys: keys},
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

func run(ctx context.Context, rc *reconcile.RunContext, nodeID string) (reconcile.Result, error) {
	err := rc.InTx(ctx, func(tx pgx.Tx, q *reconcile.Queue) error {
		var raw []byte
		var state string
		var prev []Condition
		var received time.Time
		err := tx.QueryRow(ctx, `
			SELECT i.report, i.received_at, n.state, n.conditions
			  FROM node_inventory i JOIN nodes n ON n.id = i.node_id
			 WHERE i.node_id = $1
			   FOR UPDATE OF n`, nodeID).Scan(&raw, &received, &state, &prev)
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
		conds, err := conditions(ctx, tx, nodeID, prev)
		if err != nil {
			return err
		}
		b, err := json.Marshal(conds)
		if err != nil {
			return err
		}
		if rep.GetHost().GetHostname() != "" {
			if _, err := tx.Exec(ctx, `UPDATE nodes SET hostname = $2 WHERE id = $1`, nodeID, rep.GetHost().GetHostname()); err != nil {
				return err
			}
		}
		// A pool with no acceptance checks adopts a node once its inventory
		// is in (the commands release adds diag.nvml acceptance).
		// Adoption invalidates the node's desired state in the same
		// transaction: the nodespec controller's first spec is generation 1.
		next := state
		if state == "adopting" {
			next = "adopted"
			if err := nodespec.Invalidate(ctx, q, nodeID); err != nil {
				return err
			}
		}
		if _, err := tx.Exec(ctx, `UPDATE nodes SET conditions = $2, state = $3, updated_at = now() WHERE id = $1`, nodeID, b, next); err != nil {
			return fmt.Errorf("update node: %w", err)
		}
		_, err = tx.Exec(ctx, `UPDATE node_inventory SET applied_at = clock_timestamp() WHERE node_id = $1 AND received_at = $2`, nodeID, received)
		return err
	})
	return reconcile.Done, err
}

// applyGPUs upserts the reported GPUs and marks the ones not reported.
func applyGPUs(ctx context.Context, tx pgx.Tx, nodeID string, gpus []*agentv1.GPU) error {
	ids := make([]string, 0, len(gpus))
	for _, g := range gpus {
		if g.GetUuid() == "" {
			continue
		}
		ids = append(ids, g.GetUuid())
		_, err := tx.Exec(ctx, `
			INSERT INTO devices (node_id, id, kind, index, model, serial, memory_bytes, pci_bus_id, mig_enabled, healthy, health_reason)
			VALUES ($1, $2, 'gpu', $3, $4, $5, $6, $7, $8, $9, $10)
			ON CONFLICT (node_id, id) DO UPDATE SET
			    index = EXCLUDED.index, model = EXCLUDED.model, serial = EXCLUDED.serial,
			    memory_bytes = EXCLUDED.memory_bytes, pci_bus_id = EXCLUDED.pci_bus_id,
			    mig_enabled = EXCLUDED.mig_enabled, healthy = EXCLUDED.healthy,
			    health_reason = EXCLUDED.health_reason, missing_since = NULL, updated_at = now()`,
			nodeID, g.GetUuid(), int32(g.GetIndex()), g.GetModel(), g.GetSerial(), int64(g.GetMemoryBytes()),
			g.GetPciBusId(), g.GetMigEnabled(), g.GetHealthy(), g.GetHealthReason())
		if err != nil {
			return fmt.Errorf("upsert device %s: %w", g.GetUuid(), err)
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

// conditions derives the node's conditions from its devices, keeping each
// condition's Since while its status holds.
func conditions(ctx context.Context, tx pgx.Tx, nodeID string, prev []Condition) ([]Condition, error) {
	var unhealthy, missing []string
	rows, err := tx.Query(ctx, `SELECT id, healthy, missing_since IS NOT NULL FROM devices WHERE node_id = $1 ORDER BY index, id`, nodeID)
	if err != nil {
		return nil, err
	}
	for rows.Next() {
		var id string
		var healthy, gone bool
		if err := rows.Scan(&id, &healthy, &gone); err != nil {
			rows.Close()
			return nil, err
		}
		switch {
		case gone:
			missing = append(missing, id)
		case !healthy:
			unhealthy = append(unhealthy, id)
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, err
	}
	now := time.Now().UTC()
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
	for i := range out {
		out[i].Since = now
		for _, p := range prev {
			if p.Type == out[i].Type && p.Status == out[i].Status {
				out[i].Since = p.Since
			}
		}
	}
	return out, nil
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
			if err := q.Enqueue(ctx, Kind, id); err != nil {
				return err
			}
		}
		return nil
	})
}
