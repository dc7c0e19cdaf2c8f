// Package app is the composition root of every Better Compute process: it
// turns one configuration and a list of roles into running services on one
// port (gRPC and REST over HTTP/1.1 and h2c, plus /healthz and /readyz;
// /metrics, pprof and gRPC reflection on the admin listener,
// server.adminAddr), and stops them cleanly.
//
// Only mains (the better-compute CLI and each deployable's thin main) import
// this package.
package app

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/bettercompute/bettercompute/pkg/artifacts"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/bus"
	"github.com/bettercompute/bettercompute/pkg/clientaddr"
	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/health"
	"github.com/bettercompute/bettercompute/pkg/migrate"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/startstop"
	"github.com/bettercompute/bettercompute/pkg/telemetry"
	"github.com/bettercompute/bettercompute/pkg/version"
	"github.com/bettercompute/bettercompute/pkg/wake"
	"github.com/bettercompute/bettercompute/services/api"
	"github.com/bettercompute/bettercompute/services/console"
	"github.com/bettercompute/bettercompute/services/gateway"
	iamjobs "github.com/bettercompute/bettercompute/services/iam"
	"github.com/bettercompute/bettercompute/services/inventory"
	"github.com/bettercompute/bettercompute/services/lifecycle"
	"github.com/bettercompute/bettercompute/services/mcpserver"
	"github.com/bettercompute/bettercompute/services/nodespec"
	"github.com/bettercompute/bettercompute/services/relay"
	"github.com/bettercompute/bettercompute/services/system"
)

// built lists the roles that have a service in this release. A role named
// explicitly that is not here fails at start; `all` runs these.
var built = config.BuiltRoles

// runtimeRoles are the roles whose reconcilers run on the reconciler runtime,
// each a membership of its own.
var runtimeRoles = config.RuntimeRoles

// ResolveRoles expands the configured roles into the ones to run. `all` means
// every built role, and the rest are returned as notBuilt so the caller can
// say so. A role named explicitly that is not built is an UNSUPPORTED error
// naming it: a process never runs nothing silently.
func ResolveRoles(names []string) (run, notBuilt []config.Role, err error) {
	roles, err := config.ParseRoles(names)
	if err != nil {
		return nil, nil, err
	}
	if slices.Equal(roles, []config.Role{config.RoleAll}) {
		for _, r := range config.AllRoles {
			if slices.Contains(built, r) {
				run = append(run, r)
			} else {
				notBuilt = append(notBuilt, r)
			}
		}
		return run, notBuilt, nil
	}
	for _, r := range roles {
		if !slices.Contains(built, r) {
			return nil, nil, fault.New(fault.Unsupported, "roles", "role %q is not built yet in this release (built: %s)", r, joinRoles(built))
		}
	}
	return roles, nil, nil
}

func joinRoles(rs []config.Role) string {
	s := make([]string, len(rs))
	for i, r := range rs {
		s[i] = string(r)
	}
	return strings.Join(s, ", ")
}

// Options are the process-wide dependencies handed to every service.
type Options struct {
	// Logger is the one process logger; nil discards.
	Logger *slog.Logger
	// Registry receives every metric; nil makes a fresh one.
	Registry *prometheus.Registry
	// API tunes the api role (clock, authentication cache, rate limit); the
	// zero value is production's.
	API api.Tuning
	// DBTracer, when set, sees every query of the process's pool.
	DBTracer pgx.QueryTracer
	// Kinds is the command-kind registry every role of the process uses
	// (commands.run, acceptance checks, the gateway, the sweeper); nil
	// means commands.Builtin(). The api and the controllers queue through
	// a signing view of it (commands.Registry.Signing) when
	// commands.signingKeyFile is set; the gateway never gets the key.
	Kinds *commands.Registry
	// MetalTamper, a test hook, may change each finished command the metal
	// workflow reads before it verifies its node signature (a gateway
	// faking a result); nil in production.
	MetalTamper func(c *commands.Command)
}

