// Package sim runs a fleet of simulated node daemons in one process: each is
// the real agent code (join, session, renewal) with the mock NVML backend (a
// DGX H200) and its own state directory and boot id, against a real gateway
// over real mutual TLS. dev's --sim-nodes, the load simulator in tools and
// the tests use it.
//
// Each simulated machine's mock NVML reads its injected GPU faults from
// <state>/nvml-faults.json on every health check (Fleet.Faults in process,
// FaultsPath and `bcsim fault` from another), so a test, the simulator or
// `make run` can make a GPU fail its health checks; gpu.reset mends it.
//
// Simulated daemons run commands like real ones (package command), each
// logging to its own size-bounded <state>/logs/agent.log for logs.collect.
// node.reboot restarts the simulated daemon with a new boot id (same state
// directory, so the same identity and journal); Restart and WipeJournal let
// tests do the same by hand, or lose the journal.
//
// With Config.Telemetry each daemon also has bcd's telemetry (package
// telemetry over its mock NVML): exported over OTLP to Config.OTLPEndpoint
// or its site section's endpoint, at Config.TelemetryInterval or the site
// section's, and served for a Prometheus scrape by [Fleet.MetricsHandler].
//
// Each machine's mock NVML keeps its GPUs' MIG state (mode, GPU and compute
// instances) across a daemon restart and loses the instances in a reboot,
// so the mig section's re-apply after a boot is exercised.
package sim

import (
	"cmp"
	"context"
	"crypto/ed25519"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/bettercompute/bettercompute/agent/command"
	"github.com/bettercompute/bettercompute/agent/converge"
	"github.com/bettercompute/bettercompute/agent/engines"
	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/session"
	"github.com/bettercompute/bettercompute/agent/siteconf"
	"github.com/bettercompute/bettercompute/agent/state"
	"github.com/bettercompute/bettercompute/agent/telemetry"
	"github.com/bettercompute/bettercompute/agent/upgrade"
	"github.com/bettercompute/bettercompute/agent/vps"
	vpssim "github.com/bettercompute/bettercompute/agent/vps/sim"
)

// SimDriftCheckInterval is a simulated daemon's CDI drift check interval
// unless Config.DriftCheckInterval says otherwise.
const SimDriftCheckInterval = time.Minute

