package metal_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/agent/join"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/natstest"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/app"
	"github.com/bettercompute/bettercompute/services/dev"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// The flow's tests run the whole control plane (services/dev: every role,
// embedded NATS, real PostgreSQL), the real site agent (agent/site with
// its PXE HTTP server on loopback) and fake Redfish BMCs whose power-on
// fetches the machine's iPXE script from that server and runs the real
// agent: bcd ramdisk's code (mock NVML, file disks) after a PXE boot, the
// installed system (bcd join with the token from the cloud-init seed image.deploy
// wrote) after a disk boot.

const bmcPassword = "Bmc-Pw-4f81c2-never-shown"

type env struct {
	*dev.Env
	db    *pgxpool.Pool
	logs  *logBuffer
	roots *x509.CertPool
	pub   []byte
	keyID string
	sim   *dev.SimSite
	site  string
	pool  string
}

type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func start(t *testing.T, edit func(*config.Config)) *env {
	return startWith(t, edit, app.Options{})
}

func startWith(t *testing.T, edit func(*config.Config), opts app.Options) *env {
	t.Helper()
	port := 0
	none := 0
	cfg := &config.Config{
		Database: config.Database{URL: pgtest.NewDB(t)},
		Server:   config.Server{Host: "127.0.0.1", Port: &port},
		Dev:      config.Dev{DataDir: t.TempDir(), SimNodes: &none},
		Gateway:  config.Gateway{Listen: "127.0.0.1:0", HeartbeatInterval: config.Duration(200 * time.Millisecond), LivenessInterval: config.Duration(200 * time.Millisecond)},
		Runtime:  config.Runtime{PollBusDown: config.Duration(50 * time.Millisecond), Poll: config.Duration(200 * time.Millisecond)},
		Metal:    config.Metal{Resync: config.Duration(300 * time.Millisecond)},
	}
	if edit != nil {
		edit(cfg)
	}
	cfg.Defaults()
	logs := &logBuffer{}
	opts.Logger = slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	e, err := dev.StartWith(context.Background(), cfg, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Stop(context.Background()) })
	db, err := pgxpool.New(context.Background(), cfg.Database.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	out := &env{Env: e, db: db, logs: logs}
	keyPEM, err := os.ReadFile(e.JoinKeyFile)
	if err != nil {
		t.Fatal(err)
	}
	if out.pub, out.keyID, err = join.ParsePublicKey(keyPEM); err != nil {
		t.Fatal(err)
	}
	caPEM, err := os.ReadFile(e.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	out.roots = x509.NewCertPool()
	out.roots.AppendCertsFromPEM(caPEM)
	return out
}

func (e *env) call(t *testing.T, method string, body any) map[string]any {
	t.Helper()
	b, _ := json.Marshal(body)
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, e.BaseURL()+"/api/compute/"+method, bytes.NewReader(b))
	req.Header.Set("Authorization", "Bearer "+e.Credential)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s: %d %s", method, resp.StatusCode, raw)
	}
	var out map[string]any
	if err := json.Unmarshal(raw, &out); err != nil {
		t.Fatalf("%s: %v", method, err)
	}
	return out
}

func field(m map[string]any, path ...string) string {
	var cur any = m
	for _, p := range path {
		mm, _ := cur.(map[string]any)
		cur = mm[p]
	}
	s, _ := cur.(string)
	return s
}

