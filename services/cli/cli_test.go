package cli_test

import (
	"bytes"
	"fmt"
	"io/fs"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/migrate"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/services/cli"
	"github.com/bettercompute/bettercompute/services/cli/serve"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func run(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	root := cli.NewRoot(&out, &errb)
	root.SetArgs(args)
	code = serve.Report(&errb, root.ExecuteContext(t.Context()))
	return code, out.String(), errb.String()
}

func TestServeRejectsBadInputBeforeStarting(t *testing.T) {
	t.Setenv("BC_CONFIG", "")
	t.Setenv("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
	cases := []struct {
		name string
		args []string
		code int
		want string
	}{
		{"unknown role", []string{"serve", "--roles", "bogus"}, serve.ExitConfig, `error: INVALID_CONFIG roles: unknown role "bogus"`},
		{"the worker mode gets as far as the database", []string{"serve", "--roles", "worker", "--port", "0"}, serve.ExitError, "error: UNAVAILABLE database.url: cannot reach the database"},
		{"bad port", []string{"serve", "--port", "70000"}, serve.ExitConfig, "error: INVALID_CONFIG server.port: expected a port from 0 to 65535, got 70000"},
		{"bad flag", []string{"serve", "--rolez", "api"}, serve.ExitConfig, "unknown flag: --rolez"},
		{"bad log level", []string{"serve", "--log-level", "loud"}, serve.ExitConfig, "error: INVALID_CONFIG log.level"},
		{"missing config file", []string{"--config", "/nonexistent/bc.yaml", "serve"}, serve.ExitConfig, "error: INVALID_CONFIG config: cannot read the configuration file"},
		{"bad migrate action", []string{"migrate", "sideways"}, serve.ExitConfig, `unknown migrate action "sideways"`},
		{"unreachable database", []string{"serve", "--roles", "api", "--port", "0"}, serve.ExitError, "error: UNAVAILABLE database.url: cannot reach the database"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			code, _, stderr := run(t, tc.args...)
			if code != tc.code || !strings.Contains(stderr, tc.want) {
				t.Fatalf("exit %d, stderr:\n%s\nwant exit %d and %q", code, stderr, tc.code, tc.want)
			}
		})
	}
}

func TestServeWithoutDatabase(t *testing.T) {
	t.Setenv("BC_CONFIG", "")
	t.Setenv("DATABASE_URL", "")
	t.Setenv("BC_DATABASE_URL", "")
	code, _, stderr := run(t, "serve", "--roles", "api")
	if code != serve.ExitConfig || !strings.Contains(stderr, "INVALID_CONFIG database.url: required") {
		t.Fatalf("exit %d: %s", code, stderr)
	}
}

func TestMigrateAndVersion(t *testing.T) {
	t.Setenv("BC_CONFIG", "")
	url := pgtest.NewEmptyDB(t)

	code, out, stderr := run(t, "migrate", "status", "--database-url", url)
	if code != 0 || !strings.Contains(out, "00001_init") || !strings.Contains(out, "pending") {
		t.Fatalf("status before: exit %d\n%s%s", code, out, stderr)
	}
	code, out, stderr = run(t, "migrate", "--database-url", url, "--log-format", "text")
	// Versions may skip numbers (work in flight reserves them): count the files.
	files, err := fs.Glob(migrate.Files(), "*.sql")
	if err != nil {
		t.Fatal(err)
	}
	if code != 0 || !strings.Contains(out, fmt.Sprintf("applied %d migration(s); schema is at version %d", len(files), migrate.Latest())) {
		t.Fatalf("up: exit %d\n%s%s", code, out, stderr)
	}
	code, out, _ = run(t, "migrate", "up", "--database-url", url)
	if code != 0 || !strings.Contains(out, "applied 0 migration(s)") {
		t.Fatalf("second up: exit %d\n%s", code, out)
	}
	code, out, _ = run(t, "migrate", "status", "--database-url", url)
	if code != 0 || strings.Contains(out, "pending") || !strings.Contains(out, "applied") {
		t.Fatalf("status after: exit %d\n%s", code, out)
	}

	code, out, _ = run(t, "version")
	if code != 0 || !strings.HasPrefix(out, "better-compute ") || !strings.Contains(out, fmt.Sprintf("schema %d", migrate.Latest())) {
		t.Fatalf("version: exit %d %q", code, out)
	}
}
