package dev_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/sim"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/services/dev"
	"github.com/bettercompute/bettercompute/services/gateway"
	"github.com/bettercompute/bettercompute/services/joinservice"
)

// BenchmarkGatewayFleet holds N simulated nodes (agent/sim: the real agent
// code, a mock DGX H200 each) against one gateway over real mutual TLS, with
// the dev control plane (API, joinservice, inventory controller, PostgreSQL
// from pgtest) around it, and reports:
//
//   - joins/s: N fresh nodes joined through the gateway (Join relayed to
//     joinservice), 16 in flight as sim's default;
//   - gw-heap-MiB/1k-sessions, gw-rss-MiB/1k-sessions: the gateway's
//     HeapInuse (after a GC) and VmRSS with N idle sessions, less the same
//     before any node dialled, per 1,000 sessions;
//   - gw-millicores/1k-sessions: the gateway's CPU while the sessions idle
//     (heartbeats every 10 s, liveness every 5 s: the production defaults);
//   - liveness-writes/s: the gateway's liveness statements per second while
//     idle, for the whole fleet;
//   - storm-s: after the gateway is stopped (SIGTERM: sessions cancelled,
//     connections closed) and a new one listens on the same port, the time
//     until it holds all N sessions again; storm-db-stmts: its statements
//     in that time;
//   - mock-nvml-KiB/node: the heap one simulated node's mock NVML takes.
//
// The gateway runs in a child process (this test binary re-executed as
// TestGatewayBenchChild, built exactly as the gateway role builds it), so
// its memory and CPU are its own and not the simulated nodes'.
//
// N is BC_BENCH_NODES (default 200), the idle window BC_BENCH_IDLE
// (default 11s, two liveness intervals):
//
//	cd services && BC_BENCH_NODES=1000 BC_BENCH_IDLE=30s go test ./dev -run '^$' -bench GatewayFleet -benchtime 1x -timeout 30m
func BenchmarkGatewayFleet(b *testing.B) {
	n := envInt(b, "BC_BENCH_NODES", 200)
	idle := 11 * time.Second
	if v := os.Getenv("BC_BENCH_IDLE"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			b.Fatalf("BC_BENCH_IDLE: %v", err)
		}
		idle = d
	}
	raiseFileLimit(b)

	zero, port := 0, 0
	cfg := &config.Config{
		Database: config.Database{URL: pgtest.NewDB(b)},
		Server:   config.Server{Host: "127.0.0.1", Port: &port},
		Dev:      config.Dev{DataDir: b.TempDir(), SimNodes: &zero},
		Gateway:  config.Gateway{Listen: "127.0.0.1:0"},
	}
	cfg.Defaults()
	env, err := dev.Start(b.Context(), cfg, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer env.Stop(context.Background())

	// The measured gateway, in its own process.
	child := childConfig{
		DatabaseURL: cfg.Database.URL, JoinService: cfg.JoinService, ID: "gw-bench", Listen: "127.0.0.1:0",
		HeartbeatInterval: 10 * time.Second, LivenessInterval: 5 * time.Second,
	}
	gw := startChild(b, child)
	defer func() { gw.stop(b) }()
	child.Listen = gw.addr
	base := gw.gcStats(b)

	// What one node's mock NVML costs, measured here, before the fleet.
	mockKiB := mockNVMLKiB(b, 32)

	var pool struct{ Pool struct{ ID string } }
	benchCall(b, env, "pools/create", map[string]any{"tenantId": "root", "name": "bench", "class": "gpu", "idempotencyKey": "bench-pool"}, &pool)
	var tok struct{ Token string }
	benchCall(b, env, "joinTokens/create", map[string]any{"tenantId": "root", "poolId": pool.Pool.ID, "uses": n, "idempotencyKey": "bench-token"}, &tok)
	pub, keyID, roots := joinMaterial(b, env)

	var up atomic.Int64
	b.ResetTimer()
	start := time.Now()
	fleet, err := sim.Start(b.Context(), sim.Config{
		Gateway: gw.addr, RootCAs: roots, Token: tok.Token,
		JoinserviceKey: pub, JoinserviceKeyID: keyID, Root: filepath.Join(b.TempDir(), "sim"), Prefix: "bench",
		OnSession: func(ok bool) {
			if ok {
				up.Add(1)
			} else {
				up.Add(-1)
			}
		},
	}, n)
	if err != nil {
		b.Fatal(err)
	}
	defer fleet.Stop()
	joined := time.Since(start)
	gw.waitSessions(b, n, 10*time.Minute)
	allUp := time.Since(start)
	b.Logf("N=%d: joined in %s (%.1f/s), all sessions in %s; %d sessions seen by the nodes", n, joined.Round(time.Millisecond), float64(n)/joined.Seconds(), allUp.Round(time.Millisecond), up.Load())

	// Idle: settle one liveness interval, then measure a window.
	time.Sleep(child.LivenessInterval + time.Second)
	before := gw.latest()
	t0 := time.Now()
	time.Sleep(idle)
	after := gw.latest()
	window := time.Since(t0).Seconds()
	held := gw.gcStats(b)
	if held.Sessions != n {
		b.Fatalf("gateway holds %d sessions, want %d", held.Sessions, n)
	}
	perK := 1000 / float64(n)
	heapMiB := float64(held.HeapInuse-base.HeapInuse) / (1 << 20) * perK
	rssMiB := float64(held.RSSKiB-base.RSSKiB) / 1024 * perK
	cpu := (after.CPU - before.CPU).Seconds() / window * 1000 * perK
	liveness := float64(after.Liveness-before.Liveness) / window
	b.Logf("gateway idle with %d sessions: heap in use %.1f MiB (base %.1f), RSS %.1f MiB (base %.1f), %d goroutines (base %d), CPU %.2f s in %.1f s, %d liveness statements, %d statements in all",
		n, float64(held.HeapInuse)/(1<<20), float64(base.HeapInuse)/(1<<20), float64(held.RSSKiB)/1024, float64(base.RSSKiB)/1024,
		held.Goroutines, base.Goroutines, (after.CPU - before.CPU).Seconds(), window, after.Liveness-before.Liveness, after.Statements-before.Statements)

	// Reconnect storm: stop the gateway, start a new one on the same port.
	gw.stop(b)
	down := time.Now()
	gw = startChild(b, child)
	listening := time.Now()
	gw.waitSessions(b, n, 10*time.Minute)
	storm := time.Since(listening)
	last := gw.latest()
	b.Logf("restart: new gateway listening %s after the old one stopped; all %d sessions back in %s, %d statements (%d liveness)",
		listening.Sub(down).Round(time.Millisecond), n, storm.Round(time.Millisecond), last.Statements, last.Liveness)

	b.ReportMetric(float64(n), "nodes")
	b.ReportMetric(float64(n)/joined.Seconds(), "joins/s")
	b.ReportMetric(heapMiB, "gw-heap-MiB/1k-sessions")
	b.ReportMetric(rssMiB, "gw-rss-MiB/1k-sessions")
	b.ReportMetric(float64(held.Goroutines-base.Goroutines)/float64(n), "gw-goroutines/session")
	b.ReportMetric(cpu, "gw-millicores/1k-sessions")
	b.ReportMetric(liveness, "liveness-writes/s")
	b.ReportMetric(storm.Seconds(), "storm-s")
	b.ReportMetric(float64(last.Statements), "storm-db-stmts")
	b.ReportMetric(mockKiB, "mock-nvml-KiB/node")
}

