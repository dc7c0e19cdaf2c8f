// Package api assembles the `api` role: the gRPC services of
// bettercompute.compute.v1, their REST mapping through grpc-gateway
// (POST /api/compute/{group}/{method}, proto3 JSON bodies), the OpenAPI
// document, gRPC health and reflection, and one error envelope for both
// transports.
//
// Handlers return *fault.Error; this package alone turns them into gRPC
// statuses and REST bodies.
package api

import (
	"cmp"
	"context"
	"crypto/ed25519"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/test/bufconn"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
	"github.com/bettercompute/bettercompute/proto/openapi"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/clientaddr"
	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/outbound"
	"github.com/bettercompute/bettercompute/pkg/ratelimit"
	"github.com/bettercompute/bettercompute/pkg/secrets"
	"github.com/bettercompute/bettercompute/pkg/wake"
)

// OpenAPIPath serves the generated OpenAPI 3 document (with the bearer
// scheme and the error envelope), which client generators accept.
const OpenAPIPath = "/api/compute/openapi.json"

// SwaggerPath serves the Swagger 2.0 document OpenAPIPath served before the
// OpenAPI 3 one. Deprecated: kept for one release; read OpenAPIPath.
const SwaggerPath = "/api/compute/swagger.json"

// Prefix is where every REST method lives.
const Prefix = "/api/compute/"

// MaxRequestBytes bounds a request body (REST) or message (gRPC).
const MaxRequestBytes = 4 << 20

// Config is what the API role needs. Zero values are documented per field.
type Config struct {
	// Logger is the process logger; nil discards.
	Logger *slog.Logger
	// System serves the system group. Required.
	System computev1.SystemServiceServer
	// DB is the database pool. Required.
	DB *pgxpool.Pool
	// Authorizer makes every decision; nil builds one over DB.
	Authorizer *authz.Authorizer
	// Tuning turns the role's knobs; the zero value is production's.
	Tuning
	// Methods overrides the method registry, for tests; nil means
	// [Methods].
	Methods map[string]Method
	// Waker sends the wakes a mutation collected after its commit (the
	// work it enqueued, the commands it queued or cancelled, ...); nil
	// means one over NATS that wakes no node's gateway (their resync
	// dispatches).
	Waker *wake.Waker
	// Capacity tunes inline placement of reservations.
	Capacity CapacityOptions
	// AuditKey is the public half of the audit key, with which audit.verify
	// checks checkpoint signatures; nil means it does not check them (and
	// says so in its answer).
	AuditKey ed25519.PublicKey
	// NATS is the bus: events.watch is woken by the event stream, and
	// webhooks.test and webhooks.redeliver poke the relays' deliverers. Nil
	// polls the database.
	NATS *nats.Conn
	// Watch bounds events.watch streams (events.maxStreamLifetime,
	// events.maxWatchesPerIdentity, events.maxWatches).
	Watch WatchLimits
	// AllowInsecureWebhooks permits http:// webhook endpoints on loopback
	// (webhooks.allowInsecure).
	AllowInsecureWebhooks bool
	// Providers are the outbound rules provider pools' endpoints are
	// checked under at pools.update (config.Providers.Outbound); the zero
	// value is production's.
	Providers outbound.Options
	// Kinds is the command-kind registry commands.run checks and queues
	// through; nil means commands.Builtin().
	Kinds *commands.Registry
	// AllowPrivateWebhooks permits webhook endpoints at private addresses
	// (webhooks.allowPrivateNetworks); without it a literal private
	// address is refused at create and update.
	AllowPrivateWebhooks bool
	// Registerer receives the role's metrics
	// (bc_api_deprecated_fields_total); nil registers none.
	Registerer prometheus.Registerer
	// TrustedProxies are the proxies (server.trustedProxies) whose
	// X-Forwarded-For names the client address the per-address limits key
	// on; nil trusts none (the connection's peer is the client).
	TrustedProxies *clientaddr.Trusted
	// Secrets seals the BMC credentials metal.enroll stores
	// (secrets.keyFile); nil refuses metal.enroll UNSUPPORTED naming that
	// setting.
	Secrets *secrets.Keyring
	// MaxRepairClearsPerNode is how many times nodes.clearRepair may clear
	// one node in 7 days (health.maxRepairClearsPerNode); 0 means
	// [DefaultMaxRepairClearsPerNode].
	MaxRepairClearsPerNode int
	// Tunnels opens the node's side of tunnels (the gateway holding the
	// node); nil answers Connect UNSUPPORTED.
	Tunnels TunnelDialer
	// TunnelLimits bound tunnels.
	TunnelLimits TunnelLimits
}