// App is one running process.
type App struct {
	cfg    *config.Config
	logger *slog.Logger
	reg    registry // see metrics.go
	roles  []config.Role
	opts   Options

	life    startstop.Once
	ready   atomic.Bool
	pool    *pgxpool.Pool
	runtime *reconcile.Runtime
	gateway *gatewayServer
	joinSvc *joinServer // the node CA and HPKE key live here, or nowhere in the process
	admin   *adminServer
	relay   *relay.Service
	localGW atomic.Pointer[gateway.Gateway] // for in-process dispatch
	// waker sends every transaction's wakes after commit, to the process's
	// own gateway directly and over the bus to the others.
	waker *wake.Waker
	// kinds is the command-kind registry; admitKinds the view of it the
	// roles that queue commands use, signing with the command-signing key
	// (see prepareCommandSigning). The gateway gets kinds: it holds no key.
	kinds      *commands.Registry
	admitKinds *commands.Registry

	nc      *nats.Conn
	api     *api.Server
	srv     *http.Server
	ln      net.Listener
	served  chan struct{}
	tracing func(context.Context) error
	checks  []health.Check
}

// New validates cfg (defaults must already be filled) and resolves the roles.
// It does no I/O: a bad configuration fails here, before anything touches the
// database.
func New(cfg *config.Config, opts Options) (*App, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	roles, notBuilt, err := ResolveRoles(cfg.Roles)
	if err != nil {
		return nil, err
	}
	if err := cfg.RequireDatabase(); err != nil {
		return nil, err
	}
	var oldGatewayKey bool
	if slices.Contains(roles, config.RoleGateway) {
		all := slices.Equal(cfg.Roles, nil) || slices.Contains(cfg.Roles, string(config.RoleAll))
		switch {
		case cfg.Host.Gateway != "":
			if cfg.Gateway.Listen == "" {
				cfg.Gateway.Listen = cfg.Host.Gateway
			}
		case cfg.Gateway.Listen != "":
			// `all` keyed its gateway on gateway.listen before host.gateway.
			oldGatewayKey = all
		case all:
			// `all` runs a gateway only where host.gateway says so.
			roles = slices.DeleteFunc(roles, func(r config.Role) bool { return r == config.RoleGateway })
		default:
			cfg.Gateway.Listen = ":8443"
		}
	}
	roles = resolveJoinService(cfg, roles)
	if slices.Contains(roles, config.RoleJoinService) || (slices.Contains(roles, config.RoleGateway) && !cfg.RelaysJoins()) {
		if err := cfg.RequireJoinServiceKeys(); err != nil {
			return nil, err
		}
	}
	if slices.Contains(roles, config.RoleGateway) {
		if err := cfg.RequireGatewayTLS(); err != nil {
			return nil, err
		}
	}
	logger := opts.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if len(notBuilt) > 0 {
		logger.Info("roles not built yet in this release are skipped by `all`", "roles", joinRoles(notBuilt))
	}
	if oldGatewayKey {
		logger.Warn("`all` runs a gateway because gateway.listen is set: set host.gateway instead (gateway.listen alone stops starting one under `all` after this release)",
			"gateway.listen", cfg.Gateway.Listen)
	}
	reg := opts.Registry
	if reg == nil {
		reg = telemetry.NewRegistry()
	}
	return &App{cfg: cfg, logger: logger, reg: reg, roles: roles, opts: opts, tracing: func(context.Context) error { return nil },
		kinds: cmp.Or(opts.Kinds, commands.Builtin())}, nil
}

// Roles returns the roles this process runs.
func (a *App) Roles() []config.Role { return a.roles }

// Start connects to the database (migrating it unless server.noMigrate is
// set, else refusing a schema behind this binary), connects to the bus when
// one is configured, builds the roles' services and starts serving. On error
// everything already started is stopped. A second Start, or one after Stop,
// is an error.
func (a *App) Start(ctx context.Context) error {
	err := a.life.Start(func() error {
		if err := a.start(ctx); err != nil {
			a.stop(context.WithoutCancel(ctx))
			return err
		}
		return nil
	})
	if errors.Is(err, startstop.ErrStarted) || errors.Is(err, startstop.ErrStopped) {
		return errors.New("app: Start called twice or after Stop")
	}
	return err
}