// mockNVMLKiB is the heap in use per mock NVML collector (a DGX H200).
func mockNVMLKiB(b *testing.B, k int) float64 {
	var m0, m1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m0)
	invs := make([]*inventory.Collector, k)
	for i := range invs {
		host := fmt.Sprintf("mock-%d", i)
		inv, err := inventory.Open(inventory.Config{Backend: inventory.BackendMock, Hostname: host, MachineID: host})
		if err != nil {
			b.Fatal(err)
		}
		invs[i] = inv
	}
	runtime.GC()
	runtime.ReadMemStats(&m1)
	for _, inv := range invs {
		_ = inv.Close()
	}
	return float64(int64(m1.HeapInuse)-int64(m0.HeapInuse)) / 1024 / float64(k)
}

func envInt(b *testing.B, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		b.Fatalf("%s=%q: want a positive integer", name, v)
	}
	return n
}

// raiseFileLimit lifts the soft open-files limit to the hard one: every
// simulated node holds a connection, and so does the gateway for each.
func raiseFileLimit(tb testing.TB) {
	var l syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l); err != nil {
		tb.Fatal(err)
	}
	if l.Cur < l.Max {
		l.Cur = l.Max
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &l); err != nil {
			tb.Fatal(err)
		}
	}
}

func benchCall(b *testing.B, env *dev.Env, method string, body, out any) {
	b.Helper()
	raw, _ := json.Marshal(body)
	req, _ := http.NewRequestWithContext(b.Context(), http.MethodPost, env.BaseURL()+"/api/compute/"+method, strings.NewReader(string(raw)))
	req.Header.Set("Authorization", "Bearer "+env.Credential)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	got, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		b.Fatalf("%s: %d %s", method, resp.StatusCode, got)
	}
	if err := json.Unmarshal(got, out); err != nil {
		b.Fatal(err)
	}
}

