// Package db opens Better Compute's PostgreSQL pool and runs transactions that
// retry on serialization failures and deadlocks.
//
// Nothing here keeps session state between transactions (no session advisory
// locks, no named prepared statements when [Config.PgBouncer] is set), so all
// access works behind PgBouncer in transaction mode.
package db

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Config says how to reach PostgreSQL.
type Config struct {
	// URL is a libpq connection URL or DSN (postgres://user@host:5432/db).
	URL string
	// MaxConns caps the pool; 0 keeps pgx's default (max(4, NumCPU)).
	MaxConns int32
	// PgBouncer selects a query mode that uses no named prepared statements,
	// for PgBouncer in transaction mode.
	PgBouncer bool
	// ApplicationName is reported in pg_stat_activity; empty means
	// "better-compute".
	ApplicationName string
	// Tracer, when set, sees every query (tests count statements with it).
	Tracer pgx.QueryTracer
	// IdleInTransactionTimeout, when set, is sent as the session's
	// idle_in_transaction_session_timeout (not through PgBouncer, which
	// refuses startup parameters): a transaction left idle that long — its
	// process paused or stuck — is ended by the server, and its locks with it.
	IdleInTransactionTimeout time.Duration
}

// Open builds a pool and checks that the server answers.
func Open(ctx context.Context, cfg Config) (*pgxpool.Pool, error) {
	pc, err := pgxpool.ParseConfig(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("parse database url: %w", err)
	}
	if cfg.MaxConns > 0 {
		pc.MaxConns = cfg.MaxConns
	}
	if cfg.PgBouncer {
		pc.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
	}
	if cfg.Tracer != nil {
		pc.ConnConfig.Tracer = cfg.Tracer
	}
	if t := cfg.IdleInTransactionTimeout; t > 0 && !cfg.PgBouncer {
		if _, ok := pc.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"]; !ok {
			pc.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"] = strconv.FormatInt(max(t.Milliseconds(), 1), 10)
		}
	}
	if _, ok := pc.ConnConfig.RuntimeParams["application_name"]; !ok {
		name := cfg.ApplicationName
		if name == "" {
			name = "better-compute"
		}
		pc.ConnConfig.RuntimeParams["application_name"] = name
	}
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("open database pool: %w", err)
	}
	pingCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := pool.Ping(pingCtx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("connect to %s: %w", Redact(cfg.URL), err)
	}
	return pool, nil
}

// Redact returns url with any password replaced by "xxxxx", for logs.
func Redact(url string) string {
	pc, err := pgconn.ParseConfig(url)
	if err != nil || pc.Password == "" {
		return url
	}
	// pgconn has no un-parser; keep the shape recognisable without the secret.
	return fmt.Sprintf("postgres://%s:xxxxx@%s:%d/%s", pc.User, pc.Host, pc.Port, pc.Database)
}

// Beginner is what [InTx] needs: a pool, a connection or a transaction (which
// then opens a savepoint).
type Beginner interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// TxOptions tunes [InTx].
type TxOptions struct {
	pgx.TxOptions
	// MaxAttempts bounds retries of serialization failures and deadlocks;
	// 0 means 10.
	MaxAttempts int
}

// InTx runs fn in a transaction and commits it. When the transaction fails
// with a serialization failure (40001) or a deadlock (40P01), at fn or at
// commit, it is rolled back and fn runs again in a new transaction after a
// short jittered back-off, up to MaxAttempts times. fn must therefore have no
// effects outside the transaction.
func InTx(ctx context.Context, db Beginner, opts TxOptions, fn func(pgx.Tx) error) error {
	attempts := opts.MaxAttempts
	if attempts <= 0 {
		attempts = 10
	}
	backoff := 2 * time.Millisecond
	for attempt := 1; ; attempt++ {
		err := runTx(ctx, db, opts.TxOptions, fn)
		if err == nil || !Retryable(err) || attempt >= attempts {
			return err
		}
		sleep := backoff/2 + rand.N(backoff)
		select {
		case <-ctx.Done():
			return errors.Join(err, ctx.Err())
		case <-time.After(sleep):
		}
		backoff = min(backoff*2, 500*time.Millisecond)
	}
}

func runTx(ctx context.Context, db Beginner, opts pgx.TxOptions, fn func(pgx.Tx) error) (err error) {
	tx, err := db.BeginTx(ctx, opts)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer func() {
		if err != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	if err = fn(tx); err != nil {
		return err
	}
	if err = tx.Commit(ctx); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

// SQLSTATEs that [InTx] retries.
const (
	SerializationFailure = "40001"
	DeadlockDetected     = "40P01"
)

// Retryable reports whether err is a serialization failure or a deadlock, which
// a fresh transaction may not hit.
func Retryable(err error) bool {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code == SerializationFailure || pe.Code == DeadlockDetected
	}
	return false
}

// Now returns the database's clock: the start of q's transaction (now()).
func Now(ctx context.Context, q interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}) (time.Time, error) {
	var t time.Time
	if err := q.QueryRow(ctx, `SELECT now()`).Scan(&t); err != nil {
		return time.Time{}, fmt.Errorf("read the database clock: %w", err)
	}
	return t, nil
}

// CreateDatabase creates database name on the server q is connected to
// unless it exists; creating it concurrently with another caller is fine.
func CreateDatabase(ctx context.Context, q interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}, name string) error {
	var exists bool
	if err := q.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)`, name).Scan(&exists); err != nil {
		return fmt.Errorf("look for database %s: %w", name, err)
	}
	if exists {
		return nil
	}
	// Another caller starting at the same moment may win the race (42P04).
	_, err := q.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
	var pe *pgconn.PgError
	if err != nil && (!errors.As(err, &pe) || pe.Code != "42P04") {
		return fmt.Errorf("create database %s: %w", name, err)
	}
	return nil
}
