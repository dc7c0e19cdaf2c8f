package dev_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/sim"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/services/app"
	"github.com/bettercompute/bettercompute/services/dev"
)

// BenchmarkGatewayFleet holds N simulated nodes (agent/sim, the engine of
// bcsim: the real agent code, a mock DGX H200 each) against one gateway
// over real mutual TLS, with the dev control plane (API, joinservice,
// nodespec controller, controllers, relay; PostgreSQL from pgtest, an
// embedded NATS) around it, and reports:
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
//   - change-bus-up-s, change-bus-down-s: a fleet-wide change (the pool's
//     site settings, pools.update) until observedGeneration == generation
//     on every node in the database, with the bus up and with NATS stopped;
//     change-*-p50-s and -p99-s: per node, from the API call to the node's
//     Observed report of the new generation;
//   - storm-s: after the gateway is stopped (SIGTERM: sessions cancelled,
//     connections closed) and a new one listens on the same port, the time
//     until it holds all N sessions again; storm-db-stmts: its statements
//     in that time; storm-peak-db-conns: the most connections the database
//     had open, for every process, while it lasted;
//   - mock-nvml-KiB/node: the heap one simulated node's mock NVML takes.
//
// The gateway runs in a child process (this test binary re-executed as
// TestGatewayBenchChild, which runs services/app with roles [gateway],
// exactly as `serve --roles gateway` does), so its memory and CPU are its
// own and not the simulated nodes'; it receives desired-state pokes from
// the parent's nodespec controller over NATS, and resyncs from the database
// without it.
//
// N is BC_BENCH_NODES (default 200), the idle window BC_BENCH_IDLE
// (default 11s, two liveness intervals); the simulated nodes' state lives
// under BC_BENCH_SIMROOT (default: /dev/shm when it exists — a fleet has a
// disk per node, the simulator one for all):
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

	ns := natstest.New(b)
	zero, port := 0, 0
	cfg := &config.Config{
		Database: config.Database{URL: pgtest.NewDB(b)},
		NATS:     config.NATS{URL: ns.URL()},
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
	dbPool, err := pgxpool.New(b.Context(), cfg.Database.URL)
	if err != nil {
		b.Fatal(err)
	}
	defer dbPool.Close()

	// The measured gateway, in its own process, configured as the parent.
	child := *cfg
	child.Roles = []string{string(config.RoleGateway)}
	child.Gateway.ID, child.Gateway.Listen = "gw-bench", "127.0.0.1:0"
	child.Gateway.HeartbeatInterval = config.Duration(10 * time.Second)
	child.Gateway.LivenessInterval = config.Duration(5 * time.Second)
	child.Server.NoMigrate = true
	gw := startChild(b, &child)
	defer func() { gw.stop(b) }()
	child.Gateway.Listen = gw.addr
	base := gw.gcStats(b)

	// What one node's mock NVML costs, measured here, before the fleet.
	mockKiB := mockNVMLKiB(b, 32)

	var pool struct{ Pool struct{ ID string } }
	benchCall(b, env, "pools/create", map[string]any{"tenantId": "root", "name": "bench", "class": "gpu", "idempotencyKey": "bench-pool"}, &pool)
	var tok struct{ Token string }
	benchCall(b, env, "joinTokens/create", map[string]any{"tenantId": "root", "poolId": pool.Pool.ID, "uses": n, "idempotencyKey": "bench-token"}, &tok)
	pub, keyID, roots := joinMaterial(b, env)

	var up atomic.Int64
	obs := newObservedLog(n)
	simRoot := os.Getenv("BC_BENCH_SIMROOT")
	if simRoot == "" {
		simRoot = b.TempDir()
		if fi, err := os.Stat("/dev/shm"); err == nil && fi.IsDir() {
			if simRoot, err = os.MkdirTemp("/dev/shm", "bc-bench-sim-"); err != nil {
				b.Fatal(err)
			}
			defer func() { _ = os.RemoveAll(simRoot) }()
		}
	}
	b.ResetTimer()
	start := time.Now()
	fleet, err := sim.Start(b.Context(), sim.Config{
		Gateway: gw.addr, RootCAs: roots, Token: tok.Token,
		JoinserviceKey: pub, JoinserviceKeyID: keyID, Root: filepath.Join(simRoot, "sim"), Prefix: "bench",
		CommandKey: env.CommandKey, NoLogFiles: true,
		OnSession: func(ok bool) {
			if ok {
				up.Add(1)
			} else {
				up.Add(-1)
			}
		},
		OnObserved: obs.record,
	}, n)
	if err != nil {
		b.Fatal(err)
	}
	defer fleet.Stop()
	joined := time.Since(start)
	gw.waitSessions(b, n, 10*time.Minute)
	allUp := time.Since(start)
	b.Logf("N=%d: joined in %s (%.1f/s), all sessions in %s; %d sessions seen by the nodes", n, joined.Round(time.Millisecond), float64(n)/joined.Seconds(), allUp.Round(time.Millisecond), up.Load())
	waitFleet(b, dbPool, pool.Pool.ID, n, "", 5*time.Minute) // adopted and converged
	settle(b, dbPool, 5*time.Minute)

	// Idle: settle one liveness interval, then measure a window.
	time.Sleep(time.Duration(child.Gateway.LivenessInterval) + time.Second)
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

	// A fleet-wide change, with the bus up and then with NATS stopped.
	changes := map[string]fleetChange{}
	for _, phase := range []struct{ name, level string }{{"bus-up", "debug"}, {"bus-down", "warn"}} {
		settle(b, dbPool, 5*time.Minute)
		if phase.name == "bus-down" {
			ns.Stop()
		}
		changes[phase.name] = changeFleet(b, env, dbPool, gw, obs, fleet, pool.Pool.ID, n, phase.level)
		c := changes[phase.name]
		b.Logf("fleet change, %s: every node's spec stored %s and every node converged in the database %s after pools.update; per node p50 %s, p99 %s, last %s",
			phase.name, c.stored.Round(time.Millisecond), c.total.Round(time.Millisecond), c.p50.Round(time.Millisecond), c.p99.Round(time.Millisecond), c.last.Round(time.Millisecond))
	}
	ns.Restart()

	// Reconnect storm: stop the gateway, start a new one on the same port.
	gw.stop(b)
	down := time.Now()
	peak := sampleConnections(b, dbPool)
	gw = startChild(b, &child)
	listening := time.Now()
	gw.waitSessions(b, n, 10*time.Minute)
	storm := time.Since(listening)
	last := gw.latest()
	peakConns := peak()
	b.Logf("restart: new gateway listening %s after the old one stopped; all %d sessions back in %s, %d statements (%d liveness), at most %d database connections open",
		listening.Sub(down).Round(time.Millisecond), n, storm.Round(time.Millisecond), last.Statements, last.Liveness, peakConns)

	b.ReportMetric(float64(n), "nodes")
	b.ReportMetric(float64(n)/joined.Seconds(), "joins/s")
	b.ReportMetric(heapMiB, "gw-heap-MiB/1k-sessions")
	b.ReportMetric(rssMiB, "gw-rss-MiB/1k-sessions")
	b.ReportMetric(float64(held.Goroutines-base.Goroutines)/float64(n), "gw-goroutines/session")
	b.ReportMetric(cpu, "gw-millicores/1k-sessions")
	b.ReportMetric(liveness, "liveness-writes/s")
	for _, name := range []string{"bus-up", "bus-down"} {
		c := changes[name]
		b.ReportMetric(c.total.Seconds(), "change-"+name+"-s")
		b.ReportMetric(c.stored.Seconds(), "change-"+name+"-specs-stored-s")
		b.ReportMetric(c.p50.Seconds(), "change-"+name+"-p50-s")
		b.ReportMetric(c.p99.Seconds(), "change-"+name+"-p99-s")
	}
	b.ReportMetric(storm.Seconds(), "storm-s")
	b.ReportMetric(float64(last.Statements), "storm-db-stmts")
	b.ReportMetric(float64(peakConns), "storm-peak-db-conns")
	b.ReportMetric(mockKiB, "mock-nvml-KiB/node")
}

