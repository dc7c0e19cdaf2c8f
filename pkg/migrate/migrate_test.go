package migrate_test

import (
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/migrate"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// empty returns a pool on a database with no schema at all.
func empty(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool, err := db.Open(t.Context(), db.Config{URL: pgtest.NewEmptyDB(t), MaxConns: 8})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func newMigrator(t *testing.T, pool *pgxpool.Pool, cfg migrate.Config) *migrate.Migrator {
	t.Helper()
	m, err := migrate.New(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Close() })
	return m
}

func TestUpFromEmpty(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		cfg  migrate.Config
	}{
		{"advisory lock", migrate.Config{}},
		{"table lock (PgBouncer)", migrate.Config{TableLock: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pool := empty(t)
			ctx := t.Context()

			if v, err := migrate.Current(ctx, pool); err != nil || v != 0 {
				t.Fatalf("Current on an empty database = %d, %v", v, err)
			}
			if _, err := migrate.Check(ctx, pool); !errors.Is(err, migrate.ErrSchemaBehind) {
				t.Fatalf("Check on an empty database = %v", err)
			}

			m := newMigrator(t, pool, tc.cfg)
			st, err := m.Status(ctx)
			if err != nil || len(st) == 0 || st[0].Applied {
				t.Fatalf("Status before Up = %+v, %v", st, err)
			}

			applied, err := m.Up(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if len(applied) != len(st) || applied[len(applied)-1].Version != migrate.Latest() {
				t.Fatalf("applied %+v, want every one of %+v", applied, st)
			}
			if applied[0].Name != "00001_init" {
				t.Errorf("first migration named %q", applied[0].Name)
			}
			if v, err := migrate.Check(ctx, pool); err != nil || v != migrate.Latest() {
				t.Fatalf("Check after Up = %d, %v", v, err)
			}

			for _, table := range []string{"tenants", "workers", "leases", "work_queue", "outbox", "idempotency", "audit"} {
				var ok bool
				if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&ok); err != nil || !ok {
					t.Errorf("table %s missing (%v)", table, err)
				}
			}
			var root string
			if err := pool.QueryRow(ctx, `SELECT name FROM tenants WHERE id = 'root' AND parent_id IS NULL`).Scan(&root); err != nil {
				t.Fatalf("root tenant: %v", err)
			}

			again, err := m.Up(ctx)
			if err != nil || len(again) != 0 {
				t.Fatalf("a second Up applied %+v, %v", again, err)
			}
			st, err = m.Status(ctx)
			if err != nil {
				t.Fatal(err)
			}
			for _, s := range st {
				if !s.Applied {
					t.Errorf("%d %s not applied", s.Version, s.Name)
				}
			}
		})
	}
}

func TestConcurrentMigratorsApplyOnce(t *testing.T) {
	t.Parallel()
	pool := empty(t)
	const n = 4
	var wg sync.WaitGroup
	applied := make([]int, n)
	errs := make([]error, n)
	for i := range n {
		m := newMigrator(t, pool, migrate.Config{})
		wg.Go(func() {
			a, err := m.Up(t.Context())
			applied[i], errs[i] = len(a), err
		})
	}
	wg.Wait()
	total := 0
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("migrator %d: %v", i, errs[i])
		}
		total += applied[i]
	}
	var rows int
	if err := pool.QueryRow(t.Context(), `SELECT count(*) FROM goose_db_version WHERE version_id > 0`).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	want := len(mustStatus(t, pool))
	if total != want || rows != want {
		t.Fatalf("migrators applied %d in all and recorded %d rows, want %d each", total, rows, want)
	}
}

func mustStatus(t *testing.T, pool *pgxpool.Pool) []migrate.Status {
	t.Helper()
	st, err := newMigrator(t, pool, migrate.Config{}).Status(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func TestCheckAcceptsANewerSchema(t *testing.T) {
	t.Parallel()
	pool := pgtest.New(t) // already migrated
	if _, err := pool.Exec(t.Context(), `INSERT INTO goose_db_version (version_id, is_applied) VALUES ($1, true)`, migrate.Latest()+1); err != nil {
		t.Fatal(err)
	}
	v, err := migrate.Check(t.Context(), pool)
	if err != nil || v != migrate.Latest()+1 {
		t.Fatalf("Check = %d, %v: a newer schema must be accepted during a rolling deploy", v, err)
	}
}

func TestCheckMessageSaysWhatToRun(t *testing.T) {
	t.Parallel()
	_, err := migrate.Check(t.Context(), empty(t))
	if err == nil || !strings.Contains(err.Error(), "run `better-compute migrate`") {
		t.Fatalf("Check = %v", err)
	}
}

func TestLatestMatchesFiles(t *testing.T) {
	t.Parallel()
	if migrate.Latest() < 1 {
		t.Fatalf("Latest = %d", migrate.Latest())
	}
}
