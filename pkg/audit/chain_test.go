package audit_test

import (
	"crypto/ed25519"
	"crypto/rand"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/audit"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// record is the i-th test row.
func record(i int) audit.Record {
	return audit.Record{
		TenantID: "root", Actor: fmt.Sprintf("idn_%d", i), ActorTenantID: "root", Action: "compute:pools:create",
		Resource: fmt.Sprintf(`Pool::"pool_%d"`, i), RequestID: fmt.Sprintf("req-%d", i),
		Method: "/bettercompute.compute.v1.PoolsService/Create",
		Detail: map[string]any{"name": fmt.Sprintf("p%d", i), "nested": map[string]any{"b": 2, "a": []any{1, "x"}}},
	}
}

// write appends n rows, each in its own transaction.
func write(t *testing.T, db *pgxpool.Pool, n int) {
	t.Helper()
	for i := range n {
		if err := audit.Write(t.Context(), db, record(i)); err != nil {
			t.Fatal(err)
		}
	}
}

// chain chains everything committed, in batches of limit, and returns how
// many rows it chained.
func chain(t *testing.T, db *pgxpool.Pool, limit int) int {
	t.Helper()
	total := 0
	for {
		var n int
		err := pgx.BeginTxFunc(t.Context(), db, pgx.TxOptions{}, func(tx pgx.Tx) error {
			var err error
			n, err = audit.Chain(t.Context(), tx, limit)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		total += n
		if n < limit {
			return total
		}
	}
}

func checkpoint(t *testing.T, db *pgxpool.Pool, s *audit.Signer) bool {
	t.Helper()
	var wrote bool
	err := pgx.BeginTxFunc(t.Context(), db, pgx.TxOptions{}, func(tx pgx.Tx) error {
		var err error
		wrote, err = audit.Checkpoint(t.Context(), tx, s)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return wrote
}

func verify(t *testing.T, db *pgxpool.Pool, pub ed25519.PublicKey) audit.Verdict {
	t.Helper()
	v, err := audit.Verify(t.Context(), db, pub)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func exec(t *testing.T, db *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	if _, err := db.Exec(t.Context(), sql, args...); err != nil {
		t.Fatal(err)
	}
}

// idAt returns the id of the row at chain position seq.
func idAt(t *testing.T, db *pgxpool.Pool, seq int) string {
	t.Helper()
	var id int64
	if err := db.QueryRow(t.Context(), `SELECT id FROM audit WHERE chain_seq = $1`, seq).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return strconv.FormatInt(id, 10)
}

func newSigner(t *testing.T) *audit.Signer {
	t.Helper()
	_, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return audit.NewSigner(key)
}

// setup is a database with n chained rows and a signed checkpoint of them.
func setup(t *testing.T, n int) (*pgxpool.Pool, *audit.Signer) {
	t.Helper()
	db := pgtest.New(t)
	s := newSigner(t)
	write(t, db, n)
	if got := chain(t, db, 100); got != n {
		t.Fatalf("chained %d rows, want %d", got, n)
	}
	if !checkpoint(t, db, s) {
		t.Fatal("no checkpoint written")
	}
	if v := verify(t, db, s.Public()); !v.OK || v.RecordsChecked != int64(n) {
		t.Fatalf("untouched chain: %+v", v)
	}
	return db, s
}

func wantBad(t *testing.T, v audit.Verdict, id, reason string) {
	t.Helper()
	if v.OK || v.FirstBadID != id || !strings.Contains(v.Reason, reason) {
		t.Fatalf("verdict %+v, want not ok naming %q with a reason containing %q", v, id, reason)
	}
}

func TestChainWhileWritersCommit(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	const writers, txs = 8, 30
	var wg sync.WaitGroup
	done := make(chan struct{})
	errs := make(chan error, writers+1)
	for w := range writers {
		wg.Go(func() {
			for i := range txs {
				// 1 to 3 rows per transaction, as a mutation writes.
				err := pgx.BeginTxFunc(t.Context(), db, pgx.TxOptions{}, func(tx pgx.Tx) error {
					for k := range 1 + (w+i)%3 {
						if err := audit.Write(t.Context(), tx, record(w*1000+i*10+k)); err != nil {
							return err
						}
					}
					return nil
				})
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	var chainer sync.WaitGroup
	chainer.Go(func() {
		for {
			select {
			case <-done:
				return
			default:
			}
			err := pgx.BeginTxFunc(t.Context(), db, pgx.TxOptions{}, func(tx pgx.Tx) error {
				_, err := audit.Chain(t.Context(), tx, 7)
				return err
			})
			if err != nil {
				errs <- err
				return
			}
		}
	})
	wg.Wait()
	close(done)
	chainer.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	chain(t, db, 7)

	var total, chained, distinct, lo, hi int64
	err := db.QueryRow(t.Context(), `SELECT count(*), count(chain_seq), count(DISTINCT chain_seq), coalesce(min(chain_seq), 0), coalesce(max(chain_seq), 0) FROM audit`).
		Scan(&total, &chained, &distinct, &lo, &hi)
	if err != nil {
		t.Fatal(err)
	}
	if total == 0 || chained != total || distinct != total || lo != 1 || hi != total {
		t.Fatalf("%d rows: %d chained, %d distinct positions from %d to %d; want every row once at 1..%d", total, chained, distinct, lo, hi, total)
	}
	if v := verify(t, db, nil); !v.OK || v.RecordsChecked != total || v.Unchained != 0 {
		t.Fatalf("verdict %+v", v)
	}
}

func TestChainTakesALowerIDCommittedLater(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	slow, err := db.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = slow.Rollback(t.Context()) }()
	if err := audit.Write(t.Context(), slow, record(1)); err != nil { // takes the lower id
		t.Fatal(err)
	}
	write(t, db, 1)
	if n := chain(t, db, 10); n != 1 {
		t.Fatalf("chained %d rows, want the committed one", n)
	}
	if v := verify(t, db, nil); !v.OK || v.RecordsChecked != 1 || v.Unchained != 0 {
		t.Fatalf("verdict %+v", v)
	}
	if err := slow.Commit(t.Context()); err != nil {
		t.Fatal(err)
	}
	if v := verify(t, db, nil); !v.OK || v.Unchained != 1 {
		t.Fatalf("verdict %+v, want ok with 1 unchained", v)
	}
	if n := chain(t, db, 10); n != 1 {
		t.Fatalf("chained %d rows, want the late one", n)
	}
	var lowSeq, highSeq int64
	if err := db.QueryRow(t.Context(), `SELECT min(chain_seq) FILTER (WHERE id = (SELECT min(id) FROM audit)),
		max(chain_seq) FILTER (WHERE id = (SELECT max(id) FROM audit)) FROM audit`).Scan(&lowSeq, &highSeq); err != nil {
		t.Fatal(err)
	}
	if lowSeq != 2 || highSeq != 1 {
		t.Fatalf("lower id at position %d, higher at %d; want 2 and 1 (no row chained below a chained one)", lowSeq, highSeq)
	}
	if v := verify(t, db, nil); !v.OK || v.RecordsChecked != 2 {
		t.Fatalf("verdict %+v", v)
	}
}

func TestVerifyFindsAChangedRecord(t *testing.T) {
	t.Parallel()
	for name, stmt := range map[string]string{
		"detail":    `UPDATE audit SET detail = '{"name": "forged"}' WHERE chain_seq = 7`,
		"actor":     `UPDATE audit SET actor = 'idn_someone_else' WHERE chain_seq = 7`,
		"time":      `UPDATE audit SET at = at - interval '1 microsecond' WHERE chain_seq = 7`,
		"decision":  `UPDATE audit SET decision = 'deny' WHERE chain_seq = 7`,
		"hash":      `UPDATE audit SET hash = sha256(hash) WHERE chain_seq = 7`,
		"no hash":   `UPDATE audit SET hash = NULL WHERE chain_seq = 7`,
		"nested":    `UPDATE audit SET detail = jsonb_set(detail, '{nested,b}', '3') WHERE chain_seq = 7`,
		"big digit": `UPDATE audit SET detail = '{"n": 12345678901234567891, "nested": {"b": 2}}' WHERE chain_seq = 7`,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db, s := pgtest.New(t), newSigner(t)
			write(t, db, 12)
			// A number float64 cannot tell from its neighbour: detail keeps
			// every digit, so changing the last one is caught.
			exec(t, db, `UPDATE audit SET detail = '{"n": 12345678901234567890, "nested": {"b": 2}}' WHERE id = (SELECT min(id) + 6 FROM audit)`)
			chain(t, db, 5)
			checkpoint(t, db, s)
			if v := verify(t, db, s.Public()); !v.OK {
				t.Fatalf("untouched: %+v", v)
			}
			id := idAt(t, db, 7)
			exec(t, db, stmt)
			v := verify(t, db, s.Public())
			wantBad(t, v, id, "record "+id+" (chain position 7) does not match its hash")
			if v.RecordsChecked != 7 {
				t.Fatalf("checked %d records, want 7 (stops at the bad one)", v.RecordsChecked)
			}
		})
	}

	t.Run("key order and spacing of detail do not matter", func(t *testing.T) {
		t.Parallel()
		db, s := setup(t, 5)
		exec(t, db, `UPDATE audit SET detail = '{ "nested": {"a": [1, "x"], "b": 2},  "name": "p2" }' WHERE chain_seq = 3`)
		if v := verify(t, db, s.Public()); !v.OK {
			t.Fatalf("verdict %+v", v)
		}
	})
}

func TestVerifyFindsDeletedRecords(t *testing.T) {
	t.Parallel()

	t.Run("a middle record", func(t *testing.T) {
		t.Parallel()
		db, s := setup(t, 10)
		next := idAt(t, db, 5)
		exec(t, db, `DELETE FROM audit WHERE chain_seq = 4`)
		wantBad(t, verify(t, db, s.Public()), next, "chain position 4 is missing")
	})

	t.Run("a middle record, the positions closed up", func(t *testing.T) {
		t.Parallel()
		db, s := setup(t, 10)
		next := idAt(t, db, 5)
		exec(t, db, `DELETE FROM audit WHERE chain_seq = 4`)
		exec(t, db, `UPDATE audit SET chain_seq = -chain_seq WHERE chain_seq > 4`)
		exec(t, db, `UPDATE audit SET chain_seq = -chain_seq - 1 WHERE chain_seq < 0`)
		wantBad(t, verify(t, db, s.Public()), next, "does not match its hash")
	})

	t.Run("the first record", func(t *testing.T) {
		t.Parallel()
		db, s := setup(t, 3)
		next := idAt(t, db, 2)
		exec(t, db, `DELETE FROM audit WHERE chain_seq = 1`)
		wantBad(t, verify(t, db, s.Public()), next, "chain position 1 is missing")
	})

	t.Run("the newest records, against the checkpoint", func(t *testing.T) {
		t.Parallel()
		db, s := setup(t, 10)
		exec(t, db, `DELETE FROM audit WHERE chain_seq > 7`)
		v := verify(t, db, s.Public())
		wantBad(t, v, "", "records after chain position 7 were deleted; the checkpoint at chain position 10")
		if v.RecordsChecked != 7 {
			t.Fatalf("checked %d, want 7", v.RecordsChecked)
		}
	})

	t.Run("the newest records, then new ones chained in their place", func(t *testing.T) {
		t.Parallel()
		db, s := setup(t, 10)
		exec(t, db, `DELETE FROM audit WHERE chain_seq > 7`)
		write(t, db, 3)
		chain(t, db, 10)
		wantBad(t, verify(t, db, s.Public()), idAt(t, db, 10), "the checkpoint at chain position 10")
	})

	t.Run("every record", func(t *testing.T) {
		t.Parallel()
		db, s := setup(t, 4)
		exec(t, db, `DELETE FROM audit`)
		wantBad(t, verify(t, db, s.Public()), "", "records after chain position 0 were deleted")
	})
}

func TestCheckpoints(t *testing.T) {
	t.Parallel()

	t.Run("signed, only when the head moved", func(t *testing.T) {
		t.Parallel()
		db := pgtest.New(t)
		s := newSigner(t)
		if checkpoint(t, db, s) {
			t.Fatal("a checkpoint of an empty chain")
		}
		write(t, db, 3)
		chain(t, db, 10)
		if !checkpoint(t, db, s) || checkpoint(t, db, s) {
			t.Fatal("want one checkpoint of an unchanged head")
		}
		var seq int64
		var head, sig []byte
		var keyID string
		if err := db.QueryRow(t.Context(), `SELECT chain_seq, head_hash, signature, key_id FROM audit_checkpoints`).Scan(&seq, &head, &sig, &keyID); err != nil {
			t.Fatal(err)
		}
		if seq != 3 || keyID != s.KeyID() || len(keyID) != 16 || !ed25519.Verify(s.Public(), audit.CheckpointMessage(seq, head), sig) {
			t.Fatalf("checkpoint %d %x %x %q", seq, head, sig, keyID)
		}
		v := verify(t, db, s.Public())
		if !v.OK || !v.SignaturesChecked || v.Reason != "" || v.LastCheckpoint == nil || v.LastCheckpoint.ChainSeq != 3 {
			t.Fatalf("verdict %+v", v)
		}
	})

	t.Run("a wrong public key is a signature mismatch", func(t *testing.T) {
		t.Parallel()
		db, _ := setup(t, 4)
		other := newSigner(t)
		wantBad(t, verify(t, db, other.Public()), "", "signature")
	})

	t.Run("a forged signature is a signature mismatch", func(t *testing.T) {
		t.Parallel()
		db, s := setup(t, 4)
		exec(t, db, `UPDATE audit_checkpoints SET signature = sha512(signature)`)
		wantBad(t, verify(t, db, s.Public()), "", "signature (key "+s.KeyID()+") does not verify")
	})

	t.Run("a rewritten checkpoint names the record", func(t *testing.T) {
		t.Parallel()
		db, s := setup(t, 4)
		exec(t, db, `UPDATE audit_checkpoints SET head_hash = sha256(head_hash)`)
		wantBad(t, verify(t, db, s.Public()), idAt(t, db, 4), "the checkpoint at chain position 4")
	})

	t.Run("unsigned without a signer", func(t *testing.T) {
		t.Parallel()
		db := pgtest.New(t)
		write(t, db, 3)
		chain(t, db, 10)
		if !checkpoint(t, db, nil) {
			t.Fatal("no checkpoint")
		}
		var sig []byte
		var keyID string
		if err := db.QueryRow(t.Context(), `SELECT signature, key_id FROM audit_checkpoints`).Scan(&sig, &keyID); err != nil {
			t.Fatal(err)
		}
		if sig != nil || keyID != "" {
			t.Fatalf("signature %x key %q, want none", sig, keyID)
		}
		v := verify(t, db, nil)
		if !v.OK || v.SignaturesChecked || !strings.Contains(v.Reason, "signatures were not checked") || v.LastCheckpoint.ChainSeq != 3 {
			t.Fatalf("verdict %+v", v)
		}

		// The key configured later: the early unsigned checkpoint passes,
		// said so; one unsigned after a signed one does not.
		s := newSigner(t)
		write(t, db, 2)
		chain(t, db, 10)
		checkpoint(t, db, s)
		v = verify(t, db, s.Public())
		if !v.OK || !strings.Contains(v.Reason, "1 early checkpoints are unsigned") || v.LastCheckpoint.ChainSeq != 5 {
			t.Fatalf("verdict %+v", v)
		}
		write(t, db, 1)
		chain(t, db, 10)
		checkpoint(t, db, nil)
		wantBad(t, verify(t, db, s.Public()), "", "the checkpoint at chain position 6 is unsigned, but an earlier one is signed")
	})
}

func TestVerifyPages(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	s := newSigner(t)
	// 2,600 rows over three pages, a checkpoint every 100 (more than a
	// page of checkpoints would be 1,000: a few dozen show the merge).
	exec(t, db, `INSERT INTO audit (tenant_id, actor, action, resource, detail)
		SELECT 'root', 'idn_' || i, 'compute:pools:create', 'Pool::"p' || i || '"', jsonb_build_object('i', i)
		  FROM generate_series(1, 2600) AS i`)
	for range 26 {
		err := pgx.BeginTxFunc(t.Context(), db, pgx.TxOptions{}, func(tx pgx.Tx) error {
			if _, err := audit.Chain(t.Context(), tx, 100); err != nil {
				return err
			}
			_, err := audit.Checkpoint(t.Context(), tx, s)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	v := verify(t, db, s.Public())
	if !v.OK || v.RecordsChecked != 2600 || v.LastCheckpoint.ChainSeq != 2600 || v.Unchained != 0 {
		t.Fatalf("verdict %+v", v)
	}
	id := idAt(t, db, 2345)
	exec(t, db, `UPDATE audit SET resource = 'Pool::"elsewhere"' WHERE chain_seq = 2345`)
	v = verify(t, db, s.Public())
	wantBad(t, v, id, "chain position 2345")
	if v.LastCheckpoint.ChainSeq != 2300 {
		t.Fatalf("last checkpoint %d, want 2300", v.LastCheckpoint.ChainSeq)
	}
}

func TestReconcilers(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	s := newSigner(t)
	rt, err := reconcile.New(db, nil, reconcile.Config{Roles: []string{reconcile.RoleControllers}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rt.Stop)
	for _, r := range audit.Reconcilers(audit.Config{Signer: s}) {
		if err := rt.Register(r); err != nil {
			t.Fatal(err)
		}
	}
	write(t, db, 5)
	tick := func(name string) {
		t.Helper()
		if err := workqueue.Enqueue(t.Context(), db, name, "all"); err != nil {
			t.Fatal(err)
		}
		if tr, err := rt.Jobs()[name].Tick(t.Context()); err != nil || tr.Done != 1 {
			t.Fatalf("tick %s: %+v %v", name, tr, err)
		}
	}
	tick(audit.ChainName)
	// The first chained rows get the first checkpoint at once.
	if v := verify(t, db, s.Public()); !v.OK || v.RecordsChecked != 5 || v.LastCheckpoint == nil || v.LastCheckpoint.ChainSeq != 5 {
		t.Fatalf("after audit.chain: %+v", v)
	}
	// Later ones wait for audit.checkpoint.
	write(t, db, 2)
	tick(audit.ChainName)
	if v := verify(t, db, s.Public()); !v.OK || v.RecordsChecked != 7 || v.LastCheckpoint == nil || v.LastCheckpoint.ChainSeq != 5 {
		t.Fatalf("after a second audit.chain: %+v", v)
	}
	tick(audit.CheckpointName)
	v := verify(t, db, s.Public())
	if !v.OK || v.RecordsChecked != 7 || v.LastCheckpoint == nil || v.LastCheckpoint.ChainSeq != 7 || v.LastCheckpoint.KeyID != s.KeyID() {
		t.Fatalf("after audit.checkpoint: %+v", v)
	}
}

func TestSigner(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "pki", "audit.key")
	made, err := audit.EnsureSigner(path)
	if err != nil {
		t.Fatal(err)
	}
	again, err := audit.EnsureSigner(path)
	if err != nil || again.KeyID() != made.KeyID() || !again.Public().Equal(made.Public()) {
		t.Fatalf("reloaded %v %v, want the same key", again, err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("key file %v %v, want mode 0600", fi, err)
	}
	if made.KeyID() != audit.KeyID(made.Public()) || len(made.KeyID()) != 16 {
		t.Fatalf("key id %q", made.KeyID())
	}
	bad := filepath.Join(dir, "bad.key")
	if err := os.WriteFile(bad, []byte("not a key"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{filepath.Join(dir, "missing.key"), bad} {
		if _, err := audit.LoadSigner(p); fault.CodeOf(err) != fault.InvalidConfig || !strings.Contains(err.Error(), "audit.signingKeyFile") {
			t.Fatalf("LoadSigner(%s): %v, want INVALID_CONFIG audit.signingKeyFile", p, err)
		}
	}
}
