package sites_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/sites"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// fieldOf is the field of err's first *fault.Error.
func fieldOf(err error) string {
	if fe, ok := fault.As(err); ok {
		return fe.Field
	}
	return ""
}

func TestSites(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t)
	s, err := sites.Create(ctx, db, sites.Site{ID: sites.NewID(), TenantID: "root", Name: "fra1", Labels: map[string]string{"dc": "fra"}})
	if err != nil {
		t.Fatal(err)
	}
	if s.Generation != 1 || s.BootHolder != "" || s.BootEpoch != 0 || s.Labels["dc"] != "fra" {
		t.Fatalf("created %+v", s)
	}
	if _, err := sites.Create(ctx, db, sites.Site{ID: sites.NewID(), TenantID: "root", Name: "fra1"}); fault.CodeOf(err) != fault.Conflict || fieldOf(err) != "name" {
		t.Fatalf("a second fra1: %v, want CONFLICT on name", err)
	}
	if _, err := sites.Get(ctx, db, "other", s.ID); fault.CodeOf(err) != fault.NotFound || fieldOf(err) != "siteId" {
		t.Fatalf("get from another tenant: %v, want NOT_FOUND on siteId", err)
	}
	got, err := sites.List(ctx, db, "root", "", 10)
	if err != nil || len(got) != 1 || got[0].ID != s.ID {
		t.Fatalf("list: %+v %v", got, err)
	}
	a, err := sites.CreateAgent(ctx, db, sites.Agent{ID: sites.NewAgentID(), TenantID: "root", SiteID: s.ID, Hostname: "pxe-1"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sites.AcquireLease(ctx, db, s.ID, a.ID, time.Minute); err != nil {
		t.Fatal(err)
	}
	if err := sites.Delete(ctx, db, "root", s.ID); fault.CodeOf(err) != fault.Conflict {
		t.Fatalf("delete with a live boot lease: %v, want CONFLICT", err)
	}
	if _, err := sites.RevokeAgent(ctx, db, s.ID, a.ID); err != nil {
		t.Fatal(err)
	}
	if err := sites.Delete(ctx, db, "root", s.ID); err != nil {
		t.Fatalf("delete once its agent is revoked: %v", err)
	}
	if _, err := sites.GetAgent(ctx, db, a.ID); fault.CodeOf(err) != fault.NotFound {
		t.Fatalf("the agent outlived its site: %v", err)
	}
}

func TestTokens(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t)
	s, err := sites.Create(ctx, db, sites.Site{ID: sites.NewID(), TenantID: "root", Name: "ams1"})
	if err != nil {
		t.Fatal(err)
	}
	mint := func(uses int, ttl time.Duration) sites.MintedToken {
		m := sites.MintToken()
		if _, err := sites.CreateToken(ctx, db, sites.Token{ID: m.ID, TenantID: "root", SiteID: s.ID, Uses: uses,
			ExpiresAt: time.Now().Add(ttl)}, m.Hash); err != nil {
			t.Fatal(err)
		}
		return m
	}
	m := mint(1, time.Hour)
	if !sites.IsToken(m.Token) || sites.IsToken("bcjt_"+m.Token[5:]) {
		t.Fatalf("IsToken(%q) wrong", m.Token)
	}
	tok, err := sites.RedeemToken(ctx, db, m.Token)
	if err != nil || tok.SiteID != s.ID || tok.UsesLeft != 0 {
		t.Fatalf("redeem: %+v %v", tok, err)
	}
	cases := []struct {
		name  string
		token string
		want  error
	}{
		{"spent", m.Token, sites.ErrTokenExhausted},
		{"malformed", "bcst_nope", sites.ErrTokenMalformed},
		{"wrong secret", wrongSecret(m.Token), sites.ErrTokenUnknown},
		{"expired", mint(1, -time.Second).Token, sites.ErrTokenExpired},
	}
	revoked := mint(3, time.Hour)
	if _, err := sites.RevokeToken(ctx, db, "root", s.ID, revoked.ID); err != nil {
		t.Fatal(err)
	}
	cases = append(cases, struct {
		name  string
		token string
		want  error
	}{"revoked", revoked.Token, sites.ErrTokenRevoked})
	for _, c := range cases {
		_, err := sites.RedeemToken(ctx, db, c.token)
		if !errors.Is(err, c.want) || fault.CodeOf(err) != fault.Unauthenticated || fieldOf(err) != "sealedToken" {
			t.Errorf("%s: %v, want UNAUTHENTICATED sealedToken %v", c.name, err, c.want)
		}
	}

	// Concurrent redemptions never spend more uses than a token has.
	five := mint(5, time.Hour)
	var ok atomic.Int32
	var wg sync.WaitGroup
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := sites.RedeemToken(ctx, db, five.Token); err == nil {
				ok.Add(1)
			} else if !errors.Is(err, sites.ErrTokenExhausted) {
				t.Errorf("concurrent redeem: %v", err)
			}
		}()
	}
	wg.Wait()
	if ok.Load() != 5 {
		t.Fatalf("%d of 20 concurrent redemptions of a 5-use token succeeded", ok.Load())
	}

	// Prune keeps tokens until 30 days after they end.
	if _, err := db.Exec(ctx, `UPDATE site_tokens SET revoked_at = now() - interval '31 days' WHERE id = $1`, revoked.ID); err != nil {
		t.Fatal(err)
	}
	n, err := sites.PruneTokens(ctx, db, 100)
	if err != nil || n != 1 {
		t.Fatalf("prune: %d %v, want the one token revoked 31 days ago", n, err)
	}
}