// Config describes the fleet.
type Config struct {
	// Gateway is the gateway's host:port; ServerName the name its
	// certificate carries (empty: the host of Gateway).
	Gateway, ServerName string
	// RootCAs verify the gateway (the node CA's bundle).
	RootCAs *x509.CertPool
	// Token is a join token with at least as many uses as nodes that have
	// not joined yet.
	Token string
	// JoinserviceKey and JoinserviceKeyID are joinservice's HPKE key.
	JoinserviceKey   []byte
	JoinserviceKeyID string
	// Root holds one state directory per node (node-0000, …); a node whose
	// directory already holds an identity does not join again.
	Root string
	// Prefix names the simulated hosts (<prefix>-0000); default "sim".
	Prefix string
	// JoinConcurrency bounds joins in flight; default 16.
	JoinConcurrency int
	// Logger; nil discards.
	Logger *slog.Logger
	// OnSession, when set, is called by every node with true when its
	// session is established and false when it ends (see session.Config).
	OnSession func(up bool)
	// OnObserved, when set, is called by daemon i after it sent an
	// Observed report of observedGeneration (see session.Config).
	OnObserved func(i int, observedGeneration int64)
	// CommandKey is the control plane's command-signing public key every
	// daemon pins; nil refuses destructive commands (BAD_SIGNATURE).
	CommandKey ed25519.PublicKey
	// DenyKinds are command kinds every daemon refuses.
	DenyKinds []string
	// NoReboot disallows node.reboot (UNSUPPORTED); by default it
	// restarts the simulated daemon with a new boot id.
	NoReboot bool
	// Executors replace built-in command kinds' executors on every daemon
	// (tests: slow, blocking or counting ones); see
	// session.Config.CommandExecutors.
	Executors map[string]command.Func
	// NoLogFiles keeps the daemons from holding a log file of their own
	// (for logs.collect): a load simulator's 10,000 nodes would hold
	// 10,000 more open files beside their connections. They then log to
	// Logger only, and logs.collect finds no agent log on them.
	NoLogFiles bool
	// RebootHook, when set, replaces the simulated reboot of daemon i
	// (tests: a reboot that never comes, to keep node.reboot in flight).
	RebootHook func(ctx context.Context, i int, reason string) error
	// HealthCheckInterval, when set, replaces every daemon's health
	// section check_interval (see session.Config).
	HealthCheckInterval time.Duration
	// DriftCheckInterval is how often each daemon checks its CDI spec for
	// a hand edit (session.Config.DriftCheckInterval); 0 means
	// SimDriftCheckInterval, not a real node's 5 s: nobody edits a
	// simulated node's spec by hand, and 10,000 daemons checking every 5 s
	// would read 2,000 files a second.
	DriftCheckInterval time.Duration
	// VPS runs every daemon's instances section on the simulated VPS
	// runtime (agent/vps/sim: a `sleep infinity` process per running
	// instance, under <state>/vps), so the simulated machines can be the
	// hosts of a vps-host pool. The processes outlive the daemons (a
	// restarted daemon adopts them): [Fleet.DeleteInstances] ends them.
	VPS bool
	// Telemetry gives every daemon bcd's telemetry (its mock GPUs'
	// readings and its own metrics, package telemetry): exported over
	// OTLP/gRPC to OTLPEndpoint every TelemetryInterval (0: 10 s), as
	// `bcd node --otlp-endpoint --telemetry-interval` does — the site
	// section's endpoint and interval winning, as on bcd — and served to
	// a scrape by [Fleet.MetricsHandler]. Off by default: nothing is
	// collected.
	Telemetry         bool
	OTLPEndpoint      string
	TelemetryInterval time.Duration
	// OnExport, when set with Telemetry, hears every daemon's every OTLP
	// export attempt (nil error: delivered).
	OnExport func(err error)
	// AgentVersion is the bcd version every daemon reports in its Hello
	// until a simulated upgrade; default "sim".
	AgentVersion string
	// ReleaseKey, when set, is the release public key every daemon pins:
	// its agent section admits, downloads, checks and stages builds with
	// bcd's installer, and hands over to them in a SIMULATED trial and
	// exec (upgrade.go): the daemon reconnects reporting the new version,
	// the build itself never runs. Nil refuses every release manifest, as
	// bcd without --release-key.
	ReleaseKey ed25519.PublicKey
	// FailUpgrade, when set, says whether daemon i's simulated trial of
	// version fails: it rolls back and latches UpgradeFailed.
	FailUpgrade func(i int, version string) bool
	// ReconvergeInterval, when set, replaces every daemon's periodic
	// converge of its newest desired state (session.Config; a minute by
	// default): a cleared UpgradeFailed latch is retried at the next one.
	ReconvergeInterval time.Duration
}

// Fleet is a running fleet.
type Fleet struct {
	cfg    Config
	runCtx context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex // serialises Restart, WipeJournal and Stop
	nodes  []string
	ds     []*daemon
	boots  int

	// bgMu guards stopped and bg (reboots restart daemons in the
	// background; Stop waits for them).
	bgMu    sync.Mutex
	stopped bool
	bg      sync.WaitGroup
}

// daemon is one simulated node daemon.
type daemon struct {
	store  *state.Store
	inv    *inventory.Collector
	log    *command.LogFile
	nodeID string
	boot   string
	cancel context.CancelFunc
	done   chan struct{}

	telMu sync.Mutex
	tel   *telemetry.Telemetry // while running, with Config.Telemetry
	prom  http.Handler         // tel's scrape handler

	// version is what its Hello reports; installer its release installer
	// (Config.ReleaseKey), nil without one.
	version   string
	installer *upgrade.Installer
}