// startSite creates a site and a pool, and runs one real site agent with
// PXE (its HTTP server on loopback) holding the site's boot lease: the
// simulated site of services/dev, which `make run` runs too.
func (e *env) startSite(t *testing.T) {
	t.Helper()
	e.site = field(e.call(t, "sites/create", map[string]any{"tenantId": "root", "name": "fra1"}), "site", "id")
	e.pool = field(e.call(t, "pools/create", map[string]any{"tenantId": "root", "name": "metal", "class": "gpu"}), "pool", "id")
	tok := field(e.call(t, "sites/createToken", map[string]any{"tenantId": "root", "siteId": e.site}), "token")
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	s, err := dev.StartSimSite(ctx, dev.SimSiteConfig{Gateway: e.App.GatewayAddr(), RootCAs: e.roots, JoinserviceKey: e.pub,
		JoinserviceKeyID: e.keyID, CommandKey: e.CommandKey, Token: tok, Root: t.TempDir(), Hostname: "site-1",
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	e.sim = s
}

// machine is a simulated server (services/dev's): a fake BMC and file
// disks.
type machine struct{ *dev.SimMachine }

func (e *env) newMachine(t *testing.T, i int, imgClient *http.Client) *machine {
	t.Helper()
	m, err := e.sim.AddMachine(dev.SimMachineConfig{Name: fmt.Sprintf("m%d", i), MAC: fmt.Sprintf("02:00:00:00:00:%02x", i+1),
		SystemID: fmt.Sprintf("sys-%d", i), SerialNumber: fmt.Sprintf("SN-%d", i), Username: "admin", Password: bmcPassword,
		ImageClient: imgClient, OnError: func(err error) { t.Logf("machine %d: %v", i, err) }})
	if err != nil {
		t.Fatal(err)
	}
	return &machine{m}
}

func (e *env) enroll(t *testing.T, m *machine, name string) (id, node string) {
	t.Helper()
	out := e.call(t, "metal/enroll", map[string]any{"tenantId": "root", "siteId": e.site, "poolId": e.pool, "name": name,
		"bmc": map[string]any{"address": m.BMC.URL, "username": "admin", "password": bmcPassword}})
	return field(out, "machine", "id"), field(out, "machine", "nodeId")
}

func (e *env) machineState(t *testing.T, id string) (string, string) {
	t.Helper()
	var st, reason string
	if err := e.db.QueryRow(t.Context(), `SELECT state, failed_reason FROM machines WHERE id = $1`, id).Scan(&st, &reason); err != nil {
		t.Fatal(err)
	}
	return st, reason
}

func (e *env) waitState(t *testing.T, id, want string, d time.Duration) {
	t.Helper()
	// While it waits, every 20 s it logs where the machine is (its step,
	// attempts and deadline, its newest site task and command), so a
	// timeout says where the flow stalled.
	last := time.Now()
	poll.Until(t, d, "machine "+id+" "+want, func() bool {
		if time.Since(last) > 20*time.Second {
			last = time.Now()
			e.logFlow(t, id)
		}
		st, reason := e.machineState(t, id)
		if st == "failed" && want != "failed" {
			t.Fatalf("machine %s failed: %s", id, reason)
		}
		return st == want
	})
}

// logFlow logs machine id's step and its newest site task and command.
func (e *env) logFlow(t *testing.T, id string) {
	t.Helper()
	var st, purpose, boot, node, reason string
	var attempts int
	var deadline *time.Time
	var now time.Time
	_ = e.db.QueryRow(t.Context(), `SELECT state, purpose, boot, node_id, step_attempts, step_deadline, failed_reason, now()
		FROM machines WHERE id = $1`, id).Scan(&st, &purpose, &boot, &node, &attempts, &deadline, &reason, &now)
	var task, cmd string
	_ = e.db.QueryRow(t.Context(), `SELECT coalesce(string_agg(kind||' '||state||' a='||attempts||' '||error, '; ' ORDER BY created_at DESC), '')
		FROM (SELECT * FROM site_tasks WHERE machine_id = $1 ORDER BY created_at DESC LIMIT 3) x`, id).Scan(&task)
	_ = e.db.QueryRow(t.Context(), `SELECT coalesce(string_agg(kind||' '||state||' '||reason, '; ' ORDER BY created_at DESC), '')
		FROM (SELECT * FROM commands WHERE node_id = $1 ORDER BY created_at DESC LIMIT 3) x`, node).Scan(&cmd)
	var ready, seen string
	_ = e.db.QueryRow(t.Context(), `SELECT ready, coalesce(to_char(last_seen_at, 'HH24:MI:SS.MS'), '') FROM nodes WHERE id = $1`, node).Scan(&ready, &seen)
	t.Logf("machine %s: %s (%s, boot %s) attempts=%d deadline=%v now=%s reason=%q; node %s ready=%s seen=%s; tasks [%s]; commands [%s]",
		id, st, purpose, boot, attempts, deadline, now.Format("15:04:05.000"), reason, node, ready, seen, task, cmd)
}

func zeroed(t *testing.T, path string) bool {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return bytes.Count(b, []byte{0}) == len(b)
}

// TestFlow: two machines are enrolled and reach ready (inspected, the
// ramdisk booted over the site's PXE, diagnosed, every disk zeroed and the
// wipe's signature verified); one is deployed and its installed system
// joins as the node reserved at enrollment; released, it is wiped back to
// ready. The BMC password is in no API answer, log line or row of any
// table (outbox events, audit, site tasks, commands).
func TestFlow(t *testing.T) {
	t.Parallel()
	image := bytes.Repeat([]byte("bettercompute-image "), 4096)
	sum := sha256.Sum256(image)
	imgSrv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(image) }))
	t.Cleanup(imgSrv.Close)

	e := start(t, nil)
	e.startSite(t)
	m1, m2 := e.newMachine(t, 1, imgSrv.Client()), e.newMachine(t, 2, imgSrv.Client())
	id1, node1 := e.enroll(t, m1, "m1")
	id2, _ := e.enroll(t, m2, "m2")
	e.waitState(t, id1, "ready", 3*time.Minute)
	e.waitState(t, id2, "ready", 3*time.Minute)
	// Enrolled without TLS options, each pinned its BMC's certificate at
	// the first inspect (trust on first use).
	for id, m := range map[string]*machine{id1: m1, id2: m2} {
		if got := e.pinned(t, id); got != m.BMC.CertificateSHA256() {
			t.Errorf("machine %s pinned %q, want its BMC's certificate %s", id, got, m.BMC.CertificateSHA256())
		}
	}
	for _, m := range []*machine{m1, m2} {
		for _, d := range m.Disks {
			if !zeroed(t, d) {
				t.Errorf("disk %s of %s not zeroed", d, m.MAC)
			}
		}
	}

	// Deploy m1: the ramdisk writes the image and the seed; the installed
	// system joins as node1.
	e.call(t, "metal/deploy", map[string]any{"tenantId": "root", "machineId": id1, "image": map[string]any{"url": imgSrv.URL + "/image.raw",
		"sha256": hex.EncodeToString(sum[:]), "sizeBytes": len(image)}})
	e.waitState(t, id1, "joined", 3*time.Minute)
	var nodeState string
	if err := e.db.QueryRow(t.Context(), `SELECT state FROM nodes WHERE id = $1`, node1).Scan(&nodeState); err != nil {
		t.Fatal(err)
	}
	if nodeState != "adopting" && nodeState != "adopted" {
		t.Fatalf("node %s is %s after the deploy", node1, nodeState)
	}
	if got, _ := os.ReadFile(m1.Disks[0]); !bytes.HasPrefix(got, image) {
		t.Errorf("disk %s does not hold the image", m1.Disks[0])
	}

	// Release: back to ready, wiped again.
	e.call(t, "metal/release", map[string]any{"tenantId": "root", "machineId": id1})
	e.waitState(t, id1, "ready", 3*time.Minute)
	if !zeroed(t, m1.Disks[0]) {
		t.Errorf("disk %s not zeroed after the release", m1.Disks[0])
	}

	// Every transition is an event, in order: the workflow's
	// machine.state_changed, the API's requests; the password is nowhere.
	rows, err := e.db.Query(t.Context(), `SELECT CASE WHEN type = 'machine.state_changed' THEN payload->>'from' || '>' || (payload->>'to')
		ELSE type END FROM outbox WHERE resource_id = $1 AND type <> 'machine.enrolled' ORDER BY id`, id1)
	if err != nil {
		t.Fatal(err)
	}
	seq, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"enrolled>inspecting", "inspecting>booting-ramdisk", "booting-ramdisk>diagnosing", "diagnosing>wiping", "wiping>ready",
		"machine.deploy_requested", "deploying>rebooting", "rebooting>joined",
		"machine.release_requested", "booting-ramdisk>wiping", "wiping>ready"}
	if strings.Join(seq, " ") != strings.Join(want, " ") {
		t.Errorf("events of %s:\n got %v\nwant %v", id1, seq, want)
	}
	get := e.call(t, "metal/get", map[string]any{"tenantId": "root", "machineId": id1})
	blob, _ := json.Marshal(get)
	if strings.Contains(string(blob), bmcPassword) {
		t.Error("the BMC password is in metal.get's answer")
	}
	// Nor in any outbox event, audit row, site task, command or log line.
	e.sweep(t, bmcPassword, id1)
}

