// Package dev runs the whole control plane on a developer's machine: every
// built role in one process, an embedded NATS server with JetStream, and
// PostgreSQL resolved like the test harness does (database.url, else the local
// server, else a private cluster under dev.dataDir).
package dev

import (
	"context"
	"crypto/ed25519"
	"encoding/pem"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/agent/sim"

	"github.com/bettercompute/bettercompute/pkg/audit"
	"github.com/bettercompute/bettercompute/pkg/bootstrap"
	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/natsembed"
	"github.com/bettercompute/bettercompute/pkg/pglocal"
	"github.com/bettercompute/bettercompute/pkg/providers"
	"github.com/bettercompute/bettercompute/pkg/secrets"
	"github.com/bettercompute/bettercompute/services/api"
	"github.com/bettercompute/bettercompute/services/app"
)

// Database is the database dev creates and uses on a resolved server.
const Database = "bettercompute_dev"

// Env is a running dev environment.
type Env struct {
	App      *app.App
	NATSURL  string
	Database string
	// Credential is a root API key: made on the first start and kept under
	// dev.dataDir, shown again by later starts.
	Credential string
	// CredentialNew says Credential was made by this start.
	CredentialNew bool
	// CredentialPath is the 0600 file that keeps Credential.
	CredentialPath string
	// JoinKeyFile and CAFile are what `bcd join` needs: joinservice's public
	// key and the node CA's bundle.
	JoinKeyFile, CAFile string
	// Fleet is the simulated fleet (dev.simNodes), or nil.
	Fleet *sim.Fleet
	// Metal is the simulated bare-metal site (dev.simMachines), or nil.
	Metal *SimSite
	// MetalSiteID and MetalMachines are its site's id and its machines.
	MetalSiteID   string
	MetalMachines []*SimMachine
	metal         *devMetal
	// VPSFleet is the simulated VPS hosts of the hosted pool VPSPoolID
	// (dev.simInstances), or nil; Provider is the fake provider serving
	// the provider pool ProviderPoolID at ProviderURL.
	VPSFleet                  *sim.Fleet
	VPSPoolID, ProviderPoolID string
	Provider                  *providers.Fake
	ProviderURL               string
	vps                       *devVPS
	// CommandKey is the public half of the command-signing key (made once
	// under dev.dataDir/pki unless commands.signingKeyFile is set): what
	// daemons pin to verify destructive commands.
	CommandKey ed25519.PublicKey
	// PrometheusURL is the Prometheus dev started (RunOptions.Prometheus,
	// when one is installed), or "".
	PrometheusURL string
	prom          *devPrometheus
	// wantProm says dev was asked to start Prometheus.
	wantProm bool
	simMig   bool
	stops    []func()
	// SimPoolID is the simulated nodes' pool "sim". ReleaseKeyPath is dev's
	// release key (under dev.dataDir/pki), which they pin;
	// SimUpgradeManifest the signed manifest of the simulated second build
	// dev published for them (upgrade.go), or "".
	SimPoolID, ReleaseKeyPath, SimUpgradeManifest string
	releaseKey                                    ed25519.PrivateKey
}

// RunOptions are what [Run] adds to [Start].
type RunOptions struct {
	// Prometheus starts the prometheus binary on PATH, when there is one,
	// scraping the simulated nodes' telemetry and the control plane
	// (under dev.dataDir/prometheus); without one the banner says how to
	// get it. Best effort: a Prometheus that fails is logged, dev runs on.
	Prometheus bool
	// PrometheusListen is its address; "" is PrometheusListen, or a free
	// loopback port when that is taken.
	PrometheusListen string
	// SimMig gives the first simulated node a MIG layout on its GPU 0
	// (3g.71gb + 2g.35gb + 2 × 1g.18gb), which its mock NVML applies: GPU
	// 0 is then not bookable whole. make run sets it; tests that count
	// the fleet's whole GPUs leave it off.
	SimMig bool
}

