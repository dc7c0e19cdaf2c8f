package chaos_test

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/agent/command"
	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/sim"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/chaos"
)

// bin is the better-compute binary TestMain built.
var bin string

func TestMain(m *testing.M) {
	code := func() int {
		if !testingShort() {
			dir, err := os.MkdirTemp("", "bc-chaos-bin")
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 1
			}
			defer func() { _ = os.RemoveAll(dir) }()
			bin = filepath.Join(dir, "better-compute")
			out, err := exec.Command("go", "build", "-o", bin, "github.com/bettercompute/bettercompute/services/cmd/better-compute").CombinedOutput()
			if err != nil {
				fmt.Fprintf(os.Stderr, "build better-compute: %v\n%s", err, out)
				return 1
			}
		}
		code := pgtest.Run(m)
		if code == 0 {
			if err := pgtest.Leaks(); err != nil {
				fmt.Fprintln(os.Stderr, "chaos: goroutines leaked by the tests:", err)
				code = 1
			}
		}
		return code
	}()
	os.Exit(code)
}

// testingShort reads -short before m.Run has parsed the flags.
func testingShort() bool {
	for _, a := range os.Args[1:] {
		if a == "-test.short" || a == "-test.short=true" {
			return true
		}
	}
	return false
}

// fleetSize is BC_CHAOS_NODES (make chaos), 4 by default.
func fleetSize(t *testing.T) int {
	n := 4
	if s := os.Getenv("BC_CHAOS_NODES"); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v < 1 || v > 2000 {
			t.Fatalf("BC_CHAOS_NODES=%q: expected 1 to 2000", s)
		}
		n = v
	}
	return n
}

// runs counts diag.nvml runs on the daemons by the payload's level, which
// the suite makes unique per command.
type runs struct {
	mu sync.Mutex
	n  map[string]int
}

func (r *runs) diag(_ context.Context, body *agentv1.CommandBody) (*agentv1.CommandResult, error) {
	level := body.GetDiagNvml().GetLabel()
	r.mu.Lock()
	r.n[level]++
	r.mu.Unlock()
	return &agentv1.CommandResult{Kind: &agentv1.CommandResult_DiagNvml{DiagNvml: &agentv1.DiagNvmlResult{DriverVersion: level}}}, nil
}

func (r *runs) count(level string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.n[level]
}

func (r *runs) total() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	t := 0
	for _, n := range r.n {
		t += n
	}
	return t
}

// writeLog records, in the test's database, who wrote nodes, outbox,
// commands and bookings rows (by application_name, which the harness sets
// per process), every lease that changed hands (its new fence) and every
// worker row inserted: what the fencing scenario reads.
const writeLog = `
CREATE TABLE chaos_writes (id bigserial PRIMARY KEY, app text NOT NULL, tbl text NOT NULL, detail text,
	at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION chaos_log() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF TG_TABLE_NAME = 'leases' THEN
		IF TG_OP = 'INSERT' OR NEW.fence IS DISTINCT FROM OLD.fence THEN
			INSERT INTO chaos_writes (app, tbl, detail) VALUES (current_setting('application_name'), 'leases:acquire', NEW.holder);
		END IF;
	ELSIF TG_TABLE_NAME = 'workers' THEN
		INSERT INTO chaos_writes (app, tbl, detail) VALUES (current_setting('application_name'), 'workers', NEW.id);
	ELSE
		INSERT INTO chaos_writes (app, tbl) VALUES (current_setting('application_name'), TG_TABLE_NAME);
	END IF;
	RETURN NULL;
END $$;
CREATE TRIGGER chaos_nodes AFTER INSERT OR UPDATE ON nodes FOR EACH ROW EXECUTE FUNCTION chaos_log();
CREATE TRIGGER chaos_outbox AFTER INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION chaos_log();
CREATE TRIGGER chaos_commands AFTER INSERT OR UPDATE ON commands FOR EACH ROW EXECUTE FUNCTION chaos_log();
CREATE TRIGGER chaos_leases AFTER INSERT OR UPDATE ON leases FOR EACH ROW EXECUTE FUNCTION chaos_log();
CREATE TRIGGER chaos_workers AFTER INSERT ON workers FOR EACH ROW EXECUTE FUNCTION chaos_log();
`

