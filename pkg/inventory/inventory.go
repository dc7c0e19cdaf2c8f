// Package inventory is the store of node_inventory: the latest hardware
// report of each node, as the gateway received it from the node's session,
// and when the inventory job last applied it.
package inventory

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Store stores report (a bettercompute.agent.v1.InventoryReport's proto3
// JSON) as node's latest, received now, if the node's session is still
// epoch; false when a newer session owns the node (a late report, ignored).
func Store(ctx context.Context, q Querier, node string, epoch int64, report []byte) (bool, error) {
	tag, err := q.Exec(ctx, `
		INSERT INTO node_inventory (node_id, session_epoch, report, received_at)
		SELECT id, session_epoch, $3, now() FROM nodes WHERE id = $1 AND session_epoch = $2
		ON CONFLICT (node_id) DO UPDATE
		   SET session_epoch = EXCLUDED.session_epoch, report = EXCLUDED.report, received_at = now()`,
		node, epoch, json.RawMessage(report))
	if err != nil {
		return false, fmt.Errorf("store inventory of %s: %w", node, err)
	}
	return tag.RowsAffected() > 0, nil
}

// Pending is a node's latest report with what the inventory job reads of
// the node alongside it.
type Pending struct {
	Report     []byte
	ReceivedAt time.Time
	// State, Conditions (JSON) and BootID are the node's.
	State      string
	Conditions json.RawMessage
	BootID     string
	// Acceptance is the node's pool's acceptance checks.
	Acceptance []string
}

// LockLatest reads node's latest report, locking the node (FOR UPDATE)
// until q's transaction ends; false when there is no report or no node.
func LockLatest(ctx context.Context, q Querier, node string) (Pending, bool, error) {
	var p Pending
	err := q.QueryRow(ctx, `
		SELECT i.report, i.received_at, n.state, n.conditions, n.boot_id, p.acceptance
		  FROM node_inventory i JOIN nodes n ON n.id = i.node_id JOIN pools p ON p.id = n.pool_id
		 WHERE i.node_id = $1
		   FOR UPDATE OF n`, node).Scan(&p.Report, &p.ReceivedAt, &p.State, &p.Conditions, &p.BootID, &p.Acceptance)
	if errors.Is(err, pgx.ErrNoRows) {
		return Pending{}, false, nil
	}
	if err != nil {
		return Pending{}, false, fmt.Errorf("read report: %w", err)
	}
	return p, true, nil
}

// MarkApplied records that node's report received at receivedAt has been
// applied (a newer report since is left pending).
func MarkApplied(ctx context.Context, q Querier, node string, receivedAt time.Time) error {
	if _, err := q.Exec(ctx, `UPDATE node_inventory SET applied_at = clock_timestamp() WHERE node_id = $1 AND received_at = $2`, node, receivedAt); err != nil {
		return fmt.Errorf("mark inventory of %s applied: %w", node, err)
	}
	return nil
}

// NodesInShards returns the nodes of shards with a report: the inventory
// job's resync keys.
func NodesInShards(ctx context.Context, q Querier, shards []int) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT n.id FROM nodes n JOIN node_inventory i ON i.node_id = n.id WHERE n.shard = ANY($1)`, shards)
	if err != nil {
		return nil, fmt.Errorf("nodes with inventory: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// Unapplied returns up to limit nodes whose latest report was never
// applied.
func Unapplied(ctx context.Context, q Querier, limit int) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT node_id FROM node_inventory WHERE applied_at IS NULL OR applied_at < received_at LIMIT $1`, limit)
	if err != nil {
		return nil, fmt.Errorf("unapplied inventory: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// AppliedSince reports whether node's latest report arrived after t and
// has been applied; false when the node has none.
func AppliedSince(ctx context.Context, q Querier, node string, t time.Time) (bool, error) {
	var ok bool
	err := q.QueryRow(ctx, `SELECT coalesce(applied_at >= received_at AND received_at > $2, false) FROM node_inventory WHERE node_id = $1`,
		node, t).Scan(&ok)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	return ok, err
}