// childConfig is what the parent hands the gateway process.
type childConfig struct {
	DatabaseURL                         string
	JoinService                         config.JoinService
	ID, Listen                          string
	HeartbeatInterval, LivenessInterval time.Duration
}

// childStats is what the gateway process reports, every 100 ms and after
// each "gc" asked on its stdin.
type childStats struct {
	Addr       string
	Sessions   int
	HeapInuse  int64
	RSSKiB     int64
	Goroutines int
	CPU        time.Duration // user + system
	Liveness   int64         // liveness statements
	Statements int64         // every statement on the gateway's pool
	GC         bool
}

const statsPrefix = "BCSTATS "

type childProc struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	addr  string
	mu    sync.Mutex
	last  childStats
	gcs   chan childStats
	done  chan struct{}
}

func startChild(b *testing.B, c childConfig) *childProc {
	b.Helper()
	raw, _ := json.Marshal(c)
	cmd := exec.Command(os.Args[0], "-test.run=^TestGatewayBenchChild$", "-test.bench=^$", "-test.timeout=0")
	cmd.Env = append(os.Environ(), "BC_BENCH_CHILD="+string(raw))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	p := &childProc{cmd: cmd, stdin: stdin, gcs: make(chan childStats, 1), done: make(chan struct{})}
	ready := make(chan string, 1)
	go func() {
		defer close(p.done)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			line, ok := strings.CutPrefix(sc.Text(), statsPrefix)
			if !ok {
				continue
			}
			var s childStats
			if json.Unmarshal([]byte(line), &s) != nil {
				continue
			}
			p.mu.Lock()
			p.last = s
			p.mu.Unlock()
			select {
			case ready <- s.Addr:
			default:
			}
			if s.GC {
				p.gcs <- s
			}
		}
	}()
	select {
	case p.addr = <-ready:
	case <-p.done:
		b.Fatal("gateway process exited before listening")
	case <-time.After(time.Minute):
		b.Fatal("gateway process not listening after a minute")
	}
	return p
}

func (p *childProc) latest() childStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.last
}

func (p *childProc) gcStats(b *testing.B) childStats {
	b.Helper()
	if _, err := io.WriteString(p.stdin, "gc\n"); err != nil {
		b.Fatal(err)
	}
	select {
	case s := <-p.gcs:
		return s
	case <-time.After(time.Minute):
		b.Fatal("no stats from the gateway process")
		return childStats{}
	}
}

