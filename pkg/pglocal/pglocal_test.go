package pglocal_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/bettercompute/bettercompute/pkg/pglocal"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// clusterOptions resolve only to a private cluster.
func clusterOptions(dataDir string) pglocal.Options {
	return pglocal.Options{SkipLocal: true, SkipContainer: true, Fast: true, DataDir: dataDir}
}

// resolve calls Resolve and stops the server at test end.
func resolve(t *testing.T, opts pglocal.Options) *pglocal.Server {
	t.Helper()
	s, err := pglocal.Resolve(t.Context(), opts)
	if err != nil {
		if errors.Is(err, pglocal.ErrNoServer) && os.Getenv("CI") != "true" {
			t.Skip(err)
		}
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Stop(); err != nil {
			t.Errorf("stop: %v", err)
		}
	})
	return s
}

// dataDir returns a directory for a cluster inside t.TempDir, whose parents
// the postgres user may enter when we run as root.
func dataDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	for _, d := range []string{filepath.Dir(dir), dir} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return filepath.Join(dir, "pg")
}

func query(t *testing.T, url, sql string, args ...any) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return "", err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var out string
	err = conn.QueryRow(ctx, sql, args...).Scan(&out)
	return out, err
}

func mustExec(t *testing.T, url, sql string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, sql); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func mustQuery(t *testing.T, url, sql string, args ...any) string {
	t.Helper()
	out, err := query(t, url, sql, args...)
	if err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return out
}

func TestResolve(t *testing.T) {
	t.Parallel()

	t.Run("finds the local server", func(t *testing.T) {
		t.Parallel()
		s, err := pglocal.Resolve(t.Context(), pglocal.Options{SkipCluster: true, SkipContainer: true})
		if errors.Is(err, pglocal.ErrNoServer) {
			t.Skipf("no local server (the other paths are tested apart): %v", err)
		}
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Stop() })
		if s.Source != pglocal.SourceLocal {
			t.Fatalf("source = %q, want %q", s.Source, pglocal.SourceLocal)
		}
		if got := mustQuery(t, s.URL, "SELECT current_database()"); got != "postgres" {
			t.Errorf("database = %q, want postgres", got)
		}
	})

	t.Run("reports what it tried", func(t *testing.T) {
		t.Parallel()
		_, err := pglocal.Resolve(t.Context(), pglocal.Options{
			URLEnv:        "PGLOCAL_TEST_UNSET_VARIABLE",
			LocalURL:      "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable",
			SkipCluster:   true,
			SkipContainer: true,
		})
		if !errors.Is(err, pglocal.ErrNoServer) {
			t.Fatalf("err = %v, want ErrNoServer", err)
		}
		t.Log(err)
	})

	t.Run("uses testcontainers only when Docker is healthy", func(t *testing.T) {
		t.Parallel()
		s, err := pglocal.Resolve(t.Context(), pglocal.Options{SkipLocal: true, SkipCluster: true})
		if err != nil {
			// No engine here: the error must say so, not hang or panic.
			if !errors.Is(err, pglocal.ErrNoServer) || !strings.Contains(err.Error(), "testcontainers: ") {
				t.Fatalf("err = %v", err)
			}
			t.Log(err)
			return
		}
		t.Cleanup(func() { _ = s.Stop() })
		if s.Source != pglocal.SourceContainer {
			t.Fatalf("source = %q", s.Source)
		}
		mustQuery(t, s.URL, "SELECT 1::text")
	})

	t.Run("starts a private cluster and stops it", func(t *testing.T) {
		t.Parallel()
		s := resolve(t, clusterOptions(""))
		if s.Source != pglocal.SourceCluster {
			t.Fatalf("source = %q, want %q", s.Source, pglocal.SourceCluster)
		}
		if got := mustQuery(t, s.URL, "SHOW listen_addresses"); got != "127.0.0.1" {
			t.Errorf("listen_addresses = %q", got)
		}
		if got := mustQuery(t, s.URL, "SHOW fsync"); got != "off" {
			t.Errorf("fsync = %q, want off with Fast", got)
		}
		if err := s.Stop(); err != nil {
			t.Fatal(err)
		}
		if _, err := query(t, s.URL, "SELECT 1::text"); err == nil {
			t.Fatal("server still answers after Stop")
		}
		if _, err := os.Stat(s.DataDir); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("temporary data dir %s not removed: %v", s.DataDir, err)
		}
		if err := s.Stop(); err != nil {
			t.Errorf("second Stop: %v", err)
		}
	})

	t.Run("keeps a cluster's data and port across restarts", func(t *testing.T) {
		t.Parallel()
		dir := dataDir(t)
		first := resolve(t, clusterOptions(dir))
		mustExec(t, first.URL, "CREATE TABLE kept AS SELECT 'yes'::text AS v")
		if err := first.Stop(); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(filepath.Join(dir, "PG_VERSION")); err != nil {
			t.Fatalf("Stop removed a given data dir: %v", err)
		}

		second := resolve(t, clusterOptions(dir))
		if second.URL != first.URL {
			t.Errorf("URL changed across restart: %s, then %s", first.URL, second.URL)
		}
		if got := mustQuery(t, second.URL, "SELECT v FROM kept"); got != "yes" {
			t.Errorf("kept = %q", got)
		}
	})

	t.Run("removes a stale postmaster.pid", func(t *testing.T) {
		t.Parallel()
		dir := dataDir(t)
		s := resolve(t, clusterOptions(dir))
		if err := s.Stop(); err != nil {
			t.Fatal(err)
		}

		// A live process that is not postgres holds the recorded pid, as
		// after a container restart. postgres alone would refuse to start.
		sleeper := exec.Command("sleep", "600")
		if err := sleeper.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_ = sleeper.Process.Kill()
			_ = sleeper.Wait()
		})
		pid := strconv.Itoa(sleeper.Process.Pid)
		stale := pid + "\n" + dir + "\n1700000000\n5432\n\n127.0.0.1\n  1234567     12345\nready   \n"
		if err := os.WriteFile(filepath.Join(dir, "postmaster.pid"), []byte(stale), 0o600); err != nil {
			t.Fatal(err)
		}

		again := resolve(t, clusterOptions(dir))
		mustQuery(t, again.URL, "SELECT 1::text")
	})

	t.Run("adopts a cluster already running in the data dir", func(t *testing.T) {
		t.Parallel()
		dir := dataDir(t)
		owner := resolve(t, clusterOptions(dir))
		adopted := resolve(t, clusterOptions(dir))
		if adopted.URL != owner.URL || adopted.Source != pglocal.SourceCluster {
			t.Fatalf("adopted %s %s, want %s cluster", adopted.Source, adopted.URL, owner.URL)
		}
		if err := adopted.Stop(); err != nil {
			t.Fatal(err)
		}
		mustQuery(t, owner.URL, "SELECT 1::text") // still running
	})
}

