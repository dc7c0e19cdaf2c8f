package secrets_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/secrets"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func keyring(t *testing.T, keys ...[]byte) *secrets.Keyring {
	t.Helper()
	kr, err := secrets.NewKeyring(keys...)
	if err != nil {
		t.Fatal(err)
	}
	return kr
}

// TestSealedAtRest: a secret is stored as ciphertext (the plaintext's bytes
// are in no column), opens with its keyring, and does not open with another
// key, in another tenant, or after any byte of its row is changed or its
// row is copied onto another secret.
func TestSealedAtRest(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t)
	key := secrets.NewKey()
	kr := keyring(t, key)
	plain := secrets.BMCCredentials{Username: "admin", Password: "pa55-Hunter2-unique"}.Marshal()
	id := secrets.NewID()
	if err := secrets.Put(ctx, db, kr, secrets.Secret{ID: id, TenantID: "root", Kind: secrets.KindBMC, Plain: plain}); err != nil {
		t.Fatal(err)
	}
	var keyID string
	var nonce, ct []byte
	if err := db.QueryRow(ctx, `SELECT key_id, nonce, ciphertext FROM secrets WHERE id = $1`, id).Scan(&keyID, &nonce, &ct); err != nil {
		t.Fatal(err)
	}
	if keyID != kr.KeyID() || keyID != secrets.KeyID(key) || len(keyID) != 16 {
		t.Fatalf("key id %q, want %q (16 hex digits)", keyID, kr.KeyID())
	}
	if bytes.Contains(ct, []byte("pa55-Hunter2-unique")) || bytes.Contains(ct, []byte("admin")) {
		t.Fatal("the ciphertext holds the plaintext")
	}
	var anywhere int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM secrets s WHERE position('pa55-Hunter2-unique'::bytea IN s.ciphertext) > 0
		OR position('pa55-Hunter2-unique'::bytea IN s.nonce) > 0 OR s::text LIKE '%pa55-Hunter2%'`).Scan(&anywhere); err != nil || anywhere != 0 {
		t.Fatalf("%d rows hold the password (%v)", anywhere, err)
	}

	got, err := secrets.Open(ctx, db, kr, "root", id)
	if err != nil || !bytes.Equal(got, plain) {
		t.Fatalf("open: %q %v", got, err)
	}
	creds, err := secrets.ParseBMC(got)
	if err != nil || creds.Password != "pa55-Hunter2-unique" {
		t.Fatalf("parse: %v %v", creds, err)
	}

	// Another key does not open it.
	if _, err := secrets.Open(ctx, db, keyring(t, secrets.NewKey()), "root", id); !errors.Is(err, secrets.ErrUnknownKey) {
		t.Fatalf("open with another key: %v, want ErrUnknownKey", err)
	}
	// Another tenant does not find it.
	if _, err := secrets.Open(ctx, db, kr, "acme", id); fault.CodeOf(err) != fault.NotFound || !errors.Is(err, secrets.ErrNotFound) {
		t.Fatalf("open in another tenant: %v, want NOT_FOUND", err)
	}
	// A changed ciphertext, nonce or tenant does not open.
	for _, tamper := range []string{
		`UPDATE secrets SET ciphertext = set_byte(ciphertext, 0, get_byte(ciphertext, 0) # 1) WHERE id = $1`,
		`UPDATE secrets SET nonce = set_byte(nonce, 3, get_byte(nonce, 3) # 128) WHERE id = $1`,
		`UPDATE secrets SET nonce = substring(nonce FROM 2) WHERE id = $1`,
	} {
		t.Run(tamper[:30], func(t *testing.T) {
			tx, err := db.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback(ctx) }()
			if _, err := tx.Exec(ctx, tamper, id); err != nil {
				t.Fatal(err)
			}
			if _, err := secrets.Open(ctx, tx, kr, "root", id); !errors.Is(err, secrets.ErrTampered) {
				t.Fatalf("opened a tampered row: %v", err)
			}
		})
	}
	// The row copied onto another id (or tenant) does not open there.
	other := secrets.NewID()
	fixture.Tenant(t, db, fixture.TenantOpts{ID: "acme"})
	if _, err := db.Exec(ctx, `INSERT INTO secrets (id, tenant_id, kind, key_id, nonce, ciphertext)
		SELECT $2, tenant_id, kind, key_id, nonce, ciphertext FROM secrets WHERE id = $1`, id, other); err != nil {
		t.Fatal(err)
	}
	if _, err := secrets.Open(ctx, db, kr, "root", other); !errors.Is(err, secrets.ErrTampered) {
		t.Fatalf("a row copied to another id opened: %v", err)
	}
	if _, err := db.Exec(ctx, `INSERT INTO secrets (id, tenant_id, kind, key_id, nonce, ciphertext)
		SELECT id || 'x', 'acme', kind, key_id, nonce, ciphertext FROM secrets WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
	if _, err := secrets.Open(ctx, db, kr, "acme", id+"x"); !errors.Is(err, secrets.ErrTampered) {
		t.Fatalf("a row copied to another tenant opened: %v", err)
	}

	// Metadata without opening; delete.
	m, err := secrets.Get(ctx, db, "root", id)
	if err != nil || m.Kind != secrets.KindBMC || m.KeyID != kr.KeyID() {
		t.Fatalf("get: %+v %v", m, err)
	}
	if err := secrets.Delete(ctx, db, "root", id); err != nil {
		t.Fatal(err)
	}
	if _, err := secrets.Open(ctx, db, kr, "root", id); fault.CodeOf(err) != fault.NotFound {
		t.Fatalf("open after delete: %v", err)
	}
	if err := secrets.Delete(ctx, db, "root", id); fault.CodeOf(err) != fault.NotFound {
		t.Fatalf("delete twice: %v", err)
	}
	// No keyring: UNSUPPORTED naming the setting.
	err = secrets.Put(ctx, db, nil, secrets.Secret{ID: secrets.NewID(), TenantID: "root", Kind: secrets.KindBMC, Plain: plain})
	if fe, ok := fault.As(err); !ok || fe.Code != fault.Unsupported || fe.Field != "secrets.keyFile" {
		t.Fatalf("put without a keyring: %v", err)
	}
}

// TestKeyRotation: a keyring of a new key followed by the old one seals with
// the new key and opens what the old one sealed; Reseal moves the old rows
// to the new key, after which the new key alone opens everything.
func TestKeyRotation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t)
	oldKey, newKey := secrets.NewKey(), secrets.NewKey()
	old := keyring(t, oldKey)
	var ids []string
	for i := range 3 {
		id := secrets.NewID()
		ids = append(ids, id)
		if err := secrets.Put(ctx, db, old, secrets.Secret{ID: id, TenantID: "root", Kind: secrets.KindBMC, Plain: fmt.Appendf(nil, "p%d", i)}); err != nil {
			t.Fatal(err)
		}
	}
	rotated := keyring(t, newKey, oldKey)
	if rotated.KeyID() != secrets.KeyID(newKey) {
		t.Fatalf("the rotated keyring seals with %s, want the new key %s", rotated.KeyID(), secrets.KeyID(newKey))
	}
	fresh := secrets.NewID()
	if err := secrets.Put(ctx, db, rotated, secrets.Secret{ID: fresh, TenantID: "root", Kind: secrets.KindBMC, Plain: []byte("new")}); err != nil {
		t.Fatal(err)
	}
	if m, _ := secrets.Get(ctx, db, "root", fresh); m.KeyID != secrets.KeyID(newKey) {
		t.Fatalf("sealed by %s, want the new key", m.KeyID)
	}
	for i, id := range ids {
		if got, err := secrets.Open(ctx, db, rotated, "root", id); err != nil || string(got) != fmt.Sprintf("p%d", i) {
			t.Fatalf("the old key's secret %s with the rotated keyring: %q %v", id, got, err)
		}
	}
	if _, err := secrets.Open(ctx, db, old, "root", fresh); !errors.Is(err, secrets.ErrUnknownKey) {
		t.Fatalf("the old keyring opened a secret of the new key: %v", err)
	}
	newOnly := keyring(t, newKey)
	if _, err := secrets.Open(ctx, db, newOnly, "root", ids[0]); !errors.Is(err, secrets.ErrUnknownKey) {
		t.Fatalf("the new key alone opened an old secret before Reseal: %v", err)
	}
	n, err := secrets.Reseal(ctx, db, rotated, 2)
	if err != nil || n != 2 {
		t.Fatalf("reseal: %d %v, want 2 (the limit)", n, err)
	}
	if n, err = secrets.Reseal(ctx, db, rotated, 100); err != nil || n != 1 {
		t.Fatalf("reseal the rest: %d %v, want 1", n, err)
	}
	if n, err = secrets.Reseal(ctx, db, rotated, 100); err != nil || n != 0 {
		t.Fatalf("reseal when done: %d %v, want 0", n, err)
	}
	for i, id := range ids {
		if got, err := secrets.Open(ctx, db, newOnly, "root", id); err != nil || string(got) != fmt.Sprintf("p%d", i) {
			t.Fatalf("after reseal, the new key alone: %q %v", got, err)
		}
	}
}

// TestKeyFiles: raw, hex and base64 key files load to the same key id; a
// short file, a missing file and a keyring of one key twice are refused,
// naming secrets.keyFile; EnsureKeyFile makes a 0600 key once and reuses
// it.
func TestKeyFiles(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	key := secrets.NewKey()
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	raw := write("raw", key)
	hx := write("hex", []byte(hex.EncodeToString(key)+"\n"))
	b64 := write("b64", []byte(base64.StdEncoding.EncodeToString(key)+"\n"))
	for _, p := range []string{raw, hx, b64} {
		kr, err := secrets.LoadKeyring(p)
		if err != nil || kr.KeyID() != secrets.KeyID(key) {
			t.Fatalf("%s: %v %v", p, kr, err)
		}
	}
	for name, paths := range map[string][]string{
		"short":   {write("short", key[:16])},
		"missing": {filepath.Join(dir, "nope")},
		"twice":   {raw, hx},
	} {
		if _, err := secrets.LoadKeyring(paths...); fault.CodeOf(err) != fault.InvalidConfig || !strings.Contains(err.Error(), "secrets.keyFile") {
			t.Errorf("%s: %v, want INVALID_CONFIG on secrets.keyFile", name, err)
		}
	}
	made := filepath.Join(dir, "dev", "pki", "secrets.key")
	kr1, err := secrets.EnsureKeyFile(made)
	if err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(made)
	if err != nil || st.Mode().Perm() != 0o600 || st.Size() != secrets.KeySize {
		t.Fatalf("made %v %v, want a 0600 file of 32 bytes", st, err)
	}
	kr2, err := secrets.EnsureKeyFile(made)
	if err != nil || kr2.KeyID() != kr1.KeyID() {
		t.Fatalf("a second EnsureKeyFile: %v %v, want the same key", kr2, err)
	}
	if !bytes.Equal(kr1.Fingerprint([]byte("x")), kr2.Fingerprint([]byte("x"))) ||
		bytes.Equal(kr1.Fingerprint([]byte("x")), keyring(t, secrets.NewKey()).Fingerprint([]byte("x"))) {
		t.Fatal("fingerprints: want equal under one key, different under another")
	}
}

// TestBMCCredentialsRedact: no printed or logged form of BMCCredentials
// holds the password; its JSON (the sealed payload) does.
func TestBMCCredentialsRedact(t *testing.T) {
	t.Parallel()
	c := secrets.BMCCredentials{Username: "admin", Password: "s3cr3t-P4ss"}
	var logged bytes.Buffer
	lg := slog.New(slog.NewJSONHandler(&logged, nil))
	lg.Info("bmc", "creds", c)
	slog.New(slog.NewTextHandler(&logged, nil)).Info("bmc", "creds", c, "ptr", &c)
	forms := []string{c.String(), fmt.Sprint(c), fmt.Sprintf("%v %+v %#v %s %q %x", c, c, c, c, c, c), fmt.Sprintf("%v", &c), logged.String()}
	for _, f := range forms {
		if strings.Contains(f, "s3cr3t") {
			t.Errorf("a printed form holds the password: %s", f)
		}
	}
	if !strings.Contains(logged.String(), "admin") {
		t.Errorf("the log lost the user name: %s", logged.String())
	}
	if !bytes.Contains(c.Marshal(), []byte("s3cr3t-P4ss")) {
		t.Error("the payload lost the password")
	}
	for _, bad := range []secrets.BMCCredentials{{Password: "x"}, {Username: "a"}, {Username: strings.Repeat("u", 257), Password: "x"},
		{Username: "a", Password: strings.Repeat("p", 1025)}} {
		if err := bad.Validate(); err == nil {
			t.Errorf("%v validated", bad)
		}
	}
	if _, err := secrets.ParseBMC([]byte(`{"username":"a","password":"s3cr3t-P4ss"`)); err == nil || strings.Contains(err.Error(), "s3cr3t") {
		t.Errorf("parse of a broken payload: %v", err)
	}
}
