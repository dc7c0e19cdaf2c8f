// Package bcd is the node daemon's command line: `bcd join` redeems a join
// token for the node's identity, `bcd node` holds the node's session with
// the control plane; `bcd site join` enrolls a site agent with a site token
// and `bcd site run` holds its session and the site's boot lease (see
// site.go); `bcd ramdisk` runs a machine's commissioning ramdisk as its
// node, with a restricted certificate and signed results (see ramdisk.go).
//
// Every flag can also be set in the environment as BCD_<FLAG> (upper case,
// dashes as underscores: --joinservice-key is BCD_JOINSERVICE_KEY); a flag
// on the command line wins.
//
// The agent stays light: it never imports pgx or the control plane's packages
// (a test guards its dependency list).
package bcd

import (
	"cmp"
	"context"
	"crypto/ed25519"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/bettercompute/bettercompute/agent/cdi"
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
	"github.com/bettercompute/bettercompute/agent/vps/libvirt"
	vpssim "github.com/bettercompute/bettercompute/agent/vps/sim"
)

// Version is set at link time (-X .../agent/bcd.Version=v0.1.0).
var Version = ""

// DefaultRoot is where bcd keeps its state unless --root says otherwise.
const DefaultRoot = "/var/lib/bcd"

// notBuilt are the subcommands later releases add.
var notBuilt = map[string]string{}

// Main runs bcd with args (without the program name) and returns the exit
// code. SIGINT and SIGTERM stop `bcd node`.
func Main(args []string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return Run(ctx, args, stdout, stderr)
}

// Run is Main under ctx: `bcd node` runs until ctx ends.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "help" || args[0] == "-h" || args[0] == "--help" {
		usage(stdout)
		return 0
	}
	var err error
	switch cmd := args[0]; {
	case cmd == "version":
		fmt.Fprintf(stdout, "bcd %s (%s)\n", version(), runtime.Version())
		return 0
	case cmd == "join":
		err = runJoin(ctx, args[1:], stdout, stderr)
	case cmd == "node":
		err = runNode(ctx, args[1:], stderr)
	case cmd == "site":
		err = runSite(ctx, args[1:], stdout, stderr)
	case cmd == "ramdisk":
		err = runRamdisk(ctx, args[1:], stderr)
	case cmd == "upgrade":
		err = runUpgrade(args[1:], stdout, stderr)
	case notBuilt[cmd] != "":
		fmt.Fprintf(stderr, "error: UNSUPPORTED: bcd %s is not built yet in this release\n", cmd)
		return 1
	default:
		fmt.Fprintf(stderr, "error: unknown command %q\n", cmd)
		usage(stderr)
		return 2
	}
	switch {
	case err == nil:
		return 0
	case errors.Is(err, flag.ErrHelp):
		return 0
	case errors.As(err, new(usageError)):
		fmt.Fprintf(stderr, "error: %v\n", err)
		return 2
	default:
		fmt.Fprintf(stderr, "error: %v\n", err)
		return 1
	}
}

// usageError is a mistake in the command line (exit code 2).
type usageError struct{ error }

func usage(w io.Writer) {
	fmt.Fprintln(w, `usage: bcd <command> [flags]

commands:
  version   print the version
  join      join this server to a control plane with a join token
  node      run the node daemon (session, inventory, commands, certificate renewal)
  site      bcd site join: enroll a site agent with a site token; bcd site run: run it (session, boot lease)
  ramdisk   run a machine's commissioning ramdisk: join with its boot token, run the flow's commands, sign the results
  upgrade   bcd upgrade clear: clear this node's UpgradeFailed latch`)
	fmt.Fprintln(w, "\nflags can be set as BCD_<FLAG> environment variables; `bcd <command> -h` lists them")
}

// flags is a FlagSet whose string flags default to BCD_* variables.
type flags struct{ *flag.FlagSet }

func newFlags(name string, stderr io.Writer) flags {
	fs := flag.NewFlagSet("bcd "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	return flags{fs}
}

func (f flags) str(name, def, help string) *string {
	env := "BCD_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
	if v, ok := os.LookupEnv(env); ok {
		def = v
	}
	return f.String(name, def, help+" ($"+env+")")
}

func (f flags) boolean(name string, def bool, help string) *bool {
	env := "BCD_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
	if v, ok := os.LookupEnv(env); ok {
		if b, err := strconv.ParseBool(v); err == nil {
			def = b
		}
	}
	return f.Bool(name, def, help+" ($"+env+")")
}

func (f flags) parse(args []string) error {
	if err := f.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usageError{err}
	}
	if f.NArg() > 0 {
		return usageError{fmt.Errorf("unexpected arguments %q", f.Args())}
	}
	return nil
}