// Start joins (where needed) and runs n simulated nodes until Stop. It
// returns once every node has joined; sessions open in the background.
func Start(ctx context.Context, cfg Config, n int) (*Fleet, error) {
	cfg.Prefix = cmp.Or(cfg.Prefix, "sim")
	cfg.JoinConcurrency = cmp.Or(cfg.JoinConcurrency, 16)
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if err := os.MkdirAll(cfg.Root, 0o755); err != nil {
		return nil, err
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	f := &Fleet{cfg: cfg, runCtx: runCtx, cancel: cancel}
	sem := make(chan struct{}, cfg.JoinConcurrency)
	errs := make([]error, n)
	stores := make([]*state.Store, n)
	invs := make([]*inventory.Collector, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			stores[i], invs[i], errs[i] = f.prepare(ctx, i)
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		for _, inv := range invs {
			if inv != nil {
				_ = inv.Close()
			}
		}
		cancel()
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for i := range n {
		id, _ := stores[i].Identity()
		var lf *command.LogFile
		if !cfg.NoLogFiles {
			var err error
			if lf, err = command.OpenLog(command.LogPath(stores[i].Root()), 0); err != nil {
				cfg.Logger.Warn("simulated node logs only to the fleet's logger", "node", id.NodeID, "err", err)
			}
		}
		f.nodes = append(f.nodes, id.NodeID)
		d := &daemon{store: stores[i], inv: invs[i], log: lf, nodeID: id.NodeID}
		if cfg.ReleaseKey != nil {
			d.installer = upgrade.New(upgrade.Config{Root: stores[i].Root(), Key: cfg.ReleaseKey})
		}
		d.version = cmp.Or(d.installedVersion(), cfg.AgentVersion, "sim")
		f.ds = append(f.ds, d)
		f.start(i)
	}
	return f, nil
}

// start runs daemon i with a new boot id. f.mu is held.
func (f *Fleet) start(i int) {
	d := f.ds[i]
	f.boots++
	d.boot = fmt.Sprintf("%s-boot-%04d-%d-%d", f.cfg.Prefix, i, time.Now().UnixNano(), f.boots)
	f.run(i)
}

// run runs daemon i with its current boot id. f.mu is held.
func (f *Fleet) run(i int) {
	d := f.ds[i]
	ctx, cancel := context.WithCancel(f.runCtx)
	d.cancel, d.done = cancel, make(chan struct{})
	logger := f.cfg.Logger
	if d.log != nil {
		logger = slog.New(slog.NewMultiHandler(f.cfg.Logger.Handler(), slog.NewTextHandler(d.log, nil)))
	}
	var reboot func(context.Context, string) error
	switch {
	case f.cfg.NoReboot:
	case f.cfg.RebootHook != nil:
		reboot = func(ctx context.Context, reason string) error { return f.cfg.RebootHook(ctx, i, reason) }
	default:
		reboot = func(context.Context, string) error {
			f.bgMu.Lock()
			defer f.bgMu.Unlock()
			if !f.stopped {
				f.bg.Go(func() { f.Restart(i, true) })
			}
			return nil
		}
	}
	cfg := session.Config{
		Gateway: f.cfg.Gateway, ServerName: f.cfg.ServerName, State: d.store, Inventory: d.inv,
		BootID: d.boot, AgentVersion: d.version, Agent: f.agent(i), Logger: logger, OnSession: f.cfg.OnSession,
		CommandKey: f.cfg.CommandKey, DenyKinds: f.cfg.DenyKinds, RebootHook: reboot,
		CommandExecutors: f.cfg.Executors, HealthCheckInterval: f.cfg.HealthCheckInterval, ReconvergeInterval: f.cfg.ReconvergeInterval,
		DriftCheckInterval: cmp.Or(f.cfg.DriftCheckInterval, SimDriftCheckInterval),
		// A simulated node has no kernel or journal of its own: it never
		// reads the host's. Its kernel, journal and nvidia sources are
		// "not available" unless a test puts fixtures there.
		LogSources: command.LogSources{Kmsg: filepath.Join(d.store.Root(), "kmsg"), Journalctl: filepath.Join(d.store.Root(), "journalctl")},
		// The runtime section's engine files and CDI directories go under
		// the node's own state directory; no engine is installed there, so
		// each is "not checked".
		Runtime: converge.Runtime{Root: d.store.Root(), Runner: engines.NoCLI},
	}
	if f.cfg.VPS {
		rec, err := f.vps(i, logger)
		if err != nil {
			f.cfg.Logger.Warn("simulated node runs no VPS runtime", "node", d.nodeID, "err", err)
		}
		cfg.VPS = rec
	}
	if f.cfg.OnObserved != nil {
		cfg.OnObserved = func(gen int64) { f.cfg.OnObserved(i, gen) }
	}
	var stopTel func()
	if f.cfg.Telemetry {
		var err error
		if stopTel, err = f.telemetry(i, &cfg, logger); err != nil {
			f.cfg.Logger.Warn("simulated node has no telemetry", "node", d.nodeID, "err", err)
		}
	}
	done := d.done
	f.wg.Go(func() {
		defer close(done)
		if stopTel != nil {
			defer stopTel()
		}
		if err := session.Run(ctx, cfg); err != nil {
			f.cfg.Logger.Warn("simulated node stopped", "node", d.nodeID, "err", err)
		}
	})
}

// telemetry gives daemon i bcd's telemetry, wired into cfg as bcd node
// wires it: the session, converge and command hooks, and the site section
// moving the export. The returned func ends it. f.mu is held.
func (f *Fleet) telemetry(i int, cfg *session.Config, logger *slog.Logger) (func(), error) {
	d := f.ds[i]
	tel, err := telemetry.New(telemetry.Config{GPUs: d.inv, NodeID: d.nodeID, Hostname: fmt.Sprintf("%s-%04d", f.cfg.Prefix, i),
		ServiceVersion: "sim", Logger: logger, OnExport: f.cfg.OnExport})
	if err != nil {
		return nil, err
	}
	interval := cmp.Or(f.cfg.TelemetryInterval, telemetry.DefaultInterval)
	if err := tel.Configure(f.cfg.OTLPEndpoint, interval); err != nil {
		_ = tel.Close(context.Background())
		return nil, err
	}
	follow := tel.Follow(f.cfg.OTLPEndpoint, interval)
	onSession := cfg.OnSession
	cfg.OnSession = func(up bool) {
		tel.SessionUp(up)
		if onSession != nil {
			onSession(up)
		}
	}
	cfg.OnSection, cfg.OnCommandUpdate = tel.SectionConverged, tel.CommandUpdate
	cfg.Site = converge.Site{OnChange: func(s siteconf.Settings) { follow.Set(s.OTLPEndpoint, s.TelemetryInterval) }}
	d.telMu.Lock()
	d.tel, d.prom = tel, tel.Handler()
	d.telMu.Unlock()
	return func() {
		d.telMu.Lock()
		if d.tel == tel {
			d.tel, d.prom = nil, nil
		}
		d.telMu.Unlock()
		follow.Stop()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = tel.Close(ctx)
	}, nil
}

// MetricsHandler serves each simulated daemon's metrics for a Prometheus
// scrape, as `bcd node --prometheus-listen` would on each machine:
// /nodes/<n>/metrics is daemon n's (404 while it runs no telemetry, or
// without Config.Telemetry).
func (f *Fleet) MetricsHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /nodes/{n}/metrics", func(w http.ResponseWriter, r *http.Request) {
		n, err := strconv.Atoi(r.PathValue("n"))
		f.mu.Lock()
		var d *daemon
		if err == nil && n >= 0 && n < len(f.ds) {
			d = f.ds[n]
		}
		f.mu.Unlock()
		var h http.Handler
		if d != nil {
			d.telMu.Lock()
			h = d.prom
			d.telMu.Unlock()
		}
		if h == nil {
			http.NotFound(w, r)
			return
		}
		h.ServeHTTP(w, r)
	})
	return mux
}

