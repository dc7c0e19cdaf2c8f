package audit

// The audit hash chain.
//
// Every audit row gets a place in one chain spanning every tenant: chain_seq
// 1, 2, 3… and hash = SHA-256(previous row's hash ‖ canonical(row)), the
// first row's previous hash being 32 zero bytes. Rows are written inside
// every mutation's transaction, so chaining them there would serialize every
// mutation on the chain head; and ids come from an identity, so a row with a
// lower id can commit after a higher one. So rows are written unchained and
// one chainer at a time ([Chain], under a transaction advisory lock, run by
// the audit.chain singleton) gives the committed unchained rows the next
// positions in id order. No row is ever chained below one already chained.
//
// [Checkpoint] records the chain head in audit_checkpoints, signed with the
// audit key, and [Verify] recomputes the chain and checks every checkpoint.

import (
	"bytes"
	"cmp"
	"context"
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/keyfile"
)

// chainLock keys the transaction-scoped advisory lock under which the chain
// head is read and extended ("bcaudit" as a number): audit.chain and
// audit.checkpoint are separate singletons and may run at once, and without
// it both could read the same head. Mutations never take it.
const chainLock int64 = 0x62636175646974

// canonicalVersion is the first field of every canonical encoding, so a
// later encoding can never be confused with this one.
const canonicalVersion = "bc-audit-v1"

// CheckpointDomain starts every message a checkpoint signs. The signed
// message is CheckpointDomain, then chain_seq as 8 bytes big-endian, then
// the 32-byte head hash: see [CheckpointMessage].
const CheckpointDomain = "bettercompute audit checkpoint v1\n"

// zeroHash is the previous hash of the first row.
var zeroHash = make([]byte, sha256.Size)

// chainColumns are the columns a chained row's hash covers, then its place
// in the chain.
const chainColumns = `id, at, tenant_id, actor, actor_tenant_id, action, resource, decision, request_id, method, detail::text, chain_seq, hash`

// chainRow is an audit row as the chain sees it. Detail stays the JSON text
// PostgreSQL returns, so numbers keep every digit.
type chainRow struct {
	id                                                              int64
	at                                                              time.Time
	tenantID, actor, actorTenantID, action, resource, decision, req string
	method, detail                                                  string
	seq                                                             *int64
	hash                                                            []byte
}

func scanChainRow(r pgx.CollectableRow) (chainRow, error) {
	var x chainRow
	err := r.Scan(&x.id, &x.at, &x.tenantID, &x.actor, &x.actorTenantID, &x.action, &x.resource, &x.decision,
		&x.req, &x.method, &x.detail, &x.seq, &x.hash)
	return x, err
}

// canonical encodes r at chain position seq: each field as a 4-byte
// big-endian length and its bytes, in this order: the version
// ("bc-audit-v1"), chain_seq, id (both 8 bytes big-endian), at (UTC unix
// microseconds, 8 bytes big-endian), tenant_id, actor, actor_tenant_id,
// action, resource, decision, request_id, method, and detail as canonical
// JSON (numbers as written, object keys sorted, no spaces).
func canonical(r chainRow, seq int64) ([]byte, error) {
	detail, err := canonicalJSON(r.detail)
	if err != nil {
		return nil, fmt.Errorf("audit record %d: detail: %w", r.id, err)
	}
	var b bytes.Buffer
	field := func(p []byte) {
		b.Write(binary.BigEndian.AppendUint32(nil, uint32(len(p))))
		b.Write(p)
	}
	num := func(n int64) { field(binary.BigEndian.AppendUint64(nil, uint64(n))) }
	field([]byte(canonicalVersion))
	num(seq)
	num(r.id)
	num(r.at.UTC().UnixMicro())
	for _, s := range []string{r.tenantID, r.actor, r.actorTenantID, r.action, r.resource, r.decision, r.req, r.method} {
		field([]byte(s))
	}
	field(detail)
	return b.Bytes(), nil
}