func runJoin(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	f := newFlags("join", stderr)
	token := f.str("token", "", "join token bcjt_<id>.<secret> (prefer the environment: flags show in ps)")
	gateway := f.str("gateway", "", "gateway host:port, or several comma-separated (each attempt goes to the next)")
	root := f.str("root", DefaultRoot, "state directory")
	keyFile := f.str("joinservice-key", "", "joinservice's HPKE public key: PEM PUBLIC KEY (X25519) or 32 bytes hex/base64 (default <root>/joinservice.pub)")
	keyID := f.str("joinservice-key-id", "", "id of that key (default: the PEM's Key-Id header, else derived from the key)")
	caFile := f.str("ca", "", "PEM CA certificates that sign the gateway's certificate (default: the system's roots)")
	serverName := f.str("server-name", "", "name on the gateway's certificate (default: the host of --gateway)")
	nvml := f.str("nvml", inventory.BackendReal, "NVML backend: real or mock")
	retryFor := f.str("retry-for", "2m", "how long to keep trying while the gateway is unreachable, unavailable or busy (0: try once)")
	if err := f.parse(args); err != nil {
		return err
	}
	if *token == "" || *gateway == "" {
		return usageError{errors.New("--token and --gateway are required")}
	}
	retryDur, err := time.ParseDuration(*retryFor)
	if err != nil || retryDur < 0 || retryDur > 24*time.Hour {
		return usageError{fmt.Errorf("--retry-for: want a duration from 0 to 24h, got %q", *retryFor)}
	}
	store, err := state.Open(*root)
	if err != nil {
		return err
	}
	if *keyFile == "" {
		*keyFile = filepath.Join(*root, "joinservice.pub")
	}
	b, err := os.ReadFile(*keyFile)
	if err != nil {
		return fmt.Errorf("joinservice key: %w", err)
	}
	pub, pemID, err := join.ParsePublicKey(b)
	if err != nil {
		return err
	}
	var roots *x509.CertPool
	if *caFile != "" {
		pemCA, err := os.ReadFile(*caFile)
		if err != nil {
			return fmt.Errorf("ca: %w", err)
		}
		roots = x509.NewCertPool()
		if !roots.AppendCertsFromPEM(pemCA) {
			return fmt.Errorf("ca: no certificates in %s", *caFile)
		}
	}
	inv, err := inventory.Open(inventory.Config{Backend: *nvml})
	if err != nil {
		return err
	}
	defer func() { _ = inv.Close() }()
	id, err := join.Join(ctx, join.Config{
		Gateway: *gateway, ServerName: *serverName, RootCAs: roots, Token: *token,
		JoinserviceKey: pub, JoinserviceKeyID: cmp.Or(*keyID, pemID), State: store, Claims: inv,
		RetryFor: retryDur,
		OnRetry: func(attempt int, wait time.Duration, err error) {
			fmt.Fprintf(stderr, "bcd join: attempt %d: %v; trying again in %s\n", attempt, err, wait.Round(100*time.Millisecond))
		},
	})
	if err != nil {
		return err
	}
	leaf, err := id.Leaf()
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "joined as %s (certificate valid until %s); state in %s\n", id.NodeID, leaf.NotAfter.UTC().Format("2006-01-02 15:04:05Z"), store.Root())
	return nil
}