// Restart stops simulated daemon i and starts it again on the same state
// directory (identity and journal), with a new boot id when newBoot (a
// reboot) or the same one (the daemon alone restarted). It does nothing
// after Stop.
func (f *Fleet) Restart(i int, newBoot bool) {
	f.restart(i, newBoot, false)
}

// Halt stops simulated daemon i and leaves it stopped — a node whose daemon
// died or whose network is gone — until [Fleet.Resume]. It does nothing
// after Stop.
func (f *Fleet) Halt(i int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.runCtx.Err() != nil {
		return
	}
	d := f.ds[i]
	d.cancel()
	<-d.done
}

// Resume starts simulated daemon i again after [Fleet.Halt], with the same
// boot id (the daemon alone was down). It does nothing after Stop.
func (f *Fleet) Resume(i int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.runCtx.Err() != nil {
		return
	}
	select {
	case <-f.ds[i].done:
		f.run(i)
	default: // running
	}
}

// WipeJournal stops simulated daemon i, deletes its command journal (so it
// reports a new journal id) and starts it again with the same boot id. It
// does nothing after Stop.
func (f *Fleet) WipeJournal(i int) {
	f.restart(i, false, true)
}

func (f *Fleet) restart(i int, newBoot, wipe bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.runCtx.Err() != nil {
		return
	}
	d := f.ds[i]
	d.cancel()
	<-d.done
	if wipe {
		if err := os.RemoveAll(filepath.Join(d.store.Root(), command.JournalDir)); err != nil {
			f.cfg.Logger.Warn("wiping the journal", "node", d.nodeID, "err", err)
		}
	}
	if newBoot {
		// The machine rebooted: its GPUs' MIG instances are gone (the
		// daemon lays them out again before it reports the mig section
		// converged); a daemon restart alone keeps them.
		d.inv.SimulateReboot()
		f.start(i)
	} else {
		f.run(i)
	}
}

