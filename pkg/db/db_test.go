package db_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestInTxRetriesASerializationFailure(t *testing.T) {
	t.Parallel()
	pool := pgtest.New(t)
	ctx := t.Context()
	if _, err := pool.Exec(ctx, `CREATE TABLE counter (id int PRIMARY KEY, n int NOT NULL); INSERT INTO counter VALUES (1, 0)`); err != nil {
		t.Fatal(err)
	}
	attempts := 0
	err := db.InTx(ctx, pool, db.TxOptions{TxOptions: pgx.TxOptions{IsoLevel: pgx.RepeatableRead}}, func(tx pgx.Tx) error {
		attempts++
		var n int
		if err := tx.QueryRow(ctx, `SELECT n FROM counter WHERE id = 1`).Scan(&n); err != nil {
			return err
		}
		if attempts == 1 {
			// Another writer commits after our snapshot was taken.
			if _, err := pool.Exec(ctx, `UPDATE counter SET n = n + 10 WHERE id = 1`); err != nil {
				return err
			}
		}
		_, err := tx.Exec(ctx, `UPDATE counter SET n = $1 WHERE id = 1`, n+1)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if attempts != 2 {
		t.Fatalf("attempts = %d, want 2 (one serialization failure, one success)", attempts)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT n FROM counter`).Scan(&n); err != nil || n != 11 {
		t.Fatalf("n = %d, %v: the retry must see the other writer's update", n, err)
	}
}

func TestInTxOutcomes(t *testing.T) {
	t.Parallel()
	pool := pgtest.New(t)
	ctx := t.Context()
	if _, err := pool.Exec(ctx, `CREATE TABLE t (v text)`); err != nil {
		t.Fatal(err)
	}

	t.Run("deadlock is retried", func(t *testing.T) {
		attempts := 0
		err := db.InTx(ctx, pool, db.TxOptions{}, func(tx pgx.Tx) error {
			attempts++
			if _, err := tx.Exec(ctx, `INSERT INTO t VALUES ('deadlock')`); err != nil {
				return err
			}
			if attempts < 3 {
				return &pgconn.PgError{Code: db.DeadlockDetected}
			}
			return nil
		})
		if err != nil || attempts != 3 {
			t.Fatalf("err=%v attempts=%d", err, attempts)
		}
		var rows int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM t WHERE v = 'deadlock'`).Scan(&rows)
		if rows != 1 {
			t.Fatalf("rows = %d: failed attempts must roll back", rows)
		}
	})

	t.Run("other errors roll back and return at once", func(t *testing.T) {
		attempts := 0
		boom := errors.New("boom")
		err := db.InTx(ctx, pool, db.TxOptions{}, func(tx pgx.Tx) error {
			attempts++
			_, _ = tx.Exec(ctx, `INSERT INTO t VALUES ('boom')`)
			return boom
		})
		if !errors.Is(err, boom) || attempts != 1 {
			t.Fatalf("err=%v attempts=%d", err, attempts)
		}
		var rows int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM t WHERE v = 'boom'`).Scan(&rows)
		if rows != 0 {
			t.Fatalf("rows = %d: the failed transaction committed", rows)
		}
	})

	t.Run("attempts are bounded", func(t *testing.T) {
		attempts := 0
		err := db.InTx(ctx, pool, db.TxOptions{MaxAttempts: 3}, func(pgx.Tx) error {
			attempts++
			return &pgconn.PgError{Code: db.SerializationFailure}
		})
		if !db.Retryable(err) || attempts != 3 {
			t.Fatalf("err=%v attempts=%d", err, attempts)
		}
	})

	t.Run("a cancelled context stops retrying", func(t *testing.T) {
		cctx, cancel := context.WithCancel(ctx)
		attempts := 0
		err := db.InTx(cctx, pool, db.TxOptions{}, func(pgx.Tx) error {
			attempts++
			cancel()
			return &pgconn.PgError{Code: db.SerializationFailure}
		})
		if !errors.Is(err, context.Canceled) || attempts != 1 {
			t.Fatalf("err=%v attempts=%d", err, attempts)
		}
	})
}

func TestOpen(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDB(t)
	for _, bouncer := range []bool{false, true} {
		pool, err := db.Open(t.Context(), db.Config{URL: url, MaxConns: 2, PgBouncer: bouncer})
		if err != nil {
			t.Fatal(err)
		}
		var name string
		if err := pool.QueryRow(t.Context(), `SELECT current_setting('application_name')`).Scan(&name); err != nil || name != "better-compute" {
			t.Errorf("application_name = %q, %v", name, err)
		}
		if pool.Config().MaxConns != 2 {
			t.Errorf("MaxConns = %d", pool.Config().MaxConns)
		}
		pool.Close()
	}

	_, err := db.Open(t.Context(), db.Config{URL: "postgres://bc:secret@127.0.0.1:1/none?connect_timeout=1"})
	if err == nil || strings.Contains(err.Error(), "secret") {
		t.Fatalf("Open on a closed port = %v (and must not leak the password)", err)
	}
}

// TestIdleInTransactionTimeout: a transaction left idle past the timeout
// (its process paused) is ended by the server and its row lock released,
// so another session's write goes through; through PgBouncer nothing is
// sent (it refuses startup parameters).
func TestIdleInTransactionTimeout(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	url := pgtest.NewDB(t)
	pool, err := db.Open(ctx, db.Config{URL: url, MaxConns: 3, IdleInTransactionTimeout: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var setting string
	if err := pool.QueryRow(ctx, `SELECT current_setting('idle_in_transaction_session_timeout')`).Scan(&setting); err != nil || setting != "500ms" {
		t.Fatalf("idle_in_transaction_session_timeout = %q, %v", setting, err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE t (id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 0)`); err != nil {
		t.Fatal(err)
	}
	stuck, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Returns its connection to the pool, or pool.Close waits forever.
	defer func() { _ = stuck.Rollback(context.Background()) }()
	if _, err := stuck.Exec(ctx, `UPDATE t SET v = 1 WHERE id = 1`); err != nil {
		t.Fatal(err)
	}
	// The stuck transaction holds the row; another write waits for the
	// server to end it.
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if _, err := pool.Exec(wctx, `UPDATE t SET v = 2 WHERE id = 1`); err != nil {
		t.Fatalf("a write behind a transaction left idle: %v", err)
	}
	sctx, scancel := context.WithTimeout(ctx, 10*time.Second)
	defer scancel()
	if _, err := stuck.Exec(sctx, `SELECT 1`); err == nil {
		t.Fatal("the idle transaction survived its timeout")
	}
	var v int
	if err := pool.QueryRow(ctx, `SELECT v FROM t WHERE id = 1`).Scan(&v); err != nil || v != 2 {
		t.Fatalf("v = %d (%v), want 2: the idle transaction's write must be rolled back", v, err)
	}

	bounced, err := db.Open(ctx, db.Config{URL: url, MaxConns: 1, PgBouncer: true, IdleInTransactionTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer bounced.Close()
	if err := bounced.QueryRow(ctx, `SELECT current_setting('idle_in_transaction_session_timeout')`).Scan(&setting); err != nil || setting == "1s" {
		t.Fatalf("through PgBouncer the setting must not be sent: %q, %v", setting, err)
	}
}
