// Package mcpserver is the api role's Model Context Protocol server: typed
// tools over the API, each called as the caller's own identity, at /mcp
// (streamable HTTP) and on stdio for `better-compute mcp`.
//
// The tools are a fixed set (see [ReadTools] and [MutatingTools]); there is
// no shell and no arbitrary command. Every tool calls the API through
// [Config.Conn] with the caller's credential: over HTTP the bearer key of
// the very HTTP request that carries the call (never a shared service
// credential, never another request's), on stdio the key the connection was
// dialled with. Policies decide and the audit log names the real caller.
//
// Mutating tools take dryRun, which answers what would happen (the nodes,
// GPUs and bookings affected) and changes nothing; destructive ones (drain,
// and any destructive command kind such as node.reboot) are refused unless
// confirm is true. ReadOnly offers only the read tools.
package mcpserver

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/json"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/modelcontextprotocol/go-sdk/auth"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/grpc"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
	"github.com/bettercompute/bettercompute/proto/client"

	"github.com/bettercompute/bettercompute/pkg/clientaddr"
	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/ratelimit"
	"github.com/bettercompute/bettercompute/services/api"
)

// Path is where the streamable HTTP transport is mounted on the api role's
// port.
const Path = "/mcp"

// Name is the server's name in the MCP handshake.
const Name = "better-compute"

// Config is what the MCP server needs.
type Config struct {
	// Conn is a connection to the API: api.Server.Conn in the api role, a
	// client connection to a remote API for `better-compute mcp`.
	Conn grpc.ClientConnInterface
	// ReadOnly offers only the read tools (mcp.readOnly).
	ReadOnly bool
	// Version is reported to clients as the server's version.
	Version string
	// Logger; nil discards.
	Logger *slog.Logger
	// Kinds is the command-kind registry whose API kinds commands_run
	// offers; nil means commands.Builtin() (the API's allowlist).
	Kinds *commands.Registry
	// TrustedProxies (server.trustedProxies) tell the HTTP client's address
	// behind a proxy; nil trusts none.
	TrustedProxies *clientaddr.Trusted
	// RatePerSecond and RateBurst bound each identity's HTTP requests (those
	// that call no tool, such as initialize and tools/list, included); 0
	// means the API's defaults, 100 a second with a burst of 200. Over it a
	// request is answered 429 RATE_LIMITED.
	RatePerSecond float64
	RateBurst     int
}

// Bounds of the HTTP transport.
const (
	// maxBodyBytes bounds one HTTP request's body (a JSON-RPC message).
	maxBodyBytes = 1 << 20
	// maxTokenLength bounds the bearer key read from Authorization.
	maxTokenLength = 512
	// identifyTimeout bounds the system.whoAmI call that checks each HTTP
	// request's key.
	identifyTimeout = 10 * time.Second
)

// callerKey is the context key of the HTTP request's verified caller.
type callerKey struct{}

// Extra keys of the TokenInfo the HTTP handler attaches to each request.
const (
	extraToken  = "bc.token"
	extraTenant = "bc.tenant"
	extraHost   = "bc.clientHost"
)

