package console

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"net"
	"net/http"
	"net/url"
	"strings"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
	"github.com/bettercompute/bettercompute/proto/client"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/services/api"
)

// CookieName is the session cookie: it holds the signed-in API key.
const CookieName = "bc_console"

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

// csrfLabel is what the CSRF token is a MAC of, keyed by the session's key.
const csrfLabel = "bettercompute console csrf v1"

// session is a signed-in request: its key, who it is and the tenant the
// page is about.
type session struct {
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

// csrfToken derives the CSRF token of a session from its key: unforgeable
// without the HttpOnly cookie.
func csrfToken(key string) string {
	m := hmac.New(sha256.New, []byte(key))
	m.Write([]byte(csrfLabel))
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
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

// sessionCookie is the cookie that holds key (or clears it when key is "").
func sessionCookie(r *http.Request, key string) *http.Cookie {
	ck := &http.Cookie{
		Name: CookieName, Value: key, Path: Prefix, HttpOnly: true, SameSite: http.SameSiteStrictMode,
		Secure: r.TLS != nil || !loopbackHost(r),
	}
	if key == "" {
		ck.MaxAge = -1
	}
	return ck
}

// sessionKey is the API key the request's cookie holds.
func sessionKey(r *http.Request) (string, bool) {
	ck, err := r.Cookie(CookieName)
	if err != nil || validKey(ck.Value) != nil {
		return "", false
	}
	return ck.Value, true
}

// open reads the request's session and asks the API who it is; without a
// session, or with a key the API no longer takes, it redirects to the
// sign-in page (clearing the cookie) and reports false.
func (c *Console) open(w http.ResponseWriter, r *http.Request) (*session, bool) {
	key, ok := sessionKey(r)
	if !ok {
		http.Redirect(w, r, Prefix+"login", http.StatusSeeOther)
		return nil, false
	}
	s := &session{key: key, host: c.clientHost(r), CSRF: csrfToken(key)}
	s.ctx = api.AsCaller(r.Context(), key, s.host)
	who, err := computev1.NewSystemServiceClient(c.cfg.Conn).WhoAmI(s.ctx, &computev1.WhoAmIRequest{})
	if err != nil {
		if env := client.EnvelopeOf(err); env.Code == client.CodeUnauthenticated {
			http.SetCookie(w, sessionCookie(r, ""))
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
		key, ok := sessionKey(r)
		if !ok {
			http.Redirect(w, r, Prefix+"login", http.StatusSeeOther)
			return
		}
		if !hmac.Equal([]byte(r.PostFormValue("csrf")), []byte(csrfToken(key))) {
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
	if _, ok := sessionKey(r); ok && r.URL.Query().Get("expired") == "" {
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
// keeps it in the session cookie.
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
	if _, err := computev1.NewSystemServiceClient(c.cfg.Conn).WhoAmI(ctx, &computev1.WhoAmIRequest{}); err != nil {
		status := http.StatusUnauthorized
		if info, ok := fault.Lookup(fault.Code(client.EnvelopeOf(err).Code)); ok {
			status = info.HTTP
		}
		c.renderLogin(w, r, status, err)
		return
	}
	http.SetCookie(w, sessionCookie(r, key))
	http.Redirect(w, r, Prefix, http.StatusSeeOther)
}

func (c *Console) logout(w http.ResponseWriter, r *http.Request, _ *session) {
	http.SetCookie(w, sessionCookie(r, ""))
	http.Redirect(w, r, Prefix+"login", http.StatusSeeOther)
}
