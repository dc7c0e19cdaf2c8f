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
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
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
