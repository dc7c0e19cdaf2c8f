package dev_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/agent/command"
	"github.com/bettercompute/bettercompute/agent/sim"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/app"
	"github.com/bettercompute/bettercompute/services/dev"
)

// Kinds the control plane knows and the simulated daemons do not: the
// test registers them on the process's registry (the one the dev gateway,
// API and command-sweeper use), as a module would at start. Neither is on
// the API's allowlist.
const (
	// kindDaemonUnknown carries a diag.nvml payload under a name no daemon
	// knows: the daemon answers UNSUPPORTED.
	kindDaemonUnknown = "e2e.daemon-unknown"
	// kindShortTimeout times out one second after its deadline.
	kindShortTimeout = "e2e.short-timeout"
)

// testKinds is the built-in kinds and the two above: the control planes
// of these tests run with it, and the tests queue through it.
var testKinds = sync.OnceValue(func() *commands.Registry {
	r := commands.Builtin()
	r.MustRegister(commands.Kind{Name: kindDaemonUnknown, Field: "diag_nvml", RetrySafe: true,
		Lane: commands.LaneDiag, Timeout: time.Minute, Doc: "e2e: a kind the daemons do not know."})
	r.MustRegister(commands.Kind{Name: kindShortTimeout, Field: "diag_nvml",
		Lane: commands.LaneDiag, Timeout: time.Second, Doc: "e2e: a kind with a one-second timeout."})
	return r
})

