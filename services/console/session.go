package console

import (
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
	"github.com/bettercompute/bettercompute/proto/client"

	"github.com/bettercompute/bettercompute/pkg/consolesessions"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/services/api"
)

// CookieName is the session cookie: it holds the session id (never the API
// key), the key of a server-side session (table console_sessions).
const CookieName = "bc_console"

// sessionIDLen is the length of a session id: 32 random bytes, base64url.
const sessionIDLen = 43

// Limits on what the console reads from a request.
const (
	// maxFormBytes bounds a POST body.
	maxFormBytes = 64 << 10
	// maxKeyLen bounds an API key (bck_<id>.<secret>).
	maxKeyLen = 512
	// maxField bounds every other form or query field.
	maxField = 256
	// maxTenantLen bounds a tenant id.
	maxTenantLen = 253
)

// csrfLabel is what the CSRF token is a MAC of, keyed by the session id;
// sealLabel the same for the key that seals the session's API key.
const (
	csrfLabel = "bettercompute console csrf v1"
	sealLabel = "bettercompute console seal v1"
)

// session is a signed-in request: its session id and API key, who it is
// and the tenant the page is about.
type session struct {
	id   string
	key  string
	host string
	// CSRF is the token every form of this session carries.
	CSRF string
	// Who is the key's identity (system.whoAmI).
	Who *computev1.WhoAmIResponse
	// Tenant is the page's tenant: the tenant query or form field, else the
	// identity's own.
	Tenant string
	ctx    context.Context
}

// Selected says the page is about another tenant than the identity's own.
func (s *session) Selected() bool { return s.Who != nil && s.Tenant != s.Who.GetTenantId() }

// csrfToken derives the CSRF token of a session from its id: unforgeable
// without the HttpOnly cookie, and different for every session.
func csrfToken(id string) string {
	return base64.RawURLEncoding.EncodeToString(mac(id, csrfLabel))
}

func mac(id, label string) []byte {
	m := hmac.New(sha256.New, []byte(id))
	m.Write([]byte(label))
	return m.Sum(nil)
}

// newSessionID is a fresh session id: 256 random bits.
func newSessionID() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	return base64.RawURLEncoding.EncodeToString(b)
}

// sessionAEAD is the cipher that seals a session's API key: AES-256-GCM
// under a key derived from the session id, which only the browser holds.
func sessionAEAD(id string) cipher.AEAD {
	block, err := aes.NewCipher(mac(id, sealLabel))
	if err != nil {
		panic(err) // a 32-byte key always makes a cipher
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		panic(err)
	}
	return aead
}

// sealKey seals key for the session id (bound to the row's id hash).
func sealKey(id, key string) []byte {
	aead := sessionAEAD(id)
	nonce := make([]byte, aead.NonceSize())
	_, _ = rand.Read(nonce)
	return aead.Seal(nonce, nonce, []byte(key), consolesessions.Hash(id))
}

// openKey opens what sealKey sealed.
func openKey(id string, sealed []byte) (string, error) {
	aead := sessionAEAD(id)
	if len(sealed) < aead.NonceSize() {
		return "", errors.New("sealed key too short")
	}
	key, err := aead.Open(nil, sealed[:aead.NonceSize()], sealed[aead.NonceSize():], consolesessions.Hash(id))
	if err != nil {
		return "", fmt.Errorf("open the session's key: %w", err)
	}
	return string(key), nil
}

// validKey checks the shape of an API key before it goes anywhere.
func validKey(key string) error {
	switch {
	case key == "":
		return fault.New(fault.InvalidInput, "key", "enter an API key (bck_…)")
	case len(key) > maxKeyLen:
		return fault.New(fault.InvalidInput, "key", "at most %d characters, got %d", maxKeyLen, len(key))
	}
	for _, r := range key {
		if (r < 'a' || r > 'z') && (r < 'A' || r > 'Z') && (r < '0' || r > '9') && r != '_' && r != '.' && r != '-' {
			return fault.New(fault.InvalidInput, "key", "an API key has only letters, digits and _ . -")
		}
	}
	return nil
}

// clientHost is the request's client address without its port, behind
// the trusted proxies.
func (c *Console) clientHost(r *http.Request) string {
	return c.cfg.TrustedProxies.FromRequest(r)
}

