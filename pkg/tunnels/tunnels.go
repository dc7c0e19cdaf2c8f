// Package tunnels is the store of the tunnels table (migration 00044): one
// row per port forward a caller opened to a node's target (docs/tunnels.md).
//
// Open inserts a row with the hash of a one-time connect token, checking
// the per-node and per-tenant limits on tunnels not yet closed under a lock
// per tenant; Connect spends the token (the first connect wins; a token is
// good for TokenTTL); AddBytes records what flowed; Close ends a row once,
// with why; Doomed finds, for the rows a relay holds, which must close and
// why (closed by tunnels.close, expired, the opener's key or identity
// revoked, the node retired); Prune deletes rows closed Retention ago.
package tunnels

import (
	"context"
	"crypto/subtle"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/secret"
)

// Bounds.
const (
	// TokenPrefix starts a connect token: bctt_<id>.<secret>, where the
	// tunnel's id is "tun_<id>".
	TokenPrefix = "bctt_"
	// IDPrefix starts a tunnel's id.
	IDPrefix = "tun_"
	// TokenTTL is how long a connect token is good for.
	TokenTTL = 60 * time.Second
	// MaxNotAfter bounds a tunnel's lifetime.
	MaxNotAfter = 8 * time.Hour
	// DefaultNotAfter is a tunnel's lifetime when open names none.
	DefaultNotAfter = time.Hour
	// Retention is how long a closed row is kept.
	Retention = 30 * 24 * time.Hour
	// DefaultPerNode and DefaultPerTenant are the limits on tunnels not
	// yet closed.
	DefaultPerNode   = 16
	DefaultPerTenant = 256
)

// Why a tunnel closed (close_reason, and tunnel.closed's reason).
const (
	ClosedByCaller   = "closed"        // either end closed its side, or tunnels.close
	ClosedExpired    = "expired"       // not_after passed
	ClosedRevoked    = "revoked"       // the opener's key or identity was revoked
	ClosedRetired    = "node_retired"  // the node was retired
	ClosedSession    = "session_ended" // the node's session ended
	ClosedRefused    = "refused"       // the node refused to open it
	ClosedUnused     = "token_expired" // nobody connected in time
	ClosedUnroutable = "unroutable"    // no gateway here holds the node
	ClosedAPIStopped = "api_stopped"   // the relaying API process stopped
	ClosedAPI        = "tunnels.close" // tunnels.close
	ClosedError      = "error"         // the relay failed
)

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Tunnel is one row.
type Tunnel struct {
	ID, TenantID, NodeID, Target, Reason string
	OpenedBy, OpenedByKey                string
	NotAfter, CreatedAt                  time.Time
	ConnectedAt, ClosedAt                *time.Time
	RelayProcess, CloseReason            string
	BytesIn, BytesOut                    int64
}

// Live reports whether the tunnel has not closed.
func (t Tunnel) Live() bool { return t.ClosedAt == nil }

const columns = `id, tenant_id, node_id, target, reason, opened_by, opened_by_key, not_after, created_at,
	connected_at, closed_at, relay_process, close_reason, bytes_in, bytes_out`

func scan(row pgx.Row) (Tunnel, error) {
	var t Tunnel
	err := row.Scan(&t.ID, &t.TenantID, &t.NodeID, &t.Target, &t.Reason, &t.OpenedBy, &t.OpenedByKey, &t.NotAfter, &t.CreatedAt,
		&t.ConnectedAt, &t.ClosedAt, &t.RelayProcess, &t.CloseReason, &t.BytesIn, &t.BytesOut)
	return t, err
}

// OpenArgs is a tunnel to open.
type OpenArgs struct {
	TenantID, NodeID, Target, Reason string
	OpenedBy, OpenedByKey            string
	NotAfter                         time.Time
	// PerNode and PerTenant are the limits on tunnels not yet closed; 0
	// means the defaults.
	PerNode, PerTenant int
}

// Opened is a new tunnel and its connect token, returned once.
type Opened struct {
	Tunnel Tunnel
	Token  string
	// TokenNotAfter is when the token stops working.
	TokenNotAfter time.Time
}

