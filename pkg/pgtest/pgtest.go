// Package pgtest gives each test its own PostgreSQL database with the current
// schema.
//
// The first call in a test binary resolves a server with [pglocal] (honouring
// TEST_DATABASE_URL) and makes sure a template database migrated to the
// embedded migrations exists on it; each test's database is then a cheap
// `CREATE DATABASE ... TEMPLATE` copy, dropped when the test ends.
//
// When no server can be found, tests that ask for a database are skipped,
// or fail when the environment has CI=true.
//
// The template is named after a hash of the migration files, so test binaries
// running in parallel (as `go test ./...` runs them) share it, and a changed
// migration gets a new one. It is created under an advisory lock, marked as a
// template and closed to connections, which a template copy needs.
//
// Use [Main] (or [Run]) in TestMain so that a private cluster started for the
// binary is stopped and its directory removed, and, with Main, so that the
// package's tests fail if they leave goroutines running:
//
//	func TestMain(m *testing.M) { pgtest.Main(m) }
package pgtest

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/migrate"
	"github.com/bettercompute/bettercompute/pkg/pglocal"
)

// EnvURL names the environment variable that, when set, selects the server
// to use (a URL to a database from which the user may create databases).
const EnvURL = "TEST_DATABASE_URL"

// templateLock keys the advisory lock under which templates are created
// ("bcpgtest" as a number).
const templateLock int64 = 0x6263706774657374

// harness is what every test in the binary shares.
type harness struct {
	srv      *pglocal.Server
	admin    *pgxpool.Pool // on the server's maintenance database
	template string
}

var (
	mu       sync.Mutex
	shared   *harness
	setupErr error
	setUp    bool
)

// get resolves the server and creates the template once per binary.
func get() (*harness, error) {
	mu.Lock()
	defer mu.Unlock()
	if !setUp {
		setUp = true
		shared, setupErr = setup()
	}
	return shared, setupErr
}

func setup() (*harness, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	srv, err := pglocal.Resolve(ctx, pglocal.Options{URLEnv: EnvURL, Fast: true})
	if err != nil {
		return nil, err
	}
	admin, err := db.Open(ctx, db.Config{URL: srv.URL, MaxConns: 4, ApplicationName: "pgtest"})
	if err != nil {
		return nil, errors.Join(err, srv.Stop())
	}
	h := &harness{srv: srv, admin: admin, template: TemplateName()}
	if err := h.ensureTemplate(ctx); err != nil {
		admin.Close()
		return nil, errors.Join(fmt.Errorf("template %s: %w", h.template, err), srv.Stop())
	}
	return h, nil
}

// TemplateName returns the name of the template database for the embedded
// migrations: "bctmpl_" and a hash of the migration files.
func TemplateName() string {
	h := sha256.New()
	err := fs.WalkDir(migrate.Files(), ".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := fs.ReadFile(migrate.Files(), path)
		if err != nil {
			return err
		}
		fmt.Fprintf(h, "%s\x00%d\x00", path, len(b))
		h.Write(b)
		return nil
	})
	if err != nil {
		panic(err) // embedded files always read
	}
	return "bctmpl_" + hex.EncodeToString(h.Sum(nil))[:16]
}

// ensureTemplate creates and migrates the template unless a finished one
// exists. datistemplate marks it finished: a creator that died half way
// leaves a database without it, which the next one drops and redoes.
func (h *harness) ensureTemplate(ctx context.Context) error {
	// The lock is a session lock, so it needs a connection of its own.
	conn, err := pgx.Connect(ctx, h.srv.URL)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", templateLock); err != nil {
		return fmt.Errorf("lock: %w", err)
	}
	// Closing the connection releases the lock too; unlock anyway so that a
	// waiter need not wait for the backend to exit.
	defer func() {
		_, _ = conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", templateLock)
	}()

	var done bool
	err = conn.QueryRow(ctx, "SELECT datistemplate FROM pg_database WHERE datname = $1", h.template).Scan(&done)
	switch {
	case err == nil && done:
		return nil
	case err == nil:
		if _, err := conn.Exec(ctx, "DROP DATABASE "+ident(h.template)+" WITH (FORCE)"); err != nil {
			return fmt.Errorf("drop unfinished template: %w", err)
		}
	case !errors.Is(err, pgx.ErrNoRows):
		return err
	}

	if _, err := conn.Exec(ctx, "CREATE DATABASE "+ident(h.template)+" TEMPLATE template0 ENCODING 'UTF8'"); err != nil {
		return fmt.Errorf("create: %w", err)
	}
	if err := migrateDB(ctx, h.srv.URL, h.template); err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, "ALTER DATABASE "+ident(h.template)+" WITH ALLOW_CONNECTIONS false"); err != nil {
		return err
	}
	// Copying needs the template to have no sessions; the migration pool's
	// backends may still be exiting.
	if err := waitNoSessions(ctx, conn, h.template); err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, "ALTER DATABASE "+ident(h.template)+" WITH IS_TEMPLATE true"); err != nil {
		return err
	}
	return nil
}

func migrateDB(ctx context.Context, serverURL, name string) error {
	u, err := pglocal.DatabaseURL(serverURL, name)
	if err != nil {
		return err
	}
	pool, err := db.Open(ctx, db.Config{URL: u, MaxConns: 2, ApplicationName: "pgtest-migrate"})
	if err != nil {
		return err
	}
	defer pool.Close()
	m, err := migrate.New(pool, migrate.Config{})
	if err != nil {
		return err
	}
	defer m.Close()
	_, err = m.Up(ctx)
	return err
}