func runNode(ctx context.Context, args []string, stderr io.Writer) error {
	f := newFlags("node", stderr)
	gateway := f.str("gateway", "", "gateway host:port, or several comma-separated: the node starts at a random one and moves to the next when its session ends")
	root := f.str("root", DefaultRoot, "state directory (written by bcd join)")
	serverName := f.str("server-name", "", "name on the gateway's certificate (default: the host of --gateway)")
	nvml := f.str("nvml", inventory.BackendReal, "NVML backend: real or mock (the mock's GPU faults are read from <root>/nvml-faults.json)")
	bootID := f.str("boot-id", "", "boot id (default: /proc/sys/kernel/random/boot_id)")
	commandKey := f.str("command-key", "", "the control plane's command-signing public key (PEM PUBLIC KEY, Ed25519); without it destructive commands are refused")
	denyKinds := f.str("deny-kinds", "", "comma-separated command kinds this node refuses")
	allowReboot := f.boolean("allow-reboot", false, "let node.reboot reboot the machine (systemctl reboot)")
	vpsRuntime := f.str("vps-runtime", VPSNone, "VPS runtime of a vps-host: sim (a process per instance), libvirt (QEMU domains through libvirtd) or none")
	vpsDir := f.str("vps-dir", "", "VPS state directory: the sim runtime's instances, libvirt's images/ and seeds/ (default: <root>/vps)")
	kmsg := f.str("kmsg", "/dev/kmsg", "the kernel's ring buffer logs.collect reads for its kernel and nvidia sources")
	journalctl := f.str("journalctl", "journalctl", "the journalctl binary logs.collect runs for its journal source (a name is looked up on PATH)")
	cdiDir := f.str("cdi-dir", "", "the CDI directory the devices section writes "+cdi.SpecFile+" into, the container engines' (default: "+cdi.DefaultDir+"; with --nvml mock, <root>/cdi)")
	devRoot := f.str("dev-root", "/", "the root the GPUs' device nodes (/dev/nvidia*) are found under, for the CDI spec")
	driverRoot := f.str("driver-root", "/", "the root the NVIDIA driver's libraries and binaries are found under, for the CDI spec")
	nvidiaCTK := f.str("nvidia-ctk", "", "the nvidia-ctk binary of the CDI spec's update-ldcache hook (default: looked up on PATH; absent, the spec has no hook)")
	dcgmi := f.str("dcgmi", inventory.DefaultDCGMI, "the dcgmi binary diag.nvml (levels medium, long, full) and the health section's background diagnostics run for DCGM's diagnostics (a name is looked up on PATH; absent, they report DCGM not installed)")
	siteRoot := f.str("site-root", "/", "root the site section's NTP, DNS and proxy files and the runtime section's engine configuration and CDI directories are written under (etc/systemd/…, etc/chrony/…, etc/bettercompute/proxy.env, etc/containerd/conf.d/…, etc/docker/daemon.json, var/run/cdi, …); bcd never restarts the services that read them")
	logLevel := f.str("log-level", "info", "log level until the site section sets one: debug, info, warn or error")
	otlpEndpoint := f.str("otlp-endpoint", "", "OTLP/gRPC endpoint the node's metrics go to: http://host:port (plain), https://host:port or host:port (TLS); empty: no export until the site section names one")
	telemetryInterval := f.str("telemetry-interval", telemetry.DefaultInterval.String(), "how often the metrics are collected and exported (1s to 1h)")
	promListen := f.str("prometheus-listen", "", "address of a local Prometheus scrape endpoint (/metrics), e.g. 127.0.0.1:9400; empty: off")
	releaseKey := f.str("release-key", "", "the release public key (PEM PUBLIC KEY, Ed25519; not the command key) release manifests of the agent section must be signed with; without it upgrades are refused")
	trialTimeout := f.str("upgrade-trial-timeout", DefaultTrialTimeout.String(), "how long a new build has to open its session and report before it is rolled back (1s to 10m)")
	if err := f.parse(args); err != nil {
		return err
	}
	if *gateway == "" {
		return usageError{errors.New("--gateway is required")}
	}
	if *siteRoot == "" {
		return usageError{errors.New("--site-root: want a directory, \"/\" on a real node")}
	}
	defLevel := siteconf.Settings{LogLevel: *logLevel}.Level(slog.Level(-100))
	if defLevel == slog.Level(-100) {
		return usageError{fmt.Errorf("--log-level: want debug, info, warn or error, got %q", *logLevel)}
	}
	interval, err := time.ParseDuration(*telemetryInterval)
	if err != nil || interval < telemetry.MinInterval || interval > telemetry.MaxInterval {
		return usageError{fmt.Errorf("--telemetry-interval: want a duration from %s to %s, got %q", telemetry.MinInterval, telemetry.MaxInterval, *telemetryInterval)}
	}
	switch *vpsRuntime {
	case VPSNone, VPSSim, VPSLibvirt:
	default:
		return usageError{fmt.Errorf("--vps-runtime: want sim, libvirt or none, got %q", *vpsRuntime)}
	}
	// A build on trial: its report descriptor is closed on exec before
	// anything starts a process.
	trialReport := trialReporter()
	trial, err := time.ParseDuration(*trialTimeout)
	if err != nil || trial < time.Second || trial > 10*time.Minute {
		return usageError{fmt.Errorf("--upgrade-trial-timeout: want a duration from 1s to 10m, got %q", *trialTimeout)}
	}
	var pub ed25519.PublicKey
	if *commandKey != "" {
		b, err := os.ReadFile(*commandKey)
		if err != nil {
			return fmt.Errorf("command key: %w", err)
		}
		if pub, err = command.ParsePublicKey(b); err != nil {
			return err
		}
	}
	var deny []string
	for k := range strings.SplitSeq(*denyKinds, ",") {
		if k = strings.TrimSpace(k); k != "" {
			deny = append(deny, k)
		}
	}
	var reboot func(context.Context, string) error
	if *allowReboot {
		reboot = systemctlReboot
	}
	store, err := state.Open(*root)
	if err != nil {
		return err
	}
	inst, err := openInstaller(store.Root(), *releaseKey)
	if err != nil {
		return err
	}
	boot, err := state.BootID(*bootID)
	if err != nil {
		return err
	}
	logFile, err := command.OpenLog(command.LogPath(store.Root()), 0)
	if err != nil {
		return err
	}
	defer func() { _ = logFile.Close() }()
	// The site section's log_level switches level live (converge.Site).
	level := new(slog.LevelVar)
	level.Set(defLevel)
	opts := &slog.HandlerOptions{Level: level}
	logger := slog.New(slog.NewMultiHandler(slog.NewTextHandler(stderr, opts), slog.NewTextHandler(logFile, opts)))
	// site is the applied site settings; the telemetry exporter follows
	// OTLPEndpoint and TelemetryInterval with site.Subscribe, HTTP clients
	// take site.Proxy.
	site := new(siteconf.Live)
	invCfg := inventory.Config{Backend: *nvml, Logger: logger, DiskPath: store.Root(), DCGMI: *dcgmi}
	if *nvml == inventory.BackendMock {
		// The mock's GPUs can be broken from outside (see inventory.Faults).
		invCfg.FaultsFile = filepath.Join(store.Root(), inventory.FaultsFile)
	}
	inv, err := inventory.Open(invCfg)
	if err != nil {
		return err
	}
	defer func() { _ = inv.Close() }()
	rec, closeVPS, err := openVPS(*vpsRuntime, cmp.Or(*vpsDir, filepath.Join(store.Root(), "vps")), inv, logger)
	if err != nil {
		return err
	}
	defer closeVPS()
	if *cdiDir == "" {
		*cdiDir = cdi.DefaultDir
		if *nvml == inventory.BackendMock {
			*cdiDir = filepath.Join(store.Root(), filepath.Dir(converge.CDISpecFile))
		}
	}
	cdiW, err := cdi.New(cdi.Config{Dir: *cdiDir, DevRoot: *devRoot, DriverRoot: *driverRoot, NvidiaCTK: *nvidiaCTK})
	if err != nil {
		return err
	}
	if trialReport != nil && *promListen != "" {
		// The daemon that runs this build on trial still listens there;
		// once exec'd, this build does.
		logger.Info("upgrade trial: no Prometheus endpoint", "prometheus-listen", *promListen)
		*promListen = ""
	}
	tel, stopTel, err := startTelemetry(ctx, store, inv, logger, *otlpEndpoint, interval, *promListen)
	if err != nil {
		return err
	}
	defer stopTel()
	// The site section's OTLP endpoint and telemetry interval, when it
	// sets them, win over --otlp-endpoint and --telemetry-interval;
	// removed, the flags' return. The Follower configures the exporter on
	// its own goroutine, not the converging one the subscription runs on.
	follow := tel.Follow(*otlpEndpoint, interval)
	defer follow.Stop()
	site.Subscribe(func(s siteconf.Settings) { follow.Set(s.OTLPEndpoint, s.TelemetryInterval) })
	cfg := session.Config{
		CDI:       cdiW,
		OnSession: tel.SessionUp, OnSection: tel.SectionConverged, OnCommandUpdate: tel.CommandUpdate,
		Gateway: *gateway, ServerName: *serverName, State: store, Inventory: inv,
		BootID: boot, AgentVersion: version(), Logger: logger,
		CommandKey: pub, DenyKinds: deny, RebootHook: reboot, VPS: rec,
		LogSources: command.LogSources{Kmsg: *kmsg, Journalctl: *journalctl},
		Site:       converge.Site{Root: *siteRoot, LogLevel: level, DefaultLogLevel: defLevel, OnChange: site.Set},
		// The runtime section's engine files and CDI directories are under
		// the same root as the site section's files.
		Runtime: converge.Runtime{Root: *siteRoot, Runner: engines.Exec{}, NvidiaCTK: *nvidiaCTK},
	}
	cfg.OnReport = trialReport
	if inst != nil && trialReport == nil {
		// A trial this daemon did not see through (it was stopped or
		// killed meanwhile) is not tried again by itself.
		recovered, err := inst.RecoverTrial()
		if err != nil {
			return err
		}
		if recovered {
			logger.Error("upgrade: the daemon stopped during a trial; UpgradeFailed latched")
		}
	}
	// The agent section hands over to a new build: the session ends, the
	// build runs as a child on trial, and this process execs it once it
	// reported, or rolls back and latches UpgradeFailed and opens its
	// session again (docs/agent-upgrades.md).
	for {
		sctx, cancel := context.WithCancel(ctx)
		var handed *upgrade.Staged
		var mu sync.Mutex
		cfg.Agent = converge.Agent{Installer: inst, Handover: func(st upgrade.Staged) {
			mu.Lock()
			handed = &st
			mu.Unlock()
			cancel()
		}}
		err := session.Run(sctx, cfg)
		cancel()
		mu.Lock()
		st := handed
		mu.Unlock()
		if st == nil || ctx.Err() != nil {
			return err
		}
		logger.Info("upgrade: handing over; the new build is on trial", "from", version(), "to", st.Manifest.Version, "slot", st.Slot, "timeout", trial)
		terr := inst.BeginTrial(*st)
		if terr == nil {
			terr = runTrial(ctx, *st, args, trial, stderr)
		}
		if ctx.Err() != nil {
			return nil
		}
		if terr == nil {
			if terr = inst.Activate(*st); terr == nil {
				logger.Info("upgrade: the new build reported; exec", "version", st.Manifest.Version)
				terr = execCurrent(inst, args)
			}
		}
		logger.Error("upgrade failed: rolled back, UpgradeFailed latched", "version", st.Manifest.Version, "err", terr)
		if err := inst.Fail(*st, terr.Error()); err != nil {
			return fmt.Errorf("upgrade: latching UpgradeFailed: %w", err)
		}
	}
}