// StartRun is [Start] with what [Run] adds (a MIG layout on a simulated
// node, Prometheus): for tests of those.
func StartRun(ctx context.Context, cfg *config.Config, logger *slog.Logger, run RunOptions) (*Env, error) {
	return start(ctx, cfg, app.Options{Logger: logger}, run)
}

// Start resolves PostgreSQL and NATS as the package comment says and starts
// every built role. cfg must have defaults filled and be valid; a nil logger
// discards. Stop the Env when done.
func Start(ctx context.Context, cfg *config.Config, logger *slog.Logger) (*Env, error) {
	return StartWith(ctx, cfg, app.Options{Logger: logger})
}

// StartWith is [Start] with the process options of the control plane (its
// logger, its command kinds).
func StartWith(ctx context.Context, cfg *config.Config, opts app.Options) (_ *Env, err error) {
	return start(ctx, cfg, opts, RunOptions{})
}

func start(ctx context.Context, cfg *config.Config, opts app.Options, run RunOptions) (_ *Env, err error) {
	logger := opts.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	env := &Env{wantProm: run.Prometheus}
	defer func() {
		if err != nil {
			env.Stop(context.WithoutCancel(ctx))
		}
	}()
	dataDir, err := filepath.Abs(cfg.Dev.DataDir)
	if err != nil {
		return nil, fmt.Errorf("dev data dir: %w", err)
	}
	if err := os.MkdirAll(dataDir, 0o755); err != nil {
		return nil, fmt.Errorf("dev data dir: %w", err)
	}

	if cfg.Database.URL == "" {
		srv, err := pglocal.Resolve(ctx, pglocal.Options{DataDir: filepath.Join(dataDir, "pg"), Logger: logger})
		if err != nil {
			return nil, fmt.Errorf("find a PostgreSQL server for dev (set database.url to use another): %w", err)
		}
		env.stops = append(env.stops, func() {
			if err := srv.Stop(); err != nil {
				logger.Warn("stop private PostgreSQL", "err", err)
			}
		})
		logger.Info("postgres", "source", srv.Source, "dataDir", srv.DataDir)
		if cfg.Database.URL, err = ensureDatabase(ctx, srv.URL, Database); err != nil {
			return nil, err
		}
	}
	env.Database = cfg.Database.URL

	if cfg.NATS.URL == "" {
		ns, err := natsembed.Start(natsembed.Options{Port: -1, StoreDir: filepath.Join(dataDir, "nats"), ServerName: "bc-dev"})
		if err != nil {
			return nil, fmt.Errorf("start embedded NATS: %w", err)
		}
		env.stops = append(env.stops, func() {
			if err := ns.Shutdown(); err != nil {
				logger.Warn("stop embedded NATS", "err", err)
			}
		})
		cfg.NATS.URL = ns.ClientURL()
	}
	env.NATSURL = cfg.NATS.URL

	// The gateway, with a node CA and joinservice key made once under the
	// data dir, so nodes can join the dev control plane.
	js := &cfg.JoinService
	if js.CACertFile == "" && js.HPKEKeyFile == "" && js.KeyDir == "" {
		js.KeyDir = filepath.Join(dataDir, "pki")
	}
	if cfg.Gateway.Listen == "" {
		cfg.Gateway.Listen = DefaultGatewayListen
	}
	if cfg.Host.Gateway == "" {
		cfg.Host.Gateway = cfg.Gateway.Listen
	}
	// The command-signing key, made once under the data dir like the CA.
	if cfg.Commands.SigningKeyFile == "" {
		cfg.Commands.SigningKeyFile = filepath.Join(dataDir, "pki", CommandKeyFile)
	}
	signer, err := commands.EnsureSigner(cfg.Commands.SigningKeyFile)
	if err != nil {
		return nil, fmt.Errorf("command-signing key: %w", err)
	}
	env.CommandKey = signer.Public()
	// The audit key, made once under the data dir like the command key.
	if cfg.Audit.SigningKeyFile == "" {
		cfg.Audit.SigningKeyFile = filepath.Join(dataDir, "pki", AuditKeyFile)
	}
	if _, err := audit.EnsureSigner(cfg.Audit.SigningKeyFile); err != nil {
		return nil, fmt.Errorf("audit key: %w", err)
	}
	// The key that seals BMC credentials, made once like the others.
	if cfg.Secrets.KeyFile == "" {
		cfg.Secrets.KeyFile = filepath.Join(dataDir, "pki", SecretsKeyFile)
		if _, err := secrets.EnsureKeyFile(cfg.Secrets.KeyFile); err != nil {
			return nil, fmt.Errorf("secrets key: %w", err)
		}
	}

	// The release key and the artifacts directory of make run's second
	// build (upgrade.go).
	if *cfg.Dev.SimNodes > 0 {
		env.ReleaseKeyPath = filepath.Join(dataDir, "pki", ReleaseKeyFile)
		if env.releaseKey, err = ensureReleaseKey(env.ReleaseKeyPath); err != nil {
			return nil, fmt.Errorf("release key: %w", err)
		}
		if cfg.Artifacts.Dir == "" {
			cfg.Artifacts.Dir = filepath.Join(dataDir, "artifacts")
		}
	}

	// Webhooks to a receiver on this machine (http://127.0.0.1:…) work in
	// dev; a deployment must opt in to both.
	cfg.Webhooks.AllowInsecure = true
	cfg.Webhooks.AllowPrivateNetworks = true
	// The same for the fake provider dev serves on 127.0.0.1.
	cfg.Providers.AllowInsecure = true
	cfg.Providers.AllowPrivateNetworks = true

	// The simulated site's ramdisk files, served here so the site's image
	// cache fetches and verifies real ones (the simulated machines boot in
	// process and never read them).
	if *cfg.Dev.SimMachines > 0 && cfg.Metal.Ramdisk.KernelURL == "" && cfg.Metal.Ramdisk.InitrdURL == "" {
		stop, err := serveSimRamdisk(&cfg.Metal.Ramdisk)
		if err != nil {
			return nil, fmt.Errorf("simulated ramdisk files: %w", err)
		}
		env.stops = append(env.stops, stop)
	}

	// dev keeps /metrics and reflection on its API port while that is
	// loopback (its default): one port to remember on a laptop.
	if cfg.Server.AdminAddr == "" && loopbackHost(cfg.Server.Host) {
		cfg.Server.AdminAddr = config.AdminOnAPIPort
	}
	opts.Logger = logger
	env.App, err = app.New(cfg, opts)
	if err != nil {
		return nil, err
	}
	if err := env.App.Start(ctx); err != nil {
		return nil, err
	}
	if env.JoinKeyFile, env.CAFile, err = writeJoinFiles(env.App, filepath.Join(dataDir, "pki")); err != nil {
		return nil, err
	}
	env.CredentialPath = filepath.Join(dataDir, CredentialFile)
	if env.Credential, env.CredentialNew, err = rootCredential(ctx, cfg.Database.URL, env.CredentialPath); err != nil {
		return nil, err
	}
	if n := *cfg.Dev.SimNodes; n > 0 && env.App.GatewayAddr() != "" {
		// The simulated nodes run bcd's telemetry only for a Prometheus
		// to scrape it.
		_, lookErr := exec.LookPath("prometheus")
		tel := run.Prometheus && lookErr == nil
		if env.Fleet, err = startFleet(ctx, env, filepath.Join(dataDir, "sim"), n, tel, run.SimMig, logger); err != nil {
			return nil, fmt.Errorf("simulated fleet: %w", err)
		}
		if env.SimUpgradeManifest, err = publishSimBuild(cfg.Artifacts.Dir, loopbackBaseURL(env), env.releaseKey); err != nil {
			return nil, fmt.Errorf("simulated second build: %w", err)
		}
	}
	if n := *cfg.Dev.SimMachines; n > 0 && env.App.GatewayAddr() != "" {
		if env.metal, err = startMetal(ctx, env, filepath.Join(dataDir, "metal-sim"), n, logger.With("component", "metal-sim")); err != nil {
			return nil, fmt.Errorf("simulated site: %w", err)
		}
		env.Metal, env.MetalSiteID, env.MetalMachines = env.metal.Site, env.metal.SiteID, env.metal.Machines
	}
	if *cfg.Dev.SimInstances && env.App.GatewayAddr() != "" {
		if env.vps, err = startVPS(ctx, env, filepath.Join(dataDir, "vps-sim"), logger); err != nil {
			return nil, fmt.Errorf("simulated VPS pools: %w", err)
		}
		env.VPSFleet, env.VPSPoolID = env.vps.fleet, env.vps.hostedPool
		env.Provider, env.ProviderPoolID, env.ProviderURL = env.vps.provider, env.vps.providerPool, env.vps.providerURL
	}
	if run.Prometheus {
		if env.prom, err = startPrometheus(env, filepath.Join(dataDir, "prometheus"), run.PrometheusListen, logger.With("component", "prometheus")); err != nil {
			logger.Warn("prometheus not started", "err", err)
			env.prom, err = nil, nil
		}
		if env.prom != nil {
			env.PrometheusURL = env.prom.URL
		}
	}
	return env, nil
}

