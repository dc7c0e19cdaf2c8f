package api_test

import (
	"context"
	"fmt"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/audit"
	"github.com/bettercompute/bettercompute/pkg/bootstrap"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/api"
	"github.com/bettercompute/bettercompute/services/app"
)

// setupAuditKey is [setup] with an audit key, and a chain and checkpoints
// that run often. It returns the key's id.
func setupAuditKey(t *testing.T) (*harness, string) {
	t.Helper()
	keyFile := filepath.Join(t.TempDir(), "audit.key")
	signer, err := audit.EnsureSigner(keyFile)
	if err != nil {
		t.Fatal(err)
	}
	url := pgtest.NewDB(t)
	h := &harness{clock: &clock{t: time.Now()}, queries: &atomic.Int64{}}
	port := 0
	cfg := &config.Config{
		Database: config.Database{URL: url}, Server: config.Server{Host: "127.0.0.1", Port: &port, NoMigrate: true},
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
	if err := a.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Stop(context.Background()) })
	h.base = "http://" + a.Addr()
	if h.db, err = pgxpool.New(context.Background(), url); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.db.Close)
	cred, err := bootstrap.Run(context.Background(), h.db)
	if err != nil {
		t.Fatal(err)
	}
	h.root = cred.Token
	if h.conn, err = grpc.NewClient(a.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials())); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.conn.Close() })
	return h, signer.KeyID()
}

// verifyREST calls audit.verify over REST as root.
func (h *harness) verifyREST(t *testing.T) map[string]any {
	t.Helper()
	code, body := h.rest(t, h.root, "audit/verify", `{"tenantId":"root"}`)
	if code != http.StatusOK {
		t.Fatalf("audit.verify: %d %v", code, body)
	}
	return body
}

// settled polls audit.verify until every audit row is chained and, with
// checkpointed, the newest checkpoint covers them all.
func (h *harness) settled(t *testing.T, checkpointed bool) map[string]any {
	t.Helper()
	var body map[string]any
	poll.UntilNil(t, 30*time.Second, "the audit chain to settle", func() error {
		body = h.verifyREST(t)
		cp, _ := body["lastCheckpoint"].(map[string]any)
		covered := !checkpointed || (cp != nil && cp["chainSeq"] == body["recordsChecked"])
		if body["ok"] == true && body["recordsUnchained"] == "0" && body["recordsChecked"] != "0" && covered {
			return nil
		}
		return fmt.Errorf("%v", body)
	})
	return body
}

// mutate makes n pools as root, each an audit row.
func (h *harness) mutate(t *testing.T, n int) {
	t.Helper()
	for i := range n {
		code, body := h.rest(t, h.root, "pools/create", fmt.Sprintf(`{"tenantId":"root","class":"gpu","name":"audited-%d"}`, i))
		if code != http.StatusOK {
			t.Fatalf("pools.create: %d %v", code, body)
		}
	}
}

func TestAuditVerify(t *testing.T) {
	t.Parallel()
	h, keyID := setupAuditKey(t)
	h.mutate(t, 3)
	body := h.settled(t, true)
	total := h.count(t, `SELECT count(*) FROM audit`)
	if body["recordsChecked"] != strconv.Itoa(total) || body["firstBadRecordId"] != "" || body["reason"] != "" {
		t.Fatalf("untouched chain of %d rows: %v", total, body)
	}
	cp := body["lastCheckpoint"].(map[string]any)
	if cp["keyId"] != keyID || cp["signature"] == "" || len(cp["headHash"].(string)) != 64 || cp["time"] == nil {
		t.Fatalf("checkpoint %v, want one signed by %s", cp, keyID)
	}

	t.Run("only on root", func(t *testing.T) {
		code, body := h.rest(t, h.root, "audit/verify", `{"tenantId":"acme"}`)
		wantREST(t, code, body, fault.InvalidInput, "tenantId")
		if !strings.Contains(body["message"].(string), "verify on root") {
			t.Fatalf("message %v", body)
		}
		_, tok := h.member(t, "acme", "auditor")
		h.policy(t, "acme", "members", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)
		code, body = h.rest(t, tok, "audit/verify", `{"tenantId":"root"}`)
		wantREST(t, code, body, fault.AccessDenied, "tenantId")
		h.settled(t, true)
	})

	t.Run("a changed row is named", func(t *testing.T) {
		var id int64
		if err := h.db.QueryRow(t.Context(), `SELECT id FROM audit WHERE action = 'compute:pools:create' ORDER BY chain_seq OFFSET 1 LIMIT 1`).Scan(&id); err != nil {
			t.Fatal(err)
		}
		if _, err := h.db.Exec(t.Context(), `UPDATE audit SET actor = 'idn_forged', detail = '{"name": "forged"}' WHERE id = $1`, id); err != nil {
			t.Fatal(err)
		}
		want := strconv.FormatInt(id, 10)
		body := h.verifyREST(t)
		if body["ok"] != false || body["firstBadRecordId"] != want || !strings.Contains(body["reason"].(string), "record "+want+" (chain position") {
			t.Fatalf("after changing record %s: %v", want, body)
		}
		v, err := computev1.NewAuditServiceClient(h.conn).Verify(as(h.root), &computev1.AuditServiceVerifyRequest{TenantId: "root"})
		if err != nil || v.GetOk() || v.GetFirstBadRecordId() != want {
			t.Fatalf("gRPC verify: %v %v", v, err)
		}
	})
}

func TestAuditVerifyWithoutAKey(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	h.mutate(t, 2)
	body := h.settled(t, false)
	if !strings.Contains(body["reason"].(string), "signatures were not checked") {
		t.Fatalf("verdict %v, want it to say signatures were not checked", body)
	}
}