// BootID returns simulated daemon i's current boot id.
func (f *Fleet) BootID(i int) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ds[i].boot
}

// Root returns simulated daemon i's state directory.
func (f *Fleet) Root(i int) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ds[i].store.Root()
}

// prepare opens node i's state and inventory and joins it if it has no
// identity yet.
func (f *Fleet) prepare(ctx context.Context, i int) (*state.Store, *inventory.Collector, error) {
	host := fmt.Sprintf("%s-%04d", f.cfg.Prefix, i)
	// Simulated nodes share this machine's disk: their writes skip the
	// fsyncs a real node's make (state.OpenUnsynced).
	st, err := state.OpenUnsynced(NodeDir(f.cfg.Root, i))
	if err != nil {
		return nil, nil, err
	}
	inv, err := inventory.Open(inventory.Config{Backend: inventory.BackendMock, Hostname: host, MachineID: host + "-machine", SystemSerial: host + "-serial",
		FaultsFile: filepath.Join(st.Root(), inventory.FaultsFile)})
	if err != nil {
		return nil, nil, err
	}
	if _, err := st.Identity(); err == nil {
		return st, inv, nil
	} else if !errors.Is(err, state.ErrNotJoined) {
		_ = inv.Close()
		return nil, nil, err
	}
	_, err = join.Join(ctx, join.Config{
		Gateway: f.cfg.Gateway, ServerName: f.cfg.ServerName, RootCAs: f.cfg.RootCAs, Token: f.cfg.Token,
		JoinserviceKey: f.cfg.JoinserviceKey, JoinserviceKeyID: f.cfg.JoinserviceKeyID, State: st, Claims: inv,
	})
	if err != nil {
		_ = inv.Close()
		return nil, nil, fmt.Errorf("join %s: %w", host, err)
	}
	return st, inv, nil
}