type suite struct {
	t     *testing.T
	top   *chaos.Topology
	db    *pgxpool.Pool
	pool  string
	nodes []string
	runs  *runs
	round int
	cmds  []string // every command id the suite ran
}

// TestChaos runs the control plane as compose.yaml does, one OS process per
// deployable (two nodespec-controllers), against one PostgreSQL and a real
// nats-server, joins a fleet of simulated nodes (the real agent) through the
// gateway process, books GPUs, and then, one after another: SIGKILLs
// nats-server and restarts it empty; SIGSTOPs a nodespec-controller past its
// lease (the other takes over; resumed, it writes nothing until it holds a
// new lease); SIGKILLs the gateway, and the controllers and a
// nodespec-controller mid-run; terminates every control-plane connection to
// PostgreSQL. After each, a desired-state change made during the fault and
// one after it converge on every node, and a command per node made during
// and after succeeds having run exactly once; at the end the reservation is
// still bound to the GPUs it had.
func TestChaos(t *testing.T) {
	if testing.Short() {
		t.Skip("starts the control plane as separate processes")
	}
	started := time.Now()
	n := fleetSize(t)
	dbURL := pgtest.NewDB(t)
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "chaos-test"
	db, err := pgxpool.NewWithConfig(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.Exec(t.Context(), writeLog); err != nil {
		t.Fatal(err)
	}

	top := chaos.Start(t, chaos.Options{Bin: bin, DBURL: dbURL,
		Env: []string{
			// Leases short enough for a takeover within seconds.
			"BC_RUNTIME_HEARTBEAT=500ms", "BC_RUNTIME_LEASE_TTL=2s",
			"BC_GATEWAY_HEARTBEAT_INTERVAL=1s", "BC_GATEWAY_LIVENESS_INTERVAL=1s",
		},
		Extra: map[string]string{"nodespec-controller-b": "nodespec-controller"},
	})
	s := &suite{t: t, top: top, db: db, runs: &runs{n: map[string]int{}}}
	s.join(n)
	t.Logf("%d nodes joined through the gateway process, %s after start", n, time.Since(started).Round(time.Millisecond))

	resv := s.reserve()

	t.Run("nats-server SIGKILLed, restarted with an empty store", func(t *testing.T) {
		s.t = t
		top.Kill("nats-server")
		during := s.change()
		cmds := s.commands("nats-down")
		top.RestartNATSEmpty()
		s.converged(during)
		s.succeededOnce(cmds, "nats-down")
		s.roundTrip("nats-back")
	})

	t.Run("a nodespec-controller SIGSTOPped past its lease is fenced after SIGCONT", func(t *testing.T) {
		s.t = t
		s.fencing()
	})

	t.Run("gateway SIGKILLed mid-run: nodes reconnect, queued commands deliver once", func(t *testing.T) {
		s.t = t
		s.change()
		cmdsBefore := s.commands("gw-inflight")
		top.Kill("gateway")
		during := s.change()
		cmds := s.commands("gw-down")
		top.Restart("gateway")
		s.converged(during)
		s.succeededOnce(cmdsBefore, "gw-inflight")
		s.succeededOnce(cmds, "gw-down")
		s.roundTrip("gw-back")
	})

	t.Run("controllers and a nodespec-controller SIGKILLed mid-run", func(t *testing.T) {
		s.t = t
		during := s.change()
		cmds := s.commands("ctl-kill")
		top.Kill("controllers")
		top.Kill("nodespec-controller-b")
		top.Restart("controllers")
		top.Restart("nodespec-controller-b")
		s.converged(during)
		s.succeededOnce(cmds, "ctl-kill")
		s.roundTrip("ctl-back")
	})

	t.Run("every control-plane connection to PostgreSQL terminated", func(t *testing.T) {
		s.t = t
		s.terminateBackends()
		during := s.change()
		cmds := s.commands("pg-term")
		s.terminateBackends()
		s.converged(during)
		s.succeededOnce(cmds, "pg-term")
		s.roundTrip("pg-back")
	})

	t.Run("the reservation booked before the chaos is still bound to the same GPUs", func(t *testing.T) {
		s.t = t
		got := s.reservation(resv.ID)
		if got.State != "bound" || bookingSet(got) != bookingSet(resv) {
			t.Fatalf("reservation after the chaos: %+v\nbefore: %+v", got, resv)
		}
		var bookings int
		if err := db.QueryRow(t.Context(), `SELECT count(*) FROM bookings WHERE reservation_id = $1 AND active`, resv.ID).Scan(&bookings); err != nil {
			t.Fatal(err)
		}
		if bookings != len(resv.Bookings) {
			t.Fatalf("%d booking rows for %s, want %d", bookings, resv.ID, len(resv.Bookings))
		}
	})

	t.Run("no command ran twice, none was lost", func(t *testing.T) {
		s.t = t
		if got := s.runs.total(); got != len(s.cmds) {
			t.Fatalf("the daemons ran diag.nvml %d times for %d commands", got, len(s.cmds))
		}
		var dup int
		if err := db.QueryRow(t.Context(), `SELECT count(*) FROM (SELECT resource_id FROM outbox WHERE type = 'command.succeeded'
			AND resource_id = ANY($1) GROUP BY 1 HAVING count(*) <> 1) d`, s.cmds).Scan(&dup); err != nil {
			t.Fatal(err)
		}
		var events int
		if err := db.QueryRow(t.Context(), `SELECT count(DISTINCT resource_id) FROM outbox WHERE type = 'command.succeeded' AND resource_id = ANY($1)`,
			s.cmds).Scan(&events); err != nil {
			t.Fatal(err)
		}
		if dup != 0 || events != len(s.cmds) {
			t.Fatalf("command.succeeded events: %d commands with one, %d with another count; %d commands", events, dup, len(s.cmds))
		}
	})
	t.Logf("chaos suite with %d nodes: %s", n, time.Since(started).Round(time.Millisecond))
}

// join makes a pool and a join token and joins n simulated nodes through
// the gateway process, and waits until each is adopted and converged.
func (s *suite) join(n int) {
	t, top := s.t, s.top
	var pool struct{ Pool struct{ ID string } }
	top.MustCall("pools/create", map[string]any{"tenantId": "root", "name": "chaos", "class": "gpu", "idempotencyKey": "chaos-pool"}, &pool)
	s.pool = pool.Pool.ID
	var tok struct{ Token string }
	top.MustCall("joinTokens/create", map[string]any{"tenantId": "root", "poolId": s.pool, "uses": n, "idempotencyKey": "chaos-token"}, &tok)
	caPEM, err := os.ReadFile(filepath.Join(top.Public, "ca.pem"))
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		t.Fatal("ca.pem holds no certificate")
	}
	keyPEM, err := os.ReadFile(filepath.Join(top.Public, "joinservice.pub"))
	if err != nil {
		t.Fatal(err)
	}
	pub, keyID, err := join.ParsePublicKey(keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	f, err := sim.Start(t.Context(), sim.Config{Gateway: top.GatewayAddr, ServerName: "127.0.0.1", RootCAs: roots, Token: tok.Token,
		JoinserviceKey: pub, JoinserviceKeyID: keyID, Root: t.TempDir(), Prefix: "chaos", NoLogFiles: true, NoReboot: true,
		Executors: map[string]command.Func{command.KindDiagNvml: s.runs.diag}}, n)
	if err != nil {
		t.Fatalf("join %d nodes through the gateway process: %v", n, err)
	}
	t.Cleanup(f.Stop)
	s.nodes = f.Nodes()
	poll.UntilNil(t, 3*time.Minute, "every node adopted and converged", func() error {
		var ok int
		err := s.db.QueryRow(t.Context(), `SELECT count(*) FROM nodes WHERE pool_id = $1 AND state = 'adopted'
			AND generation > 0 AND observed_generation = generation`, s.pool).Scan(&ok)
		if err == nil && ok != n {
			err = fmt.Errorf("%d of %d", ok, n)
		}
		return s.pause(err)
	})
}

// pause sleeps between polls of the database (not an assertion) and returns
// err.
func (s *suite) pause(err error) error {
	if err != nil {
		time.Sleep(200 * time.Millisecond)
	}
	return err
}

type reservation struct {
	ID       string
	State    string
	Bookings []struct{ NodeID, DeviceID string }
}

func bookingSet(r reservation) string {
	var b strings.Builder
	for _, x := range r.Bookings {
		b.WriteString(x.NodeID + "/" + x.DeviceID + ",")
	}
	return b.String()
}

func (s *suite) reservation(id string) reservation {
	var out struct{ Reservation reservation }
	s.call("reservations/get", map[string]any{"tenantId": "root", "reservationId": id}, &out)
	return out.Reservation
}

// reserve books 4 GPUs on one node and waits until the node applied it.
func (s *suite) reserve() reservation {
	var out struct{ Reservation reservation }
	s.top.MustCall("reservations/create", map[string]any{"tenantId": "root", "poolId": s.pool, "gpuCount": 4,
		"constraints": map[string]any{"sameNode": true}, "idempotencyKey": "chaos-resv"}, &out)
	if len(out.Reservation.Bookings) != 4 {
		s.t.Fatalf("reservation %+v", out.Reservation)
	}
	var r reservation
	poll.UntilNil(s.t, 3*time.Minute, "the reservation bound", func() error {
		r = s.reservation(out.Reservation.ID)
		if r.State != "bound" {
			return s.pause(fmt.Errorf("state %s", r.State))
		}
		return nil
	})
	return r
}

// call is Call retried while the API or its database is away (a chaos step
// may be in progress); every create the suite makes carries an idempotency
// key, so a retry never makes a second one.
func (s *suite) call(method string, body, out any) {
	s.t.Helper()
	poll.UntilNil(s.t, 2*time.Minute, method, func() error {
		err := s.top.Call(method, body, out)
		var ae *chaos.APIError
		if errors.As(err, &ae) && ae.Status < 500 {
			s.t.Fatalf("%s: %v", method, err)
		}
		return s.pause(err)
	})
}

var levels = []string{"debug", "info", "warn", "error"}

// change updates the pool's site log level to the next value and returns
// it.
func (s *suite) change() string {
	s.round++
	level := levels[s.round%len(levels)]
	var out map[string]any
	s.call("pools/update", map[string]any{"tenantId": "root", "poolId": s.pool, "site": map[string]any{"logLevel": level}, "updateMask": "site"}, &out)
	return level
}

// converged waits until every node's spec has the site log level and the
// node applied it (observedGeneration = generation), unless a later change
// replaced it: it waits for the latest change.
func (s *suite) converged(level string) {
	s.t.Helper()
	poll.UntilNil(explaining{s.t, s.explainSpecs}, 3*time.Minute, "every node converged on logLevel "+level, func() error {
		var ok, total int
		err := s.db.QueryRow(s.t.Context(), `SELECT count(*) FILTER (WHERE generation > 0 AND observed_generation = generation
			AND spec->'site'->>'logLevel' = $2), count(*) FROM nodes WHERE pool_id = $1`, s.pool, level).Scan(&ok, &total)
		if err == nil && ok != total {
			err = fmt.Errorf("%d of %d", ok, total)
		}
		return s.pause(err)
	})
}

// explaining is a testing.TB whose Fatalf first logs what explain finds,
// so a convergence that times out says which part stood still.
type explaining struct {
	testing.TB
	explain func(testing.TB)
}

func (e explaining) Fatalf(format string, args ...any) {
	e.Helper()
	e.explain(e.TB)
	e.TB.Fatalf(format, args...)
}

// explainSpecs logs each node's desired and observed generations, its
// gateway and its nodespec work row: whether the controller, the gateway or
// the daemon held the node back.
func (s *suite) explainSpecs(t testing.TB) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rows, err := s.db.Query(ctx, `SELECT n.id, n.state, n.generation, n.observed_generation, coalesce(n.spec->'site'->>'logLevel', ''),
			coalesce(n.gateway_id, ''), coalesce(n.spec_error, ''),
			coalesce((SELECT format('gen=%s attempts=%s run_after=%s claimed_by=%s claimed_until=%s fence=%s last_error=%s', w.generation, w.attempts,
				w.run_after, w.claimed_by, w.claimed_until, w.claim_fence, w.last_error) FROM work_queue w WHERE w.kind = 'nodespec' AND w.key = n.id), 'no work row')
		FROM nodes n WHERE n.pool_id = $1 ORDER BY n.id`, s.pool)
	if err != nil {
		t.Logf("explain: %v", err)
		return
	}
	defer rows.Close()
	for rows.Next() {
		var id, state, level, gw, specErr, work string
		var gen, observed int64
		if err := rows.Scan(&id, &state, &gen, &observed, &level, &gw, &specErr, &work); err != nil {
			t.Logf("explain: %v", err)
			return
		}
		t.Logf("node %s %s: generation %d observed %d logLevel %q gateway %q spec_error %q; nodespec work: %s",
			id, state, gen, observed, level, gw, specErr, work)
	}
	if err := rows.Err(); err != nil {
		t.Logf("explain: %v", err)
	}
}