func waitNoSessions(ctx context.Context, conn *pgx.Conn, name string) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		var n int
		err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE datname = $1", name).Scan(&n)
		if err != nil {
			return err
		}
		if n == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			_, err := conn.Exec(context.WithoutCancel(ctx), "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1", name)
			return err
		case <-tick.C:
		}
	}
}

// NewDB creates a database for t, a copy of the migrated template, drops it
// when t ends, and returns its URL. It skips t when no server can be found
// (fails it when CI=true).
func NewDB(t testing.TB) string {
	t.Helper()
	return newDB(t, func(h *harness) string { return h.template })
}

// NewEmptyDB is [NewDB] without the schema: a database with no migrations
// applied, for tests of migrating and of refusing an old schema.
func NewEmptyDB(t testing.TB) string {
	t.Helper()
	return newDB(t, func(*harness) string { return "template0" })
}

func newDB(t testing.TB, template func(*harness) string) string {
	t.Helper()
	h, err := get()
	if err != nil {
		if errors.Is(err, pglocal.ErrNoServer) && os.Getenv("CI") != "true" {
			t.Skipf("pgtest: %v (set %s to choose a server)", err, EnvURL)
		}
		t.Fatalf("pgtest: %v", err)
	}
	name := dbName(t.Name())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := h.admin.Exec(ctx, "CREATE DATABASE "+ident(name)+" TEMPLATE "+ident(template(h))); err != nil {
		t.Fatalf("pgtest: create database %s: %v", name, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if _, err := h.admin.Exec(ctx, "DROP DATABASE IF EXISTS "+ident(name)+" WITH (FORCE)"); err != nil {
			t.Errorf("pgtest: drop database %s: %v", name, err)
		}
	})
	u, err := pglocal.DatabaseURL(h.srv.URL, name)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	return u
}

// New returns a pool on a fresh database for t (see [NewDB]), closed when t
// ends.
func New(t testing.TB) *pgxpool.Pool {
	t.Helper()
	u := NewDB(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool, err := db.Open(ctx, db.Config{URL: u, MaxConns: 4, ApplicationName: "pgtest"})
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(pool.Close) // runs before NewDB's drop
	return pool
}

// Run runs m's tests, then stops what the package started: it closes its
// connections and stops a private cluster, removing its directory. It
// returns m's exit code, for a TestMain that does more than [Main] (which
// also checks for leaked goroutines):
//
//	func TestMain(m *testing.M) {
//		code := pgtest.Run(m)
//		// … more checks, setting code …
//		os.Exit(code)
//	}
//
// Without it, a private cluster still stops when the test binary exits, but
// its directory stays behind in the temporary directory.
func Run(m *testing.M) int {
	code := m.Run()
	if err := Shutdown(); err != nil {
		fmt.Fprintln(os.Stderr, "pgtest:", err)
		if code == 0 {
			code = 1
		}
	}
	return code
}

// Main is TestMain for a package that needs nothing else: it calls [Run],
// then fails the binary if the tests left goroutines running ([Leaks]),
// and exits with its code.
func Main(m *testing.M) {
	code := Run(m)
	if code == 0 {
		if err := Leaks(); err != nil {
			fmt.Fprintln(os.Stderr, "pgtest: goroutines leaked by the tests:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// Leaks reports the goroutines still running besides the caller's and the
// test framework's (goleak: a pool, a server or a loop that a test did not
// close or stop), for a TestMain that does more than [Main]; nil when none
// are.
func Leaks() error {
	// goleak.Find waits about a second; an embedded nats-server's file
	// store and timer goroutines can take longer to end after its
	// shutdown returned on a busy machine, so look again for up to 10 s.
	// Two of an embedded nats-server's own goroutines can outlive its
	// WaitForShutdown for good: a stream's file-store flush loop
	// created while the server shut down, and its access-time ticker.
	// They belong to the server library, not to code under test.
	ignore := []goleak.Option{
		goleak.IgnoreTopFunction("github.com/nats-io/nats-server/v2/server.(*fileStore).flushStreamStateLoop"),
		goleak.IgnoreTopFunction("github.com/nats-io/nats-server/v2/server/ats.Register.func1"),
	}
	err := goleak.Find(ignore...)
	for deadline := time.Now().Add(10 * time.Second); err != nil && time.Now().Before(deadline); {
		err = goleak.Find(ignore...)
	}
	return err
}

// Shutdown closes the package's connections and stops a server it started.
// Tests that ask for a database afterwards set everything up again.
func Shutdown() error {
	mu.Lock()
	defer mu.Unlock()
	h := shared
	shared, setupErr, setUp = nil, nil, false
	if h == nil {
		return nil
	}
	h.admin.Close()
	return h.srv.Stop()
}

// dbName makes a database name from a test name: recognisable, unique, and
// within PostgreSQL's 63 bytes.
func dbName(test string) string {
	var b strings.Builder
	b.WriteString("pgt_")
	for _, r := range strings.ToLower(test) {
		if b.Len() >= 40 {
			break
		}
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' {
			b.WriteRune(r)
		} else {
			b.WriteByte('_')
		}
	}
	b.WriteByte('_')
	b.WriteString(rand.Text()[:10])
	return strings.ToLower(b.String())
}

func ident(name string) string { return pgx.Identifier{name}.Sanitize() }
