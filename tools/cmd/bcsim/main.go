// Command bcsim is the load simulator: it runs many simulated bcd node
// daemons (the real agent code with a mock DGX H200 NVML each, see
// agent/sim) in one process against a gateway over mutual TLS, and prints,
// as it goes, how many of them hold a session.
//
//	bcsim --gateway 127.0.0.1:8443 --ca .data/pki/ca.pem \
//	      --joinservice-key .data/pki/joinservice.pub --token bcjt_… --nodes 1000
//
// Nodes already joined under --root are reused (no token needed for them).
//
// It also times fleet-wide changes as the nodes see them: when nodes start
// reporting a newer observed generation (a pools.update of the site
// settings, say), it prints, once every node has, how long the wave took
// from its first report to its last, with the per-node p50 and p99.
//
// With --otlp-endpoint every node also runs bcd's telemetry (its eight mock
// GPUs' readings and its own metrics) and exports it over OTLP/gRPC there
// every --telemetry-interval, as `bcd node --otlp-endpoint` does; off by
// default. --cpu-every prints the simulator's own CPU (cores, and per node)
// and the exports delivered and failed, so one can measure what telemetry
// costs a fleet (see docs/node-telemetry.md and tools/cmd/otlpsink).
//
// `bcsim fault` breaks (or mends) a simulated machine's GPUs while the
// simulator runs; their health checks see it on the next pass:
//
//	bcsim fault --root bcsim-state --machine sim-0003 --gpu 2 --xid 79
//	bcsim fault --root bcsim-state --machine sim-0003 --gpu 2 --clear
//	bcsim fault --root bcsim-state --machine sim-0003 --gpu 0 --mig-needs-reset
package main

import (
	"context"
	"crypto/ed25519"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/sim"
	"github.com/bettercompute/bettercompute/proto/agentrelease"
)