// canonicalJSON re-encodes a JSON document with encoding/json, which sorts
// object keys; numbers are kept as written (json.Number).
func canonicalJSON(s string) ([]byte, error) {
	dec := json.NewDecoder(strings.NewReader(s))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	return json.Marshal(v)
}

// rowHash is SHA-256(prev ‖ canonical(r, seq)).
func rowHash(prev []byte, r chainRow, seq int64) ([]byte, error) {
	c, err := canonical(r, seq)
	if err != nil {
		return nil, err
	}
	h := sha256.New()
	h.Write(prev)
	h.Write(c)
	return h.Sum(nil), nil
}

// lockChain takes the chain's advisory lock until tx ends.
func lockChain(ctx context.Context, tx pgx.Tx) error {
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, chainLock); err != nil {
		return fmt.Errorf("lock audit chain: %w", err)
	}
	return nil
}

// head returns the newest chained row's position and hash (0 and the zero
// hash when nothing is chained). The unique index on chain_seq answers it
// from its end.
func head(ctx context.Context, q Querier) (int64, []byte, error) {
	rows, err := q.Query(ctx, `SELECT chain_seq, hash FROM audit WHERE chain_seq IS NOT NULL ORDER BY chain_seq DESC LIMIT 1`)
	if err != nil {
		return 0, nil, fmt.Errorf("read audit chain head: %w", err)
	}
	type hd struct {
		Seq  int64
		Hash []byte
	}
	h, err := pgx.CollectExactlyOneRow(rows, pgx.RowToStructByPos[hd])
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, zeroHash, nil
	}
	if err != nil {
		return 0, nil, fmt.Errorf("read audit chain head: %w", err)
	}
	return h.Seq, h.Hash, nil
}

// Chain gives up to limit committed, unchained audit rows the next chain
// positions, in id order, and their hashes, and returns how many it
// chained. It takes the chain's advisory lock for the rest of tx, so
// chainers never interleave; a full batch means more may be waiting.
func Chain(ctx context.Context, tx pgx.Tx, limit int) (int, error) {
	if err := lockChain(ctx, tx); err != nil {
		return 0, err
	}
	seq, prev, err := head(ctx, tx)
	if err != nil {
		return 0, err
	}
	// audit_unchained (id) WHERE chain_seq IS NULL serves this scan in
	// order, so it never walks the chained rows.
	rows, err := tx.Query(ctx, `SELECT `+chainColumns+` FROM audit WHERE chain_seq IS NULL ORDER BY id LIMIT $1 FOR UPDATE`, limit)
	if err != nil {
		return 0, fmt.Errorf("read unchained audit rows: %w", err)
	}
	batch, err := pgx.CollectRows(rows, scanChainRow)
	if err != nil {
		return 0, fmt.Errorf("read unchained audit rows: %w", err)
	}
	if len(batch) == 0 {
		return 0, nil
	}
	ids := make([]int64, len(batch))
	seqs := make([]int64, len(batch))
	hashes := make([][]byte, len(batch))
	for i, r := range batch {
		seq++
		h, err := rowHash(prev, r, seq)
		if err != nil {
			return 0, err
		}
		ids[i], seqs[i], hashes[i], prev = r.id, seq, h, h
	}
	_, err = tx.Exec(ctx, `
		UPDATE audit AS a SET chain_seq = u.seq, hash = u.hash
		  FROM unnest($1::bigint[], $2::bigint[], $3::bytea[]) AS u(id, seq, hash)
		 WHERE a.id = u.id`, ids, seqs, hashes)
	if err != nil {
		return 0, fmt.Errorf("chain audit rows: %w", err)
	}
	return len(batch), nil
}

// CheckpointMessage is what a checkpoint's signature covers:
// [CheckpointDomain], chain_seq as 8 bytes big-endian, then head_hash.
func CheckpointMessage(chainSeq int64, headHash []byte) []byte {
	m := []byte(CheckpointDomain)
	m = binary.BigEndian.AppendUint64(m, uint64(chainSeq))
	return append(m, headHash...)
}