// loopbackHost says the request named a loopback host (plain HTTP to it
// may carry a cookie without Secure).
func loopbackHost(r *http.Request) bool {
	h := r.Host
	if hh, _, err := net.SplitHostPort(h); err == nil {
		h = hh
	}
	h = strings.Trim(h, "[]")
	if strings.EqualFold(h, "localhost") {
		return true
	}
	ip := net.ParseIP(h)
	return ip != nil && ip.IsLoopback()
}

// sessionCookie is the cookie that holds session id (or clears it when id
// is ""). It lives no longer than the session's lifetime.
func (c *Console) sessionCookie(r *http.Request, id string) *http.Cookie {
	ck := &http.Cookie{
		Name: CookieName, Value: id, Path: Prefix, HttpOnly: true, SameSite: http.SameSiteStrictMode,
		Secure: r.TLS != nil || !loopbackHost(r), MaxAge: int(c.lifetime.Seconds()),
	}
	if id == "" {
		ck.MaxAge = -1
	}
	return ck
}

// sessionID is the session id the request's cookie holds, if it is shaped
// like one.
func sessionID(r *http.Request) (string, bool) {
	ck, err := r.Cookie(CookieName)
	if err != nil || len(ck.Value) != sessionIDLen {
		return "", false
	}
	if _, err := base64.RawURLEncoding.DecodeString(ck.Value); err != nil {
		return "", false
	}
	return ck.Value, true
}

// errNoSession is lookup's answer for a request without a live session.
var errNoSession = errors.New("no console session")

// lookup finds the request's live session and marks it seen: its id and
// API key, or errNoSession (no cookie, an unknown, ended or idle session),
// or the database's error.
func (c *Console) lookup(r *http.Request) (id, key string, err error) {
	id, ok := sessionID(r)
	if !ok {
		return "", "", errNoSession
	}
	row, err := consolesessions.Touch(r.Context(), c.cfg.DB, consolesessions.Hash(id), c.now(), c.idle)
	if errors.Is(err, consolesessions.ErrNotFound) {
		return "", "", errNoSession
	}
	if err != nil {
		return "", "", err
	}
	if key, err = openKey(id, row.SealedKey); err != nil {
		return "", "", err
	}
	return id, key, nil
}

// open reads the request's session and asks the API who it is; without a
// live session, or with a key the API no longer takes, it redirects to the
// sign-in page (ending the session and clearing the cookie) and reports
// false.
func (c *Console) open(w http.ResponseWriter, r *http.Request) (*session, bool) {
	id, key, err := c.lookup(r)
	if err != nil {
		if errors.Is(err, errNoSession) {
			if _, had := sessionID(r); had {
				http.SetCookie(w, c.sessionCookie(r, ""))
				http.Redirect(w, r, Prefix+"login?expired=1", http.StatusSeeOther)
			} else {
				http.Redirect(w, r, Prefix+"login", http.StatusSeeOther)
			}
			return nil, false
		}
		c.logger.Error("console: look up session", "err", err)
		c.renderLogin(w, r, http.StatusServiceUnavailable, fault.New(fault.Unavailable, "", "the console cannot check its sessions now; retry"))
		return nil, false
	}
	s := &session{id: id, key: key, host: c.clientHost(r), CSRF: csrfToken(id)}
	s.ctx = api.AsCaller(r.Context(), key, s.host)
	who, err := computev1.NewSystemServiceClient(c.cfg.Conn).WhoAmI(s.ctx, &computev1.WhoAmIRequest{})
	if err != nil {
		if env := client.EnvelopeOf(err); env.Code == client.CodeUnauthenticated {
			// The key was revoked or expired: the session ends with it.
			if err := c.endSession(r, id); err != nil {
				c.logger.Warn("console: end session", "err", err)
			}
			http.SetCookie(w, c.sessionCookie(r, ""))
			http.Redirect(w, r, Prefix+"login?expired=1", http.StatusSeeOther)
			return nil, false
		}
		status := http.StatusServiceUnavailable
		if info, ok := fault.Lookup(fault.Code(client.EnvelopeOf(err).Code)); ok {
			status = info.HTTP
		}
		c.renderLogin(w, r, status, err)
		return nil, false
	}
	s.Who = who
	s.Tenant = who.GetTenantId()
	if t := r.URL.Query().Get("tenant"); t != "" && len(t) <= maxTenantLen {
		s.Tenant = t
	}
	if r.Method == http.MethodPost {
		if t := r.PostFormValue("tenant"); t != "" && len(t) <= maxTenantLen {
			s.Tenant = t
		}
	}
	return s, true
}