// CommandKeyFile is the command-signing key's file name under
// <dev.dataDir>/pki.
const CommandKeyFile = "command-signing.key"

// AuditKeyFile is the audit key's file name under <dev.dataDir>/pki.
const AuditKeyFile = "audit.key"

// SecretsKeyFile is the secrets key's file name under <dev.dataDir>/pki
// (secrets.keyFile).
const SecretsKeyFile = "secrets.key"

// DefaultGatewayListen is where dev's gateway listens unless configured.
const DefaultGatewayListen = "127.0.0.1:8443"

// writeJoinFiles writes what `bcd join` needs to trust and reach this control
// plane: joinservice's public key and the node CA's bundle.
func writeJoinFiles(a *app.App, dir string) (keyFile, caFile string, err error) {
	js := a.JoinService()
	if js == nil {
		return "", "", nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", "", err
	}
	pub, err := js.Key().PublicKeyPEM()
	if err != nil {
		return "", "", err
	}
	keyFile, caFile = filepath.Join(dir, "joinservice.pub"), filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(keyFile, pub, 0o644); err != nil {
		return "", "", err
	}
	var bundle []byte
	for _, der := range js.CA().TrustBundle() {
		bundle = append(bundle, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})...)
	}
	if err := os.WriteFile(caFile, bundle, 0o644); err != nil {
		return "", "", err
	}
	return keyFile, caFile, nil
}

