package pgtest_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func scalar[T any](t *testing.T, pool *pgxpool.Pool, sql string, args ...any) T {
	t.Helper()
	var v T
	if err := pool.QueryRow(t.Context(), sql, args...).Scan(&v); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return v
}

func TestNew(t *testing.T) {
	t.Parallel()

	t.Run("gives each test its own migrated database", func(t *testing.T) {
		t.Parallel()
		// Two tests at once, each writing to its own database.
		var (
			mu    sync.Mutex
			names []string
		)
		for i := range 2 {
			t.Run(fmt.Sprintf("test %d", i), func(t *testing.T) {
				t.Parallel()
				pool := pgtest.New(t)
				name := scalar[string](t, pool, "SELECT current_database()")
				mu.Lock()
				names = append(names, name)
				mu.Unlock()

				if got := scalar[string](t, pool, "SELECT name FROM tenants WHERE id = 'root'"); got != "root" {
					t.Errorf("root tenant name = %q", got)
				}
				mine := fmt.Sprintf("tenant_%d", i)
				if _, err := pool.Exec(t.Context(), "INSERT INTO tenants (id, parent_id, name) VALUES ($1, 'root', $1)", mine); err != nil {
					t.Fatal(err)
				}
				if n := scalar[int](t, pool, "SELECT count(*) FROM tenants"); n != 2 {
					t.Errorf("%d tenants, want root and %s only: the other test's write is visible", n, mine)
				}
			})
		}
		t.Cleanup(func() {
			if len(names) == 2 && names[0] == names[1] {
				t.Errorf("both tests got database %s", names[0])
			}
		})
	})

	t.Run("writes in one database are invisible in another", func(t *testing.T) {
		t.Parallel()
		a, b := pgtest.New(t), pgtest.New(t)
		if _, err := a.Exec(t.Context(), "INSERT INTO tenants (id, parent_id, name) VALUES ('only_a', 'root', 'a')"); err != nil {
			t.Fatal(err)
		}
		if n := scalar[int](t, b, "SELECT count(*) FROM tenants WHERE id = 'only_a'"); n != 0 {
			t.Errorf("b sees a's tenant")
		}
		if n := scalar[int](t, a, "SELECT count(*) FROM tenants WHERE id = 'only_a'"); n != 1 {
			t.Errorf("a does not see its own tenant")
		}
	})

	t.Run("drops the database when the test ends", func(t *testing.T) {
		t.Parallel()
		var name string
		t.Run("user", func(t *testing.T) {
			name = scalar[string](t, pgtest.New(t), "SELECT current_database()")
		})
		admin := pgtest.New(t)
		if n := scalar[int](t, admin, "SELECT count(*) FROM pg_database WHERE datname = $1", name); n != 0 {
			t.Errorf("database %s still exists", name)
		}
	})

	t.Run("the template is closed to connections", func(t *testing.T) {
		t.Parallel()
		pool := pgtest.New(t)
		var isTemplate, allowConn bool
		err := pool.QueryRow(t.Context(), "SELECT datistemplate, datallowconn FROM pg_database WHERE datname = $1", pgtest.TemplateName()).Scan(&isTemplate, &allowConn)
		if err != nil {
			t.Fatal(err)
		}
		if !isTemplate || allowConn {
			t.Errorf("datistemplate = %v, datallowconn = %v", isTemplate, allowConn)
		}
		if !strings.HasPrefix(pgtest.TemplateName(), "bctmpl_") {
			t.Errorf("template name %q", pgtest.TemplateName())
		}
	})
}

func TestNewDB(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDB(t)
	pool, err := pgxpool.New(t.Context(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var v int64
	if err := pool.QueryRow(context.Background(), "SELECT max(version_id) FROM goose_db_version").Scan(&v); err != nil {
		t.Fatal(err)
	}
	if v == 0 {
		t.Error("not migrated")
	}
}

func TestNewEmptyDB(t *testing.T) {
	t.Parallel()
	url := pgtest.NewEmptyDB(t)
	pool, err := pgxpool.New(t.Context(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var tables int
	if err := pool.QueryRow(t.Context(), "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").Scan(&tables); err != nil {
		t.Fatal(err)
	}
	if tables != 0 {
		t.Errorf("an empty database has %d tables", tables)
	}
	if url == pgtest.NewEmptyDB(t) {
		t.Error("two calls returned the same database")
	}
}