// prefixRE is what --prefix takes: it names hosts and state directories.
var prefixRE = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$`)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "fault" {
		if err := runFault(os.Args[2:], os.Stdout, os.Stderr); err != nil {
			if !errors.Is(err, flag.ErrHelp) {
				fmt.Fprintln(os.Stderr, "bcsim:", err)
			}
			os.Exit(1)
		}
		return
	}
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "bcsim:", err)
		os.Exit(1)
	}
}

func run() error {
	var (
		gateway     = flag.String("gateway", "127.0.0.1:8443", "the gateway's host:port, or several comma-separated: each node starts at a random one and moves to the next when its session ends")
		prefix      = flag.String("prefix", "sim", "names the simulated machines <prefix>-0000…, so two simulators can join one tenant as different hardware")
		serverName  = flag.String("server-name", "", "the name in the gateway's certificate (default: the host of --gateway)")
		caFile      = flag.String("ca", "", "the node CA bundle (PEM) that verifies the gateway; required")
		keyFile     = flag.String("joinservice-key", "", "joinservice's public key (PEM); required for nodes that have not joined")
		token       = flag.String("token", "", "a join token with a use for every node that has not joined")
		nodes       = flag.Int("nodes", 100, "how many simulated nodes to run")
		root        = flag.String("root", "bcsim-state", "state directory (one per node); joined nodes are reused")
		concurrency = flag.Int("join-concurrency", 16, "joins in flight")
		every       = flag.Duration("every", time.Second, "how often to print the session count")
		verbose     = flag.Bool("v", false, "log the agents' warnings to stderr")
		logFiles    = flag.Bool("log-files", false, "give every node a log file of its own (for logs.collect): one more open file per node")
		vpsHosts    = flag.Bool("vps", false, "run every node's instances section on the simulated VPS runtime (a process per running instance), so the nodes can host a vps-host pool")
		otlp        = flag.String("otlp-endpoint", "", "export every node's telemetry over OTLP/gRPC here (http://host:port plain, https://host:port or host:port TLS), as bcd node does; empty: no telemetry")
		telEvery    = flag.Duration("telemetry-interval", 10*time.Second, "how often each node collects and exports its telemetry (1s to 1h; the site section's wins)")
		releaseKey  = flag.String("release-key", "", "the release public key (PEM, `better-compute artifacts keygen`'s release.pub) the nodes pin: a signed manifest in their agent section is downloaded and checked, then the handover is simulated (docs/agent-upgrades.md); empty: every manifest is refused")
		agentVer    = flag.String("agent-version", "", "the bcd version the nodes report in their Hello until a simulated upgrade (default sim)")
		cpuEvery    = flag.Duration("cpu-every", 0, "print the simulator's CPU use (cores, per node) and the telemetry exports this often (0: never)")
	)
	flag.Parse()
	if *caFile == "" || *nodes < 1 {
		flag.Usage()
		return errors.New("--ca and --nodes ≥ 1 are required")
	}
	if !prefixRE.MatchString(*prefix) {
		return fmt.Errorf("--prefix %q: expected 1 to 32 lower-case letters, digits and inner dashes", *prefix)
	}
	raiseFileLimit()

	caPEM, err := os.ReadFile(*caFile)
	if err != nil {
		return err
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		return fmt.Errorf("no certificate in %s", *caFile)
	}
	var pub []byte
	var keyID string
	if *keyFile != "" {
		keyPEM, err := os.ReadFile(*keyFile)
		if err != nil {
			return err
		}
		if pub, keyID, err = join.ParsePublicKey(keyPEM); err != nil {
			return err
		}
	}
	var release ed25519.PublicKey
	if *releaseKey != "" {
		b, err := os.ReadFile(*releaseKey)
		if err != nil {
			return err
		}
		if release, err = agentrelease.ParsePublicKey(b); err != nil {
			return err
		}
	}
	logger := slog.New(slog.DiscardHandler)
	if *verbose {
		logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	start := time.Now()
	fmt.Printf("joining and starting %d nodes against %s\n", *nodes, *gateway)
	var sessions, exportsOK, exportsFailed atomic.Int64
	waves := newWaves(*nodes)
	fleet, err := sim.Start(ctx, sim.Config{
		Gateway: *gateway, ServerName: *serverName, RootCAs: roots, Token: *token, Prefix: *prefix,
		JoinserviceKey: pub, JoinserviceKeyID: keyID, Root: *root,
		JoinConcurrency: *concurrency, Logger: logger, NoLogFiles: !*logFiles, VPS: *vpsHosts,
		ReleaseKey: release, AgentVersion: *agentVer,
		OnSession: func(up bool) {
			if up {
				sessions.Add(1)
			} else {
				sessions.Add(-1)
			}
		},
		OnObserved: waves.observed,
		Telemetry:  *otlp != "", OTLPEndpoint: *otlp, TelemetryInterval: *telEvery,
		OnExport: func(err error) {
			if err != nil {
				exportsFailed.Add(1)
			} else {
				exportsOK.Add(1)
			}
		},
	}, *nodes)
	if err != nil {
		return err
	}
	defer fleet.Stop()
	fmt.Printf("%d nodes ready in %s (%.1f/s)\n", *nodes, time.Since(start).Round(time.Millisecond), float64(*nodes)/time.Since(start).Seconds())

	t := time.NewTicker(*every)
	defer t.Stop()
	var cpuTick <-chan time.Time
	if *cpuEvery > 0 {
		ct := time.NewTicker(*cpuEvery)
		defer ct.Stop()
		cpuTick = ct.C
	}
	prevAt, prevCPU, prevOK, prevFailed := time.Now(), cpuTime(), exportsOK.Load(), exportsFailed.Load()
	last := int64(-1)
	for {
		select {
		case <-ctx.Done():
			fmt.Println("stopping")
			return nil
		case <-cpuTick:
			at, c, ok, failed := time.Now(), cpuTime(), exportsOK.Load(), exportsFailed.Load()
			sec := at.Sub(prevAt).Seconds()
			cores := (c - prevCPU).Seconds() / sec
			rss := rssBytes()
			fmt.Printf("%s  cpu %.3f cores, %.1f µs/s per node; rss %.0f MiB, %.0f KiB per node; telemetry exports/s %.1f delivered, %.1f failed\n",
				time.Since(start).Round(time.Second), cores, cores*1e6/float64(*nodes), float64(rss)/(1<<20), float64(rss)/1024/float64(*nodes),
				float64(ok-prevOK)/sec, float64(failed-prevFailed)/sec)
			prevAt, prevCPU, prevOK, prevFailed = at, c, ok, failed
		case <-t.C:
			if n := sessions.Load(); n != last {
				fmt.Printf("%s  sessions %d/%d\n", time.Since(start).Round(time.Second), n, *nodes)
				last = n
			}
			if line := waves.report(); line != "" {
				fmt.Printf("%s  %s\n", time.Since(start).Round(time.Second), line)
			}
		}
	}
}

// waves times fleet-wide changes: a wave starts when a node reports an
// observed generation above the one it had when the last wave ended, and
// ends when every node has.
type waves struct {
	mu    sync.Mutex
	gen   []int64     // each node's highest observed generation
	base  []int64     // its generation when the current wave started
	moved []time.Time // when it passed base in the current wave
	start time.Time   // the wave's first report; zero between waves
	count int         // nodes moved in the current wave
}

func newWaves(n int) *waves {
	return &waves{gen: make([]int64, n), base: make([]int64, n), moved: make([]time.Time, n)}
}

func (w *waves) observed(i int, gen int64) {
	now := time.Now()
	w.mu.Lock()
	defer w.mu.Unlock()
	if gen <= w.gen[i] {
		return
	}
	first := w.gen[i] == 0
	w.gen[i] = gen
	if first {
		w.base[i] = gen // joining, not a change
		return
	}
	if w.start.IsZero() {
		w.start = now
		w.count = 0
		clear(w.moved)
	}
	if w.moved[i].IsZero() && gen > w.base[i] {
		w.moved[i] = now
		w.count++
	}
}

// report returns a line when a wave is in progress or just ended.
func (w *waves) report() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.start.IsZero() {
		return ""
	}
	if w.count < len(w.gen) {
		return fmt.Sprintf("change: %d/%d nodes at a newer generation, %s since the first", w.count, len(w.gen), time.Since(w.start).Round(time.Millisecond))
	}
	lat := make([]time.Duration, len(w.moved))
	for i, t := range w.moved {
		lat[i] = t.Sub(w.start)
	}
	slices.Sort(lat)
	line := fmt.Sprintf("change: all %d nodes at a newer generation in %s from the first report (per node p50 %s, p99 %s)",
		len(lat), lat[len(lat)-1].Round(time.Millisecond), lat[len(lat)/2].Round(time.Millisecond), lat[len(lat)*99/100].Round(time.Millisecond))
	w.start = time.Time{}
	copy(w.base, w.gen)
	return line
}

// cpuTime is the process's user and system CPU time.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// rssBytes is the process's resident set (Linux /proc/self/statm; 0
// elsewhere).
func rssBytes() int64 {
	b, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) < 2 {
		return 0
	}
	pages, _ := strconv.ParseInt(f[1], 10, 64)
	return pages * int64(os.Getpagesize())
}

// raiseFileLimit lifts the open-files limit: every simulated node holds a
// connection and a log file and opens its state files as it converges. It
// asks for a million (a root process may raise its hard limit up to
// fs.nr_open) and settles for the hard limit.
func raiseFileLimit() {
	var l syscall.Rlimit
	if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l) != nil {
		return
	}
	if syscall.Setrlimit(syscall.RLIMIT_NOFILE, &syscall.Rlimit{Cur: 1 << 20, Max: max(l.Max, 1<<20)}) == nil {
		return
	}
	if l.Cur < l.Max {
		l.Cur = l.Max
		_ = syscall.Setrlimit(syscall.RLIMIT_NOFILE, &l)
	}
}