// commands runs a diag.nvml on every node, its level naming the step and
// the node, and returns their ids.
func (s *suite) commands(step string) []string {
	ids := make([]string, 0, len(s.nodes))
	for _, node := range s.nodes {
		var out struct{ Command struct{ ID string } }
		key := step + "/" + node
		s.call("commands/run", map[string]any{"tenantId": "root", "nodeId": node, "kind": "diag.nvml",
			"payload": map[string]any{"label": key}, "idempotencyKey": key}, &out)
		ids = append(ids, out.Command.ID)
	}
	s.cmds = append(s.cmds, ids...)
	return ids
}

// succeededOnce waits until every command succeeded and checks that each
// ran exactly once on its daemon.
func (s *suite) succeededOnce(ids []string, step string) {
	s.t.Helper()
	poll.UntilNil(s.t, 3*time.Minute, step+": every command succeeded", func() error {
		rows, err := s.db.Query(s.t.Context(), `SELECT id, state, reason FROM commands WHERE id = ANY($1)`, ids)
		if err != nil {
			return s.pause(err)
		}
		type row struct{ ID, State, Reason string }
		got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
		if err != nil {
			return s.pause(err)
		}
		done := 0
		for _, r := range got {
			switch r.State {
			case "succeeded":
				done++
			case "failed", "expired", "cancelled":
				s.t.Fatalf("%s: command %s %s (%s)", step, r.ID, r.State, r.Reason)
			}
		}
		if done != len(ids) {
			return s.pause(fmt.Errorf("%d of %d succeeded", done, len(ids)))
		}
		return nil
	})
	for _, node := range s.nodes {
		if n := s.runs.count(step + "/" + node); n != 1 {
			s.t.Fatalf("%s: the command on %s ran %d times", step, node, n)
		}
	}
}