func (a *App) start(ctx context.Context) (err error) {
	if a.tracing, err = telemetry.SetupTracing(ctx, a.cfg.Telemetry.OTLPEndpoint, a.cfg.Telemetry.ServiceName); err != nil {
		return err
	}
	a.pool, err = db.Open(ctx, db.Config{URL: a.cfg.Database.URL, MaxConns: int32(a.cfg.Database.MaxConns), PgBouncer: a.cfg.Database.PgBouncer, Tracer: a.opts.DBTracer,
		IdleInTransactionTimeout: a.cfg.Database.IdleInTransactionTimeout.Std()})
	if err != nil {
		return fault.Wrap(err, fault.Unavailable, "database.url", "cannot reach the database: %v", err)
	}
	if err := a.prepareSchema(ctx); err != nil {
		return err
	}
	if a.cfg.NATS.URL != "" {
		if a.nc, err = bus.Connect(a.cfg.NATS.URL, "better-compute", a.logger); err != nil {
			return fault.Wrap(err, fault.InvalidConfig, "nats.url", "cannot use the bus: %v", err)
		}
	} else {
		a.logger.Warn("no nats.url configured: running without the bus, polling the database only")
	}
	a.waker = wake.New(a.nc, func(ctx context.Context, ids []string) (map[string]string, error) {
		return nodes.Gateways(ctx, a.pool, ids)
	}, a.logger)
	a.checks = a.healthChecks()
	if err := a.prepareCommandSigning(); err != nil {
		return err
	}
	// bettercompute_command_duration_seconds: observed by whichever role of
	// this process settles a command (gateway, api, command-sweeper).
	if err := a.reg.Register(commands.Collector()); err != nil {
		return err
	}
	if err := a.startRuntime(ctx); err != nil {
		return err
	}
	if err := a.startJoinService(ctx); err != nil {
		return err
	}
	if slices.Contains(a.roles, config.RoleGateway) {
		if err := a.startGateway(ctx); err != nil {
			return err
		}
	}
	if err := a.startRelay(ctx); err != nil {
		return err
	}

	addr := net.JoinHostPort(a.cfg.Server.Host, strconv.Itoa(*a.cfg.Server.Port))
	if a.ln, err = net.Listen("tcp", addr); err != nil {
		return fault.Wrap(err, fault.Unavailable, "server.port", "cannot listen on %s: %v", addr, err)
	}
	handler, err := a.buildHandler(ctx)
	if err != nil {
		return err
	}
	tlsCfg, err := a.serverTLS()
	if err != nil {
		return err
	}
	a.srv = a.newHTTPServer(handler, tlsCfg)
	if err := a.startAdmin(); err != nil {
		return err
	}
	if a.api != nil {
		a.srv.RegisterOnShutdown(a.api.CloseStreams)
	}
	a.served = make(chan struct{})
	go func() {
		defer close(a.served)
		serve := func() error { return a.srv.Serve(a.ln) }
		if tlsCfg != nil {
			serve = func() error { return a.srv.ServeTLS(a.ln, "", "") }
		}
		if err := serve(); err != nil && !errors.Is(err, http.ErrServerClosed) {
			a.logger.Error("server stopped", "err", err)
		}
	}()
	a.ready.Store(true)
	if a.api != nil {
		a.api.SetServing(true)
	}
	a.logger.InfoContext(ctx, "serving", "addr", a.Addr(), "roles", joinRoles(a.roles))
	return nil
}

func (a *App) prepareSchema(ctx context.Context) error {
	if !a.cfg.Server.NoMigrate {
		m, err := migrate.New(a.pool, migrate.Config{TableLock: a.cfg.Database.PgBouncer, Logger: a.logger})
		if err != nil {
			return err
		}
		defer func() { _ = m.Close() }()
		if _, err := m.Up(ctx); err != nil {
			return err
		}
	}
	current, err := migrate.Check(ctx, a.pool)
	if err != nil {
		return err
	}
	a.logger.InfoContext(ctx, "database schema", "version", current, "required", migrate.Latest())
	return nil
}