// CapacityOptions tune inline placement.
type CapacityOptions struct {
	// LostAfter: a node unseen this long is not booked; 0 means
	// capacity.DefaultLostAfter.
	LostAfter time.Duration
}

// Tuning are the api role's knobs that tests and benchmarks turn. The zero
// value is production's.
type Tuning struct {
	// Now is the clock of authentication, expiry and rate limits; nil means
	// time.Now.
	Now func() time.Time
	// AuthTTL bounds how long an authentication is cached; 0 means 30s.
	AuthTTL time.Duration
	// RatePerSecond is each identity's sustained request rate; 0 means 100.
	RatePerSecond float64
	// RateBurst is each identity's burst; 0 means 200.
	RateBurst int
	// AnonymousPerSecond and AnonymousBurst bound, per client address, the
	// requests that need no credential (System.Health, System.Version);
	// 0 means 10 a second with a burst of 20.
	AnonymousPerSecond float64
	AnonymousBurst     int
	// FailedAuthPerSecond and FailedAuthBurst bound, per client address,
	// failed authentications: once a client address has spent its burst on
	// bad credentials, its bad credentials are answered RATE_LIMITED until
	// the bucket refills. A valid credential is never refused for its
	// address's failures (behind a NAT or an ingress one address is many
	// users). 0 means 1 a second with a burst of 10.
	FailedAuthPerSecond float64
	FailedAuthBurst     int
	// NoReflection leaves gRPC reflection off this server (the admin
	// listener serves it instead).
	NoReflection bool
	// MaxDeadline caps every request's deadline (and is the deadline of
	// requests without one); 0 means 30s.
	MaxDeadline time.Duration
}

// Server is the API role's gRPC server and REST gateway.
type Server struct {
	logger  *slog.Logger
	grpc    *grpc.Server
	health  *health.Server
	conn    *grpc.ClientConn
	methods map[string]Method
	authn   *iam.Authenticator
	authz   *authz.Authorizer
	adm     *admission.Admitter
	db      *pgxpool.Pool
	limiter *ratelimit.Keyed // per identity
	// anon and failedAuth are per client address (see clientAddr).
	anon, failedAuth *ratelimit.Keyed
	proxies          *clientaddr.Trusted
	maxDL            time.Duration
	now              func() time.Time
	kinds            *commands.Registry

	capacity CapacityOptions
	auditKey ed25519.PublicKey
	secrets  *secrets.Keyring

	maxRepairClears int

	nc                    *nats.Conn
	allowInsecureWebhooks bool
	allowPrivateWebhooks  bool
	providers             outbound.Options
	deprecations          *deprecations
	tail                  *tailer
	closing               chan struct{}
	closeOnce             sync.Once

	tunnels      TunnelDialer
	tunnelLimits TunnelLimits
	relays       relaySet
	proc         string // names this process in tunnels.relay_process
}