// VPS runtimes of --vps-runtime.
const (
	VPSNone    = "none"
	VPSSim     = "sim"
	VPSLibvirt = "libvirt"
)

// openVPS opens the VPS runtime kind names under dir (nil for none) and
// its reconciler, whose instances' GPUs are inv's; the closer disconnects
// (instances keep running).
func openVPS(kind, dir string, inv session.Inventory, logger *slog.Logger) (*vps.Reconciler, func(), error) {
	var rt vps.Runtime
	closer := func() {}
	switch kind {
	case VPSNone:
		return nil, closer, nil
	case VPSSim:
		r, err := vpssim.New(vpssim.Config{Dir: dir, Logger: logger})
		if err != nil {
			return nil, nil, err
		}
		rt = r
	case VPSLibvirt:
		r, err := libvirt.Connect(libvirt.Config{ImageDir: filepath.Join(dir, "images"), SeedDir: filepath.Join(dir, "seeds"), Logger: logger})
		if err != nil {
			return nil, nil, err
		}
		rt, closer = r, func() { _ = r.Close() }
	}
	rec, err := vps.NewReconciler(vps.Config{Runtime: rt, GPUs: session.GPUAddresses(inv), Logger: logger})
	if err != nil {
		closer()
		return nil, nil, err
	}
	return rec, closer, nil
}

// systemctlReboot is node.reboot's hook with --allow-reboot: it asks
// systemd to reboot and returns once systemctl has.
func systemctlReboot(ctx context.Context, _ string) error {
	out, err := exec.CommandContext(ctx, "systemctl", "reboot").CombinedOutput()
	if err != nil {
		return fmt.Errorf("systemctl reboot: %w: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

func version() string {
	if Version != "" {
		return Version
	}
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return "dev"
}