// CredentialFile, under dev.dataDir, keeps the root credential dev made on
// its first start, so later starts can show it again.
const CredentialFile = "root-credential"

// rootCredential returns the credential kept at path when it still
// authenticates against the database, else bootstraps a new one and keeps it
// there (mode 0600). fresh says it was just made.
func rootCredential(ctx context.Context, url, path string) (token string, fresh bool, err error) {
	pool, err := db.Open(ctx, db.Config{URL: url, MaxConns: 2, ApplicationName: "better-compute dev"})
	if err != nil {
		return "", false, err
	}
	defer pool.Close()
	if b, err := os.ReadFile(path); err == nil {
		if kept := strings.TrimSpace(string(b)); bootstrap.Valid(ctx, pool, kept) {
			return kept, false, nil
		}
	}
	cred, err := bootstrap.Run(ctx, pool)
	if err != nil {
		return "", false, err
	}
	if err := os.WriteFile(path, []byte(cred.Token+"\n"), 0o600); err != nil {
		return "", false, fmt.Errorf("keep the root credential: %w", err)
	}
	return cred.Token, true, nil
}

// Stop stops the app, then the NATS server and PostgreSQL cluster dev
// started, in reverse order.
func (e *Env) Stop(ctx context.Context) {
	if e.prom != nil {
		e.prom.stop()
		e.prom = nil
	}
	if e.vps != nil {
		e.vps.stop()
		e.vps = nil
	}
	if e.metal != nil {
		e.metal.stop()
		e.metal = nil
	}
	if e.Fleet != nil {
		e.Fleet.Stop()
	}
	if e.App != nil {
		e.App.Stop(ctx)
	}
	for i := len(e.stops) - 1; i >= 0; i-- {
		e.stops[i]()
	}
	e.stops = nil
}