// TestAStepThatTimesOutIsRetriedThenFails: a BMC that answers every
// request 503 fails inspecting's attempts (short step timeouts, two
// attempts); the machine is failed at inspecting with the reason.
func TestAStepThatTimesOutIsRetriedThenFails(t *testing.T) {
	t.Parallel()
	e := start(t, func(c *config.Config) {
		c.Metal.MaxAttempts = 2
		c.Metal.StepTimeouts = map[string]config.Duration{"inspecting": config.Duration(3 * time.Second)}
	})
	e.startSite(t)
	m := e.newMachine(t, 1, nil)
	m.BMC.BMC.FailNext(1 << 30)
	id, _ := e.enroll(t, m, "m1")
	e.waitState(t, id, "failed", 2*time.Minute)
	var step, reason string
	var attempts int
	if err := e.db.QueryRow(t.Context(), `SELECT failed_step, failed_reason FROM machines WHERE id = $1`, id).Scan(&step, &reason); err != nil {
		t.Fatal(err)
	}
	if step != "inspecting" || !strings.Contains(reason, "inspecting: attempt 2") {
		t.Fatalf("failed at %q: %q; want inspecting, its second attempt's reason", step, reason)
	}
	if err := e.db.QueryRow(t.Context(), `SELECT count(*) FROM site_tasks WHERE machine_id = $1 AND kind = 'bmc.inspect'`, id).Scan(&attempts); err != nil {
		t.Fatal(err)
	}
	if attempts < 2 {
		t.Fatalf("%d bmc.inspect tasks, want one per attempt (2)", attempts)
	}
	if strings.Contains(e.logs.String(), bmcPassword) {
		t.Error("the BMC password is in the log")
	}
}