// Handler returns the streamable HTTP handler: each request's bearer key is
// the identity its tool calls run as. A request without a key, or with one
// the API does not accept, is answered 401 with the API's error envelope
// before any MCP processing. The transport is stateless (no Mcp-Session-Id,
// GET and DELETE answer 405): each request is answered on its own, and
// every tool call runs with the key of the HTTP request that carries it.
func Handler(cfg Config) http.Handler {
	s := newServer(cfg, httpCaller)
	mcpHandler := mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return s.mcp }, &mcp.StreamableHTTPOptions{
		Logger: s.logger,
		// Stateless: every tool is one request and its answer (no
		// server-to-client requests, no subscriptions), so the server keeps
		// no session between requests: nothing for a flood of `initialize`
		// to pile up, nothing to outlive the server's stop. Each request
		// gets a temporary session closed when it is answered.
		Stateless:           true,
		MaxRequestBodyBytes: maxBodyBytes,
	})
	// RequireBearerToken is how the SDK learns the request's TokenInfo (the
	// session's owner, and RequestExtra.TokenInfo of each call); the key was
	// checked below, so the verifier returns what that check found.
	verified := auth.RequireBearerToken(func(_ context.Context, token string, r *http.Request) (*auth.TokenInfo, error) {
		ti, ok := r.Context().Value(callerKey{}).(*auth.TokenInfo)
		if !ok || ti.Extra[extraToken] != token {
			return nil, auth.ErrInvalidToken
		}
		return ti, nil
	}, &auth.RequireBearerTokenOptions{AllowMissingExpiration: true})(mcpHandler)

	ids := &identities{m: map[[32]byte]identity{}}
	limit := ratelimit.New(cmp.Or(cfg.RatePerSecond, 100), cmp.Or(cfg.RateBurst, 200), nil)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		token, env := bearerToken(r)
		if env != nil {
			writeEnvelope(w, http.StatusUnauthorized, *env)
			return
		}
		host := cfg.TrustedProxies.FromRequest(r)
		who, err := ids.identify(r.Context(), s.conn, token, host)
		if err != nil {
			e := client.EnvelopeOf(err)
			if e.Code == client.CodeUnauthenticated {
				e.Message = "the API key in Authorization was not accepted: " + e.Message
				e.Field = "Authorization"
			}
			writeEnvelope(w, httpStatus(e.Code), e)
			return
		}
		if !limit.Allow(who.identityID) {
			writeEnvelope(w, httpStatus(client.CodeRateLimited), client.Envelope{Code: client.CodeRateLimited,
				Message: "identity " + who.identityID + " is over its MCP request rate; retry later"})
			return
		}
		ti := &auth.TokenInfo{
			UserID: who.identityID,
			Extra:  map[string]any{extraToken: token, extraTenant: who.tenantID, extraHost: host},
		}
		verified.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), callerKey{}, ti)))
	})
}

// identity is whom a key authenticates as, and until when that answer is
// reused.
type identity struct {
	identityID, tenantID string
	until                time.Time
}

// identities caches system.whoAmI's answers by the key's SHA-256 for
// identifyTTL, so a client's requests do not each spend the caller's API
// rate on it (only successes are kept). The tool calls themselves still carry the key, so the
// API authenticates (and refuses a revoked key) on every one.
type identities struct {
	mu sync.Mutex
	m  map[[32]byte]identity
}

// identifyTTL and maxIdentities bound the cache.
const (
	identifyTTL   = 10 * time.Second
	maxIdentities = 10000
)

func (c *identities) identify(ctx context.Context, conn grpc.ClientConnInterface, token, host string) (identity, error) {
	k := sha256.Sum256([]byte(token))
	now := time.Now()
	c.mu.Lock()
	id, ok := c.m[k]
	c.mu.Unlock()
	if ok && now.Before(id.until) {
		return id, nil
	}
	ctx, cancel := context.WithTimeout(ctx, identifyTimeout)
	defer cancel()
	who, err := computev1.NewSystemServiceClient(conn).WhoAmI(api.AsCaller(ctx, token, host), &computev1.WhoAmIRequest{})
	if err != nil {
		return identity{}, err
	}
	id = identity{identityID: who.GetIdentityId(), tenantID: who.GetTenantId(), until: now.Add(identifyTTL)}
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.m) >= maxIdentities {
		for key, v := range c.m {
			if !now.Before(v.until) {
				delete(c.m, key)
			}
		}
		if len(c.m) >= maxIdentities {
			clear(c.m)
		}
	}
	c.m[k] = id
	return id, nil
}

// bearerToken reads the request's `Authorization: Bearer <key>`, or the
// envelope of a 401 saying what is wrong with it.
func bearerToken(r *http.Request) (string, *client.Envelope) {
	h := r.Header.Get("Authorization")
	if h == "" {
		return "", &client.Envelope{Code: client.CodeUnauthenticated, Field: "Authorization",
			Message: "the MCP server needs an API key: send `Authorization: Bearer bck_…`; every tool runs as that key's identity"}
	}
	scheme, token, ok := strings.Cut(h, " ")
	token = strings.TrimSpace(token)
	if !ok || !strings.EqualFold(scheme, "Bearer") || token == "" || strings.ContainsAny(token, " \t") {
		return "", &client.Envelope{Code: client.CodeUnauthenticated, Field: "Authorization",
			Message: "expected `Authorization: Bearer <API key>`"}
	}
	if len(token) > maxTokenLength {
		return "", &client.Envelope{Code: client.CodeUnauthenticated, Field: "Authorization",
			Message: "the bearer key is longer than any API key"}
	}
	return token, nil
}