// BaseURL is the HTTP base URL of the running app.
func (e *Env) BaseURL() string { return "http://" + e.App.Addr() }

// Banner is what dev prints once it serves.
func (e *Env) Banner() string {
	base := e.BaseURL()
	var b strings.Builder
	fmt.Fprintf(&b, "\nBetter Compute dev control plane is up (roles: %s)\n\n", rolesString(e.App.Roles()))
	fmt.Fprintf(&b, "  REST     %s/api/compute/{group}/{method}   e.g. curl -X POST %s/api/compute/system/version -d '{}'\n", base, base)
	fmt.Fprintf(&b, "  gRPC     %s (h2c; reflection on)\n", e.App.Addr())
	fmt.Fprintf(&b, "  OpenAPI  %s%s\n", base, api.OpenAPIPath)
	fmt.Fprintf(&b, "  Console  %s/console/   (sign in with an API key, e.g. the root credential below)\n", base)
	fmt.Fprintf(&b, "  MCP      %s/mcp (streamable HTTP, bearer key) or `better-compute mcp` on stdio\n", base)
	fmt.Fprintf(&b, "  health   %s/healthz  %s/readyz\n", base, base)
	if admin := e.App.AdminAddr(); admin != "" {
		fmt.Fprintf(&b, "  metrics  http://%s/metrics (server.adminAddr)\n", admin)
	} else {
		fmt.Fprintf(&b, "  metrics  %s/metrics\n", base)
	}
	fmt.Fprintf(&b, "  NATS     %s\n", e.NATSURL)
	fmt.Fprintf(&b, "  Events   better-compute events watch tenantId=root   (or SSE: curl -N -H 'Authorization: Bearer <key>' '%s%s?tenantId=root')\n", base, api.WatchPath)
	if gw := e.App.GatewayAddr(); gw != "" {
		fmt.Fprintf(&b, "  Gateway  %s (mTLS); join a node with\n", gw)
		fmt.Fprintf(&b, "           bcd join --gateway %s --token <joinTokens.create> --joinservice-key %s --ca %s --root DIR\n", gw, e.JoinKeyFile, e.CAFile)
	}
	if e.Fleet != nil {
		fmt.Fprintf(&b, "  Fleet    %d simulated nodes (mock DGX H200) in pool \"sim\": better-compute api nodes.list tenantId=root\n", len(e.Fleet.Nodes()))
		fmt.Fprintf(&b, "  Tunnel   the pool allows 127.0.0.1 ports 1024-65535: better-compute tunnel %s --target 127.0.0.1:8000 --local 127.0.0.1:8000\n", e.Fleet.Nodes()[0])
		fmt.Fprintf(&b, "           (or better-compute ssh %s --target 127.0.0.1:2222 to an sshd on port 2222)\n", e.Fleet.Nodes()[0])
		if e.simMig {
			fmt.Fprintf(&b, "           %s's GPU 0 is MIG 3g.71gb+2g.35gb+2×1g.18gb: better-compute api nodes.getSpec tenantId=root nodeId=%s\n", e.Fleet.Nodes()[0], e.Fleet.Nodes()[0])
		}
	}
	b.WriteString(e.simUpgradeBanner())
	if e.Metal != nil {
		fmt.Fprintf(&b, "  Metal    site %q (%s; its agent in process, PXE over HTTP at %s): %d simulated machines (fake Redfish BMCs) in pool %q;\n",
			SimSiteName, e.MetalSiteID, e.Metal.PXE.Addrs().BaseURL, len(e.MetalMachines), SimMetalPool)
		fmt.Fprintf(&b, "           all reach ready and %s1 is deployed and joins as a node: better-compute api metal.list tenantId=root\n", SimMachinePrefix)
	}
	if e.VPSFleet != nil {
		fmt.Fprintf(&b, "  VPS      hosted pool %q (%s): %d simulated hosts (mock DGX H200, an instance is a process each);\n",
			SimVPSPool, e.VPSPoolID, len(e.VPSFleet.Nodes()))
		fmt.Fprintf(&b, "           provider pool %q (%s) on a fake provider at %s; e.g.\n", SimProviderPool, e.ProviderPoolID, e.ProviderURL)
		fmt.Fprintf(&b, "           better-compute api instances.create tenantId=root poolId=%s vcpus:=2 memoryMiB:=4096 diskGiB:=40 image=ubuntu-24.04 idempotencyKey=vm-1\n", e.VPSPoolID)
		fmt.Fprintf(&b, "           (poolId=%s for a machine at the provider); better-compute api instances.list tenantId=root\n", e.ProviderPoolID)
	}
	switch {
	case e.PrometheusURL != "" && e.Fleet != nil:
		fmt.Fprintf(&b, "  Telemetry Prometheus %s scrapes the %d simulated nodes' GPU telemetry and the control plane;\n", e.PrometheusURL, len(e.Fleet.Nodes()))
		fmt.Fprintf(&b, "           e.g. %s/graph?g0.expr=gpu_utilization_percent (config and log under dev.dataDir/prometheus)\n", e.PrometheusURL)
	case e.PrometheusURL != "":
		fmt.Fprintf(&b, "  Telemetry Prometheus %s scrapes the control plane (no simulated nodes)\n", e.PrometheusURL)
	case e.wantProm:
		fmt.Fprintf(&b, "  Telemetry %s\n", PrometheusHint)
	}
	fmt.Fprintf(&b, "  Postgres %s\n\n", db.Redact(e.Database))
	// The credential itself is printed once, when it is made: a later start
	// names only the file keeping it, so terminal scrollback and captured
	// logs of every start do not carry a root key.
	switch {
	case e.Credential != "" && e.CredentialNew:
		fmt.Fprintf(&b, "  Root credential (new; shown this once, kept in %s, mode 0600):\n    %s\n", e.CredentialPath, e.Credential)
		fmt.Fprintf(&b, "  e.g. curl -X POST %s/api/compute/system/whoAmI -H 'Authorization: Bearer %s' -d '{}'\n\n", base, e.Credential)
	case e.Credential != "":
		fmt.Fprintf(&b, "  Root credential: kept in %s (mode 0600)\n", e.CredentialPath)
		fmt.Fprintf(&b, "  e.g. curl -X POST %s/api/compute/system/whoAmI -H \"Authorization: Bearer $(cat %s)\" -d '{}'\n\n", base, e.CredentialPath)
	}
	return b.String()
}

func rolesString(rs []config.Role) string {
	s := make([]string, len(rs))
	for i, r := range rs {
		s[i] = string(r)
	}
	return strings.Join(s, ",")
}

// Run starts dev, prints the banner to out, serves until ctx is done and
// stops.
func Run(ctx context.Context, cfg *config.Config, logger *slog.Logger, out io.Writer, opts RunOptions) error {
	env, err := start(ctx, cfg, app.Options{Logger: logger}, opts)
	if err != nil {
		return err
	}
	fmt.Fprint(out, env.Banner())
	<-ctx.Done()
	logger.Info("shutting down")
	env.Stop(context.WithoutCancel(ctx))
	return nil
}

// ensureDatabase creates name on the server at adminURL unless it exists and
// returns its URL.
func ensureDatabase(ctx context.Context, adminURL, name string) (string, error) {
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return "", fmt.Errorf("connect to %s: %w", db.Redact(adminURL), err)
	}
	defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()
	if err := db.CreateDatabase(ctx, conn, name); err != nil {
		return "", err
	}
	return pglocal.DatabaseURL(adminURL, name)
}

// loopbackHost reports whether host (server.host) listens on loopback
// only: localhost or a loopback IP.
func loopbackHost(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