// startRuntime runs the reconciler runtime for the runtime roles this process
// hosts, each a membership with its own shard leases: the runtime's own jobs
// (the worker janitor, resync), the inventory controller and the liveness
// job for `controllers` and the nodespec controller for `nodespec-controller`. Later modules
// register theirs here.
func (a *App) startRuntime(ctx context.Context) error {
	var roles []string
	for _, r := range runtimeRoles {
		if slices.Contains(a.roles, r) || (r == config.RoleScheduler && a.schedulerHosted()) {
			roles = append(roles, string(r))
		}
	}
	if len(roles) == 0 {
		return nil
	}
	rc := a.cfg.Runtime
	rt, err := reconcile.New(a.pool, a.nc, reconcile.Config{
		Roles:        roles,
		Heartbeat:    rc.Heartbeat.Std(),
		LeaseTTL:     rc.LeaseTTL.Std(),
		ResyncEvery:  rc.ResyncEvery.Std(),
		ResyncJitter: rc.ResyncJitter.Std(),
		Poll:         rc.Poll.Std(),
		PollBusDown:  rc.PollBusDown.Std(),
		Concurrency:  rc.Concurrency,
		Batch:        rc.Batch,
		Logger:       a.logger,
		Registerer:   a.reg,
		Version:      version.Get().Version,
		Waker:        a.waker,
	})
	if err != nil {
		return err
	}
	if slices.Contains(roles, reconcile.RoleControllers) {
		for _, r := range inventory.New(inventory.Config{Kinds: a.admitKinds}) {
			if err := rt.Register(r); err != nil {
				return err
			}
		}
		n := a.cfg.Nodes
		if err := rt.Register(lifecycle.Liveness(lifecycle.Config{
			NotReadyAfter: n.NotReadyAfter.Std(), LostAfter: n.LostAfter.Std(), Every: n.LivenessEvery.Std(),
			UnhealthyThreshold: n.UnhealthyThreshold, Brakes: n.Brakes(),
		})); err != nil {
			return err
		}
		// bc_eviction_paused{scope}, read from the brakes table at scrape.
		if err := a.reg.Register(&lifecycle.BrakesCollector{Pool: a.pool}); err != nil {
			return err
		}
		// bettercompute_nodes and bettercompute_node_conditions, read from
		// the nodes table at scrape.
		if err := a.reg.Register(&lifecycle.FleetCollector{Pool: a.pool}); err != nil {
			return err
		}
		// The drain job's periodic pass (due drains) runs on the liveness
		// period: a drain completes within one of its deadline.
		if err := rt.Register(lifecycle.Drain(lifecycle.DrainConfig{
			Every: n.LivenessEvery.Std(), LostNode: a.cfg.Capacity.LostNode,
		})); err != nil {
			return err
		}
		if err := a.registerHealth(rt); err != nil {
			return err
		}
		// fleet.drift: the nodes' Drifted condition.
		for _, r := range lifecycle.Drift(lifecycle.DriftConfig{
			StuckAfter: a.cfg.Fleet.StuckAfter.Std(), Every: a.cfg.Fleet.DriftEvery.Std(),
		}) {
			if err := rt.Register(r); err != nil {
				return err
			}
		}
		// The rollout job: pool keys, back every second while a rollout
		// progresses (docs/rollouts.md).
		if err := rt.Register(lifecycle.Rollout(lifecycle.RolloutConfig{Kinds: a.admitKinds})); err != nil {
			return err
		}
	}
	if slices.Contains(roles, reconcile.RoleNodeSpec) {
		// The nodespec controller pokes the gateway holding the node after
		// a generation change: directly when it is in this process, over the
		// bus otherwise. Gateways also resync from the database, so a lost
		// poke only delays delivery.
		reg, err := nodeSpecRegistry()
		if err != nil {
			return err
		}
		if err := rt.Register(nodespec.Reconciler(nodespec.Config{Registry: reg})); err != nil {
			return err
		}
	}
	if slices.Contains(roles, string(config.RoleMetal)) {
		if err := a.registerMetal(rt); err != nil {
			return err
		}
	}
	if slices.Contains(roles, string(config.RoleVPS)) {
		if err := a.registerVPS(rt); err != nil {
			return err
		}
	}
	if slices.Contains(roles, reconcile.RoleScheduler) {
		if err := a.registerCapacity(rt); err != nil {
			return err
		}
	}
	if slices.Contains(roles, string(config.RoleIAM)) {
		// IAM's jobs, each under a singleton lease (services/iam).
		rs, err := iamjobs.Reconcilers(iamjobs.Config{IAM: a.cfg.IAM, Logger: a.logger.With("role", "iam"), Registerer: a.reg})
		if err != nil {
			return err
		}
		for _, r := range rs {
			if err := rt.Register(r); err != nil {
				return err
			}
		}
	}
	if err := a.registerCommands(rt, roles); err != nil {
		return err
	}
	if err := a.registerAudit(rt, roles); err != nil {
		return err
	}
	if err := rt.Start(ctx); err != nil {
		return err
	}
	a.runtime = rt
	return nil
}