// sameOrigin says a POST came from the console's own pages: a browser's
// Sec-Fetch-Site, else its Origin, else its Referer names this host.
// Requests with none of them (not a browser) pass; the CSRF token still
// binds them to the session.
func sameOrigin(r *http.Request) bool {
	switch r.Header.Get("Sec-Fetch-Site") {
	case "", "same-origin", "none":
	default:
		return false
	}
	if o := r.Header.Get("Origin"); o != "" {
		u, err := url.Parse(o)
		return err == nil && u.Host != "" && strings.EqualFold(u.Host, r.Host)
	}
	if ref := r.Header.Get("Referer"); ref != "" {
		u, err := url.Parse(ref)
		return err == nil && u.Host != "" && strings.EqualFold(u.Host, r.Host)
	}
	return true
}

// mutationFunc is a POST action of a signed-in session with a checked form.
type mutationFunc func(w http.ResponseWriter, r *http.Request, s *session)

// mutation guards a POST: a bounded form, the console's own origin, a
// session and its CSRF token (compared in constant time). Anything else
// is 403 before the action runs.
func (c *Console) mutation(h mutationFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
		if !sameOrigin(r) {
			http.Error(w, "forbidden: this form was not posted from the console's own origin", http.StatusForbidden)
			return
		}
		if err := r.ParseForm(); err != nil {
			http.Error(w, "bad form: "+err.Error(), http.StatusRequestEntityTooLarge)
			return
		}
		id, ok := sessionID(r)
		if !ok {
			http.Redirect(w, r, Prefix+"login", http.StatusSeeOther)
			return
		}
		if !hmac.Equal([]byte(r.PostFormValue("csrf")), []byte(csrfToken(id))) {
			http.Error(w, "forbidden: missing or wrong csrf token (reload the page)", http.StatusForbidden)
			return
		}
		s, ok := c.open(w, r)
		if !ok {
			return
		}
		h(w, r, s)
	}
}

// field reads a form field, trimmed and bounded: INVALID_INPUT naming it
// when longer than limit.
func field(r *http.Request, name string, limit int) (string, error) {
	v := strings.TrimSpace(r.PostFormValue(name))
	if len(v) > limit {
		return "", fault.New(fault.InvalidInput, name, "at most %d characters, got %d", limit, len(v))
	}
	return v, nil
}

// query reads a query parameter, trimmed and bounded like field.
func query(r *http.Request, name string, limit int) (string, error) {
	v := strings.TrimSpace(r.URL.Query().Get(name))
	if len(v) > limit {
		return "", fault.New(fault.InvalidInput, name, "at most %d characters, got %d", limit, len(v))
	}
	return v, nil
}

type loginData struct {
	Error   *client.Envelope
	Expired bool
}

func (c *Console) loginPage(w http.ResponseWriter, r *http.Request) {
	if _, ok := sessionID(r); ok && r.URL.Query().Get("expired") == "" {
		// Signed in already: the fleet page checks the key.
		http.Redirect(w, r, Prefix, http.StatusSeeOther)
		return
	}
	c.renderLogin(w, r, http.StatusOK, nil)
}

func (c *Console) renderLogin(w http.ResponseWriter, r *http.Request, status int, err error) {
	d := loginData{Expired: r.URL.Query().Get("expired") != ""}
	if err != nil {
		env := envelope(err)
		d.Error = &env
	}
	var b strings.Builder
	if err := c.login.ExecuteTemplate(&b, "login", d); err != nil {
		c.logger.Error("console: render login", "err", err)
		http.Error(w, "the console could not render this page", http.StatusInternalServerError)
		return
	}
	writeHTML(w, status, []byte(b.String()))
}

