// Package gateways is the store of the gateways table (migration 00046):
// where each gateway is reached by the control plane's other processes
// (gateway.advertise), for relaying tunnels to the gateway holding a node.
package gateways

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Retention is how long a row no node names is kept after its gateway
// last wrote it.
const Retention = 30 * 24 * time.Hour

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Register records gateway id's address.
func Register(ctx context.Context, q Querier, id, address string) error {
	_, err := q.Exec(ctx, `INSERT INTO gateways (id, address) VALUES ($1, $2)
		ON CONFLICT (id) DO UPDATE SET address = excluded.address, updated_at = now()`, id, address)
	return err
}

// Address returns gateway id's address; fault.Unavailable when it never
// registered one.
func Address(ctx context.Context, q Querier, id string) (string, error) {
	var addr string
	err := q.QueryRow(ctx, `SELECT address FROM gateways WHERE id = $1`, id).Scan(&addr)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", fault.New(fault.Unavailable, "nodeId", "gateway %s has no registered address (gateway.advertise)", id)
	}
	return addr, err
}

// Prune deletes rows older than before that no node names.
func Prune(ctx context.Context, q Querier, before time.Time) (int64, error) {
	tag, err := q.Exec(ctx, `DELETE FROM gateways g WHERE g.updated_at < $1
		AND NOT EXISTS (SELECT 1 FROM nodes n WHERE n.gateway_id = g.id)`, before)
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), nil
}