// TestAForgedWipeResultIsRefused: a wipe result changed after the ramdisk
// signed it (as a gateway faking it would) fails verification: the wiping
// attempts fail saying so and the machine never reaches ready.
func TestAForgedWipeResultIsRefused(t *testing.T) {
	t.Parallel()
	tamper := func(c *commands.Command) {
		if c.Kind == "disk.wipe" && c.State == commands.Succeeded && len(c.Result) > 0 {
			c.Result = append([]byte(nil), c.Result...)
			c.Result[len(c.Result)-1] ^= 1
		}
	}
	e := startWith(t, func(c *config.Config) { c.Metal.MaxAttempts = 2 }, app.Options{MetalTamper: tamper})
	e.startSite(t)
	m := e.newMachine(t, 1, nil)
	id, _ := e.enroll(t, m, "m1")
	e.waitState(t, id, "failed", 3*time.Minute)
	var step, reason string
	if err := e.db.QueryRow(t.Context(), `SELECT failed_step, failed_reason FROM machines WHERE id = $1`, id).Scan(&step, &reason); err != nil {
		t.Fatal(err)
	}
	if step != "wiping" || !strings.Contains(reason, "node signature does not verify") {
		t.Fatalf("failed at %q: %q; want wiping, refused for its signature", step, reason)
	}
}

