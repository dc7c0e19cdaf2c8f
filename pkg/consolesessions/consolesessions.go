// Package consolesessions is the store of the web console's server-side
// sessions (table console_sessions): a row per signed-in browser, found by
// SHA-256 of the session id the cookie carries. The id itself is never
// stored; the row holds the API key the user signed in with, sealed by the
// console under a key derived from the session id.
package consolesessions

import (
	"context"
	"crypto/sha256"
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

// Bounds of the table.
const (
	// MaxPerIdentity is how many sessions an identity keeps: a sign-in
	// beyond it ends the identity's oldest.
	MaxPerIdentity = 32
	// pruneBatch bounds the ended rows one Prune deletes.
	pruneBatch = 1000
)

// ErrNotFound is Touch's answer for a session that does not exist or has
// ended (idle, past its lifetime, signed out).
var ErrNotFound = errors.New("console session not found or ended")

// Session is a row.
type Session struct {
	// IDHash is SHA-256 of the session id (see Hash).
	IDHash     []byte
	KeyID      string
	IdentityID string
	// SealedKey is the API key, sealed by the console.
	SealedKey  []byte
	CreatedAt  time.Time
	LastSeenAt time.Time
	ExpiresAt  time.Time
}

// Hash is what is stored of a session id.
func Hash(id string) []byte {
	h := sha256.Sum256([]byte(id))
	return h[:]
}

// Create stores a new session, then ends the identity's oldest sessions
// beyond MaxPerIdentity.
func Create(ctx context.Context, q Querier, s Session) error {
	if _, err := q.Exec(ctx, `
		INSERT INTO console_sessions (id_hash, key_id, identity_id, sealed_key, created_at, last_seen_at, expires_at)
		VALUES ($1, $2, $3, $4, $5, $5, $6)`,
		s.IDHash, s.KeyID, s.IdentityID, s.SealedKey, s.CreatedAt, s.ExpiresAt); err != nil {
		return fmt.Errorf("create console session: %w", err)
	}
	if _, err := q.Exec(ctx, `
		DELETE FROM console_sessions WHERE id_hash IN (
			SELECT id_hash FROM console_sessions WHERE identity_id = $1
			ORDER BY created_at DESC, id_hash OFFSET $2)`, s.IdentityID, MaxPerIdentity); err != nil {
		return fmt.Errorf("bound an identity's console sessions: %w", err)
	}
	return nil
}

// Touch finds the live session of idHash at now and marks it seen: a
// session last seen idle or more ago, or past its expiry, is ErrNotFound.
func Touch(ctx context.Context, q Querier, idHash []byte, now time.Time, idle time.Duration) (Session, error) {
	s := Session{IDHash: idHash}
	err := q.QueryRow(ctx, `
		UPDATE console_sessions SET last_seen_at = $2
		WHERE id_hash = $1 AND last_seen_at > $3 AND expires_at > $2
		RETURNING key_id, identity_id, sealed_key, created_at, last_seen_at, expires_at`,
		idHash, now, now.Add(-idle)).Scan(&s.KeyID, &s.IdentityID, &s.SealedKey, &s.CreatedAt, &s.LastSeenAt, &s.ExpiresAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return Session{}, ErrNotFound
	}
	if err != nil {
		return Session{}, fmt.Errorf("look up console session: %w", err)
	}
	return s, nil
}

// Live reports whether the session of idHash is live at now (not signed
// out, not idle since now-idle, not expired), without marking it seen: an
// open live feed does not keep an unattended session alive.
func Live(ctx context.Context, q Querier, idHash []byte, now time.Time, idle time.Duration) (bool, error) {
	var live bool
	if err := q.QueryRow(ctx, `
		SELECT EXISTS (SELECT 1 FROM console_sessions WHERE id_hash = $1 AND last_seen_at > $3 AND expires_at > $2)`,
		idHash, now, now.Add(-idle)).Scan(&live); err != nil {
		return false, fmt.Errorf("check console session: %w", err)
	}
	return live, nil
}

// Delete ends a session (sign-out); deleting one that is gone is no error.
func Delete(ctx context.Context, q Querier, idHash []byte) error {
	if _, err := q.Exec(ctx, `DELETE FROM console_sessions WHERE id_hash = $1`, idHash); err != nil {
		return fmt.Errorf("delete console session: %w", err)
	}
	return nil
}

// Prune deletes up to a batch of ended sessions (idle since before
// now-idle, or expired at now) and says how many.
func Prune(ctx context.Context, q Querier, now time.Time, idle time.Duration) (int64, error) {
	tag, err := q.Exec(ctx, `
		DELETE FROM console_sessions WHERE id_hash IN (
			SELECT id_hash FROM console_sessions WHERE expires_at <= $1
			UNION
			SELECT id_hash FROM console_sessions WHERE last_seen_at <= $2
			LIMIT $3)`, now, now.Add(-idle), pruneBatch)
	if err != nil {
		return 0, fmt.Errorf("prune console sessions: %w", err)
	}
	return tag.RowsAffected(), nil
}
