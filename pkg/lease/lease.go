// Package lease holds fenced leases in PostgreSQL: rows in `leases`, never
// advisory locks, so they work behind PgBouncer in transaction mode.
//
// Taking a lease increments its fence. Every write made under a lease checks,
// in the same statement, that the lease still has the holder and fence the
// writer took it with and has not expired ([Clause]), so a holder that paused
// past its lease changes nothing. Lease time is database time: expiry is
// compared with now() in SQL, never with a process clock.
//
// The reconciler runtime holds its shard and singleton leases itself; a
// singleton that runs outside it (the outbox relay) holds its lease with a
// [Leader].
package lease

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/pkg/config"
)

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Held is a lease as its holder knows it.
type Held struct {
	Name  string
	Fence int64
}

// Shard returns the name of shard n's lease in membership. The controllers'
// leases are "shard:<n>", every other membership's "<membership>/shard:<n>"
// (the scheduler's are "scheduler/shard:<n>").
func Shard(membership string, n int) string {
	if membership == string(config.RoleControllers) {
		return fmt.Sprintf("shard:%d", n)
	}
	return fmt.Sprintf("%s/shard:%d", membership, n)
}

// Singleton returns the name of a shardBy:"none" reconciler's lease.
func Singleton(name string) string { return "singleton:" + name }

// Acquire takes every named lease that is free or expired for holder, for
// ttl, incrementing each one's fence, and returns those it took. Leases
// holder already holds and that have not expired are not touched: renew them.
func Acquire(ctx context.Context, q Querier, holder string, ttl time.Duration, names []string) ([]Held, error) {
	if len(names) == 0 {
		return nil, nil
	}
	// Rows are inserted (and, on conflict, locked) in input order: sorted,
	// so every writer of many leases locks them in name order.
	names = slices.Sorted(slices.Values(names))
	rows, err := q.Query(ctx, `
		INSERT INTO leases AS l (name, holder, fence, acquired_at, expires_at)
		SELECT n, $2, 1, now(), now() + $3 * interval '1 microsecond' FROM unnest($1::text[]) AS n
		ON CONFLICT (name) DO UPDATE
		   SET holder = EXCLUDED.holder, fence = l.fence + 1,
		       acquired_at = now(), expires_at = EXCLUDED.expires_at
		 WHERE l.holder IS NULL OR l.expires_at <= now()
		RETURNING name, fence`, names, holder, ttl.Microseconds())
	if err != nil {
		return nil, fmt.Errorf("acquire leases: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[Held])
}

// Renew extends every held lease that still has holder and its fence and has
// not expired, and returns those it extended. A lease missing from the result
// is lost: stop working under it.
func Renew(ctx context.Context, q Querier, holder string, ttl time.Duration, held []Held) ([]Held, error) {
	if len(held) == 0 {
		return nil, nil
	}
	names, fences := split(held)
	rows, err := q.Query(ctx, `
		WITH k AS MATERIALIZED (
			SELECT l.name FROM leases l JOIN unnest($1::text[], $2::bigint[]) AS h(name, fence)
			    ON l.name = h.name AND l.fence = h.fence AND l.holder = $3
			 ORDER BY l.name FOR UPDATE OF l)
		UPDATE leases AS l SET expires_at = now() + $4 * interval '1 microsecond'
		  FROM k WHERE l.name = k.name AND l.holder = $3 AND l.expires_at > now()
		RETURNING l.name, l.fence`, names, fences, holder, ttl.Microseconds())
	if err != nil {
		return nil, fmt.Errorf("renew leases: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[Held])
}

// Release gives up held leases so another worker can take them at once. The
// fence stays: the next holder increments it. Like [Renew] and [Acquire] it
// locks the leases in name order, as a batch's fenced transaction does (FOR
// SHARE, in name order), so releasing, renewing and running never deadlock.
// It returns how many of held it released: the others were lost already
// (taken by another holder, or their fence moved).
func Release(ctx context.Context, q Querier, holder string, held []Held) (int, error) {
	if len(held) == 0 {
		return 0, nil
	}
	names, fences := split(held)
	tag, err := q.Exec(ctx, `
		WITH k AS MATERIALIZED (
			SELECT l.name FROM leases l JOIN unnest($1::text[], $2::bigint[]) AS h(name, fence)
			    ON l.name = h.name AND l.fence = h.fence AND l.holder = $3
			 ORDER BY l.name FOR UPDATE OF l)
		UPDATE leases AS l SET holder = NULL, expires_at = '-infinity'
		  FROM k WHERE l.name = k.name AND l.holder = $3`, names, fences, holder)
	if err != nil {
		return 0, fmt.Errorf("release leases: %w", err)
	}
	return int(tag.RowsAffected()), nil
}

func split(held []Held) ([]string, []int64) {
	names := make([]string, len(held))
	fences := make([]int64, len(held))
	for i, h := range held {
		names[i], fences[i] = h.Name, h.Fence
	}
	return names, fences
}

// Clause returns a boolean SQL expression that is true only while the lease
// named by parameter $name still has holder $holder and fence $fence and has
// not expired. Put it in the WHERE of every write made under the lease, with
// the parameters numbered as given:
//
//	UPDATE things SET … WHERE id = $1 AND `+lease.Clause(2, 3, 4)
func Clause(name, holder, fence int) string {
	return fmt.Sprintf(`EXISTS (SELECT 1 FROM leases WHERE name = $%d AND holder = $%d AND fence = $%d AND expires_at > now())`, name, holder, fence)
}

// ErrLost is returned by [Hold] when the lease is no longer held.
var ErrLost = errors.New("lease lost: write fenced")

// Hold locks lease h's row in tx (FOR SHARE) if it still has holder and h's
// fence and has not expired, so no new holder can take it until tx ends, and
// returns [ErrLost] otherwise. Call it first in every transaction made under
// a lease: the writes that follow are then fenced.
func Hold(ctx context.Context, tx pgx.Tx, holder string, h Held) error {
	var ok bool
	err := tx.QueryRow(ctx, `SELECT true FROM leases WHERE name = $1 AND holder = $2 AND fence = $3 AND expires_at > now() FOR SHARE`,
		h.Name, holder, h.Fence).Scan(&ok)
	if errors.Is(err, pgx.ErrNoRows) {
		return ErrLost
	}
	if err != nil {
		return fmt.Errorf("check lease %s: %w", h.Name, err)
	}
	return nil
}
