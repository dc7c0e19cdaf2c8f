package cli

import (
	"encoding/json"
	"errors"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/audit"
	"github.com/bettercompute/bettercompute/pkg/bootstrap"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/app"
	"github.com/bettercompute/bettercompute/services/cli/serve"
)

// startAuditServer starts the control plane with an audit key and a chain
// and checkpoints that run often, and returns its base URL, a root token,
// the database and the key's id.
func startAuditServer(t *testing.T) (base, token string, db *pgxpool.Pool, keyID string) {
	t.Helper()
	keyFile := filepath.Join(t.TempDir(), "audit.key")
	signer, err := audit.EnsureSigner(keyFile)
	if err != nil {
		t.Fatal(err)
	}
	url := pgtest.NewDB(t)
	port := 0
	cfg := &config.Config{
		Database: config.Database{URL: url}, Server: config.Server{Host: "127.0.0.1", Port: &port},
		Audit: config.Audit{
			SigningKeyFile: keyFile,
			ChainEvery:     config.Duration(50 * time.Millisecond), CheckpointEvery: config.Duration(100 * time.Millisecond),
		},
	}
	cfg.Defaults()
	a, err := app.New(cfg, app.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Stop(t.Context()) })
	if db, err = pgxpool.New(t.Context(), url); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	cred, err := bootstrap.Run(t.Context(), db)
	if err != nil {
		t.Fatal(err)
	}
	return "http://" + a.Addr(), cred.Token, db, signer.KeyID()
}

// line returns the value of the "key:" line of the summary.
func line(out, key string) string {
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(key) + `:\s+(.*)$`).FindStringSubmatch(out)
	if m == nil {
		return ""
	}
	return m[1]
}

// TestAuditVerifyCommand is not parallel: it sets BETTER_COMPUTE_URL and
// BETTER_COMPUTE_TOKEN, as a user would.
func TestAuditVerifyCommand(t *testing.T) {
	base, token, db, keyID := startAuditServer(t)
	t.Setenv(EnvURL, base)
	t.Setenv(EnvToken, token)
	cfgFile := emptyClientConfig(t)

	for i := range 3 {
		code, out, stderr := execCLI(t, "", "api", "pools.create", "tenantId=root", "class=gpu", "name=p"+strconv.Itoa(i), "--client-config", cfgFile)
		if code != serve.ExitOK {
			t.Fatalf("pools.create: exit %d\n%s%s", code, out, stderr)
		}
	}
	// Wait for the chain and a checkpoint to cover every row.
	poll.UntilNil(t, 30*time.Second, "the chain to settle", func() error {
		code, out, stderr := execCLI(t, "", "audit", "verify", "--json", "--client-config", cfgFile)
		var v auditVerdict
		if err := json.Unmarshal([]byte(out), &v); err != nil || code != serve.ExitOK {
			t.Fatalf("audit verify --json: exit %d (%v)\n%s%s", code, err, out, stderr)
		}
		if v.OK && v.RecordsUnchained == "0" && v.LastCheckpoint != nil && v.LastCheckpoint.ChainSeq == v.RecordsChecked {
			return nil
		}
		return errors.New(out)
	})

	t.Run("an intact chain exits 0", func(t *testing.T) {
		code, out, stderr := execCLI(t, "", "audit", "verify", "--client-config", cfgFile)
		if code != serve.ExitOK || stderr != "" {
			t.Fatalf("exit %d\n%s%s", code, out, stderr)
		}
		var n int
		_ = db.QueryRow(t.Context(), `SELECT count(*) FROM audit`).Scan(&n)
		if line(out, "audit chain") != "ok" || line(out, "records checked") != strconv.Itoa(n) || line(out, "records unchained") != "0" ||
			!strings.HasSuffix(line(out, "last checkpoint"), "signed by key "+keyID) || line(out, "first bad record") != "" {
			t.Fatalf("summary:\n%s", out)
		}
	})

	t.Run("a changed record exits 1 naming it", func(t *testing.T) {
		var id int64
		if err := db.QueryRow(t.Context(), `SELECT id FROM audit WHERE action = 'compute:pools:create' ORDER BY chain_seq LIMIT 1`).Scan(&id); err != nil {
			t.Fatal(err)
		}
		if _, err := db.Exec(t.Context(), `UPDATE audit SET resource = 'Pool::"elsewhere"' WHERE id = $1`, id); err != nil {
			t.Fatal(err)
		}
		code, out, stderr := execCLI(t, "", "audit", "verify", "--client-config", cfgFile)
		want := strconv.FormatInt(id, 10)
		if code != serve.ExitError || line(out, "audit chain") != "DOES NOT VERIFY" || line(out, "first bad record") != want ||
			!strings.Contains(line(out, "reason"), "record "+want) {
			t.Fatalf("exit %d\n%s%s", code, out, stderr)
		}
		if strings.TrimSpace(stderr) != "error: the audit chain does not verify" {
			t.Fatalf("stderr %q", stderr)
		}
	})

	t.Run("a refused call prints the envelope", func(t *testing.T) {
		code, out, stderr := execCLI(t, "", "audit", "verify", "--token", "bck_aaaaaaaaaaaaaaaa."+strings.Repeat("a", 52), "--client-config", cfgFile)
		if code != serve.ExitError || out != "" {
			t.Fatalf("exit %d\n%s%s", code, out, stderr)
		}
		env, summary := splitEnvelope(t, stderr)
		if env.Code != "UNAUTHENTICATED" || summary != "error: audit.verify answered UNAUTHENTICATED (HTTP 401)" {
			t.Fatalf("envelope %+v, summary %q", env, summary)
		}
	})
}
