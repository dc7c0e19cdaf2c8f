package console_test

import (
	"bytes"
	"context"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/net/html"

	"github.com/bettercompute/bettercompute/pkg/bootstrap"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/consolesessions"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/services/api"
	"github.com/bettercompute/bettercompute/services/app"
)

// sessClock is the control plane's clock in these tests: real time plus
// what the test advanced it by.
type sessClock struct {
	mu  sync.Mutex
	off time.Duration
}

func (c *sessClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return time.Now().Add(c.off)
}

func (c *sessClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.off += d
}

// sessFixture is a control plane without a fleet (real PostgreSQL) whose
// API and console run on clock, with console sessions idle after 30
// minutes and over an hour after sign-in.
type sessFixture struct {
	*htFixture
	clock *sessClock
	db    *pgxpool.Pool
	root  string
}

func sessStart(t *testing.T) *sessFixture {
	t.Helper()
	dbURL := pgtest.NewDB(t)
	port := 0
	cfg := &config.Config{
		Database: config.Database{URL: dbURL},
		Server:   config.Server{Host: "127.0.0.1", Port: &port, NoMigrate: true},
		Console:  config.Console{SessionIdle: config.Duration(30 * time.Minute), SessionLifetime: config.Duration(time.Hour)},
	}
	cfg.Defaults()
	clock := &sessClock{}
	a, err := app.New(cfg, app.Options{API: api.Tuning{Now: clock.Now}})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Stop(context.Background()) })
	db, err := pgxpool.New(context.Background(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	cred, err := bootstrap.Run(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	return &sessFixture{htFixture: &htFixture{base: "http://" + a.Addr()}, clock: clock, db: db, root: cred.Token}
}

// sessions counts the console_sessions rows of session id.
func (f *sessFixture) rows(t *testing.T, id string) int {
	t.Helper()
	var n int
	if err := f.db.QueryRow(context.Background(), `SELECT count(*) FROM console_sessions WHERE id_hash = $1`, consolesessions.Hash(id)).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// signedIn says session opens a page (200), or was sent to sign in again
// (303 to login?expired=1, the cookie cleared); anything else fails.
func (f *sessFixture) signedIn(t *testing.T, session string) bool {
	t.Helper()
	resp, body := htDo(t, f.htFixture, htReq{path: "/console/reservations", session: session})
	switch {
	case resp.StatusCode == http.StatusOK:
		return true
	case resp.StatusCode == http.StatusSeeOther && resp.Header.Get("Location") == "/console/login?expired=1":
		for _, ck := range resp.Cookies() {
			if ck.Name == "bc_console" && ck.MaxAge < 0 {
				return false
			}
		}
		t.Fatalf("sent to sign in without clearing the cookie: %v", resp.Cookies())
	}
	t.Fatalf("GET /console/reservations: %d %q %s", resp.StatusCode, resp.Header.Get("Location"), body)
	return false
}

// token is the CSRF token session's pages carry.
func (f *sessFixture) token(t *testing.T, session string) string {
	t.Helper()
	_, body := htDo(t, f.htFixture, htReq{path: "/console/reservations", session: session})
	doc, err := html.Parse(strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	return htCSRF(t, doc, "create-reservation")
}

// TestConsoleLogoutEndsSessionServerSide: sign-out used to clear the cookie
// in the browser only, so a copy of the cookie (stolen, or kept by a
// shared machine) went on working. Now the session's row is deleted: the
// same cookie, replayed after sign-out, opens nothing and acts on nothing.
func TestConsoleLogoutEndsSessionServerSide(t *testing.T) {
	t.Parallel()
	f := sessStart(t)
	s := htLogin(t, f.htFixture, f.root)
	if !f.signedIn(t, s) || f.rows(t, s) != 1 {
		t.Fatal("a fresh session does not work")
	}
	token := f.token(t, s)
	resp, _ := htDo(t, f.htFixture, htReq{method: http.MethodPost, path: "/console/logout", session: s, form: url.Values{"csrf": {token}}})
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/console/login" {
		t.Fatalf("logout: %d %q", resp.StatusCode, resp.Header.Get("Location"))
	}
	if n := f.rows(t, s); n != 0 {
		t.Fatalf("%d rows of the session after sign-out", n)
	}
	if f.signedIn(t, s) {
		t.Fatal("the cookie replayed after sign-out still opens the console")
	}
	// Nor can it act: a reservation with the old cookie and its token is
	// not made (sent to sign in).
	resp, body := htDo(t, f.htFixture, htReq{method: http.MethodPost, path: "/console/reservations", session: s,
		form: url.Values{"csrf": {token}, "pool": {"sim"}, "gpus": {"1"}}})
	if resp.StatusCode != http.StatusSeeOther || !strings.HasPrefix(resp.Header.Get("Location"), "/console/login") {
		t.Fatalf("a POST with the signed-out cookie: %d %q %s", resp.StatusCode, resp.Header.Get("Location"), body)
	}
}

// TestConsoleCookieIsNotABearerKey: the cookie used to be the API key
// itself, so whoever read it (a log, a proxy, a browser extension) held a
// key that worked against the whole API, after sign-out too. Now it is a
// session id: refused as a bearer key, and neither it nor the key is in
// the sessions table in the clear.
func TestConsoleCookieIsNotABearerKey(t *testing.T) {
	t.Parallel()
	f := sessStart(t)
	s := htLogin(t, f.htFixture, f.root)
	if s == f.root || strings.Contains(s, "bck_") || strings.Contains(f.root, s) {
		t.Fatalf("the cookie %q carries the key", s)
	}
	var out struct{}
	err := htAPI(t, f.htFixture, s, "system/whoAmI", map[string]any{}, &out)
	if err == nil || !strings.Contains(err.Error(), "401") || !strings.Contains(err.Error(), "UNAUTHENTICATED") {
		t.Fatalf("the cookie as a bearer key: %v, want 401 UNAUTHENTICATED", err)
	}
	var hash, sealed []byte
	if err := f.db.QueryRow(context.Background(), `SELECT id_hash, sealed_key FROM console_sessions`).Scan(&hash, &sealed); err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(hash, []byte(s)) || bytes.Contains(sealed, []byte(f.root)) || bytes.Contains(sealed, []byte(s)) {
		t.Fatal("the sessions table holds the session id or the key in the clear")
	}
	// The console still acts as the key.
	if !f.signedIn(t, s) {
		t.Fatal("the session does not open the console")
	}
}

// TestConsoleSessionIdleExpiry: a session ends after console.sessionIdle
// (30m here) without a request, and console.sessionLifetime (1h here)
// after sign-in however active; ended rows are pruned at the next sign-in.
// Time is the control plane's injected clock, not sleeps.
func TestConsoleSessionIdleExpiry(t *testing.T) {
	t.Parallel()
	f := sessStart(t)
	idle := htLogin(t, f.htFixture, f.root)
	f.clock.Advance(29 * time.Minute)
	if !f.signedIn(t, idle) {
		t.Fatal("ended before 30 idle minutes")
	}
	f.clock.Advance(29 * time.Minute) // 58m after sign-in, 29m idle
	if !f.signedIn(t, idle) {
		t.Fatal("a request did not keep the session alive")
	}
	f.clock.Advance(31 * time.Minute)
	if f.signedIn(t, idle) {
		t.Fatal("a session idle for 31 minutes still opens the console")
	}

	active := htLogin(t, f.htFixture, f.root)
	if f.rows(t, idle) != 0 {
		t.Fatal("the idle session's row was not pruned at the next sign-in")
	}
	for range 2 {
		f.clock.Advance(25 * time.Minute)
		if !f.signedIn(t, active) {
			t.Fatal("an active session ended before its lifetime")
		}
	}
	f.clock.Advance(25 * time.Minute) // 75m after sign-in, 25m idle
	if f.signedIn(t, active) {
		t.Fatal("a session past its lifetime still opens the console")
	}
}

// TestConsoleCSRFIsBoundToTheSession: the CSRF token used to be derived
// from the API key, so every session of a key, and a token from a session
// that ended, stayed valid for all of them. Now it is an HMAC of the
// session id: another session's token, even of the same key, is refused
// (403, nothing done), and each sign-in gets a new one.
func TestConsoleCSRFIsBoundToTheSession(t *testing.T) {
	t.Parallel()
	f := sessStart(t)
	a := htLogin(t, f.htFixture, f.root)
	b := htLogin(t, f.htFixture, f.root)
	ta, tb := f.token(t, a), f.token(t, b)
	if ta == tb {
		t.Fatal("two sessions of one key share a CSRF token")
	}
	resp, _ := htDo(t, f.htFixture, htReq{method: http.MethodPost, path: "/console/logout", session: b, form: url.Values{"csrf": {ta}}})
	if resp.StatusCode != http.StatusForbidden || f.rows(t, b) != 1 {
		t.Fatalf("session b with session a's token: %d (rows %d), want 403 and b alive", resp.StatusCode, f.rows(t, b))
	}
	resp, _ = htDo(t, f.htFixture, htReq{method: http.MethodPost, path: "/console/logout", session: b, form: url.Values{"csrf": {tb}}})
	if resp.StatusCode != http.StatusSeeOther || f.rows(t, b) != 0 {
		t.Fatalf("session b with its own token: %d (rows %d)", resp.StatusCode, f.rows(t, b))
	}
	if !f.signedIn(t, a) {
		t.Fatal("ending session b ended session a")
	}
}