func (a *App) healthChecks() []health.Check {
	pool, nc := a.pool, a.nc
	checks := []health.Check{
		// Probed at most once a second however many ask: /readyz and
		// System.Health answer anyone.
		health.Cached(health.Check{Name: "database", Required: true, Run: func(ctx context.Context) error { return pool.Ping(ctx) }}, time.Second),
		health.Cached(health.Check{Name: "schema", Required: true, Run: func(ctx context.Context) error { _, err := migrate.Check(ctx, pool); return err }}, time.Second),
	}
	checks = append(checks, health.Check{Name: "bus", Required: false, Run: func(context.Context) error {
		switch {
		case nc == nil:
			return nil // not configured: polling only, by choice
		case nc.IsConnected():
			return nil
		}
		return fmt.Errorf("nats %s: polling the database until it is back", nc.Status())
	}})
	return checks
}

func (a *App) buildHandler(ctx context.Context) (http.Handler, error) {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", a.serveReady)
	_, adminOnAPI := a.cfg.Server.Admin()
	if adminOnAPI {
		mux.Handle("GET /metrics", promhttp.HandlerFor(a.reg, promhttp.HandlerOpts{Registry: a.reg}))
	}

	if slices.Contains(a.roles, config.RoleAPI) {
		az := authz.New(a.pool)
		var err error
		tuning := a.opts.API
		tuning.NoReflection = tuning.NoReflection || !adminOnAPI // served on the admin listener
		keyring, err := a.secretsKeyring()
		if err != nil {
			return nil, err
		}
		proxies, err := clientaddr.Parse(a.cfg.Server.TrustedProxies)
		if err != nil {
			return nil, fault.New(fault.InvalidConfig, "server.trustedProxies", "%v", err)
		}
		a.api, err = api.New(api.Config{
			Logger: a.logger, TrustedProxies: proxies, DB: a.pool, Authorizer: az, Tuning: tuning, Waker: a.waker,
			Capacity: a.apiCapacity(), NATS: a.nc, AllowInsecureWebhooks: a.cfg.Webhooks.AllowInsecure,
			AllowPrivateWebhooks: a.cfg.Webhooks.AllowPrivateNetworks, Providers: a.cfg.Providers.Outbound(), Kinds: a.admitKinds,
			AuditKey: a.auditKey(), Registerer: a.reg, Secrets: keyring,
			MaxRepairClearsPerNode: a.cfg.Health.MaxRepairClearsPerNode,
			Tunnels:                tunnelDialer{a},
			TunnelLimits: api.TunnelLimits{PerNode: a.cfg.Tunnels.PerNode, PerTenant: a.cfg.Tunnels.PerTenant,
				NodeBytesPerSecond: a.cfg.Tunnels.NodeBytesPerSecond, TenantBytesPerSecond: a.cfg.Tunnels.TenantBytesPerSecond},
			Watch: api.WatchLimits{
				MaxLifetime: a.cfg.Events.MaxStreamLifetime.Std(), PerIdentity: a.cfg.Events.MaxWatchesPerIdentity, Total: a.cfg.Events.MaxWatches,
			},
			System: system.New(system.Deps{
				SchemaVersion:         func(ctx context.Context) (int64, error) { return migrate.Current(ctx, a.pool) },
				RequiredSchemaVersion: migrate.Latest(),
				Checks:                a.checks,
				Authorizer:            az,
			}),
		})
		if err != nil {
			return nil, err
		}
		gw, err := a.api.Gateway(ctx)
		if err != nil {
			return nil, err
		}
		mux.HandleFunc("GET "+api.WatchPath, a.api.ServeWatch)
		mux.HandleFunc("GET "+api.TunnelConnectPath, a.api.ServeTunnel)
		mux.Handle(api.Prefix, gw)
		con, err := console.New(console.Config{Conn: a.api.Conn(), Watch: a.api.ServeWatch, Kinds: a.admitKinds, Logger: a.logger,
			TrustedProxies: proxies, DB: a.pool, Now: a.opts.API.Now,
			SessionIdle: a.cfg.Console.SessionIdle.Std(), SessionLifetime: a.cfg.Console.SessionLifetime.Std()})
		if err != nil {
			return nil, err
		}
		mux.Handle(console.Prefix, con)
		mux.Handle("GET /console", http.RedirectHandler(console.Prefix, http.StatusFound))
		if dir := a.cfg.Artifacts.Dir; dir != "" {
			mux.Handle(artifacts.Prefix, artifacts.Handler(dir))
		}
		mux.Handle(mcpserver.Path, mcpserver.Handler(mcpserver.Config{
			Conn: a.api.Conn(), ReadOnly: a.cfg.MCP.ReadOnly, Version: version.Get().Version, Kinds: a.admitKinds, Logger: a.logger,
			TrustedProxies: proxies,
		}))
	}
	if a.api == nil {
		return withGRPC(nil, mux), nil
	}
	return withGRPC(a.api.GRPC(), mux), nil
}

