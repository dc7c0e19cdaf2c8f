package iam

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// PruneKeys deletes at most limit API keys that ended (revoked, or past
// their expiry) before before, and returns how many it deleted. Their
// console sessions go with them (ON DELETE CASCADE); audit rows and events
// keep the key's id as text.
func PruneKeys(ctx context.Context, q Querier, before time.Time, limit int) (int, error) {
	tag, err := q.Exec(ctx, `
		DELETE FROM api_keys WHERE id IN (
			SELECT id FROM api_keys
			WHERE (revoked_at IS NOT NULL OR expires_at IS NOT NULL) AND coalesce(revoked_at, expires_at) < $1
			ORDER BY coalesce(revoked_at, expires_at) LIMIT $2)`, before, limit)
	if err != nil {
		return 0, fmt.Errorf("prune api keys: %w", err)
	}
	return int(tag.RowsAffected()), nil
}

// WarnExpiringKeys marks, and returns, at most limit live keys that expire
// after now and no later than now+within and were not warned of yet: each
// key is returned once in its life (the caller writes apiKey.expiring in
// the same transaction).
func WarnExpiringKeys(ctx context.Context, q Querier, now time.Time, within time.Duration, limit int) ([]APIKey, error) {
	rows, err := q.Query(ctx, `
		UPDATE api_keys SET expiry_warned_at = $1
		WHERE id IN (
			SELECT id FROM api_keys
			WHERE revoked_at IS NULL AND expiry_warned_at IS NULL AND expires_at > $1 AND expires_at <= $2
			ORDER BY expires_at LIMIT $3 FOR UPDATE SKIP LOCKED)
		RETURNING `+keyCols, now, now.Add(within), limit)
	if err != nil {
		return nil, fmt.Errorf("warn expiring api keys: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (APIKey, error) { return scanKey(r) })
}
