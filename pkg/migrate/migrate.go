// Package migrate holds Better Compute's SQL schema as embedded, numbered goose
// migrations and runs them.
//
// `better-compute migrate` applies them once per deploy, under a lock so that
// two migrators never interleave. Services never migrate behind an operator's
// back unless told to (`serve` without --no-migrate); they call [Check] at start
// and refuse to run against a schema older than the one they were built for.
package migrate

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

//go:embed sql/*.sql
var embedded embed.FS

// VersionTable is the table in which goose records applied migrations.
const VersionTable = "goose_db_version"

// lockID identifies Better Compute's migration lock among other users of the
// same database ("bcmigrate" as a number).
const lockID int64 = 0x62636d6967726174

// Files returns the embedded migration sources.
func Files() fs.FS {
	sub, err := fs.Sub(embedded, "sql")
	if err != nil {
		panic(err) // the embed pattern guarantees the directory
	}
	return sub
}

// Latest returns the highest migration version this binary carries: the
// schema version it needs.
func Latest() int64 {
	entries, err := fs.ReadDir(Files(), ".")
	if err != nil {
		panic(err)
	}
	var latest int64
	for _, e := range entries {
		n, _, ok := strings.Cut(e.Name(), "_")
		if !ok {
			continue
		}
		v, err := strconv.ParseInt(n, 10, 64)
		if err == nil && v > latest {
			latest = v
		}
	}
	return latest
}

// Config tunes a Migrator. The zero value is ready to use.
type Config struct {
	// TableLock takes the migration lock as a row in a lock table instead of a
	// session advisory lock. Set it when the connection goes through PgBouncer
	// in transaction mode, where a session lock would stay on whichever server
	// connection happened to take it.
	TableLock bool
	// Logger receives one line per applied migration. Nil discards.
	Logger *slog.Logger
}

// Migrator applies and reports the embedded migrations.
type Migrator struct {
	db       *sql.DB
	provider *goose.Provider
	logger   *slog.Logger
}

// New returns a Migrator over pool. Close it when done; it does not close
// pool.
func New(pool *pgxpool.Pool, cfg Config) (*Migrator, error) {
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	db := stdlib.OpenDBFromPool(pool)
	opts := []goose.ProviderOption{}
	if cfg.TableLock {
		l, err := lock.NewPostgresTableLocker(lock.WithTableLockID(lockID))
		if err != nil {
			return nil, fmt.Errorf("migration table lock: %w", err)
		}
		opts = append(opts, goose.WithLocker(l))
	} else {
		l, err := lock.NewPostgresSessionLocker(lock.WithLockID(lockID))
		if err != nil {
			return nil, fmt.Errorf("migration advisory lock: %w", err)
		}
		opts = append(opts, goose.WithSessionLocker(l))
	}
	p, err := goose.NewProvider(goose.DialectPostgres, db, Files(), opts...)
	if err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("migration provider: %w", err)
	}
	return &Migrator{db: db, provider: p, logger: logger}, nil
}

// Close releases the Migrator's database handle.
func (m *Migrator) Close() error { return m.db.Close() }

// Applied is one migration applied by [Migrator.Up].
type Applied struct {
	Version int64
	Name    string
}

// Up applies every pending migration, in order, under the migration lock.
// Running it again applies nothing.
func (m *Migrator) Up(ctx context.Context) ([]Applied, error) {
	res, err := m.provider.Up(ctx)
	var out []Applied
	for _, r := range res {
		if r.Error != nil {
			continue
		}
		a := Applied{Version: r.Source.Version, Name: nameOf(r.Source.Path)}
		out = append(out, a)
		m.logger.InfoContext(ctx, "applied migration", "version", a.Version, "name", a.Name, "took", r.Duration)
	}
	if err != nil {
		return out, fmt.Errorf("migrate up: %w", err)
	}
	return out, nil
}

// Status is one embedded migration and whether the database has it.
type Status struct {
	Version int64
	Name    string
	Applied bool
}

// Status lists every embedded migration and whether it is applied.
func (m *Migrator) Status(ctx context.Context) ([]Status, error) {
	st, err := m.provider.Status(ctx)
	if err != nil {
		return nil, fmt.Errorf("migrate status: %w", err)
	}
	out := make([]Status, 0, len(st))
	for _, s := range st {
		out = append(out, Status{
			Version: s.Source.Version,
			Name:    nameOf(s.Source.Path),
			Applied: s.State == goose.StateApplied,
		})
	}
	return out, nil
}

func nameOf(path string) string {
	base := path[strings.LastIndex(path, "/")+1:]
	return strings.TrimSuffix(base, ".sql")
}

// ErrSchemaBehind is returned (wrapped) by [Check] when the database lacks
// migrations this binary needs.
var ErrSchemaBehind = errors.New("database schema is behind this binary")

// Current returns the highest applied migration version, or 0 when the
// database has never been migrated.
func Current(ctx context.Context, pool *pgxpool.Pool) (int64, error) {
	// Two statements: a query naming a missing table fails at parse time even
	// in a branch that would not run.
	var exists bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, VersionTable).Scan(&exists); err != nil {
		return 0, fmt.Errorf("read schema version: %w", err)
	}
	if !exists {
		return 0, nil
	}
	var v int64
	err := pool.QueryRow(ctx, `SELECT coalesce(max(version_id), 0) FROM `+VersionTable+` WHERE is_applied`).Scan(&v)
	if err != nil {
		return 0, fmt.Errorf("read schema version: %w", err)
	}
	return v, nil
}

// Check returns an error wrapping [ErrSchemaBehind], telling the operator to
// run `better-compute migrate`, when the database's schema is older than
// [Latest]. A newer schema is accepted: migrations only add, so an older
// binary keeps working during a rolling deploy.
func Check(ctx context.Context, pool *pgxpool.Pool) (current int64, err error) {
	current, err = Current(ctx, pool)
	if err != nil {
		return 0, err
	}
	if want := Latest(); current < want {
		return current, fmt.Errorf("%w: it is at version %d and this binary needs %d; run `better-compute migrate` first", ErrSchemaBehind, current, want)
	}
	return current, nil
}