func (p *childProc) waitSessions(b *testing.B, n int, timeout time.Duration) {
	b.Helper()
	deadline := time.Now().Add(timeout)
	for p.latest().Sessions < n {
		if time.Now().After(deadline) {
			b.Fatalf("gateway holds %d of %d sessions after %s", p.latest().Sessions, n, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// stop ends the gateway as a SIGTERM does: sessions cancelled, connections
// closed. It tolerates a second call.
func (p *childProc) stop(b *testing.B) {
	b.Helper()
	if p.cmd.ProcessState != nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	<-p.done
	if err := p.cmd.Wait(); err != nil {
		b.Errorf("gateway process: %v", err)
	}
}

// TestGatewayBenchChild is the gateway process of BenchmarkGatewayFleet; it
// runs only when that benchmark starts it.
func TestGatewayBenchChild(t *testing.T) {
	raw := os.Getenv("BC_BENCH_CHILD")
	if raw == "" {
		t.Skip("the gateway process of BenchmarkGatewayFleet")
	}
	var c childConfig
	if err := json.Unmarshal([]byte(raw), &c); err != nil {
		t.Fatal(err)
	}
	raiseFileLimit(t)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()

	var liveness, statements atomic.Int64
	pool, err := db.Open(ctx, db.Config{URL: c.DatabaseURL, ApplicationName: "gateway-bench", Tracer: countingTracer{&liveness, &statements}})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	// As services/app builds the gateway role.
	js, err := joinservice.Open(c.JoinService, pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	ca := js.CA()
	cert, err := ca.ServingCertificate(c.ID, []string{"localhost", "127.0.0.1"}, 0)
	if err != nil {
		t.Fatal(err)
	}
	gw, err := gateway.New(gateway.Config{
		ID: c.ID, DB: pool, Joiner: js, TrustDomain: ca.TrustDomain().Name(),
		Revoked: func(ctx context.Context, serial string) (bool, error) {
			return nodeca.RevokedSerial(ctx, pool, serial)
		},
		HeartbeatInterval: c.HeartbeatInterval, LivenessInterval: c.LivenessInterval,
	})
	if err != nil {
		t.Fatal(err)
	}
	creds := credentials.NewTLS(&tls.Config{
		Certificates: []tls.Certificate{cert}, ClientCAs: ca.Pool(),
		ClientAuth: tls.VerifyClientCertIfGiven, MinVersion: tls.VersionTLS13,
	})
	gs := grpc.NewServer(grpc.Creds(creds),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: 30 * time.Second, Timeout: 10 * time.Second}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
	)
	agentv1.RegisterNodeServiceServer(gs, gw)
	ln, err := net.Listen("tcp", c.Listen)
	if err != nil {
		t.Fatal(err)
	}
	gw.Start()
	go func() { _ = gs.Serve(ln) }()

	var outMu sync.Mutex
	report := func(gc bool) {
		if gc {
			runtime.GC()
		}
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		var ru syscall.Rusage
		_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
		s := childStats{
			Addr: ln.Addr().String(), Sessions: gw.Sessions(), HeapInuse: int64(m.HeapInuse), RSSKiB: vmRSSKiB(),
			Goroutines: runtime.NumGoroutine(), CPU: time.Duration(ru.Utime.Nano() + ru.Stime.Nano()),
			Liveness: liveness.Load(), Statements: statements.Load(), GC: gc,
		}
		line, _ := json.Marshal(s)
		outMu.Lock()
		fmt.Println(statsPrefix + string(line))
		outMu.Unlock()
	}
	report(false)
	go func() {
		sc := bufio.NewScanner(os.Stdin)
		for sc.Scan() {
			if sc.Text() == "gc" {
				report(true)
			}
		}
	}()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			gw.Stop()
			gs.Stop()
			return
		case <-tick.C:
			report(false)
		}
	}
}

// countingTracer counts the statements on a pool and, among them, the
// gateway's liveness statements.
type countingTracer struct{ liveness, all *atomic.Int64 }

func (c countingTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	c.all.Add(1)
	if strings.Contains(d.SQL, "UPDATE nodes n SET last_seen_at") {
		c.liveness.Add(1)
	}
	return ctx
}

func (countingTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// vmRSSKiB is this process's resident set size.
func vmRSSKiB() int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			n, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return n
		}
	}
	return 0
}