func writeEnvelope(w http.ResponseWriter, status int, e client.Envelope) {
	if status == http.StatusUnauthorized {
		w.Header().Set("WWW-Authenticate", `Bearer realm="better-compute"`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(e)
}

// httpStatus is the HTTP status of an API error code, as the REST API
// answers it.
func httpStatus(c client.Code) int {
	if info, ok := fault.Lookup(fault.Code(c)); ok {
		return info.HTTP
	}
	return http.StatusBadGateway
}

// httpCaller is the credential of an HTTP request's tool call: the key and
// client address the handler verified for the HTTP request that carries it.
func httpCaller(ctx context.Context, req *mcp.CallToolRequest) (context.Context, string, error) {
	var ti *auth.TokenInfo
	if req != nil && req.Extra != nil {
		ti = req.Extra.TokenInfo
	}
	if ti == nil {
		return nil, "", fault.New(fault.Unauthenticated, "Authorization", "this call carries no API key")
	}
	token, _ := ti.Extra[extraToken].(string)
	tenant, _ := ti.Extra[extraTenant].(string)
	host, _ := ti.Extra[extraHost].(string)
	if token == "" {
		return nil, "", fault.New(fault.Unauthenticated, "Authorization", "this call carries no API key")
	}
	return api.AsCaller(ctx, token, host), tenant, nil
}

// NewServer returns the MCP server for one caller whose credential
// cfg.Conn carries on every call (a proto/client connection made with
// client.WithToken): what `better-compute mcp` runs on stdio. A tool's
// default tenant is the caller's own, from system.whoAmI.
func NewServer(cfg Config) *mcp.Server {
	var (
		mu     sync.Mutex
		tenant string
	)
	conn := cfg.Conn
	return newServer(cfg, func(ctx context.Context, _ *mcp.CallToolRequest) (context.Context, string, error) {
		mu.Lock()
		defer mu.Unlock()
		if tenant == "" {
			who, err := computev1.NewSystemServiceClient(conn).WhoAmI(ctx, &computev1.WhoAmIRequest{})
			if err != nil {
				return nil, "", err
			}
			tenant = who.GetTenantId()
		}
		return ctx, tenant, nil
	}).mcp
}

// callerFunc returns the context a tool's API calls are made with (carrying
// the caller's credential) and the caller's tenant.
type callerFunc func(ctx context.Context, req *mcp.CallToolRequest) (context.Context, string, error)

// server is the tools over one API connection.
type server struct {
	mcp    *mcp.Server
	conn   grpc.ClientConnInterface
	logger *slog.Logger
	caller callerFunc
	kinds  []commands.Kind // the API's allowlist

	nodes        computev1.NodesServiceClient
	cmds         computev1.CommandsServiceClient
	reservations computev1.ReservationsServiceClient
	capacity     computev1.CapacityServiceClient
	events       computev1.EventsServiceClient
}

func newServer(cfg Config, caller callerFunc) *server {
	logger := cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	reg := cfg.Kinds
	if reg == nil {
		reg = commands.Builtin()
	}
	s := &server{
		conn: cfg.Conn, logger: logger.With("component", "mcp"), caller: caller,
		nodes:        computev1.NewNodesServiceClient(cfg.Conn),
		cmds:         computev1.NewCommandsServiceClient(cfg.Conn),
		reservations: computev1.NewReservationsServiceClient(cfg.Conn),
		capacity:     computev1.NewCapacityServiceClient(cfg.Conn),
		events:       computev1.NewEventsServiceClient(cfg.Conn),
	}
	for _, k := range reg.Kinds() {
		if k.API {
			s.kinds = append(s.kinds, k)
		}
	}
	s.mcp = mcp.NewServer(&mcp.Implementation{Name: Name, Title: "Better Compute", Version: cmp.Or(cfg.Version, "dev")}, &mcp.ServerOptions{
		Instructions: "Typed tools over the Better Compute API, each run as your own identity. " +
			"Mutating tools take dryRun (what would happen, nothing changed); destructive ones need confirm: true.",
		Logger: s.logger,
	})
	s.addTools(cfg.ReadOnly)
	return s
}
