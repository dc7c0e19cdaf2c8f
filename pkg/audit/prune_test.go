package audit_test

import (
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/audit"
)

func prune(t *testing.T, db *pgxpool.Pool, cutoff time.Time) int {
	t.Helper()
	var n int
	err := pgx.BeginTxFunc(t.Context(), db, pgx.TxOptions{}, func(tx pgx.Tx) error {
		var err error
		n, err = audit.Prune(t.Context(), tx, cutoff)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func count(t *testing.T, db *pgxpool.Pool, sql string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(t.Context(), sql).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// prunedSetup is 15 chained rows with checkpoints at 10 and 15, pruned
// with a cutoff between them: rows 1–9 go, the chain starts at 10.
func prunedSetup(t *testing.T) (*pgxpool.Pool, *audit.Signer) {
	t.Helper()
	db, s := setup(t, 10)
	var between time.Time
	if err := db.QueryRow(t.Context(), `SELECT clock_timestamp()`).Scan(&between); err != nil {
		t.Fatal(err)
	}
	write(t, db, 5)
	chain(t, db, 100)
	if !checkpoint(t, db, s) {
		t.Fatal("no second checkpoint")
	}
	if n := prune(t, db, between); n != 9 {
		t.Fatalf("pruned %d rows, want 9 (those below the checkpoint at 10)", n)
	}
	return db, s
}

func TestPrune(t *testing.T) {
	t.Parallel()

	t.Run("keeps the checkpoint's row and verifies from it", func(t *testing.T) {
		t.Parallel()
		db, s := prunedSetup(t)
		if got := count(t, db, `SELECT min(chain_seq) FROM audit`); got != 10 {
			t.Fatalf("the kept chain starts at %d, want 10", got)
		}
		if got := count(t, db, `SELECT count(*) FROM audit_checkpoints`); got != 2 {
			t.Fatalf("%d checkpoints kept, want 2 (10 and 15)", got)
		}
		v := verify(t, db, s.Public())
		if !v.OK || v.RecordsChecked != 6 || v.PrunedBefore != 10 || !strings.Contains(v.Reason, "before chain position 10") ||
			v.LastCheckpoint == nil || v.LastCheckpoint.ChainSeq != 15 {
			t.Fatalf("verdict %+v", v)
		}
		// Again with the same cutoff, or an older one: nothing moves.
		if n := prune(t, db, time.Unix(0, 0)); n != 0 {
			t.Fatalf("an older cutoff pruned %d", n)
		}
		a, ok, err := audit.ReadAnchor(t.Context(), db)
		if err != nil || !ok || a.ChainSeq != 10 {
			t.Fatalf("anchor %+v %v %v", a, ok, err)
		}
		// The chain goes on past the pruned part.
		write(t, db, 3)
		chain(t, db, 100)
		checkpoint(t, db, s)
		if v := verify(t, db, s.Public()); !v.OK || v.RecordsChecked != 9 || v.LastCheckpoint.ChainSeq != 18 {
			t.Fatalf("after more rows: %+v", v)
		}
		// A cutoff past everything keeps the newest checkpoint's row.
		prune(t, db, time.Now().Add(time.Hour))
		if v := verify(t, db, s.Public()); !v.OK || v.RecordsChecked != 1 || v.PrunedBefore != 18 {
			t.Fatalf("after pruning to the head: %+v", v)
		}
		write(t, db, 1)
		chain(t, db, 100)
		if got := count(t, db, `SELECT max(chain_seq) FROM audit`); got != 19 {
			t.Fatalf("the next row chained at %d, want 19", got)
		}
		if v := verify(t, db, s.Public()); !v.OK || v.RecordsChecked != 2 {
			t.Fatalf("a row after pruning to the head: %+v", v)
		}
	})

	t.Run("the anchor's record changed is found", func(t *testing.T) {
		t.Parallel()
		db, s := prunedSetup(t)
		exec(t, db, `UPDATE audit SET actor = 'someone else' WHERE chain_seq = 10`)
		wantBad(t, verify(t, db, s.Public()), idAt(t, db, 10), "does not match its hash")
	})

	t.Run("a forged anchor is found", func(t *testing.T) {
		t.Parallel()
		db, s := prunedSetup(t)
		exec(t, db, `UPDATE audit_prune_anchor SET prev_hash = sha256(prev_hash)`)
		wantBad(t, verify(t, db, s.Public()), idAt(t, db, 10), "does not match its hash")
	})

	t.Run("the anchor's checkpoint deleted is found", func(t *testing.T) {
		t.Parallel()
		db, s := prunedSetup(t)
		exec(t, db, `DELETE FROM audit_checkpoints WHERE chain_seq = 10`)
		wantBad(t, verify(t, db, s.Public()), "", "no checkpoint is at chain position 10")
	})

	t.Run("kept records deleted are still found", func(t *testing.T) {
		t.Parallel()
		db, s := prunedSetup(t)
		exec(t, db, `DELETE FROM audit WHERE chain_seq = 12`)
		wantBad(t, verify(t, db, s.Public()), idAt(t, db, 13), "chain position 12 is missing")
	})

	t.Run("the anchor moved to a later checkpoint by hand is found by its signature", func(t *testing.T) {
		t.Parallel()
		db, s := prunedSetup(t)
		// Someone deletes 10–14 and points the anchor at 15 with the right
		// previous hash: the chain from 15 verifies, and the anchor's date
		// says what went — the verdict names it.
		var prev []byte
		if err := db.QueryRow(t.Context(), `SELECT hash FROM audit WHERE chain_seq = 14`).Scan(&prev); err != nil {
			t.Fatal(err)
		}
		exec(t, db, `DELETE FROM audit WHERE chain_seq < 15`)
		exec(t, db, `UPDATE audit_prune_anchor SET chain_seq = 15, prev_hash = $1`, prev)
		v := verify(t, db, s.Public())
		if !v.OK || v.PrunedBefore != 15 || !strings.Contains(v.Reason, "pruned") {
			t.Fatalf("verdict %+v: a prune by hand shows as a prune, with its dates", v)
		}
	})

	t.Run("nothing older than the cutoff, nothing pruned", func(t *testing.T) {
		t.Parallel()
		db, s := setup(t, 4)
		if n := prune(t, db, time.Unix(0, 0)); n != 0 {
			t.Fatalf("pruned %d", n)
		}
		if _, ok, _ := audit.ReadAnchor(t.Context(), db); ok {
			t.Fatal("an anchor without pruning")
		}
		if v := verify(t, db, s.Public()); !v.OK || v.RecordsChecked != 4 || v.PrunedBefore != 0 || v.Reason != "" {
			t.Fatalf("verdict %+v", v)
		}
	})
}