// commandEnv starts a dev control plane (real PostgreSQL, embedded NATS)
// with no fleet of its own, short liveness and sweep intervals, and returns
// it with a pool on its database.
func commandEnv(t testing.TB, natsURL string) (*dev.Env, *pgxpool.Pool) {
	t.Helper()
	dbURL := pgtest.NewDB(t)
	env := commandEnvOn(t, dbURL, t.TempDir(), "127.0.0.1:0", natsURL, 100*time.Millisecond, 100*time.Millisecond)
	db, err := pgxpool.New(context.Background(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	return env, db
}

// commandEnvOn starts a dev control plane on db and dataDir, its gateway on
// gw, the bus at natsURL (empty: embedded under dataDir), with the gateway's
// liveness interval (its command resync) set to resync and the daemons'
// heartbeat to heartbeat.
func commandEnvOn(t testing.TB, db, dataDir, gw, natsURL string, resync, heartbeat time.Duration) *dev.Env {
	t.Helper()
	port, none := 0, 0
	cfg := &config.Config{
		Database: config.Database{URL: db},
		NATS:     config.NATS{URL: natsURL},
		Server:   config.Server{Host: "127.0.0.1", Port: &port},
		Dev:      config.Dev{DataDir: dataDir, SimNodes: &none},
		Gateway:  config.Gateway{Listen: gw, HeartbeatInterval: config.Duration(heartbeat), LivenessInterval: config.Duration(resync)},
		Runtime:  config.Runtime{PollBusDown: config.Duration(50 * time.Millisecond)},
		Commands: config.Commands{SweepInterval: config.Duration(100 * time.Millisecond)},
	}
	cfg.Defaults()
	env, err := dev.StartWith(context.Background(), cfg, app.Options{Kinds: testKinds()})
	if err != nil {
		t.Fatal(err)
	}
	return env
}

// simFleet joins n simulated daemons to a new pool named name, pinning the
// control plane's command-signing key unless mod clears it, and waits until
// every one holds a session and applied its first generation. mod adjusts
// the fleet's configuration. The fleet stops at the end of the test.
func simFleet(t testing.TB, env *dev.Env, db *pgxpool.Pool, name string, n int, mod func(*sim.Config)) *sim.Fleet {
	t.Helper()
	f, _ := simFleetConfig(t, env, db, name, n, mod)
	return f
}

// simFleetConfig is simFleet that also returns the fleet's configuration,
// to start the same nodes again after a Stop (see startFleet).
func simFleetConfig(t testing.TB, env *dev.Env, db *pgxpool.Pool, name string, n int, mod func(*sim.Config)) (*sim.Fleet, sim.Config) {
	t.Helper()
	var pool struct{ Pool struct{ ID string } }
	call(t, env, "pools/create", map[string]any{"tenantId": "root", "name": name, "class": "gpu", "idempotencyKey": "pool-" + name}, &pool)
	var tok struct{ Token string }
	call(t, env, "joinTokens/create", map[string]any{"tenantId": "root", "poolId": pool.Pool.ID, "uses": n, "idempotencyKey": "token-" + name}, &tok)
	pub, keyID, roots := joinMaterial(t, env)
	cfg := sim.Config{
		Gateway: env.App.GatewayAddr(), RootCAs: roots, Token: tok.Token,
		JoinserviceKey: pub, JoinserviceKeyID: keyID, Root: filepath.Join(t.TempDir(), name), Prefix: name,
		CommandKey: env.CommandKey, JoinConcurrency: 64,
	}
	if mod != nil {
		mod(&cfg)
	}
	return startFleet(t, db, cfg, n, 1), cfg
}

// startFleet starts n simulated daemons on cfg (joining those without an
// identity) and waits until every one holds a session of at least epoch
// and applied its desired state. The fleet stops at the end of the test.
func startFleet(t testing.TB, db *pgxpool.Pool, cfg sim.Config, n int, epoch int64) *sim.Fleet {
	t.Helper()
	f, err := sim.Start(context.Background(), cfg, n)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Stop)
	poll.Until(t, 2*time.Minute+time.Duration(n)*100*time.Millisecond, "fleet "+cfg.Prefix+" connected and converged", func() bool {
		var ready int
		err := db.QueryRow(context.Background(), `SELECT count(*) FROM nodes WHERE id = ANY($1) AND session_epoch >= $2
			AND observed_generation >= 1 AND observed_generation = generation`, f.Nodes(), epoch).Scan(&ready)
		return err == nil && ready == n
	})
	return f
}

// waitFor is [poll.Until], under the name commands_bench_test.go calls.
func waitFor(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	poll.Until(t, within, what, cond)
}

// cmdJSON is a command as the REST API answers it.
type cmdJSON struct {
	ID, NodeID, Kind, State, Reason, Seq string
	MinGeneration                        string
	Attempts                             int
	CancelRequestedTime, DispatchTime    string
	FinishTime                           string
	Result                               map[string]any
}

func (c cmdJSON) final() bool { return c.State != "pending" && c.State != "in_flight" }

// post calls an API method and returns its status and decoded body.
func post(t testing.TB, env *dev.Env, method string, body any) (int, []byte) {
	t.Helper()
	b, _ := json.Marshal(body)
	req, _ := http.NewRequestWithContext(context.Background(), http.MethodPost, env.BaseURL()+"/api/compute/"+method, strings.NewReader(string(b)))
	req.Header.Set("Authorization", "Bearer "+env.Credential)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	raw, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, raw
}

// runReq is a commands.run request body.
func runReq(node, kind string, payload map[string]any, key string) map[string]any {
	r := map[string]any{"tenantId": "root", "nodeId": node, "kind": kind, "idempotencyKey": key}
	if payload != nil {
		r["payload"] = payload
	}
	return r
}

// runCmd queues a command through commands.run.
func runCmd(t testing.TB, env *dev.Env, node, kind string, payload map[string]any, key string) cmdJSON {
	t.Helper()
	var out struct{ Command cmdJSON }
	call(t, env, "commands/run", runReq(node, kind, payload, key), &out)
	if out.Command.ID == "" || out.Command.Kind != kind {
		t.Fatalf("commands.run answered %+v", out.Command)
	}
	return out.Command
}

// getCmd reads a command through commands.get.
func getCmd(t testing.TB, env *dev.Env, node, id string) cmdJSON {
	t.Helper()
	var out struct{ Command cmdJSON }
	call(t, env, "commands/get", map[string]any{"tenantId": "root", "nodeId": node, "commandId": id}, &out)
	return out.Command
}

// cancelCmd cancels a command through commands.cancel.
func cancelCmd(t testing.TB, env *dev.Env, node, id string) cmdJSON {
	t.Helper()
	var out struct{ Command cmdJSON }
	call(t, env, "commands/cancel", map[string]any{"tenantId": "root", "nodeId": node, "commandId": id}, &out)
	return out.Command
}

// waitFinal waits until the command is in a final state and returns it.
func waitFinal(t testing.TB, env *dev.Env, node, id string) cmdJSON {
	t.Helper()
	var c cmdJSON
	poll.Until(t, 30*time.Second, "command "+id+" to finish", func() bool {
		c = getCmd(t, env, node, id)
		return c.final()
	})
	return c
}

// wantFinal waits for the command's final state and checks it and its
// reason (a prefix; "" for none).
func wantFinal(t testing.TB, env *dev.Env, node, id, state, reason string) cmdJSON {
	t.Helper()
	c := waitFinal(t, env, node, id)
	if c.State != state || !strings.HasPrefix(c.Reason, reason) || (reason == "" && c.Reason != "") {
		t.Fatalf("command %s (%s) ended %s %q, want %s %q", id, c.Kind, c.State, c.Reason, state, reason)
	}
	return c
}

// enqueue queues a command through pkg/commands in a transaction, for what
// the API cannot express (kinds outside its allowlist, a deadline under
// ten seconds).
func enqueue(t testing.TB, db *pgxpool.Pool, req commands.Request) commands.Command {
	t.Helper()
	var c commands.Command
	err := pgx.BeginFunc(context.Background(), db, func(tx pgx.Tx) error {
		var err error
		c, _, err = testKinds().Enqueue(context.Background(), tx, req)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// dbCmd reads a command's row.
func dbCmd(t testing.TB, db *pgxpool.Pool, node, id string) commands.Command {
	t.Helper()
	c, err := commands.Lookup(context.Background(), db, node, id)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// journalEntry reads the daemon's journal entry of seq under root, nil when
// there is none.
func journalEntry(t testing.TB, root string, seq string) map[string]any {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, command.JournalDir, "cmd-"+seq+".json"))
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

// hooks replace diag.nvml on a fleet's daemons: the payload's level names
// the run, every run is counted by level, and a level "gate:<name>" blocks
// until the gate opens or the command ends (cancelled, daemon stopped).
// Their result's driverVersion is the level, so a test can tell its runs.
type hooks struct {
	mu    sync.Mutex
	runs  map[string]int
	gates map[string]chan struct{}
}

func newHooks() *hooks { return &hooks{runs: map[string]int{}, gates: map[string]chan struct{}{}} }

func (h *hooks) gate(level string) chan struct{} {
	g, ok := h.gates[level]
	if !ok {
		g = make(chan struct{})
		h.gates[level] = g
	}
	return g
}

func (h *hooks) diag(ctx context.Context, body *agentv1.CommandBody) (*agentv1.CommandResult, error) {
	level := body.GetDiagNvml().GetLabel()
	h.mu.Lock()
	h.runs[level]++
	g := h.gate(level)
	h.mu.Unlock()
	if strings.HasPrefix(level, "gate:") {
		select {
		case <-g:
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		}
	}
	return &agentv1.CommandResult{Kind: &agentv1.CommandResult_DiagNvml{DiagNvml: &agentv1.DiagNvmlResult{DriverVersion: level}}}, nil
}

// open lets every run of level through, now and later.
func (h *hooks) open(level string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	close(h.gate(level))
}

// count is how many times level ran.
func (h *hooks) count(level string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.runs[level]
}

// install puts the hooks on a fleet's configuration.
func (h *hooks) install(c *sim.Config) {
	c.Executors = map[string]command.Func{command.KindDiagNvml: h.diag}
}

// diagLevel is a diag.nvml payload with a level.
func diagLevel(level string) map[string]any { return map[string]any{"label": level} }

// nodeGeneration reads a node's desired-state generation.
func nodeGeneration(t testing.TB, db *pgxpool.Pool, node string) int64 {
	t.Helper()
	var g int64
	if err := db.QueryRow(context.Background(), `SELECT generation FROM nodes WHERE id = $1`, node).Scan(&g); err != nil {
		t.Fatal(err)
	}
	return g
}

// TestCommandsChecksEndToEnd drives every daemon check, in order, through
// the real control plane to real simulated daemons, and each kind's result
// through commands.get.
func TestCommandsChecksEndToEnd(t *testing.T) {
	t.Parallel()
	env, db := commandEnv(t, "")
	defer env.Stop(context.Background())
	h := newHooks()
	plain := simFleet(t, env, db, "real", 1, nil)
	hooked := simFleet(t, env, db, "hooked", 1, h.install)
	nokey := simFleet(t, env, db, "nokey", 1, func(c *sim.Config) { c.CommandKey = nil })
	node, hnode := plain.Nodes()[0], hooked.Nodes()[0]

	t.Run("the API refuses a kind outside its allowlist: UNSUPPORTED on kind", func(t *testing.T) {
		for _, kind := range []string{"gpu.reset", "no.such-kind", kindDaemonUnknown} {
			status, raw := post(t, env, "commands/run", runReq(node, kind, nil, "unsupported-"+kind))
			var e struct{ Code, Field string }
			_ = json.Unmarshal(raw, &e)
			if status == http.StatusOK || e.Code != "UNSUPPORTED" || e.Field != "kind" {
				t.Fatalf("commands.run kind %s: %d %s", kind, status, raw)
			}
		}
	})

	t.Run("a kind the control plane knows but the daemon does not fails UNSUPPORTED, journaled", func(t *testing.T) {
		c := enqueue(t, db, commands.Request{NodeID: node, Kind: kindDaemonUnknown, NotAfter: time.Now().Add(time.Minute)})
		got := wantFinal(t, env, node, c.ID, "failed", "UNSUPPORTED")
		if got.Attempts != 1 {
			t.Fatalf("attempts %d, want 1", got.Attempts)
		}
		if en := journalEntry(t, plain.Root(0), got.Seq); en == nil || en["reject"] != "REJECT_CODE_UNSUPPORTED" {
			t.Fatalf("journal entry of seq %s: %v", got.Seq, en)
		}
	})

	// A command for another node: the control plane cannot misroute one
	// (the gateway finds the session by the command's node_id and the
	// daemon's certificate names the node), so it is not faked here;
	// agent/command TestChecks "UNSUPPORTED: another node, not journaled"
	// covers the daemon's check.

	// min generation ahead, then reached in time or still ahead at
	// not_after: TestMinGenerationReachedInTimeRuns and
	// TestMinGenerationAheadOfSpecEndsStaleGeneration, through commands.run.

	t.Run("a held command (min generation ahead) cancelled through the API never runs", func(t *testing.T) {
		gen := nodeGeneration(t, db, hnode)
		c := enqueue(t, db, commands.Request{NodeID: hnode, Kind: "diag.nvml", Payload: diagLevel("held-cancelled"),
			NotAfter: time.Now().Add(time.Minute), MinGeneration: gen + 5})
		poll.Until(t, 30*time.Second, "the command sent", func() bool { return dbCmd(t, db, hnode, c.ID).DispatchedAt != nil })
		cancelCmd(t, env, hnode, c.ID)
		wantFinal(t, env, hnode, c.ID, "cancelled", "cancel")
		if h.count("held-cancelled") != 0 {
			t.Fatal("a cancelled held command ran")
		}
	})

	// EXPIRED from the daemon: the gateway never sends a command past its
	// not_after (Claim skips it; the sweeper expires it, see
	// TestCommandsLifecycleEndToEnd), so the daemon's own check only fires
	// on a clock race; agent/command TestChecks "EXPIRED past not_after"
	// covers it.

	t.Run("a full lane answers BUSY: the command backs off, is sent again and runs", func(t *testing.T) {
		first := runCmd(t, env, hnode, "diag.nvml", diagLevel("gate:lane"), "busy-first")
		poll.Until(t, 30*time.Second, "the first diag running", func() bool { return h.count("gate:lane") == 1 })
		second := runCmd(t, env, hnode, "diag.nvml", diagLevel("after-busy"), "busy-second")
		poll.Until(t, 30*time.Second, "the second diag rejected BUSY", func() bool { return dbCmd(t, db, hnode, second.ID).BusyCount >= 1 })
		h.open("gate:lane")
		wantFinal(t, env, hnode, first.ID, "succeeded", "")
		got := wantFinal(t, env, hnode, second.ID, "succeeded", "")
		if got.Attempts < 2 || h.count("after-busy") != 1 || h.count("gate:lane") != 1 {
			t.Fatalf("second: attempts %d; runs %d and %d", got.Attempts, h.count("after-busy"), h.count("gate:lane"))
		}
	})

	var nokeyReboot string // the command id of the next subtest's reboot
	t.Run("node.reboot on a daemon without the pinned key fails BAD_SIGNATURE and does not reboot", func(t *testing.T) {
		boot := nokey.BootID(0)
		c := runCmd(t, env, nokey.Nodes()[0], "node.reboot", map[string]any{"reason": "e2e"}, "reboot-unsigned")
		nokeyReboot = c.ID
		wantFinal(t, env, nokey.Nodes()[0], c.ID, "failed", "BAD_SIGNATURE")
		if nokey.BootID(0) != boot {
			t.Fatal("the daemon rebooted")
		}
	})

	t.Run("the gateway cannot forge destructive commands: a node.reboot row written straight into commands fails BAD_SIGNATURE on the real agent and does not reboot", func(t *testing.T) {
		// What a compromised gateway or database writer can do: write a
		// destructive command, unsigned, or with the valid signature of
		// another command (the api signed reboot-unsigned at admission).
		other := dbCmd(t, db, nokey.Nodes()[0], nokeyReboot)
		if len(other.Signature) == 0 {
			t.Fatal("the api did not sign node.reboot at admission")
		}
		boot := plain.BootID(0)
		for _, f := range []struct {
			id  string
			sig []byte
			key string
		}{{"cmd_forged_unsigned", nil, ""}, {"cmd_forged_replayed", other.Signature, other.KeyID}} {
			if _, err := db.Exec(context.Background(), `
				WITH s AS (UPDATE nodes SET next_cmd_seq = next_cmd_seq + 1 WHERE id = $2 RETURNING next_cmd_seq - 1 AS seq, tenant_id)
				INSERT INTO commands (id, tenant_id, node_id, seq, kind, payload, idempotency_key, not_after, timeout_ms, signature, key_id)
				SELECT $1, s.tenant_id, $2, s.seq, 'node.reboot', $3, $1, now() + interval '1 minute', $4, $5, $6 FROM s`,
				f.id, node, other.Payload, other.Timeout.Milliseconds(), f.sig, f.key); err != nil {
				t.Fatal(err)
			}
			wantFinal(t, env, node, f.id, "failed", "BAD_SIGNATURE")
		}
		if plain.BootID(0) != boot {
			t.Fatal("the daemon rebooted on a forged command")
		}
	})

	t.Run("diag.nvml reports each GPU through commands.get", func(t *testing.T) {
		c := runCmd(t, env, node, "diag.nvml", nil, "diag-all")
		got := wantFinal(t, env, node, c.ID, "succeeded", "")
		var res struct {
			Gpus []struct {
				UUID    string
				Healthy bool
			}
		}
		b, _ := json.Marshal(got.Result)
		_ = json.Unmarshal(b, &res)
		if len(res.Gpus) != 8 {
			t.Fatalf("result %s", b)
		}
		for _, g := range res.Gpus {
			if !strings.HasPrefix(g.UUID, "GPU-") || !g.Healthy {
				t.Fatalf("GPU %+v in %s", g, b)
			}
		}
		// An unknown GPU fails the command, with the result attached.
		c = runCmd(t, env, node, "diag.nvml", map[string]any{"gpuUuids": []string{"GPU-nope"}}, "diag-unknown")
		got = wantFinal(t, env, node, c.ID, "failed", "1 of 1 GPUs unhealthy")
		if gpus, _ := got.Result["gpus"].([]any); len(gpus) != 1 {
			t.Fatalf("failed diag: %+v", got)
		}
	})

	t.Run("inventory.refresh re-collects and reports the inventory on the session", func(t *testing.T) {
		var before time.Time
		if err := db.QueryRow(context.Background(), `SELECT received_at FROM node_inventory WHERE node_id = $1`, node).Scan(&before); err != nil {
			t.Fatal(err)
		}
		c := runCmd(t, env, node, "inventory.refresh", map[string]any{"sections": []string{"gpus"}, "rescan": true}, "refresh")
		wantFinal(t, env, node, c.ID, "succeeded", "")
		poll.Until(t, 30*time.Second, "the refreshed inventory stored", func() bool {
			var after time.Time
			_ = db.QueryRow(context.Background(), `SELECT received_at FROM node_inventory WHERE node_id = $1`, node).Scan(&after)
			return after.After(before)
		})
	})

	t.Run("logs.collect returns the daemon's log tail through commands.get, bounded", func(t *testing.T) {
		c := runCmd(t, env, node, "logs.collect", map[string]any{"maxBytes": 300}, "logs-small")
		got := wantFinal(t, env, node, c.ID, "succeeded", "")
		data, _ := base64.StdEncoding.DecodeString(fmt.Sprint(got.Result["data"]))
		if len(data) == 0 || len(data) > 300 || got.Result["truncated"] != true {
			t.Fatalf("logs: %d bytes, truncated %v", len(data), got.Result["truncated"])
		}
		c = runCmd(t, env, node, "logs.collect", nil, "logs-all")
		got = wantFinal(t, env, node, c.ID, "succeeded", "")
		data, _ = base64.StdEncoding.DecodeString(fmt.Sprint(got.Result["data"]))
		if !strings.Contains(string(data), "command accepted") || got.Result["truncated"] == true {
			t.Fatalf("logs: truncated %v, %d bytes", got.Result["truncated"], len(data))
		}
	})

	t.Run("a signed node.reboot restarts the daemon with a new boot id and succeeds", func(t *testing.T) {
		boot := plain.BootID(0)
		c := runCmd(t, env, node, "node.reboot", map[string]any{"reason": "e2e"}, "reboot-signed")
		got := wantFinal(t, env, node, c.ID, "succeeded", commands.ReasonRebooted)
		if plain.BootID(0) == boot {
			t.Fatal("boot id unchanged")
		}
		var stored string
		_ = db.QueryRow(context.Background(), `SELECT boot_id FROM nodes WHERE id = $1`, node).Scan(&stored)
		if stored != plain.BootID(0) || got.Attempts != 1 {
			t.Fatalf("stored boot %q, daemon %q, attempts %d", stored, plain.BootID(0), got.Attempts)
		}
	})
}

// TestCommandsLifecycleEndToEnd covers idempotency, expiry, cancel in each
// state, the sweeper's timeout, duplicate delivery and journal loss with
// the real agent.
func TestCommandsLifecycleEndToEnd(t *testing.T) {
	t.Parallel()
	env, db := commandEnv(t, "")
	defer env.Stop(context.Background())
	// The offline node joins, then its daemon stops; the gateway drops
	// its session as the stream ends, long before the next fleet has
	// joined and converged.
	offline := simFleet(t, env, db, "away", 1, nil)
	offline.Stop()
	h := newHooks()
	var reboots [2]atomic.Int64 // reboot hook calls per daemon
	hooked := simFleet(t, env, db, "life", 2, func(c *sim.Config) {
		h.install(c)
		// A reboot that never comes: node.reboot stays accepted.
		c.RebootHook = func(ctx context.Context, i int, _ string) error {
			reboots[i].Add(1)
			<-ctx.Done()
			return ctx.Err()
		}
	})
	node, away := hooked.Nodes()[0], offline.Nodes()[0]

	t.Run("the same idempotency key returns the same command; another body under it is CONFLICT", func(t *testing.T) {
		a := runCmd(t, env, node, "inventory.refresh", map[string]any{"sections": []string{"gpus"}}, "idem")
		b := runCmd(t, env, node, "inventory.refresh", map[string]any{"sections": []string{"gpus"}}, "idem")
		if a.ID != b.ID || a.Seq != b.Seq {
			t.Fatalf("replay made another command: %s/%s vs %s/%s", a.ID, a.Seq, b.ID, b.Seq)
		}
		status, raw := post(t, env, "commands/run", runReq(node, "inventory.refresh", map[string]any{"rescan": true}, "idem"))
		var e struct{ Code string }
		_ = json.Unmarshal(raw, &e)
		if status == http.StatusOK || e.Code != "CONFLICT" {
			t.Fatalf("another body under the key: %d %s", status, raw)
		}
		wantFinal(t, env, node, a.ID, "succeeded", "")
		// pkg/commands: a repeat of the key returns the existing command.
		x := enqueue(t, db, commands.Request{NodeID: node, Kind: "diag.nvml", IdempotencyKey: "module-key", Payload: diagLevel("idem"), NotAfter: time.Now().Add(time.Minute)})
		y := enqueue(t, db, commands.Request{NodeID: node, Kind: "diag.nvml", IdempotencyKey: "module-key", Payload: diagLevel("idem"), NotAfter: time.Now().Add(time.Minute)})
		if x.ID != y.ID {
			t.Fatalf("Enqueue repeat: %s then %s", x.ID, y.ID)
		}
		wantFinal(t, env, node, x.ID, "succeeded", "")
		if h.count("idem") != 1 {
			t.Fatalf("ran %d times", h.count("idem"))
		}
	})

	t.Run("a pending command past notAfter on an offline node expires", func(t *testing.T) {
		c := enqueue(t, db, commands.Request{NodeID: away, Kind: "diag.nvml", NotAfter: time.Now().Add(time.Second)})
		got := wantFinal(t, env, away, c.ID, "expired", commands.ReasonExpired)
		if got.Attempts != 0 || got.DispatchTime != "" {
			t.Fatalf("an offline node's command was sent: %+v", got)
		}
	})

	t.Run("cancel: pending becomes cancelled and is never sent", func(t *testing.T) {
		c := runCmd(t, env, away, "diag.nvml", nil, "cancel-pending")
		if c.State != "pending" {
			t.Fatalf("state %s", c.State)
		}
		got := cancelCmd(t, env, away, c.ID)
		if got.State != "cancelled" {
			t.Fatalf("cancel answered %+v", got)
		}
		got = getCmd(t, env, away, c.ID)
		if got.State != "cancelled" || got.Attempts != 0 || got.DispatchTime != "" {
			t.Fatalf("cancelled pending command: %+v", got)
		}
	})

	t.Run("commands.list shows a node's commands newest first, by state", func(t *testing.T) {
		var all, cancelled struct{ Commands []cmdJSON }
		call(t, env, "commands/list", map[string]any{"tenantId": "root", "nodeId": away}, &all)
		call(t, env, "commands/list", map[string]any{"tenantId": "root", "nodeId": away, "state": "cancelled"}, &cancelled)
		if len(all.Commands) != 2 || all.Commands[0].State != "cancelled" || all.Commands[1].State != "expired" {
			t.Fatalf("list: %+v", all.Commands)
		}
		if len(cancelled.Commands) != 1 || cancelled.Commands[0].ID != all.Commands[0].ID {
			t.Fatalf("list of cancelled: %+v", cancelled.Commands)
		}
	})

	t.Run("cancel: an in-flight command is cancelled on the daemon", func(t *testing.T) {
		c := runCmd(t, env, node, "diag.nvml", diagLevel("gate:never"), "cancel-inflight")
		poll.Until(t, 30*time.Second, "the diag running", func() bool { return h.count("gate:never") == 1 })
		got := cancelCmd(t, env, node, c.ID)
		if got.State != "in_flight" || got.CancelRequestedTime == "" {
			t.Fatalf("cancel answered %+v", got)
		}
		wantFinal(t, env, node, c.ID, "cancelled", "cancelled")
		if en := journalEntry(t, hooked.Root(0), got.Seq); en == nil || en["state"] != "cancelled" {
			t.Fatalf("journal: %v", en)
		}
	})

	t.Run("cancel: a finished command is returned unchanged", func(t *testing.T) {
		c := runCmd(t, env, node, "diag.nvml", diagLevel("done"), "cancel-finished")
		done := wantFinal(t, env, node, c.ID, "succeeded", "")
		got := cancelCmd(t, env, node, c.ID)
		if got.State != "succeeded" || got.CancelRequestedTime != "" || got.FinishTime != done.FinishTime {
			t.Fatalf("cancel changed a finished command: %+v", got)
		}
	})

	// A command claimed just before its node dropped (its send lost) and
	// cancelled while the node is away must not run when the node returns:
	// the gateway sends it Cancel, never the command again.
	t.Run("cancel: an in-flight command cancelled while its node is away never runs", func(t *testing.T) {
		hb := newHooks()
		back, cfg := simFleetConfig(t, env, db, "back", 1, hb.install)
		bnode := back.Nodes()[0]
		back.Stop()
		c := enqueue(t, db, commands.Request{NodeID: bnode, Kind: "diag.nvml", Payload: diagLevel("cancelled-away"), NotAfter: time.Now().Add(time.Minute)})
		var epoch int64
		if err := db.QueryRow(context.Background(), `SELECT session_epoch FROM nodes WHERE id = $1`, bnode).Scan(&epoch); err != nil {
			t.Fatal(err)
		}
		claimed, err := commands.Claim(context.Background(), db, bnode, epoch)
		if err != nil {
			t.Fatal(err)
		}
		// A gateway that has not yet seen the node leave may claim it
		// first (its resync): its send is lost the same way.
		if len(claimed) != 1 {
			if st := dbCmd(t, db, bnode, c.ID).State; st != commands.InFlight {
				t.Fatalf("claim: %v, and the command is %s", claimed, st)
			}
		}
		if got := cancelCmd(t, env, bnode, c.ID); got.State != "in_flight" || got.CancelRequestedTime == "" {
			t.Fatalf("cancel answered %+v", got)
		}
		back = startFleet(t, db, cfg, 1, epoch+1)
		wantFinal(t, env, bnode, c.ID, "cancelled", "cancel")
		if hb.count("cancelled-away") != 0 {
			t.Fatalf("a cancelled command ran %d times", hb.count("cancelled-away"))
		}
		back.Stop()
	})

	// The sweeper's timeout fails an in-flight command past not_after plus
	// its kind's timeout. Every kind a daemon runs has minutes of timeout,
	// so this uses e2e.short-timeout (one second) on the offline node,
	// claimed as a gateway would just before the node dropped (its send
	// lost): the plain command-sweeper job must fail it.
	t.Run("sweeper: in flight past notAfter plus the timeout fails with timeout", func(t *testing.T) {
		c := enqueue(t, db, commands.Request{NodeID: away, Kind: kindShortTimeout, NotAfter: time.Now().Add(time.Second)})
		var epoch int64
		if err := db.QueryRow(context.Background(), `SELECT session_epoch FROM nodes WHERE id = $1`, away).Scan(&epoch); err != nil {
			t.Fatal(err)
		}
		claimed, err := commands.Claim(context.Background(), db, away, epoch)
		if err != nil || len(claimed) != 1 || claimed[0].ID != c.ID {
			t.Fatalf("claim: %v %v", claimed, err)
		}
		wantFinal(t, env, away, c.ID, "failed", commands.ReasonTimeout)
	})

	t.Run("duplicate delivery: a daemon restarted mid-command answers the re-sent seq from its journal", func(t *testing.T) {
		c := runCmd(t, env, node, "diag.nvml", diagLevel("gate:dup"), "dup")
		poll.Until(t, 30*time.Second, "the diag running", func() bool { return h.count("gate:dup") == 1 })
		hooked.Restart(0, false) // same boot, same journal
		h.open("gate:dup")       // a second run would now finish at once
		got := wantFinal(t, env, node, c.ID, "failed", command.InterruptedReason[:len("interrupted")])
		if h.count("gate:dup") != 1 {
			t.Fatalf("the re-sent seq ran %d times", h.count("gate:dup"))
		}
		if en := journalEntry(t, hooked.Root(0), got.Seq); en == nil || en["state"] != "failed" {
			t.Fatalf("journal: %v", en)
		}
	})

	t.Run("journal lost: an in-flight retry-safe command is sent again and succeeds", func(t *testing.T) {
		c := runCmd(t, env, hooked.Nodes()[1], "diag.nvml", diagLevel("gate:lost"), "lost-safe")
		poll.Until(t, 30*time.Second, "the diag running", func() bool { return h.count("gate:lost") == 1 })
		hooked.WipeJournal(1)
		h.open("gate:lost")
		got := wantFinal(t, env, hooked.Nodes()[1], c.ID, "succeeded", "")
		if got.Attempts < 2 || h.count("gate:lost") != 2 {
			t.Fatalf("attempts %d, runs %d", got.Attempts, h.count("gate:lost"))
		}
	})

	t.Run("journal lost: an in-flight node.reboot (not retry-safe) fails journal-lost", func(t *testing.T) {
		n1 := hooked.Nodes()[1]
		boot := hooked.BootID(1)
		c := runCmd(t, env, n1, "node.reboot", map[string]any{"reason": "e2e"}, "lost-reboot")
		poll.Until(t, 30*time.Second, "the reboot under way", func() bool {
			return reboots[1].Load() == 1 && dbCmd(t, db, n1, c.ID).AcceptedAt != nil
		})
		hooked.WipeJournal(1)
		wantFinal(t, env, n1, c.ID, "failed", commands.ReasonJournalLost)
		if hooked.BootID(1) != boot {
			t.Fatal("boot id changed")
		}
		if n := reboots[1].Load(); n != 1 {
			t.Fatalf("reboot hook called %d times", n)
		}
	})
}
