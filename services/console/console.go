// Package console is the operator's web console, served by the api role at
// /console: server-rendered pages (Go templates and htmx, every asset
// embedded) that call the API as the signed-in identity.
//
// The console holds no credential of its own. Signing in with an API key
// starts a server-side session (table console_sessions, see package
// consolesessions): the cookie (HttpOnly, SameSite=Strict) carries only a
// random session id, the row holds SHA-256 of that id and the key sealed
// under a key derived from it; the session ends at sign-out (the row is
// deleted), after console.sessionIdle without a request and
// console.sessionLifetime after sign-in. Every page and action is a call on
// [Config.Conn] with the session's key (api.AsCaller), so a user sees and
// does exactly what their policies allow. Mutations are POSTs that carry a
// CSRF token derived from the session id (an HMAC of it) and come from the
// console's own origin. Live updates are the API's events watch stream
// (Server-Sent Events), proxied with the session's key.
package console

import (
	"bytes"
	"cmp"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/bettercompute/bettercompute/pkg/clientaddr"
	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/consolesessions"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/proto/client"
)

// Prefix is where the console is mounted on the api role's port.
const Prefix = "/console/"

// Config is what the console needs from the api role.
type Config struct {
	// Conn is the in-process connection to the API (api.Server.Conn): every
	// page and action is a call on it as the signed-in identity
	// (api.AsCaller). Required.
	Conn grpc.ClientConnInterface
	// Watch serves events.watch as Server-Sent Events (api.Server.ServeWatch);
	// the console's live feed is a request to it with the session's key.
	// Required.
	Watch http.HandlerFunc
	// Logger; nil discards.
	Logger *slog.Logger
	// Kinds is the command-kind registry whose API kinds (the allowlist of
	// commands.run) the node page offers; nil means commands.Builtin().
	Kinds *commands.Registry
	// TrustedProxies (server.trustedProxies) tell the browser's address
	// behind a proxy; nil trusts none.
	TrustedProxies *clientaddr.Trusted
	// DB holds the sessions (table console_sessions). Required.
	DB consolesessions.Querier
	// SessionIdle ends a session that long after its last request
	// (console.sessionIdle); 0 means 30 minutes. SessionLifetime ends it
	// that long after sign-in (console.sessionLifetime); 0 means 12 hours.
	SessionIdle, SessionLifetime time.Duration
	// Now is the sessions' clock; nil means time.Now.
	Now func() time.Time
}

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// pageNames are the templates that render a whole page inside the layout.
var pageNames = []string{"fleet", "node", "commands", "command", "reservations", "events", "audit"}

// Console is the console's handler.
type Console struct {
	cfg  Config
	now  func() time.Time
	idle time.Duration
	// lifetime is a session's absolute lifetime.
	lifetime time.Duration
	logger   *slog.Logger
	mux      *http.ServeMux
	pages    map[string]*template.Template
	login    *template.Template
	kinds    []string

	// feeds are the open live feeds by session (its id's hash), so that
	// signing out ends them at once; each also rechecks its session every
	// feedRecheck (idle, expiry, a sign-out on another replica).
	feedsMu sync.Mutex
	feeds   map[string]map[*feed]struct{}
}

// New returns the console's handler, to mount at [Prefix].
func New(cfg Config) (http.Handler, error) {
	if cfg.Conn == nil {
		return nil, errors.New("console: Config.Conn is required (the api role's in-process connection)")
	}
	if cfg.Watch == nil {
		return nil, errors.New("console: Config.Watch is required (the api role's events watch handler)")
	}
	if cfg.DB == nil {
		return nil, errors.New("console: Config.DB is required (the sessions' table)")
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	c := &Console{cfg: cfg, logger: cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler)), pages: map[string]*template.Template{},
		now: cfg.Now, idle: cmp.Or(cfg.SessionIdle, 30*time.Minute), lifetime: cmp.Or(cfg.SessionLifetime, 12*time.Hour)}
	kinds := cfg.Kinds
	if kinds == nil {
		kinds = commands.Builtin()
	}
	for _, k := range kinds.Kinds() {
		if k.API {
			c.kinds = append(c.kinds, k.Name)
		}
	}
	slices.Sort(c.kinds)
	for _, name := range pageNames {
		t, err := template.New("layout").Funcs(funcs).ParseFS(templateFS, "templates/layout.html", "templates/"+name+".html")
		if err != nil {
			return nil, fmt.Errorf("console: template %s: %w", name, err)
		}
		c.pages[name] = t
	}
	var err error
	if c.login, err = template.New("login").Funcs(funcs).ParseFS(templateFS, "templates/login.html"); err != nil {
		return nil, fmt.Errorf("console: template login: %w", err)
	}
	static, err := fs.Sub(staticFS, "static")
	if err != nil {
		return nil, err
	}
	files := http.StripPrefix(Prefix+"static/", http.FileServerFS(static))

	m := http.NewServeMux()
	m.HandleFunc("GET "+Prefix+"login", c.loginPage)
	m.HandleFunc("POST "+Prefix+"login", c.loginSubmit)
	m.HandleFunc("POST "+Prefix+"logout", c.mutation(c.logout))
	m.Handle("GET "+Prefix+"static/", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Cache-Control", "public, max-age=300")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		files.ServeHTTP(w, r)
	}))
	m.HandleFunc("GET "+Prefix+"{$}", c.view(c.fleetPage))
	m.HandleFunc("GET "+Prefix+"nodes/{id}", c.view(c.nodePage))
	m.HandleFunc("POST "+Prefix+"nodes/{id}/commands", c.mutation(c.runCommand))
	m.HandleFunc("POST "+Prefix+"nodes/{id}/drain", c.mutation(c.drain))
	m.HandleFunc("POST "+Prefix+"nodes/{id}/undrain", c.mutation(c.undrain))
	m.HandleFunc("GET "+Prefix+"commands", c.view(c.commandsPage))
	m.HandleFunc("GET "+Prefix+"commands/{id}", c.view(c.commandPage))
	m.HandleFunc("GET "+Prefix+"reservations", c.view(c.reservationsPage))
	m.HandleFunc("POST "+Prefix+"reservations", c.mutation(c.createReservation))
	m.HandleFunc("POST "+Prefix+"reservations/{id}/release", c.mutation(c.releaseReservation))
	m.HandleFunc("GET "+Prefix+"events", c.view(c.eventsPage))
	m.HandleFunc("GET "+Prefix+"events/stream", c.stream)
	m.HandleFunc("GET "+Prefix+"audit", c.view(c.auditPage))
	m.HandleFunc("POST "+Prefix+"audit", c.mutation(c.verifyAudit))
	m.HandleFunc(Prefix, func(w http.ResponseWriter, r *http.Request) {
		if _, ok := sessionID(r); !ok {
			http.Redirect(w, r, Prefix+"login", http.StatusSeeOther)
			return
		}
		http.NotFound(w, r)
	})
	c.mux = m
	return c, nil
}

