package audit

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// pruneBatch bounds the rows one [Prune] deletes.
const pruneBatch = 10000

// Anchor is where the kept part of the chain starts: the row at ChainSeq,
// on which a checkpoint was made, and PrevHash, the hash of the pruned row
// before it, from which its hash is recomputed. Every pruned row is older
// than Before (the anchor row's time).
type Anchor struct {
	ChainSeq int64
	PrevHash []byte
	Before   time.Time
	PrunedAt time.Time
}

// ReadAnchor returns the prune anchor; ok is false while nothing was ever
// pruned.
func ReadAnchor(ctx context.Context, q Querier) (a Anchor, ok bool, err error) {
	rows, err := q.Query(ctx, `SELECT chain_seq, prev_hash, before, pruned_at FROM audit_prune_anchor`)
	if err != nil {
		return Anchor{}, false, fmt.Errorf("read audit prune anchor: %w", err)
	}
	a, err = pgx.CollectExactlyOneRow(rows, pgx.RowToStructByPos[Anchor])
	if errors.Is(err, pgx.ErrNoRows) {
		return Anchor{}, false, nil
	}
	if err != nil {
		return Anchor{}, false, fmt.Errorf("read audit prune anchor: %w", err)
	}
	return a, true, nil
}

// Prune deletes audit rows older than cutoff below the newest checkpoint
// whose row is older than cutoff — the checkpoint's own row stays, so what
// is kept still verifies against a signed head — at most pruneBatch rows a
// call. It first moves the anchor to that checkpoint, in the same
// transaction, so a verification never sees a chain that starts nowhere;
// the rows below the anchor go over as many calls as they take ([Verify]
// does not read them meanwhile). Checkpoints below the anchor go with the
// last of their rows. It reports how many rows it deleted; pruneBatch of
// them means more may wait. It takes the chain's lock for the rest of tx.
func Prune(ctx context.Context, tx pgx.Tx, cutoff time.Time) (int, error) {
	if err := lockChain(ctx, tx); err != nil {
		return 0, err
	}
	// The newest checkpoint whose row is older than cutoff, and the hash of
	// the row before it (which the anchor keeps: that row may be pruned).
	var seq int64
	var prev []byte
	var at time.Time
	err := tx.QueryRow(ctx, `
		SELECT c.chain_seq, coalesce(p.hash, $2::bytea), a.at
		  FROM audit_checkpoints c JOIN audit a ON a.chain_seq = c.chain_seq
		  LEFT JOIN audit p ON p.chain_seq = c.chain_seq - 1
		 WHERE a.at < $1 ORDER BY c.chain_seq DESC LIMIT 1`, cutoff, zeroHash).Scan(&seq, &prev, &at)
	found := err == nil
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return 0, fmt.Errorf("find the audit prune point: %w", err)
	}
	old, ok, err := ReadAnchor(ctx, tx)
	if err != nil {
		return 0, err
	}
	if found && seq > old.ChainSeq {
		if seq > 1 && bytes.Equal(prev, zeroHash) {
			// The row before the checkpoint is gone though no anchor is at
			// or past it: rows were deleted by hand. Leave it to audit.verify.
			return 0, fmt.Errorf("prune audit rows: the record before chain position %d is missing; run audit.verify", seq)
		}
		if _, err := tx.Exec(ctx, `
			INSERT INTO audit_prune_anchor (chain_seq, prev_hash, before) VALUES ($1, $2, $3)
			ON CONFLICT (one) DO UPDATE SET chain_seq = EXCLUDED.chain_seq, prev_hash = EXCLUDED.prev_hash,
			       before = EXCLUDED.before, pruned_at = now()`, seq, prev, at); err != nil {
			return 0, fmt.Errorf("move the audit prune anchor: %w", err)
		}
		old, ok = Anchor{ChainSeq: seq}, true
	}
	if !ok {
		return 0, nil
	}
	// The unique index on chain_seq serves this from its start.
	tag, err := tx.Exec(ctx, `
		DELETE FROM audit WHERE id IN (
			SELECT id FROM audit WHERE chain_seq < $1 ORDER BY chain_seq LIMIT $2)`, old.ChainSeq, pruneBatch)
	if err != nil {
		return 0, fmt.Errorf("prune audit rows: %w", err)
	}
	n := int(tag.RowsAffected())
	if n < pruneBatch {
		if _, err := tx.Exec(ctx, `DELETE FROM audit_checkpoints WHERE chain_seq < $1`, old.ChainSeq); err != nil {
			return 0, fmt.Errorf("prune audit checkpoints: %w", err)
		}
	}
	return n, nil
}