// loginSubmit checks the key with system.whoAmI and, when the API takes it,
// starts a server-side session: a fresh random id in the cookie, the key
// sealed under it in the session's row. A session the browser had is
// ended; ended sessions are pruned.
func (c *Console) loginSubmit(w http.ResponseWriter, r *http.Request) {
	r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
	if !sameOrigin(r) {
		http.Error(w, "forbidden: this form was not posted from the console's own origin", http.StatusForbidden)
		return
	}
	if err := r.ParseForm(); err != nil {
		http.Error(w, "bad form: "+err.Error(), http.StatusRequestEntityTooLarge)
		return
	}
	key := strings.TrimSpace(r.PostFormValue("key"))
	if err := validKey(key); err != nil {
		c.renderLogin(w, r, http.StatusBadRequest, err)
		return
	}
	ctx := api.AsCaller(r.Context(), key, c.clientHost(r))
	who, err := computev1.NewSystemServiceClient(c.cfg.Conn).WhoAmI(ctx, &computev1.WhoAmIRequest{})
	if err != nil {
		status := http.StatusUnauthorized
		if info, ok := fault.Lookup(fault.Code(client.EnvelopeOf(err).Code)); ok {
			status = info.HTTP
		}
		c.renderLogin(w, r, status, err)
		return
	}
	keyID, _, err := iam.ParseKey(key)
	if err != nil { // the API took it, so it is shaped like a key
		c.renderLogin(w, r, http.StatusBadRequest, fault.New(fault.InvalidInput, "key", "%v", err))
		return
	}
	if old, ok := sessionID(r); ok {
		if err := c.endSession(r, old); err != nil {
			c.logger.Warn("console: end the previous session", "err", err)
		}
	}
	now := c.now()
	if _, err := consolesessions.Prune(r.Context(), c.cfg.DB, now, c.idle); err != nil {
		c.logger.Warn("console: prune ended sessions", "err", err)
	}
	id := newSessionID()
	if err := consolesessions.Create(r.Context(), c.cfg.DB, consolesessions.Session{
		IDHash: consolesessions.Hash(id), KeyID: keyID, IdentityID: who.GetIdentityId(), SealedKey: sealKey(id, key),
		CreatedAt: now, ExpiresAt: now.Add(c.lifetime),
	}); err != nil {
		c.logger.Error("console: start session", "err", err)
		c.renderLogin(w, r, http.StatusServiceUnavailable, fault.New(fault.Unavailable, "", "the console cannot start a session now; retry"))
		return
	}
	http.SetCookie(w, c.sessionCookie(r, id))
	http.Redirect(w, r, Prefix, http.StatusSeeOther)
}

// logout ends the session on the server (its row is deleted, so its id
// opens nothing any more) and clears the cookie.
func (c *Console) logout(w http.ResponseWriter, r *http.Request, s *session) {
	if err := c.endSession(r, s.id); err != nil {
		c.logger.Error("console: end session", "err", err)
		c.renderLogin(w, r, http.StatusServiceUnavailable, fault.New(fault.Unavailable, "", "the console could not end the session; retry"))
		return
	}
	http.SetCookie(w, c.sessionCookie(r, ""))
	http.Redirect(w, r, Prefix+"login", http.StatusSeeOther)
}

// endSession deletes session id's row and ends its open live feeds in this
// process (other replicas' end at their next recheck).
func (c *Console) endSession(r *http.Request, id string) error {
	hash := consolesessions.Hash(id)
	if err := consolesessions.Delete(context.WithoutCancel(r.Context()), c.cfg.DB, hash); err != nil {
		return err
	}
	c.feedsMu.Lock()
	for f := range c.feeds[string(hash)] {
		f.end(errSessionEnded)
	}
	c.feedsMu.Unlock()
	return nil
}

// errSessionEnded ends a live feed whose session ended.
var errSessionEnded = errors.New("the console session ended")

// feedRecheck is how often an open live feed checks that its session is
// still live.
const feedRecheck = 15 * time.Second

// feed is an open live feed.
type feed struct {
	end context.CancelCauseFunc
}

// openFeed registers a live feed of session id and returns its context,
// which ends when the session ends (signed out here, or found ended by a
// recheck), and its release.
func (c *Console) openFeed(ctx context.Context, id string) (context.Context, func()) {
	ctx, cancel := context.WithCancelCause(ctx)
	hash := consolesessions.Hash(id)
	f := &feed{end: cancel}
	c.feedsMu.Lock()
	if c.feeds == nil {
		c.feeds = map[string]map[*feed]struct{}{}
	}
	if c.feeds[string(hash)] == nil {
		c.feeds[string(hash)] = map[*feed]struct{}{}
	}
	c.feeds[string(hash)][f] = struct{}{}
	c.feedsMu.Unlock()
	done := make(chan struct{})
	go func() {
		t := time.NewTicker(feedRecheck)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-t.C:
				live, err := consolesessions.Live(ctx, c.cfg.DB, hash, c.now(), c.idle)
				if err == nil && !live {
					cancel(errSessionEnded)
					return
				}
			}
		}
	}()
	return ctx, func() {
		close(done)
		cancel(nil)
		c.feedsMu.Lock()
		delete(c.feeds[string(hash)], f)
		if len(c.feeds[string(hash)]) == 0 {
			delete(c.feeds, string(hash))
		}
		c.feedsMu.Unlock()
	}
}
