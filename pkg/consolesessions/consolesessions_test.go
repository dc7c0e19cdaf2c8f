package consolesessions_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/consolesessions"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestSessions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t)
	ident, err := iam.CreateIdentity(ctx, db, iam.Identity{ID: iam.NewID("idn"), TenantID: "root", Kind: iam.KindUser, Name: "ops"})
	if err != nil {
		t.Fatal(err)
	}
	key := iam.NewKey()
	if _, err := iam.CreateKey(ctx, db, iam.APIKey{ID: key.ID, IdentityID: ident.ID, TenantID: "root"}, key.Hash); err != nil {
		t.Fatal(err)
	}
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	idle := 30 * time.Minute
	mk := func(id string, at time.Time) []byte {
		t.Helper()
		h := consolesessions.Hash(id)
		if err := consolesessions.Create(ctx, db, consolesessions.Session{IDHash: h, KeyID: key.ID, IdentityID: ident.ID,
			SealedKey: []byte("sealed"), CreatedAt: at, ExpiresAt: at.Add(12 * time.Hour)}); err != nil {
			t.Fatal(err)
		}
		return h
	}
	a := mk("a", t0)
	s, err := consolesessions.Touch(ctx, db, a, t0.Add(29*time.Minute), idle)
	if err != nil || s.KeyID != key.ID || s.IdentityID != ident.ID || !bytes.Equal(s.SealedKey, []byte("sealed")) {
		t.Fatalf("touch: %+v %v", s, err)
	}
	// Seen at 29m, so alive at 58m; not at 59m+ without a request.
	if _, err := consolesessions.Touch(ctx, db, a, t0.Add(58*time.Minute), idle); err != nil {
		t.Fatal(err)
	}
	if _, err := consolesessions.Touch(ctx, db, a, t0.Add(88*time.Minute), idle); !errors.Is(err, consolesessions.ErrNotFound) {
		t.Fatalf("idle session: %v", err)
	}
	// Past its lifetime, however active.
	b := mk("b", t0)
	for m := time.Duration(0); m <= 12*time.Hour; m += 20 * time.Minute {
		_, err := consolesessions.Touch(ctx, db, b, t0.Add(m), idle)
		if (m < 12*time.Hour) != (err == nil) {
			t.Fatalf("at %s: %v", m, err)
		}
	}
	// Sign-out.
	c := mk("c", t0)
	if err := consolesessions.Delete(ctx, db, c); err != nil {
		t.Fatal(err)
	}
	if _, err := consolesessions.Touch(ctx, db, c, t0, idle); !errors.Is(err, consolesessions.ErrNotFound) {
		t.Fatalf("deleted session: %v", err)
	}
	// Retention: ended rows are pruned, live ones kept.
	d := mk("d", t0.Add(12*time.Hour))
	n, err := consolesessions.Prune(ctx, db, t0.Add(12*time.Hour+time.Minute), idle)
	if err != nil || n != 2 {
		t.Fatalf("pruned %d (%v), want a and b", n, err)
	}
	if _, err := consolesessions.Touch(ctx, db, d, t0.Add(12*time.Hour+2*time.Minute), idle); err != nil {
		t.Fatalf("the live session after the prune: %v", err)
	}
	// An identity keeps at most MaxPerIdentity sessions: the oldest go.
	for i := range consolesessions.MaxPerIdentity + 3 {
		mk(fmt.Sprintf("e%d", i), t0.Add(12*time.Hour+time.Duration(i+1)*time.Second))
	}
	var count int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM console_sessions WHERE identity_id = $1`, ident.ID).Scan(&count); err != nil {
		t.Fatal(err)
	}
	if count != consolesessions.MaxPerIdentity {
		t.Fatalf("%d sessions kept, want %d", count, consolesessions.MaxPerIdentity)
	}
	if _, err := consolesessions.Touch(ctx, db, d, t0.Add(12*time.Hour+3*time.Minute), idle); !errors.Is(err, consolesessions.ErrNotFound) {
		t.Fatalf("the oldest session past the bound: %v", err)
	}
}