// ServeHTTP serves the console with its security headers.
func (c *Console) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "+
		"connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'")
	h.Set("X-Frame-Options", "DENY")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "same-origin")
	c.mux.ServeHTTP(w, r)
}

// page is what the layout renders around every page's content.
type page struct {
	Title  string
	Active string
	S      *session
	// Error is the API's answer when the page's main call or the action
	// failed; shown as #error.
	Error *client.Envelope
	// Stream is the URL the page's EventSource opens; "" for none.
	Stream string
	Data   any
}

// Link is path with the page's tenant when it is not the identity's own.
func (p *page) Link(path string) string {
	if p.S == nil || !p.S.Selected() {
		return path
	}
	sep := "?"
	if strings.Contains(path, "?") {
		sep = "&"
	}
	return path + sep + "tenant=" + url.QueryEscape(p.S.Tenant)
}

// handler is a page: it fills p (Title, Data, Stream) or returns the error
// the page shows.
type handler func(w http.ResponseWriter, r *http.Request, s *session, p *page) (tmpl string, err error)

// view serves a GET page: a session (else the sign-in page), then the
// handler, then the layout.
func (c *Console) view(h handler) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		s, ok := c.open(w, r)
		if !ok {
			return
		}
		p := &page{S: s}
		name, err := h(w, r, s, p)
		if name == "" {
			return // the handler answered itself
		}
		c.render(w, p, name, err)
	}
}

// render writes page name with err as its #error; the status is the
// envelope's HTTP status.
func (c *Console) render(w http.ResponseWriter, p *page, name string, err error) {
	status := http.StatusOK
	if err != nil {
		env := envelope(err)
		p.Error = &env
		if info, ok := fault.Lookup(fault.Code(env.Code)); ok {
			status = info.HTTP
		} else {
			status = http.StatusInternalServerError
		}
	}
	var buf bytes.Buffer
	if err := c.pages[name].ExecuteTemplate(&buf, "layout", p); err != nil {
		c.logger.Error("console: render", "page", name, "err", err)
		http.Error(w, "the console could not render this page", http.StatusInternalServerError)
		return
	}
	writeHTML(w, status, buf.Bytes())
}

func writeHTML(w http.ResponseWriter, status int, b []byte) {
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// envelope is err as the API's error envelope. Errors the console makes
// itself are *fault.Error (bad form input) and keep their code and field.
func envelope(err error) client.Envelope {
	if fe, ok := fault.As(err); ok {
		return client.Envelope{Code: client.Code(fe.Code), Message: fe.Message, Field: fe.Field}
	}
	return client.EnvelopeOf(err)
}

// funcs are the templates' helpers.
var funcs = template.FuncMap{
	"ts": func(t *timestamppb.Timestamp) string {
		if t == nil || (t.GetSeconds() == 0 && t.GetNanos() == 0) {
			return ""
		}
		return t.AsTime().UTC().Format(time.RFC3339)
	},
	"upper": strings.ToUpper,
	"gib": func(b int64) string {
		if b <= 0 {
			return ""
		}
		return fmt.Sprintf("%.0f GiB", float64(b)/(1<<30))
	},
	"clip":      clip,
	"placement": placementOf,
	"eventJSON": eventJSON,
	"lower":     strings.ToLower,
	"join":      strings.Join,
	"sub":       func(a, b int) int { return a - b },
}
