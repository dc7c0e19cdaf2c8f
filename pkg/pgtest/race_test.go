package pgtest_test

import (
	"context"
	"os"
	"os/exec"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/pglocal"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
)

// childEnv marks a test binary started by TestTemplateRace.
const childEnv = "PGTEST_RACE_CHILD"

// TestTemplateRace runs this package's tests in three processes at once
// against a fresh server, as `go test ./...` runs packages: they must agree
// on one template, created once, and all pass.
func TestTemplateRace(t *testing.T) {
	if os.Getenv(childEnv) != "" {
		t.Skip("in a child")
	}
	t.Parallel()
	srv, err := pglocal.Resolve(t.Context(), pglocal.Options{SkipLocal: true, SkipContainer: true, Fast: true})
	if err != nil {
		t.Skipf("no private cluster: %v", err)
	}
	t.Cleanup(func() { _ = srv.Stop() })

	errs := make(chan error, 3)
	outs := make([][]byte, 3)
	for i := range 3 {
		cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^TestNew$", "-test.count=1")
		cmd.Env = append(os.Environ(), pgtest.EnvURL+"="+srv.URL, childEnv+"=1", "CI=true")
		go func() {
			var err error
			outs[i], err = cmd.CombinedOutput()
			errs <- err
		}()
	}
	failed := false
	for range 3 {
		if err := <-errs; err != nil {
			t.Errorf("child: %v", err)
			failed = true
		}
	}
	if failed {
		for _, out := range outs {
			t.Logf("%s", out)
		}
		t.FailNow()
	}

	conn, err := pgx.Connect(context.Background(), srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var templates, leftovers int
	err = conn.QueryRow(t.Context(), `
		SELECT count(*) FILTER (WHERE datname LIKE 'bctmpl\_%' AND datistemplate),
		       count(*) FILTER (WHERE datname LIKE 'pgt\_%')
		FROM pg_database`).Scan(&templates, &leftovers)
	if err != nil {
		t.Fatal(err)
	}
	if templates != 1 || leftovers != 0 {
		t.Errorf("%d templates (want 1) and %d test databases left (want 0)", templates, leftovers)
	}
}