// New builds the gRPC server with every service registered and checks the
// method registry: every method served must declare an action from the
// catalog, or New fails. Serve it with [Server.GRPC] and mount
// [Server.Gateway] once the listener's address is known.
func New(cfg Config) (*Server, error) {
	logger := cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	az := cfg.Authorizer
	if az == nil {
		az = authz.New(cfg.DB)
	}
	if cfg.NATS != nil {
		// Policy changes committed by any process reach this cache at once.
		if err := az.Listen(cfg.NATS); err != nil {
			logger.Warn("authz: policy change messages unavailable; every decision reads policy versions", "err", err)
		}
	}
	// This process's cache sees a policy change at its next decision, the
	// others when the wake reaches them (or within authz.Options.Recheck).
	waker := cfg.Waker
	if waker == nil {
		waker = wake.New(cfg.NATS, nil, logger)
	}
	waker.OnPolicies(az.Invalidate)
	now := cfg.Now
	if now == nil {
		now = time.Now
	}
	if cfg.Methods == nil {
		cfg.Methods = Methods()
	}
	if cfg.Kinds == nil {
		cfg.Kinds = commands.Builtin()
	}
	s := &Server{
		logger:   logger,
		methods:  cfg.Methods,
		authn:    iam.NewAuthenticator(iam.AuthConfig{DB: cfg.DB, TTL: cfg.AuthTTL, Now: now}),
		authz:    az,
		adm:      admission.New(admission.Config{DB: cfg.DB, Authorizer: az, Logger: logger, Waker: waker}),
		db:       cfg.DB,
		kinds:    cfg.Kinds,
		capacity: cfg.Capacity,
		auditKey: cfg.AuditKey,
		secrets:  cfg.Secrets,

		maxRepairClears: cmp.Or(cfg.MaxRepairClearsPerNode, DefaultMaxRepairClearsPerNode),
		nc:              cfg.NATS,
		closing:         make(chan struct{}),

		allowInsecureWebhooks: cfg.AllowInsecureWebhooks,
		allowPrivateWebhooks:  cfg.AllowPrivateWebhooks,
		providers:             cfg.Providers,
		limiter:               ratelimit.New(cmp.Or(cfg.RatePerSecond, 100), cmp.Or(cfg.RateBurst, 200), now),
		anon:                  ratelimit.New(cmp.Or(cfg.AnonymousPerSecond, 10), cmp.Or(cfg.AnonymousBurst, 20), now),
		failedAuth:            ratelimit.New(cmp.Or(cfg.FailedAuthPerSecond, 1), cmp.Or(cfg.FailedAuthBurst, 10), now),
		proxies:               cfg.TrustedProxies,
		maxDL:                 cmp.Or(cfg.MaxDeadline, 30*time.Second),
		now:                   now,
		tunnels:               cfg.Tunnels,
		tunnelLimits:          cfg.TunnelLimits,
		proc:                  processID(),
	}
	s.tunnelLimits.CheckInterval = cmp.Or(s.tunnelLimits.CheckInterval, time.Second)
	s.tail = newTailer(s, cfg.Watch)
	waker.OnPolicies(s.tail.policiesChanged)
	var err error
	if s.deprecations, err = newDeprecations(logger, cfg.Registerer); err != nil {
		return nil, err
	}
	gs := grpc.NewServer(
		grpc.StatsHandler(otelgrpc.NewServerHandler()),
		grpc.ChainUnaryInterceptor(unaryErrors(logger), s.deprecations.unary, s.unaryAuth),
		grpc.ChainStreamInterceptor(s.streamAuth),
		grpc.MaxRecvMsgSize(MaxRequestBytes),
	)
	computev1.RegisterSystemServiceServer(gs, cfg.System)
	computev1.RegisterTenantsServiceServer(gs, &tenants{Server: s})
	computev1.RegisterIdentitiesServiceServer(gs, &identities{Server: s})
	computev1.RegisterApiKeysServiceServer(gs, &apiKeys{Server: s})
	computev1.RegisterPoliciesServiceServer(gs, &policies{Server: s})
	computev1.RegisterPoolsServiceServer(gs, &pools{Server: s})
	computev1.RegisterRolloutsServiceServer(gs, &rolloutsAPI{Server: s})
	computev1.RegisterAuditServiceServer(gs, &auditLog{Server: s})
	computev1.RegisterJoinTokensServiceServer(gs, &joinTokens{Server: s})
	computev1.RegisterNodesServiceServer(gs, &nodes{Server: s})
	computev1.RegisterCommandsServiceServer(gs, &commandsAPI{Server: s})
	computev1.RegisterReservationsServiceServer(gs, &reservations{Server: s})
	computev1.RegisterCapacityServiceServer(gs, &capacityGroup{Server: s})
	computev1.RegisterEventsServiceServer(gs, &eventsAPI{Server: s})
	computev1.RegisterWebhooksServiceServer(gs, &webhooksAPI{Server: s})
	computev1.RegisterSitesServiceServer(gs, &sitesAPI{Server: s})
	computev1.RegisterMetalServiceServer(gs, &metalAPI{Server: s})
	computev1.RegisterInstancesServiceServer(gs, &instancesAPI{Server: s})
	computev1.RegisterTunnelsServiceServer(gs, &tunnelsAPI{Server: s})
	if err := CheckMethods(gs, s.methods); err != nil {
		return nil, err
	}
	hs := health.NewServer()
	healthpb.RegisterHealthServer(gs, hs)
	if !cfg.NoReflection {
		reflection.Register(gs)
	}
	s.grpc, s.health = gs, hs
	s.relays.watched = make(chan struct{})
	go s.watchTunnels()
	return s, nil
}

// InternalNetwork is the network of the in-process connection the REST
// gateway calls the gRPC server over (see [Server.Gateway]).
const InternalNetwork = "bufconn"

// GRPC returns the gRPC server, to be served over HTTP/2.
func (s *Server) GRPC() *grpc.Server { return s.grpc }

// SetServing marks every service SERVING or NOT_SERVING in gRPC health.
func (s *Server) SetServing(ok bool) {
	if ok {
		s.health.Resume()
	} else {
		s.health.Shutdown()
	}
}