// TestBootLease: one holder at a time; a standby takes over only once the
// lease lapsed, with a new epoch; the old holder's writes are fenced.
func TestBootLease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t)
	s, err := sites.Create(ctx, db, sites.Site{ID: sites.NewID(), TenantID: "root", Name: "lax1"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sites.AcquireLease(ctx, db, s.ID, "sag_a", 0); fault.CodeOf(err) != fault.InvalidInput {
		t.Fatalf("a zero ttl: %v, want INVALID_INPUT", err)
	}
	a, err := sites.AcquireLease(ctx, db, s.ID, "sag_a", time.Minute)
	if err != nil || !a.Held("sag_a") || a.Epoch != 1 {
		t.Fatalf("first take: %+v %v", a, err)
	}
	b, err := sites.AcquireLease(ctx, db, s.ID, "sag_b", time.Minute)
	if err != nil || b.Held("sag_b") || b.Holder != "sag_a" || b.Epoch != 1 {
		t.Fatalf("standby while a holds it: %+v %v", b, err)
	}
	renew, err := sites.AcquireLease(ctx, db, s.ID, "sag_a", time.Minute)
	if err != nil || !renew.Held("sag_a") || renew.Epoch != 1 || renew.ExpiresAt.Before(a.ExpiresAt) {
		t.Fatalf("renewal: %+v %v, want the same epoch, a later expiry", renew, err)
	}
	if err := sites.CheckFence(ctx, db, s.ID, "sag_a", 1); err != nil {
		t.Fatalf("the holder's fence: %v", err)
	}
	// a stops renewing (paused past its lease).
	if _, err := db.Exec(ctx, `UPDATE sites SET boot_expires_at = now() - interval '1 second' WHERE id = $1`, s.ID); err != nil {
		t.Fatal(err)
	}
	if err := sites.CheckFence(ctx, db, s.ID, "sag_a", 1); !errors.Is(err, sites.ErrFenced) {
		t.Fatalf("a lapsed holder's write: %v, want fenced", err)
	}
	b, err = sites.AcquireLease(ctx, db, s.ID, "sag_b", time.Minute)
	if err != nil || !b.Held("sag_b") || b.Epoch != 2 {
		t.Fatalf("take-over: %+v %v, want sag_b at epoch 2", b, err)
	}
	// a resumes: it cannot take the lease back, and its epoch is stale.
	back, err := sites.AcquireLease(ctx, db, s.ID, "sag_a", time.Minute)
	if err != nil || back.Held("sag_a") {
		t.Fatalf("the resumed holder: %+v %v, want refused", back, err)
	}
	for _, f := range []struct {
		agent string
		epoch int64
	}{{"sag_a", 1}, {"sag_a", 2}, {"sag_b", 1}} {
		if err := sites.CheckFence(ctx, db, s.ID, f.agent, f.epoch); fault.CodeOf(err) != fault.Conflict || fieldOf(err) != "bootEpoch" {
			t.Errorf("fence %s@%d: %v, want CONFLICT on bootEpoch", f.agent, f.epoch, err)
		}
	}
	if err := sites.CheckFence(ctx, db, s.ID, "sag_b", 2); err != nil {
		t.Fatal(err)
	}
	// Release hands over at once.
	if err := sites.ReleaseLease(ctx, db, s.ID, "sag_b"); err != nil {
		t.Fatal(err)
	}
	a, err = sites.AcquireLease(ctx, db, s.ID, "sag_a", time.Minute)
	if err != nil || !a.Held("sag_a") || a.Epoch != 3 {
		t.Fatalf("after release: %+v %v, want sag_a at epoch 3", a, err)
	}
}

// wrongSecret is tok with its last two characters changed (to "aa", or
// "bb" when they were "aa": a fixed suffix matched the real token one run
// in a thousand).
func wrongSecret(tok string) string {
	suffix := "aa"
	if strings.HasSuffix(tok, suffix) {
		suffix = "bb"
	}
	return tok[:len(tok)-2] + suffix
}