// sweep fails t when secret is in the captured log or in any column of any
// table (as text, and as hex, which is how bytea reads) — outbox events,
// audit rows, site tasks, commands and the rest. The same search must find
// the machine's id in several tables, or it proves nothing.
func (e *env) sweep(t *testing.T, secret, machineID string) {
	t.Helper()
	ctx := t.Context()
	if strings.Contains(e.logs.String(), secret) {
		t.Error("the log holds the BMC password")
	}
	if !strings.Contains(e.logs.String(), `"msg"`) {
		t.Error("the captured log is empty: the search proved nothing")
	}
	rows, err := e.db.Query(ctx, `SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema() AND table_type = 'BASE TABLE'`)
	if err != nil {
		t.Fatal(err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(names) < 20 {
		t.Fatalf("tables: %v %v", names, err)
	}
	hexSecret := hex.EncodeToString([]byte(secret))
	found := map[string]int{}
	for _, name := range names {
		ident := pgx.Identifier{name}.Sanitize()
		var n int
		if err := e.db.QueryRow(ctx, `SELECT count(*) FROM `+ident+` t WHERE t::text LIKE '%' || $1 || '%'`, machineID).Scan(&n); err != nil {
			t.Fatalf("search %s: %v", name, err)
		}
		if n > 0 {
			found[name] = n
		}
		if err := e.db.QueryRow(ctx, `SELECT count(*) FROM `+ident+` t WHERE t::text LIKE '%' || $1 || '%' OR t::text LIKE '%' || $2 || '%'`,
			secret, hexSecret).Scan(&n); err != nil {
			t.Fatalf("search %s: %v", name, err)
		}
		if n != 0 {
			t.Errorf("table %s: %d rows hold the BMC password", name, n)
		}
	}
	for _, want := range []string{"machines", "outbox", "audit", "site_tasks", "commands"} {
		if found[want] == 0 {
			t.Errorf("the search found machine %s in no row of %s (found: %v): it does not search", machineID, want, found)
		}
	}
}

// imageServer serves a small raw image over TLS.
func imageServer(t *testing.T) (*httptest.Server, []byte) {
	t.Helper()
	image := bytes.Repeat([]byte("bettercompute-image "), 4096)
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(image) }))
	t.Cleanup(srv.Close)
	return srv, image
}

func (e *env) deploy(t *testing.T, id string, srv *httptest.Server, image []byte) {
	t.Helper()
	sum := sha256.Sum256(image)
	e.call(t, "metal/deploy", map[string]any{"tenantId": "root", "machineId": id, "image": map[string]any{"url": srv.URL + "/image.raw",
		"sha256": hex.EncodeToString(sum[:]), "sizeBytes": len(image)}})
}

// TestChaosNATSStoppedMidFlow: NATS stops once the first machine is past
// inspecting. With the bus down every machine still reaches ready and a
// deploy still joins: the flow relies on resync alone (the metal job's
// periodic key and the work queue's bus-down polling; the gateways claim
// site tasks and deliver commands on their liveness tick). Once the bus is
// back, a release completes too.
func TestChaosNATSStoppedMidFlow(t *testing.T) {
	t.Parallel()
	ns := natstest.New(t)
	imgSrv, image := imageServer(t)
	e := start(t, func(c *config.Config) { c.NATS.URL = ns.URL() })
	e.startSite(t)
	ids := make([]string, 3)
	for i := range ids {
		m := e.newMachine(t, i+1, imgSrv.Client())
		ids[i], _ = e.enroll(t, m, fmt.Sprintf("m%d", i+1))
	}
	poll.Until(t, 2*time.Minute, "the first machine past inspecting", func() bool {
		st, _ := e.machineState(t, ids[0])
		return st != "enrolled" && st != "inspecting"
	})
	ns.Stop()
	var stopped time.Time
	if err := e.db.QueryRow(t.Context(), `SELECT now()`).Scan(&stopped); err != nil {
		t.Fatal(err)
	}
	var left int // transitions still to make with the bus down
	for _, id := range ids {
		if st, _ := e.machineState(t, id); st != "ready" {
			left++
		}
	}
	if left == 0 {
		t.Fatal("every machine was ready before the bus stopped: the test proves nothing")
	}
	for _, id := range ids {
		e.waitState(t, id, "ready", 3*time.Minute)
	}
	e.deploy(t, ids[0], imgSrv, image)
	e.waitState(t, ids[0], "joined", 3*time.Minute)
	if ns.Embedded() != nil {
		t.Fatal("the bus came back during the test")
	}
	var moved int
	if err := e.db.QueryRow(t.Context(), `SELECT count(*) FROM outbox WHERE type = 'machine.state_changed' AND created_at > $1`, stopped).Scan(&moved); err != nil {
		t.Fatal(err)
	}
	t.Logf("bus down: %d machines not ready yet, %d transitions made", left, moved)
	if moved < left {
		t.Fatalf("%d transitions with the bus down, want at least %d", moved, left)
	}

	ns.Restart()
	e.call(t, "metal/release", map[string]any{"tenantId": "root", "machineId": ids[0]})
	e.waitState(t, ids[0], "ready", 3*time.Minute)
}