// observedLog keeps, per simulated node, when it first reported each
// observed generation.
type observedLog struct {
	mu    sync.Mutex
	first []map[int64]time.Time
}

func newObservedLog(n int) *observedLog {
	l := &observedLog{first: make([]map[int64]time.Time, n)}
	for i := range l.first {
		l.first[i] = map[int64]time.Time{}
	}
	return l
}

func (l *observedLog) record(i int, gen int64) {
	now := time.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.first[i][gen]; !ok {
		l.first[i][gen] = now
	}
}

// at returns when node i first reported gen or later.
func (l *observedLog) at(i int, gen int64) (time.Time, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var first time.Time
	for g, t := range l.first[i] {
		if g >= gen && (first.IsZero() || t.Before(first)) {
			first = t
		}
	}
	return first, !first.IsZero()
}

type fleetChange struct{ total, stored, p50, p99, last time.Duration }

// profile writes this process's CPU profile to path until the returned
// function is called (BC_BENCH_PROFILE_DIR: where the time of a fleet
// change goes).
func profile(b *testing.B, path string) func() {
	f, err := os.Create(path)
	if err != nil {
		b.Fatal(err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		b.Fatal(err)
	}
	return func() {
		pprof.StopCPUProfile()
		_ = f.Close()
	}
}

// changeFleet sets the pool's site log level and times the fleet's
// convergence: total until the database shows every node converged on a
// spec with it, and per node until its Observed of that generation.
func changeFleet(b *testing.B, env *dev.Env, db *pgxpool.Pool, gw *childProc, obs *observedLog, fleet *sim.Fleet, pool string, n int, level string) fleetChange {
	b.Helper()
	start := time.Now()
	var out struct{}
	benchCall(b, env, "pools/update", map[string]any{"tenantId": "root", "poolId": pool, "site": map[string]any{"logLevel": level}, "updateMask": "site"}, &out)
	if dir := os.Getenv("BC_BENCH_PROFILE_DIR"); dir != "" {
		stop := profile(b, filepath.Join(dir, "control-plane-"+level+".pprof"))
		defer stop()
		_, _ = fmt.Fprintf(gw.stdin, "prof %s\n", filepath.Join(dir, "gateway-"+level+".pprof"))
		defer func() { _, _ = io.WriteString(gw.stdin, "unprof\n") }()
	}
	total, stored := waitFleet(b, db, pool, n, level, 5*time.Minute)
	gens := map[string]int64{}
	rows, err := db.Query(b.Context(), `SELECT id, generation FROM nodes WHERE pool_id = $1`, pool)
	if err != nil {
		b.Fatal(err)
	}
	for rows.Next() {
		var id string
		var g int64
		if err := rows.Scan(&id, &g); err != nil {
			b.Fatal(err)
		}
		gens[id] = g
	}
	if err := rows.Err(); err != nil {
		b.Fatal(err)
	}
	per := make([]time.Duration, 0, n)
	for i, id := range fleet.Nodes() {
		t, ok := obs.at(i, gens[id])
		if !ok {
			b.Fatalf("node %s converged in the database but never reported generation %d", id, gens[id])
		}
		per = append(per, t.Sub(start))
	}
	slices.Sort(per)
	return fleetChange{total: total, stored: stored, p50: per[len(per)/2], p99: per[len(per)*99/100], last: per[len(per)-1]}
}

// waitFleet waits until n nodes of pool are converged (and, when level is
// set, on a spec with that site log level), polling the database every
// 50 ms, and returns how long it took and when every node's spec was
// stored (the nodespec controller's share).
func waitFleet(b *testing.B, db *pgxpool.Pool, pool string, n int, level string, timeout time.Duration) (time.Duration, time.Duration) {
	b.Helper()
	start := time.Now()
	var stored time.Duration
	for {
		var done, specs int
		err := db.QueryRow(b.Context(), `SELECT count(*) FILTER (WHERE observed_generation = generation), count(*) FROM nodes
			WHERE pool_id = $1 AND generation > 0 AND ($2 = '' OR spec->'site'->>'logLevel' = $2)`, pool, level).Scan(&done, &specs)
		if err != nil {
			b.Fatal(err)
		}
		if specs == n && stored == 0 {
			stored = time.Since(start)
		}
		if done == n {
			return time.Since(start), stored
		}
		if time.Since(start) > timeout {
			b.Fatalf("%d of %d nodes converged after %s", done, n, timeout)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// settle waits until the control plane is idle — no work due in the queue
// but the periodic keys, no event left to publish — so that a change is
// timed on a fleet at rest, not behind the join's backlog.
func settle(b *testing.B, db *pgxpool.Pool, timeout time.Duration) {
	b.Helper()
	start := time.Now()
	for {
		var work, events int
		err := db.QueryRow(b.Context(), `SELECT (SELECT count(*) FROM work_queue WHERE key <> 'all'),
			(SELECT count(*) FROM outbox WHERE sent_at IS NULL)`).Scan(&work, &events)
		if err != nil {
			b.Fatal(err)
		}
		if work == 0 && events == 0 {
			b.Logf("control plane idle after %s", time.Since(start).Round(time.Millisecond))
			return
		}
		if time.Since(start) > timeout {
			b.Fatalf("control plane still busy after %s: %d keys of work, %d events to publish", timeout, work, events)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// sampleConnections samples the database's open connections (every
// process's) every 50 ms until the returned function is called, which
// returns the most seen.
func sampleConnections(b *testing.B, db *pgxpool.Pool) func() int {
	ctx, cancel := context.WithCancel(b.Context())
	var peak atomic.Int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			var c int64
			if db.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()`).Scan(&c) == nil && c > peak.Load() {
				peak.Store(c)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}()
	return func() int {
		cancel()
		<-done
		return int(peak.Load())
	}
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

// raiseFileLimit lifts the open-files limit: every simulated node holds a
// connection and a log file and opens its state files as it converges, and
// the gateway holds a connection per session. It asks for a million (a root
// process may raise its hard limit up to fs.nr_open) and settles for the
// hard limit.
func raiseFileLimit(tb testing.TB) {
	var l syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l); err != nil {
		tb.Fatal(err)
	}
	want := syscall.Rlimit{Cur: 1 << 20, Max: max(l.Max, 1<<20)}
	if syscall.Setrlimit(syscall.RLIMIT_NOFILE, &want) == nil {
		return
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

func startChild(b *testing.B, c *config.Config) *childProc {
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
	_ = p.stdin.Close() // ends the process's stats reader
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	<-p.done
	if err := p.cmd.Wait(); err != nil {
		b.Errorf("gateway process: %v", err)
	}
}

// TestGatewayBenchChild is the gateway process of BenchmarkGatewayFleet; it
// runs only when that benchmark starts it: services/app with the
// configuration it was handed (roles [gateway]).
func TestGatewayBenchChild(t *testing.T) {
	raw := os.Getenv("BC_BENCH_CHILD")
	if raw == "" {
		t.Skip("the gateway process of BenchmarkGatewayFleet")
	}
	var cfg config.Config
	if err := json.Unmarshal([]byte(raw), &cfg); err != nil {
		t.Fatal(err)
	}
	raiseFileLimit(t)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()

	var liveness, statements atomic.Int64
	a, err := app.New(&cfg, app.Options{DBTracer: countingTracer{&liveness, &statements}})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(ctx); err != nil {
		t.Fatal(err)
	}

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
			Addr: a.GatewayAddr(), Sessions: a.GatewaySessions(), HeapInuse: int64(m.HeapInuse), RSSKiB: vmRSSKiB(),
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
		var prof *os.File
		for sc.Scan() {
			switch line := sc.Text(); {
			case line == "gc":
				report(true)
			case strings.HasPrefix(line, "prof "): // BC_BENCH_PROFILE_DIR
				if f, err := os.Create(strings.TrimPrefix(line, "prof ")); err == nil && pprof.StartCPUProfile(f) == nil {
					prof = f
				}
			case line == "unprof" && prof != nil:
				pprof.StopCPUProfile()
				_ = prof.Close()
				prof = nil
			}
		}
	}()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			a.Stop(context.Background())
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