// FirstCheckpoint is [Checkpoint] only while there is no checkpoint at all:
// audit.chain calls it, so a new log is covered (newest rows deleted are
// caught) from its first chained rows, not an audit.checkpointEvery later.
func FirstCheckpoint(ctx context.Context, tx pgx.Tx, signer *Signer) (bool, error) {
	var exists bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM audit_checkpoints)`).Scan(&exists); err != nil {
		return false, fmt.Errorf("read audit checkpoints: %w", err)
	}
	if exists {
		return false, nil
	}
	return Checkpoint(ctx, tx, signer)
}

// Checkpoint records the chain head in audit_checkpoints when the chain has
// grown since the newest checkpoint, signed by signer (an Ed25519 signature
// over [CheckpointMessage]); with a nil signer the row has no signature and
// an empty key_id. It reports whether it wrote one. Chain first for a
// checkpoint of everything committed.
func Checkpoint(ctx context.Context, tx pgx.Tx, signer *Signer) (bool, error) {
	if err := lockChain(ctx, tx); err != nil {
		return false, err
	}
	seq, hash, err := head(ctx, tx)
	if err != nil || seq == 0 {
		return false, err
	}
	var last int64
	if err := tx.QueryRow(ctx, `SELECT coalesce(max(chain_seq), 0) FROM audit_checkpoints`).Scan(&last); err != nil {
		return false, fmt.Errorf("read audit checkpoints: %w", err)
	}
	// A head at or below the newest checkpoint has not moved (or rows were
	// deleted, which that checkpoint will show).
	if seq <= last {
		return false, nil
	}
	var sig []byte
	keyID := ""
	if signer != nil {
		sig, keyID = signer.sign(seq, hash), signer.KeyID()
	}
	_, err = tx.Exec(ctx, `INSERT INTO audit_checkpoints (chain_seq, head_hash, signature, key_id) VALUES ($1, $2, $3, $4)`,
		seq, hash, sig, keyID)
	if err != nil {
		return false, fmt.Errorf("write audit checkpoint: %w", err)
	}
	return true, nil
}

// --- the audit key ---

// Signer is the audit key: the Ed25519 key checkpoints are signed with.
// Verifiers need only its public half.
type Signer struct {
	key   ed25519.PrivateKey
	keyID string
}

// KeyID returns the key id of pub: hex of the first 8 bytes of its SHA-256
// (16 hex digits), as audit_checkpoints.key_id records it.
func KeyID(pub ed25519.PublicKey) string {
	sum := sha256.Sum256(pub)
	return hex.EncodeToString(sum[:8])
}

// NewSigner wraps key.
func NewSigner(key ed25519.PrivateKey) *Signer {
	return &Signer{key: key, keyID: KeyID(key.Public().(ed25519.PublicKey))}
}

// KeyID returns the key's id (see the function [KeyID]).
func (s *Signer) KeyID() string { return s.keyID }

// Public returns the public key that verifies checkpoints.
func (s *Signer) Public() ed25519.PublicKey { return s.key.Public().(ed25519.PublicKey) }

func (s *Signer) sign(chainSeq int64, headHash []byte) []byte {
	return ed25519.Sign(s.key, CheckpointMessage(chainSeq, headHash))
}

// LoadSigner reads an Ed25519 private key from a PEM file ("PRIVATE KEY",
// PKCS #8). A missing or unreadable file, or another key type, is
// INVALID_CONFIG "audit.signingKeyFile".
func LoadSigner(path string) (*Signer, error) {
	key, err := keyfile.LoadEd25519(path, "audit.signingKeyFile", "audit key")
	if err != nil {
		return nil, err
	}
	return NewSigner(key), nil
}

// EnsureSigner loads the key at path, generating it (mode 0600) first when
// the file does not exist: the dev control plane's key.
func EnsureSigner(path string) (*Signer, error) {
	key, err := keyfile.EnsureEd25519(path, "audit.signingKeyFile", "audit key")
	if err != nil {
		return nil, err
	}
	return NewSigner(key), nil
}

// --- verification ---

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