// TestRetryResumesAFailedMachine: a machine whose BMC refused every
// request fails at inspecting; once the BMC answers, metal.retry resumes
// the step with its attempts reset and the machine completes to ready.
func TestRetryResumesAFailedMachine(t *testing.T) {
	t.Parallel()
	e := start(t, func(c *config.Config) {
		c.Metal.MaxAttempts = 2
		c.Metal.StepTimeouts = map[string]config.Duration{"inspecting": config.Duration(3 * time.Second)}
	})
	e.startSite(t)
	m := e.newMachine(t, 1, nil)
	m.BMC.BMC.FailNext(1 << 30)
	id, _ := e.enroll(t, m, "m1")
	e.waitState(t, id, "failed", 2*time.Minute)
	m.BMC.BMC.FailNext(0)

	out := e.call(t, "metal/retry", map[string]any{"tenantId": "root", "machineId": id})
	if st := field(out, "machine", "state"); st != "inspecting" {
		t.Fatalf("retry answered state %q, want inspecting (the failed step)", st)
	}
	e.waitState(t, id, "ready", 3*time.Minute)
	var step, reason string
	if err := e.db.QueryRow(t.Context(), `SELECT failed_step, failed_reason FROM machines WHERE id = $1`, id).Scan(&step, &reason); err != nil {
		t.Fatal(err)
	}
	if step != "" || reason != "" {
		t.Fatalf("the failure is still recorded after the retry: %q %q", step, reason)
	}
	var resumed int
	if err := e.db.QueryRow(t.Context(), `SELECT count(*) FROM outbox WHERE resource_id = $1 AND type = 'machine.retried'`, id).Scan(&resumed); err != nil {
		t.Fatal(err)
	}
	if resumed != 1 {
		t.Fatalf("%d machine.retried events, want 1", resumed)
	}
	for _, d := range m.Disks {
		if !zeroed(t, d) {
			t.Errorf("disk %s not zeroed after the retried flow", d)
		}
	}
}

// TestRescueStopsWithTheRamdiskRunning: metal.rescue of a ready machine
// boots the ramdisk over PXE again and stops at rescue with it running
// (the node commissioning, its session live) for a human; the flow does
// not move it on.
func TestRescueStopsWithTheRamdiskRunning(t *testing.T) {
	t.Parallel()
	e := start(t, nil)
	e.startSite(t)
	m := e.newMachine(t, 1, nil)
	id, node := e.enroll(t, m, "m1")
	e.waitState(t, id, "ready", 3*time.Minute)
	poll.Until(t, time.Minute, "the ready machine powered off", func() bool { return !m.Running() })
	pxeBoots := countOf(m.Boots(), "Pxe")

	e.call(t, "metal/rescue", map[string]any{"tenantId": "root", "machineId": id})
	e.waitState(t, id, "rescue", 3*time.Minute)
	if got := countOf(m.Boots(), "Pxe"); got != pxeBoots+1 || !m.Running() {
		t.Fatalf("PXE boots %d → %d, running %v: rescue boots the ramdisk once more and leaves it running", pxeBoots, got, m.Running())
	}
	var reached time.Time
	if err := e.db.QueryRow(t.Context(), `SELECT now()`).Scan(&reached); err != nil {
		t.Fatal(err)
	}
	// Several resyncs (300 ms) and heartbeats later it is still in rescue,
	// the ramdisk's session live.
	poll.Until(t, time.Minute, "the ramdisk heartbeating after rescue", func() bool {
		var seen *time.Time
		_ = e.db.QueryRow(t.Context(), `SELECT last_seen_at FROM nodes WHERE id = $1`, node).Scan(&seen)
		return seen != nil && seen.After(reached.Add(2*time.Second))
	})
	var nodeState string
	if err := e.db.QueryRow(t.Context(), `SELECT state FROM nodes WHERE id = $1`, node).Scan(&nodeState); err != nil {
		t.Fatal(err)
	}
	if st, _ := e.machineState(t, id); st != "rescue" || nodeState != "commissioning" || !m.Running() {
		t.Fatalf("machine %s, node %s, running %v: want rescue with the ramdisk (commissioning) running", st, nodeState, m.Running())
	}
}

func countOf(ss []string, s string) int {
	n := 0
	for _, x := range ss {
		if x == s {
			n++
		}
	}
	return n
}