// Gateway returns the REST handler (every method under [Prefix] plus the
// OpenAPI documents), which forwards to the gRPC server at addr so that REST
// and gRPC share interceptors, limits and errors.
func (s *Server) Gateway(ctx context.Context) (http.Handler, error) {
	// The REST gateway reaches the gRPC server through an in-process
	// connection, not the listener: the listener may be TLS (with client
	// certificates) and the gateway is not a client of it. The gRPC server
	// tells these calls apart by their peer's network (InternalNetwork) and
	// takes the client's address from the X-Forwarded-For the gateway adds.
	internal := bufconn.Listen(1 << 20)
	go func() { _ = s.grpc.Serve(internal) }()
	conn, err := grpc.NewClient("passthrough:///internal",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return internal.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithStatsHandler(otelgrpc.NewClientHandler()),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(MaxRequestBytes)),
	)
	if err != nil {
		return nil, fmt.Errorf("dial own gRPC server: %w", err)
	}
	s.conn = conn
	mux := runtime.NewServeMux(
		runtime.WithErrorHandler(gatewayErrorHandler),
		runtime.WithRoutingErrorHandler(routingErrorHandler),
		runtime.WithIncomingHeaderMatcher(headerMatcher),
		runtime.WithOutgoingHeaderMatcher(outgoingHeaderMatcher),
		runtime.WithMarshalerOption(runtime.MIMEWildcard, RESTMarshaler()),
	)
	for name, register := range map[string]func(context.Context, *runtime.ServeMux, *grpc.ClientConn) error{
		"system":       computev1.RegisterSystemServiceHandler,
		"tenants":      computev1.RegisterTenantsServiceHandler,
		"identities":   computev1.RegisterIdentitiesServiceHandler,
		"apiKeys":      computev1.RegisterApiKeysServiceHandler,
		"policies":     computev1.RegisterPoliciesServiceHandler,
		"pools":        computev1.RegisterPoolsServiceHandler,
		"rollouts":     computev1.RegisterRolloutsServiceHandler,
		"audit":        computev1.RegisterAuditServiceHandler,
		"joinTokens":   computev1.RegisterJoinTokensServiceHandler,
		"nodes":        computev1.RegisterNodesServiceHandler,
		"reservations": computev1.RegisterReservationsServiceHandler,
		"capacity":     computev1.RegisterCapacityServiceHandler,
		"commands":     computev1.RegisterCommandsServiceHandler,
		"events":       computev1.RegisterEventsServiceHandler,
		"webhooks":     computev1.RegisterWebhooksServiceHandler,
		"sites":        computev1.RegisterSitesServiceHandler,
		"metal":        computev1.RegisterMetalServiceHandler,
		"instances":    computev1.RegisterInstancesServiceHandler,
		"tunnels":      computev1.RegisterTunnelsServiceHandler,
	} {
		if err := register(ctx, mux, conn); err != nil {
			return nil, fmt.Errorf("register %s gateway: %w", name, err)
		}
	}
	h := http.NewServeMux()
	h.HandleFunc("GET "+OpenAPIPath, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", openapi.ContentType)
		_, _ = w.Write(openapi.V3Document())
	})
	h.HandleFunc("GET "+SwaggerPath, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", openapi.ContentType)
		w.Header().Set("Deprecation", "true")
		w.Header().Set("Link", "<"+OpenAPIPath+`>; rel="successor-version"`)
		_, _ = w.Write(openapi.Document())
	})
	h.Handle(Prefix, http.MaxBytesHandler(mux, MaxRequestBytes))
	return h, nil
}

// Conn is the in-process connection to this server that [Server.Gateway]
// opened: what the console and the MCP server call the API through, as
// their caller (each call carries the caller's `authorization: Bearer`
// metadata and an x-forwarded-for of the HTTP client's address, as the REST
// gateway sends). Nil before Gateway.
func (s *Server) Conn() grpc.ClientConnInterface {
	if s.conn == nil {
		return nil
	}
	return s.conn
}

// AsCaller returns ctx with the outgoing metadata of a call made through
// [Server.Conn] on behalf of an HTTP client: its bearer token and its address
// (host, without the port), which the server's per-address limits and audit
// read as the REST gateway's X-Forwarded-For.
func AsCaller(ctx context.Context, token, clientHost string) context.Context {
	kv := []string{"authorization", "Bearer " + token}
	if clientHost != "" {
		kv = append(kv, "x-forwarded-for", clientHost)
	}
	return metadata.AppendToOutgoingContext(ctx, kv...)
}

// Stop stops the gRPC server at once (the HTTP server drains first) and
// closes the gateway's connection. It is safe to call more than once.
func (s *Server) Stop() {
	s.CloseStreams()
	<-s.relays.watched // after CloseStreams, which ends it
	s.tail.stop()
	s.health.Shutdown()
	s.grpc.Stop()
	if s.conn != nil {
		_ = s.conn.Close()
	}
}