func TestResolveEnv(t *testing.T) {
	// t.Setenv rules out t.Parallel.
	t.Run("uses the URL in the named variable", func(t *testing.T) {
		t.Setenv("PGLOCAL_TEST_URL", pglocal.DefaultLocalURL)
		s, err := pglocal.Resolve(t.Context(), pglocal.Options{URLEnv: "PGLOCAL_TEST_URL", SkipLocal: true, SkipCluster: true, SkipContainer: true})
		if err != nil {
			t.Skipf("local server not reachable: %v", err)
		}
		if s.Source != pglocal.SourceEnv || s.URL != pglocal.DefaultLocalURL {
			t.Errorf("got %s %s", s.Source, s.URL)
		}
		if err := s.Stop(); err != nil {
			t.Error(err)
		}
	})

	t.Run("fails on a URL that does not answer, trying nothing else", func(t *testing.T) {
		t.Setenv("PGLOCAL_TEST_URL", "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable")
		_, err := pglocal.Resolve(t.Context(), pglocal.Options{URLEnv: "PGLOCAL_TEST_URL"})
		if err == nil || errors.Is(err, pglocal.ErrNoServer) {
			t.Fatalf("err = %v, want a connection error", err)
		}
	})
}

func TestDatabaseURL(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ base, want string }{
		{"postgres://u@h:5432/postgres?sslmode=disable", "postgres://u@h:5432/t_1?sslmode=disable"},
		{"postgresql://u:p@h/", "postgresql://u:p@h/t_1"},
		{"host=h user=u dbname=postgres", "host=h user=u dbname=postgres dbname='t_1'"},
	} {
		got, err := pglocal.DatabaseURL(tc.base, "t_1")
		if err != nil || got != tc.want {
			t.Errorf("DatabaseURL(%q) = %q, %v; want %q", tc.base, got, err, tc.want)
		}
	}
}
