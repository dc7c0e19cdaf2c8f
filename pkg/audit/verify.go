package audit

import (
	"bytes"
	"cmp"
	"context"
	"crypto/ed25519"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// CheckpointRecord is one row of audit_checkpoints: a chain head, signed.
type CheckpointRecord struct {
	// ChainSeq is the position of the row whose hash was recorded.
	ChainSeq int64
	// HeadHash is that row's hash.
	HeadHash []byte
	// Signature is the Ed25519 signature over [CheckpointMessage]; nil when
	// no audit key was configured.
	Signature []byte
	// KeyID is the signing key's id; empty when unsigned.
	KeyID string
	// At is when the checkpoint was written.
	At time.Time
}

// Verdict is what [Verify] found.
type Verdict struct {
	// OK says every chained row and every checkpoint matched.
	OK bool
	// RecordsChecked counts the chained rows whose hash was recomputed (up
	// to and including the first that did not match).
	RecordsChecked int64
	// FirstBadID is the id of the first row that does not match, or ""
	// when none does or the problem is no row's (rows deleted from the end,
	// a bad signature).
	FirstBadID string
	// Reason says what did not match; when OK it may carry a note (the
	// signatures were not checked, early checkpoints are unsigned).
	Reason string
	// LastCheckpoint is the newest checkpoint that matched; nil when none
	// did.
	LastCheckpoint *CheckpointRecord
	// Unchained counts the rows this verification did not cover: written
	// but not chained yet, or chained after it read the head.
	Unchained int64
	// SignaturesChecked says checkpoint signatures were verified (a public
	// key was given).
	SignaturesChecked bool
	// PrunedBefore is the chain position the kept records start at when
	// older ones were pruned (audit.retention); 0 when none were.
	PrunedBefore int64
}

// verifyPage is how many rows (or checkpoints) Verify reads at a time.
const verifyPage = 1000

// Verify recomputes the chain: it reads every chained row in chain_seq
// order, a page at a time, checks the positions run 1, 2, 3… without a gap
// and that each row's hash is SHA-256(previous hash ‖ its canonical
// fields), and checks every checkpoint: the row at its position exists and
// has its head hash, and, when pub is set, its signature verifies with pub
// (checkpoints written before the first signed one may be unsigned: the key
// was configured later). A checkpoint past the newest chained row means rows
// were deleted from the end. It stops at the first problem.
//
// Rows chained while it runs are left for the next verification: it checks
// up to the head it saw at its start. It reads checkpoints' extent first,
// so every row a checkpoint covers had committed before the rows are read,
// and a plain pool (no snapshot) gives no false alarm.
func Verify(ctx context.Context, q Querier, pub ed25519.PublicKey) (Verdict, error) {
	// A prune that moves the anchor while this runs deletes rows it may be
	// about to read: that shows as missing positions, so verify once more
	// from the new anchor.
	v, anchor, err := verify(ctx, q, pub)
	if err != nil || v.OK {
		return v, err
	}
	now, _, err := ReadAnchor(ctx, q)
	if err != nil || now.ChainSeq <= anchor {
		return v, err
	}
	v, _, err = verify(ctx, q, pub)
	return v, err
}

// verify is one pass of [Verify]; it returns the anchor's position it
// started from (0: nothing pruned).
func verify(ctx context.Context, q Querier, pub ed25519.PublicKey) (Verdict, int64, error) {
	v := Verdict{SignaturesChecked: pub != nil}
	anchor, pruned, err := ReadAnchor(ctx, q)
	if err != nil {
		return v, 0, err
	}
	var lastCP, headSeq int64
	if err := queryRow(ctx, q, `SELECT coalesce(max(chain_seq), 0) FROM audit_checkpoints`, &lastCP); err != nil {
		return v, anchor.ChainSeq, fmt.Errorf("verify audit chain: %w", err)
	}
	headSeq, _, err = head(ctx, q)
	if err != nil {
		return v, anchor.ChainSeq, err
	}
	cps := &checkpointPager{q: q, max: lastCP}
	expect, prev := int64(1), zeroHash
	if pruned {
		// The kept chain starts at the anchor's row, chained from the
		// pruned row before it, and a checkpoint is at that row.
		expect, prev, cps.after = anchor.ChainSeq, anchor.PrevHash, anchor.ChainSeq-1
		v.PrunedBefore = anchor.ChainSeq
		cp, err := cps.peek(ctx)
		if err != nil {
			return v, anchor.ChainSeq, err
		}
		if cp == nil || cp.ChainSeq != anchor.ChainSeq {
			v.Reason = fmt.Sprintf("no checkpoint is at chain position %d, where the records kept after pruning start: the records before it were deleted", anchor.ChainSeq)
			return finishAt(ctx, q, v, headSeq, anchor.ChainSeq)
		}
	}
	var signed bool
	var unsigned int
	// checkpoint checks cp against the row at its position (nil when past
	// the end); it returns false with v filled in on a mismatch.
	checkpoint := func(cp *CheckpointRecord, r *chainRow) bool {
		if r == nil {
			v.Reason = fmt.Sprintf("records after chain position %d were deleted; the checkpoint at chain position %d (written %s) covers them",
				expect-1, cp.ChainSeq, cp.At.UTC().Format(time.RFC3339))
			return false
		}
		if !bytes.Equal(cp.HeadHash, r.hash) {
			v.FirstBadID = strconv.FormatInt(r.id, 10)
			v.Reason = fmt.Sprintf("the checkpoint at chain position %d (written %s) does not match record %d: the chain up to it was rewritten",
				cp.ChainSeq, cp.At.UTC().Format(time.RFC3339), r.id)
			return false
		}
		if pub != nil {
			switch {
			case cp.Signature == nil && signed:
				v.Reason = fmt.Sprintf("the checkpoint at chain position %d is unsigned, but an earlier one is signed: its signature is missing", cp.ChainSeq)
				return false
			case cp.Signature == nil:
				unsigned++
			case cp.KeyID != KeyID(pub) || !ed25519.Verify(pub, CheckpointMessage(cp.ChainSeq, cp.HeadHash), cp.Signature):
				v.Reason = fmt.Sprintf("the checkpoint at chain position %d: signature (key %s) does not verify with the audit key %s",
					cp.ChainSeq, cmp.Or(cp.KeyID, "none"), KeyID(pub))
				return false
			default:
				signed = true
			}
		}
		v.LastCheckpoint = cp
		return true
	}
	for after := expect - 1; after < headSeq; {
		rows, err := q.Query(ctx, `SELECT `+chainColumns+` FROM audit
			 WHERE chain_seq > $1 AND chain_seq <= $2 ORDER BY chain_seq LIMIT $3`, after, headSeq, verifyPage)
		if err != nil {
			return v, anchor.ChainSeq, fmt.Errorf("verify audit chain: %w", err)
		}
		page, err := pgx.CollectRows(rows, scanChainRow)
		if err != nil {
			return v, anchor.ChainSeq, fmt.Errorf("verify audit chain: %w", err)
		}
		if len(page) == 0 {
			break
		}
		for i := range page {
			r := &page[i]
			seq := *r.seq
			after = seq
			if seq != expect {
				v.FirstBadID = strconv.FormatInt(r.id, 10)
				v.Reason = fmt.Sprintf("chain positions %d to %d are missing: the records before record %d were deleted", expect, seq-1, r.id)
				if seq == expect+1 {
					v.Reason = fmt.Sprintf("chain position %d is missing: the record before record %d was deleted", expect, r.id)
				}
				return finishAt(ctx, q, v, headSeq, anchor.ChainSeq)
			}
			v.RecordsChecked++
			h, err := rowHash(prev, *r, seq)
			if err != nil {
				return v, anchor.ChainSeq, err
			}
			if !bytes.Equal(h, r.hash) {
				v.FirstBadID = strconv.FormatInt(r.id, 10)
				v.Reason = fmt.Sprintf("record %d (chain position %d) does not match its hash: it was changed after it was chained", r.id, seq)
				return finishAt(ctx, q, v, headSeq, anchor.ChainSeq)
			}
			for {
				cp, err := cps.peek(ctx)
				if err != nil {
					return v, anchor.ChainSeq, err
				}
				if cp == nil || cp.ChainSeq > seq {
					break
				}
				cps.next()
				if cp.ChainSeq < seq {
					// Its row is gone, yet the positions run on: a
					// checkpoint with no row of its own (made up).
					v.Reason = fmt.Sprintf("the checkpoint at chain position %d matches no record", cp.ChainSeq)
					return finishAt(ctx, q, v, headSeq, anchor.ChainSeq)
				}
				if !checkpoint(cp, r) {
					return finishAt(ctx, q, v, headSeq, anchor.ChainSeq)
				}
			}
			prev, expect = r.hash, seq+1
		}
	}
	// Checkpoints past the newest chained row cover rows that are gone.
	if cp, err := cps.peek(ctx); err != nil {
		return v, anchor.ChainSeq, err
	} else if cp != nil && !checkpoint(cp, nil) {
		return finishAt(ctx, q, v, headSeq, anchor.ChainSeq)
	}
	v.OK = true
	var notes []string
	switch {
	case pub == nil:
		notes = append(notes, "checkpoint signatures were not checked: no audit key was given")
	case unsigned > 0:
		notes = append(notes, fmt.Sprintf("%d early checkpoints are unsigned (written before the audit key was configured)", unsigned))
	}
	if pruned {
		notes = append(notes, fmt.Sprintf("the records before chain position %d (older than %s) were pruned by audit.retention on %s",
			anchor.ChainSeq, anchor.Before.UTC().Format(time.RFC3339), anchor.PrunedAt.UTC().Format(time.RFC3339)))
	}
	v.Reason = strings.Join(notes, "; ")
	return finishAt(ctx, q, v, headSeq, anchor.ChainSeq)
}

// finish counts into v the rows this verification did not cover: those not
// chained yet and those chained after it read the head (headSeq) — so that
// Unchained and RecordsChecked describe the same moment, even while the
// chainer runs.
func finishAt(ctx context.Context, q Querier, v Verdict, headSeq, anchor int64) (Verdict, int64, error) {
	v, err := finish(ctx, q, v, headSeq)
	return v, anchor, err
}

func finish(ctx context.Context, q Querier, v Verdict, headSeq int64) (Verdict, error) {
	// audit_unchained is a partial index of the unchained rows.
	if err := queryRow(ctx, q, `SELECT (SELECT count(*) FROM audit WHERE chain_seq IS NULL) +
		(SELECT count(*) FROM audit WHERE chain_seq > $1)`, &v.Unchained, headSeq); err != nil {
		return v, fmt.Errorf("count unchained audit rows: %w", err)
	}
	return v, nil
}

// checkpointPager reads checkpoints up to max in chain_seq order, a page at
// a time.
type checkpointPager struct {
	q     Querier
	max   int64
	after int64
	buf   []CheckpointRecord
	done  bool
}

// peek returns the next checkpoint without consuming it, or nil at the end.
func (p *checkpointPager) peek(ctx context.Context) (*CheckpointRecord, error) {
	if len(p.buf) == 0 && !p.done {
		rows, err := p.q.Query(ctx, `SELECT chain_seq, head_hash, signature, key_id, created_at FROM audit_checkpoints
			 WHERE chain_seq > $1 AND chain_seq <= $2 ORDER BY chain_seq LIMIT $3`, p.after, p.max, verifyPage)
		if err != nil {
			return nil, fmt.Errorf("read audit checkpoints: %w", err)
		}
		p.buf, err = pgx.CollectRows(rows, pgx.RowToStructByPos[CheckpointRecord])
		if err != nil {
			return nil, fmt.Errorf("read audit checkpoints: %w", err)
		}
		if len(p.buf) < verifyPage {
			p.done = true
		}
		if len(p.buf) > 0 {
			p.after = p.buf[len(p.buf)-1].ChainSeq
		}
	}
	if len(p.buf) == 0 {
		return nil, nil
	}
	cp := p.buf[0]
	return &cp, nil
}

// next consumes the checkpoint peek returned.
func (p *checkpointPager) next() { p.buf = p.buf[1:] }

// queryRow scans the one row of sql into dst (Querier has no QueryRow).
func queryRow(ctx context.Context, q Querier, sql string, dst any, args ...any) error {
	rows, err := q.Query(ctx, sql, args...)
	if err != nil {
		return err
	}
	_, err = pgx.CollectExactlyOneRow(rows, func(r pgx.CollectableRow) (struct{}, error) { return struct{}{}, r.Scan(dst) })
	return err
}