// roundTrip is a change and a command per node after a fault: both
// converge.
func (s *suite) roundTrip(step string) {
	s.t.Helper()
	level := s.change()
	cmds := s.commands(step)
	s.converged(level)
	s.succeededOnce(cmds, step)
}

// terminateBackends ends every connection to the test's database but the
// suite's own (pg_terminate_backend), as a failover or a PgBouncer restart
// would.
func (s *suite) terminateBackends() {
	s.t.Helper()
	var n int
	poll.UntilNil(s.t, time.Minute, "terminate the control plane's connections", func() error {
		return s.pause(s.db.QueryRow(s.t.Context(), `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
			WHERE datname = current_database() AND pid <> pg_backend_pid() AND application_name LIKE 'chaos-%'
			AND application_name <> 'chaos-test'`).Scan(&n))
	})
	if n == 0 {
		s.t.Fatal("no control-plane connection to terminate")
	}
	s.t.Logf("terminated %d connections", n)
}

// workerOf is the nodespec-controller worker id of a process.
func (s *suite) workerOf(proc string) string {
	s.t.Helper()
	var id string
	poll.UntilNil(s.t, time.Minute, proc+"'s worker", func() error {
		return s.pause(s.db.QueryRow(s.t.Context(), `SELECT detail FROM chaos_writes WHERE tbl = 'workers' AND app = $1
			AND detail LIKE 'nodespec-controller/%' ORDER BY id LIMIT 1`, "chaos-"+proc).Scan(&id))
	})
	return id
}