// VPSDir is simulated daemon i's VPS runtime directory under root.
func VPSDir(root string, i int) string { return filepath.Join(NodeDir(root, i), "vps") }

// VPSRuntime returns simulated daemon i's VPS runtime (with Config.VPS),
// for tests to look at its instances' processes.
func (f *Fleet) VPSRuntime(i int) (*vpssim.Runtime, error) {
	return vpssim.New(vpssim.Config{Dir: VPSDir(f.cfg.Root, i), Logger: f.cfg.Logger})
}

// vps is daemon i's VPS reconciler over the simulated runtime.
func (f *Fleet) vps(i int, logger *slog.Logger) (*vps.Reconciler, error) {
	rt, err := vpssim.New(vpssim.Config{Dir: VPSDir(f.cfg.Root, i), Logger: logger})
	if err != nil {
		return nil, err
	}
	return vps.NewReconciler(vps.Config{Runtime: rt, GPUs: session.GPUAddresses(f.ds[i].inv), Logger: logger})
}

// DeleteInstances ends every simulated VPS instance of every daemon (their
// processes outlive the daemons); call it after Stop when the fleet ran
// with Config.VPS.
func (f *Fleet) DeleteInstances(ctx context.Context) error {
	var errs []error
	for i := range f.ds {
		rt, err := f.VPSRuntime(i)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		obs, err := rt.List(ctx)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, o := range obs {
			errs = append(errs, rt.Delete(ctx, o.ID))
		}
	}
	return errors.Join(errs...)
}

// Faults returns simulated daemon i's injected GPU faults (its mock NVML
// reads them on every check; they live in its faults file, see
// [FaultsPath]).
func (f *Fleet) Faults(i int) *inventory.Faults {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ds[i].inv.Faults()
}

// Inventory returns simulated machine i's inventory (its mock NVML, which
// holds its GPUs' MIG state).
func (f *Fleet) Inventory(i int) *inventory.Collector {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ds[i].inv
}

// NodeDir is simulated machine i's state directory under root.
func NodeDir(root string, i int) string { return filepath.Join(root, fmt.Sprintf("node-%04d", i)) }

// FaultsPath is the faults file of a simulated machine under root, named
// by its host name (<prefix>-0003), its directory (node-0003) or its
// number (3). Its mock NVML re-reads the file on every health check, so
// another process (bcsim fault) can break and mend its GPUs.
func FaultsPath(root, machine string) (string, error) {
	num := machine
	if i := strings.LastIndexByte(machine, '-'); i >= 0 {
		num = machine[i+1:]
	}
	n, err := strconv.Atoi(num)
	if err != nil || n < 0 || num == "" {
		return "", fmt.Errorf("sim: machine %q: want <prefix>-NNNN, node-NNNN or a number", machine)
	}
	dir := NodeDir(root, n)
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		return "", fmt.Errorf("sim: no simulated machine %q under %s (no %s)", machine, root, dir)
	}
	return filepath.Join(dir, inventory.FaultsFile), nil
}

// Nodes returns the node ids of the fleet.
func (f *Fleet) Nodes() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.nodes...)
}

// Stop ends every session and waits for them.
func (f *Fleet) Stop() {
	f.bgMu.Lock()
	f.stopped = true
	f.bgMu.Unlock()
	f.cancel()
	f.bg.Wait()
	f.mu.Lock()
	defer f.mu.Unlock()
	f.wg.Wait()
	for _, d := range f.ds {
		_ = d.inv.Close()
		if d.log != nil {
			_ = d.log.Close()
		}
	}
}
