package nodeca

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"time"

	"github.com/jackc/pgx/v5"
)

// Serial is how a certificate serial is stored: lowercase hex.
func Serial(n *big.Int) string { return n.Text(16) }

// ErrRevoked is returned by [CA.VerifyNode] for a revoked (or unrecorded)
// certificate.
var ErrRevoked = errors.New("certificate revoked")

// Revoked reports whether the node certificate with serial must be refused:
// it was revoked, or the CA has no record of it.
func Revoked(ctx context.Context, q Querier, serial *big.Int) (bool, error) {
	var revoked bool
	err := q.QueryRow(ctx, `SELECT revoked_at IS NOT NULL FROM node_certificates WHERE serial = $1`, Serial(serial)).Scan(&revoked)
	if errors.Is(err, pgx.ErrNoRows) {
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("check revocation: %w", err)
	}
	return revoked, nil
}

// RevokeNode revokes every unrevoked certificate of nodeID and returns how
// many it revoked.
func RevokeNode(ctx context.Context, q Querier, nodeID string) (int64, error) {
	tag, err := q.Exec(ctx, `UPDATE node_certificates SET revoked_at = now() WHERE node_id = $1 AND revoked_at IS NULL`, nodeID)
	if err != nil {
		return 0, fmt.Errorf("revoke certificates of %s: %w", nodeID, err)
	}
	return tag.RowsAffected(), nil
}

// RevokeSerial revokes one certificate.
func RevokeSerial(ctx context.Context, q Querier, serial *big.Int) error {
	if _, err := q.Exec(ctx, `UPDATE node_certificates SET revoked_at = coalesce(revoked_at, now()) WHERE serial = $1`, Serial(serial)); err != nil {
		return fmt.Errorf("revoke certificate %s: %w", Serial(serial), err)
	}
	return nil
}

// RevokedSerial is [Revoked] for a serial written as [Serial] writes it
// (lowercase hex), the shape a gateway's revocation hook takes. A serial
// that does not parse is refused.
func RevokedSerial(ctx context.Context, q Querier, serial string) (bool, error) {
	n, ok := new(big.Int).SetString(serial, 16)
	if !ok {
		return true, nil
	}
	return Revoked(ctx, q, n)
}

// RevokedAmong returns which of serials (lowercase hex) must be refused:
// revoked, or unknown to the CA — in one statement, for a gateway's every
// session at once. A serial is accepted when it is an unrevoked node
// certificate's, or an unrevoked site agent certificate's whose agent is
// not revoked (which role a certificate may play is the SPIFFE ID's
// business, checked by the caller).
func RevokedAmong(ctx context.Context, q interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}, serials []string) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT s.serial FROM unnest($1::text[]) AS s(serial)
		LEFT JOIN node_certificates c ON c.serial = s.serial
		LEFT JOIN site_agent_certificates sc ON sc.serial = s.serial
		LEFT JOIN site_agents a ON a.id = sc.agent_id
		WHERE (c.serial IS NULL OR c.revoked_at IS NOT NULL)
		  AND (sc.serial IS NULL OR sc.revoked_at IS NOT NULL OR a.revoked_at IS NOT NULL)`, serials)
	if err != nil {
		return nil, fmt.Errorf("check revocation: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("check revocation: %w", err)
	}
	return out, nil
}

// PruneExpired deletes up to limit node certificate rows and up to limit
// site agent certificate rows that expired before before, and returns how
// many it deleted in all. An expired certificate fails verification
// whatever its row says, so its revocation record is no longer needed once
// the grace period has passed.
func PruneExpired(ctx context.Context, q Querier, before time.Time, limit int) (int64, error) {
	tag, err := q.Exec(ctx, `DELETE FROM node_certificates WHERE serial IN (
		SELECT serial FROM node_certificates WHERE not_after < $1 ORDER BY not_after LIMIT $2)`, before, limit)
	if err != nil {
		return 0, fmt.Errorf("prune node certificates: %w", err)
	}
	sites, err := q.Exec(ctx, `DELETE FROM site_agent_certificates WHERE serial IN (
		SELECT serial FROM site_agent_certificates WHERE not_after < $1 ORDER BY not_after LIMIT $2)`, before, limit)
	if err != nil {
		return 0, fmt.Errorf("prune site agent certificates: %w", err)
	}
	return tag.RowsAffected() + sites.RowsAffected(), nil
}