// Open inserts a tunnel; over a limit it is fault.RateLimited. Call it in
// the transaction of the tunnel.opened event and audit row.
func Open(ctx context.Context, tx pgx.Tx, a OpenArgs, now time.Time) (Opened, error) {
	perNode, perTenant := a.PerNode, a.PerTenant
	if perNode <= 0 {
		perNode = DefaultPerNode
	}
	if perTenant <= 0 {
		perTenant = DefaultPerTenant
	}
	// One open at a time per tenant, so two cannot both pass the count.
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext('tunnels:' || $1))`, a.TenantID); err != nil {
		return Opened{}, err
	}
	var onNode, inTenant int
	if err := tx.QueryRow(ctx, `
		SELECT count(*) FILTER (WHERE node_id = $2), count(*)
		FROM tunnels WHERE tenant_id = $1 AND closed_at IS NULL`, a.TenantID, a.NodeID).Scan(&onNode, &inTenant); err != nil {
		return Opened{}, err
	}
	switch {
	case onNode >= perNode:
		return Opened{}, fault.New(fault.RateLimited, "nodeId", "node %s has %d tunnels open, at most %d; close one first", a.NodeID, onNode, perNode)
	case inTenant >= perTenant:
		return Opened{}, fault.New(fault.RateLimited, "tenantId", "tenant %s has %d tunnels open, at most %d; close one first", a.TenantID, inTenant, perTenant)
	}
	m := secret.Mint(TokenPrefix)
	tokenNotAfter := now.Add(TokenTTL)
	row := tx.QueryRow(ctx, `
		INSERT INTO tunnels (id, tenant_id, node_id, target, reason, opened_by, opened_by_key, token_hash, token_not_after, not_after, created_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
		RETURNING `+columns,
		IDPrefix+m.ID, a.TenantID, a.NodeID, a.Target, a.Reason, a.OpenedBy, a.OpenedByKey, m.Hash, tokenNotAfter, a.NotAfter, now)
	t, err := scan(row)
	if err != nil {
		return Opened{}, err
	}
	return Opened{Tunnel: t, Token: m.Value, TokenNotAfter: tokenNotAfter}, nil
}

// ErrBadToken is a connect token that is malformed, unknown, spent,
// expired, or for a closed tunnel: all look alike to the caller.
var ErrBadToken = fault.New(fault.Unauthenticated, "token", "the connect token is not valid (malformed, spent, expired, or its tunnel closed)")

// Connect spends token for relay process proc and returns its tunnel.
func Connect(ctx context.Context, q Querier, token, proc string, now time.Time) (Tunnel, error) {
	id, sec, ok := secret.Parse(TokenPrefix, token)
	if !ok {
		return Tunnel{}, ErrBadToken
	}
	var hash []byte
	err := q.QueryRow(ctx, `SELECT token_hash FROM tunnels WHERE id = $1`, IDPrefix+id).Scan(&hash)
	if errors.Is(err, pgx.ErrNoRows) {
		return Tunnel{}, ErrBadToken
	}
	if err != nil {
		return Tunnel{}, err
	}
	if subtle.ConstantTimeCompare(hash, secret.Hash(sec)) != 1 {
		return Tunnel{}, ErrBadToken
	}
	t, err := scan(q.QueryRow(ctx, `
		UPDATE tunnels SET connected_at = $2, relay_process = $3
		WHERE id = $1 AND connected_at IS NULL AND closed_at IS NULL AND token_not_after > $2 AND not_after > $2
		RETURNING `+columns, IDPrefix+id, now, proc))
	if errors.Is(err, pgx.ErrNoRows) {
		return Tunnel{}, ErrBadToken
	}
	return t, err
}

// Get returns tenant's tunnel id.
func Get(ctx context.Context, q Querier, tenant, id string) (Tunnel, error) {
	t, err := scan(q.QueryRow(ctx, `SELECT `+columns+` FROM tunnels WHERE tenant_id = $1 AND id = $2`, tenant, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Tunnel{}, fault.New(fault.NotFound, "tunnelId", "tunnel %s not found", id)
	}
	return t, err
}

// ListFilter selects tunnels.
type ListFilter struct {
	TenantID string
	// NodeID, when set, keeps one node's.
	NodeID string
	// All includes closed tunnels; otherwise only those not closed.
	All   bool
	After string
	Limit int
}

// List pages through a tenant's tunnels in id order.
func List(ctx context.Context, q Querier, f ListFilter) ([]Tunnel, error) {
	rows, err := q.Query(ctx, `SELECT `+columns+` FROM tunnels
		WHERE tenant_id = $1 AND ($2 = '' OR node_id = $2) AND ($3 OR closed_at IS NULL) AND id > $4
		ORDER BY id LIMIT $5`, f.TenantID, f.NodeID, f.All, f.After, f.Limit)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Tunnel, error) { return scan(r) })
}

// AddBytes adds to a tunnel's byte counts.
func AddBytes(ctx context.Context, q Querier, id string, in, out int64) error {
	if in == 0 && out == 0 {
		return nil
	}
	_, err := q.Exec(ctx, `UPDATE tunnels SET bytes_in = bytes_in + $2, bytes_out = bytes_out + $3 WHERE id = $1`, id, in, out)
	return err
}

// Close closes a tunnel with why, adding the last bytes; closed is false
// when it was already closed (the row is returned as it stands).
func Close(ctx context.Context, q Querier, id, why string, in, out int64, now time.Time) (t Tunnel, closed bool, err error) {
	t, err = scan(q.QueryRow(ctx, `
		UPDATE tunnels SET closed_at = $2, close_reason = $3, bytes_in = bytes_in + $4, bytes_out = bytes_out + $5
		WHERE id = $1 AND closed_at IS NULL RETURNING `+columns, id, now, why, in, out))
	if errors.Is(err, pgx.ErrNoRows) {
		if err := AddBytes(ctx, q, id, in, out); err != nil {
			return Tunnel{}, false, err
		}
		t, err = scan(q.QueryRow(ctx, `SELECT `+columns+` FROM tunnels WHERE id = $1`, id))
		return t, false, err
	}
	return t, err == nil, err
}

// Doomed returns, of ids, those that must close and why: closed already
// (tunnels.close, from any process), past not_after, opened with a key or
// by an identity since revoked, or on a retired node.
func Doomed(ctx context.Context, q Querier, ids []string, now time.Time) (map[string]string, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	rows, err := q.Query(ctx, `
		SELECT t.id, CASE
			WHEN t.closed_at IS NOT NULL THEN CASE WHEN t.close_reason = '' THEN $3 ELSE t.close_reason END
			WHEN t.not_after <= $2 THEN $4
			WHEN i.revoked_at IS NOT NULL OR k.revoked_at IS NOT NULL OR (k.expires_at IS NOT NULL AND k.expires_at <= $2) THEN $5
			WHEN n.state = 'retired' OR n.id IS NULL THEN $6
			ELSE '' END
		FROM tunnels t
		LEFT JOIN identities i ON i.id = t.opened_by
		LEFT JOIN api_keys k ON k.id = t.opened_by_key
		LEFT JOIN nodes n ON n.id = t.node_id
		WHERE t.id = ANY($1)`, ids, now, ClosedAPI, ClosedExpired, ClosedRevoked, ClosedRetired)
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	var id, why string
	_, err = pgx.ForEachRow(rows, []any{&id, &why}, func() error {
		if why != "" {
			out[id] = why
		}
		return nil
	})
	return out, err
}

// Unused returns tunnels whose token expired with nobody connected, at
// most limit: the caller closes them (ClosedUnused).
func Unused(ctx context.Context, q Querier, now time.Time, limit int) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT id FROM tunnels
		WHERE closed_at IS NULL AND connected_at IS NULL AND token_not_after < $1 ORDER BY id LIMIT $2`, now, limit)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// Prune deletes at most limit tunnels closed before before.
func Prune(ctx context.Context, q Querier, before time.Time, limit int) (int64, error) {
	tag, err := q.Exec(ctx, `DELETE FROM tunnels WHERE id IN (
		SELECT id FROM tunnels WHERE closed_at IS NOT NULL AND closed_at < $1 ORDER BY closed_at LIMIT $2)`, before, limit)
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), nil
}