func (a *App) serveReady(w http.ResponseWriter, r *http.Request) {
	rep := health.Report{}
	if a.ready.Load() {
		rep = health.Run(r.Context(), a.checks)
	}
	w.Header().Set("Content-Type", "application/json")
	if !rep.Ready {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	_ = json.NewEncoder(w).Encode(rep)
}

// Addr returns the address the process listens on (host:port), or "" before
// Start.
func (a *App) Addr() string {
	if a.ln == nil {
		return ""
	}
	return a.ln.Addr().String()
}

// Stop stops serving (draining requests for up to server.shutdownTimeout),
// then closes the bus and the database. It tolerates Stop before Start, a
// second Stop, and Stop concurrent with Start (it waits for Start).
func (a *App) Stop(ctx context.Context) {
	a.life.Stop(func(bool) { a.stop(ctx) })
}

func (a *App) stop(ctx context.Context) {
	a.ready.Store(false)
	ctx, cancel := context.WithTimeout(ctx, a.cfg.Server.ShutdownTimeout.Std())
	defer cancel()
	if a.gateway != nil {
		// Drain first: no new session, every daemon told to move to
		// another gateway, while this process still serves everything
		// else.
		n := a.gateway.gw.Drain(ctx)
		a.logger.Info("gateway drained", "sessions", n)
	}
	if a.srv != nil {
		if err := a.srv.Shutdown(ctx); err != nil {
			a.logger.Warn("graceful shutdown timed out; closing connections", "err", err)
			_ = a.srv.Close()
		}
		<-a.served
	} else if a.ln != nil {
		_ = a.ln.Close()
	}
	if a.api != nil {
		a.api.Stop()
	}
	if a.admin != nil {
		a.admin.stop()
	}
	if a.gateway != nil {
		a.gateway.stop(ctx)
	}
	if a.joinSvc != nil {
		a.joinSvc.stop(ctx)
	}
	if a.runtime != nil {
		a.runtime.Stop() // releases its leases so other workers take over at once
	}
	if a.relay != nil {
		a.relay.Stop() // releases the relay's lease to a standby
	}
	if a.nc != nil {
		a.nc.Close()
	}
	if a.pool != nil {
		a.pool.Close()
	}
	if err := a.tracing(ctx); err != nil {
		a.logger.Warn("flush traces", "err", err)
	}
}

// Run starts the process, serves until ctx is done, then stops it.
func Run(ctx context.Context, cfg *config.Config, opts Options) error {
	a, err := New(cfg, opts)
	if err != nil {
		return err
	}
	if err := a.Start(ctx); err != nil {
		return err
	}
	<-ctx.Done()
	a.logger.Info("shutting down")
	a.Stop(context.WithoutCancel(ctx))
	return nil
}