// held counts the unexpired leases worker holds, and every lease of its
// membership.
func (s *suite) held(worker string) (mine, all int, err error) {
	err = s.db.QueryRow(s.t.Context(), `SELECT count(*) FILTER (WHERE holder = $1 AND expires_at > now()), count(*)
		FROM leases WHERE name LIKE 'nodespec-controller/%'`, worker).Scan(&mine, &all)
	return mine, all, err
}

// fencing: two nodespec-controllers (and the controllers process, whose
// role includes theirs) share the shards; a is SIGSTOPped just after a
// change (likely mid-run), past its lease; the others take every shard and
// converges the change and another; a, resumed, notices it lost its leases
// and writes nothing to nodes, outbox or commands until it holds a lease
// it took after resuming.
func (s *suite) fencing() {
	t := s.t
	a, b := s.workerOf("nodespec-controller"), s.workerOf("nodespec-controller-b")
	poll.UntilNil(t, time.Minute, "both nodespec-controllers hold shards", func() error {
		ma, _, err := s.held(a)
		if err != nil {
			return s.pause(err)
		}
		mb, _, err := s.held(b)
		if err == nil && (ma == 0 || mb == 0) {
			err = fmt.Errorf("a holds %d, b %d", ma, mb)
		}
		return s.pause(err)
	})
	first := s.change()
	s.top.Signal("nodespec-controller", syscall.SIGSTOP)
	// b and the controllers process (whose role includes the nodespec
	// controller's) take every shard.
	poll.UntilNil(t, 2*time.Minute, "the live members hold every nodespec shard", func() error {
		ma, all, err := s.held(a)
		if err != nil {
			return s.pause(err)
		}
		var others int
		err = s.db.QueryRow(t.Context(), `SELECT count(*) FROM leases WHERE name LIKE 'nodespec-controller/%'
			AND holder <> $1 AND expires_at > now()`, a).Scan(&others)
		if err == nil && (ma != 0 || others != all) {
			err = fmt.Errorf("a holds %d, the others %d of %d", ma, others, all)
		}
		return s.pause(err)
	})
	s.converged(first)
	s.roundTrip("fenced")

	var resumed time.Time
	if err := s.db.QueryRow(t.Context(), `SELECT clock_timestamp()`).Scan(&resumed); err != nil {
		t.Fatal(err)
	}
	s.top.Signal("nodespec-controller", syscall.SIGCONT)
	poll.UntilNil(t, time.Minute, "a heartbeats again", func() error {
		var beat time.Time
		err := s.db.QueryRow(t.Context(), `SELECT heartbeat_at FROM workers WHERE id = $1`, a).Scan(&beat)
		if err == nil && !beat.After(resumed) {
			err = errors.New("not yet")
		}
		return s.pause(err)
	})
	poll.Until(t, time.Minute, "a logs that it lost its leases", func() bool {
		if strings.Contains(s.top.Proc("nodespec-controller").Log(), "leases lost") {
			return true
		}
		time.Sleep(200 * time.Millisecond) // between reads, not an assertion
		return false
	})
	// Once the shards are split again, every write a made after resuming
	// comes after a lease it took after resuming.
	poll.UntilNil(t, time.Minute, "a holds shards again", func() error {
		ma, _, err := s.held(a)
		if err == nil && ma == 0 {
			err = errors.New("none yet")
		}
		return s.pause(err)
	})
	var firstLease *time.Time
	if err := s.db.QueryRow(t.Context(), `SELECT min(at) FROM chaos_writes WHERE tbl = 'leases:acquire' AND detail = $1 AND at > $2`,
		a, resumed).Scan(&firstLease); err != nil {
		t.Fatal(err)
	}
	if firstLease == nil {
		t.Fatal("a holds shards but took none after resuming")
	}
	rows, err := s.db.Query(t.Context(), `SELECT tbl, at FROM chaos_writes WHERE app = 'chaos-nodespec-controller'
		AND tbl IN ('nodes', 'outbox', 'commands') AND at > $1 AND at < $2 ORDER BY id`, resumed, *firstLease)
	if err != nil {
		t.Fatal(err)
	}
	type write struct {
		Tbl string
		At  time.Time
	}
	stale, err := pgx.CollectRows(rows, pgx.RowToStructByPos[write])
	if err != nil {
		t.Fatal(err)
	}
	if len(stale) > 0 {
		t.Fatalf("the resumed nodespec-controller wrote %d rows before it took a new lease (at %s): %+v", len(stale), firstLease, stale)
	}
	t.Logf("resumed at %s, first new lease %s after", resumed.Format(time.RFC3339Nano), firstLease.Sub(resumed))
	s.roundTrip("fence-back")
}
