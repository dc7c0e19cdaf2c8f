package metal_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	agentinv "github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/ramdisk"
	"github.com/bettercompute/bettercompute/agent/session"
	"github.com/bettercompute/bettercompute/agent/site"
	"github.com/bettercompute/bettercompute/agent/site/fakebmc"
	"github.com/bettercompute/bettercompute/agent/site/pxe"
	"github.com/bettercompute/bettercompute/agent/state"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/app"
	"github.com/bettercompute/bettercompute/services/dev"
	"github.com/bettercompute/bettercompute/services/metal"
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
	pxe   *site.PXEBoot
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
// PXE (its HTTP server on loopback) holding the site's boot lease.
func (e *env) startSite(t *testing.T) {
	t.Helper()
	e.site = field(e.call(t, "sites/create", map[string]any{"tenantId": "root", "name": "fra1"}), "site", "id")
	e.pool = field(e.call(t, "pools/create", map[string]any{"tenantId": "root", "name": "metal", "class": "gpu"}), "pool", "id")
	tok := field(e.call(t, "sites/createToken", map[string]any{"tenantId": "root", "siteId": e.site}), "token")
	st, err := state.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := site.Join(t.Context(), join.Config{Gateway: e.App.GatewayAddr(), RootCAs: e.roots, Token: tok,
		JoinserviceKey: e.pub, JoinserviceKeyID: e.keyID, State: st, Claims: site.HostClaims{Hostname: "site-1"}}); err != nil {
		t.Fatal(err)
	}
	table := pxe.NewTable()
	e.pxe, err = site.NewPXEBoot(pxe.Config{IP: netip.MustParseAddr("127.0.0.1"), DHCPAddr: "127.0.0.1:0", PXEAddr: "127.0.0.1:0",
		TFTPAddr: "127.0.0.1:0", HTTPAddr: "127.0.0.1:0", IPXEDir: t.TempDir(), CacheDir: t.TempDir(), Gateway: e.App.GatewayAddr(),
		Machines: table, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = site.Run(ctx, site.Config{Gateway: e.App.GatewayAddr(), State: st, Boot: e.pxe, Version: "test", Hostname: "site-1",
			LeaseTTL: 3 * time.Second, Logger: slog.New(slog.DiscardHandler), PXE: table})
	}()
	t.Cleanup(func() { cancel(); <-done })
	poll.Until(t, time.Minute, "the site agent serves PXE", func() bool { return e.pxe.Addrs().BaseURL != "" })
}

// machine is a simulated server: a fake BMC and file disks.
type machine struct {
	t     *testing.T
	e     *env
	mac   string
	bmc   *fakebmc.Server
	disks []string
	imgCl *http.Client

	mu      sync.Mutex
	cancel  context.CancelFunc
	done    chan struct{}
	boots   []string
	lastErr error
}

func (e *env) newMachine(t *testing.T, i int, imgClient *http.Client) *machine {
	t.Helper()
	m := &machine{t: t, e: e, mac: fmt.Sprintf("02:00:00:00:00:%02x", i+1), imgCl: imgClient}
	dir := t.TempDir()
	for d := range 2 {
		p := filepath.Join(dir, fmt.Sprintf("disk%d", d))
		junk := make([]byte, 1<<20)
		_, _ = rand.Read(junk)
		if err := os.WriteFile(p, junk, 0o600); err != nil {
			t.Fatal(err)
		}
		m.disks = append(m.disks, p)
	}
	hw := fakebmc.DefaultMachine()
	hw.SystemID = fmt.Sprintf("sys-%d", i)
	hw.SerialNumber = fmt.Sprintf("SN-%d", i)
	hw.NICs = []fakebmc.NIC{{MAC: m.mac, SpeedMbps: 25000}}
	hw.PoweredOn = false
	b, err := fakebmc.New(fakebmc.Config{Machine: hw, Username: "admin", Password: bmcPassword,
		OnPowerOn: func(target string) { go m.boot(target) }, OnPowerOff: func() { go m.off() }})
	if err != nil {
		t.Fatal(err)
	}
	if m.bmc, err = fakebmc.StartTLS(b, "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.off(); _ = m.bmc.Close() })
	return m
}

func (m *machine) off() {
	m.mu.Lock()
	cancel, done := m.cancel, m.done
	m.cancel, m.done = nil, nil
	m.mu.Unlock()
	if cancel != nil {
		cancel()
		<-done
	}
}

func (m *machine) fail(err error) {
	m.mu.Lock()
	m.lastErr = err
	m.mu.Unlock()
	m.t.Logf("machine %s: %v", m.mac, err)
}

// boot runs what the machine boots: the ramdisk over PXE, its disk's
// installed system otherwise.
func (m *machine) boot(target string) {
	m.off()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	m.mu.Lock()
	m.cancel, m.done = cancel, done
	m.boots = append(m.boots, target)
	m.mu.Unlock()
	defer close(done)
	st, err := state.Open(m.t.TempDir())
	if err != nil {
		m.fail(err)
		return
	}
	inv, err := agentinv.Open(agentinv.Config{Backend: agentinv.BackendMock, Hostname: "host-" + strings.ReplaceAll(m.mac, ":", "")})
	if err != nil {
		m.fail(err)
		return
	}
	defer func() { _ = inv.Close() }()
	jc := join.Config{Gateway: m.e.App.GatewayAddr(), RootCAs: m.e.roots, JoinserviceKey: m.e.pub, JoinserviceKeyID: m.e.keyID,
		State: st, Claims: inv}
	sc := session.Config{Gateway: m.e.App.GatewayAddr(), State: st, Inventory: inv, BootID: fmt.Sprintf("boot-%d", time.Now().UnixNano()),
		AgentVersion: "test", CommandKey: m.e.CommandKey, MinBackoff: 50 * time.Millisecond, MaxBackoff: time.Second}
	if target == "Pxe" {
		tok, err := m.bootToken(ctx)
		if err != nil {
			m.fail(err)
			return
		}
		key, err := ramdisk.NewKey()
		if err != nil {
			m.fail(err)
			return
		}
		rd, err := ramdisk.New(ramdisk.Config{Disks: m.disks, HTTPClient: m.imgCl, WorkDir: m.t.TempDir(), Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			m.fail(err)
			return
		}
		jc.Token, jc.Role, jc.Key = tok, join.RoleRamdisk, key
		sc.Key, sc.Ramdisk, sc.ResultKey, sc.NoRenew = key, rd, key, true
	} else {
		ud, err := os.ReadFile(m.disks[0] + ramdisk.UserDataSuffix)
		if err != nil {
			m.fail(fmt.Errorf("no cloud-init seed: %w", err))
			return
		}
		if jc.Token = metal.JoinTokenOf(ud); jc.Token == "" {
			m.fail(fmt.Errorf("no join token in the cloud-init seed"))
			return
		}
	}
	if _, err := join.Join(ctx, jc); err != nil {
		m.fail(fmt.Errorf("join (%s): %w", target, err))
		return
	}
	_ = session.Run(ctx, sc)
}

// bootToken fetches the machine's iPXE script from the site agent, as
// iPXE does, and reads the boot token off its kernel line.
func (m *machine) bootToken(ctx context.Context) (string, error) {
	url := m.e.pxe.Addrs().BaseURL + "/boot/" + m.mac + ".ipxe"
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer func() { _ = resp.Body.Close() }()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("GET %s: %d %s", url, resp.StatusCode, b)
	}
	for _, w := range strings.Fields(string(b)) {
		if tok, ok := strings.CutPrefix(w, pxe.KernelArgBootToken+"="); ok {
			return tok, nil
		}
	}
	return "", fmt.Errorf("no boot token in the iPXE script %q", b)
}

func (e *env) enroll(t *testing.T, m *machine, name string) (id, node string) {
	t.Helper()
	out := e.call(t, "metal/enroll", map[string]any{"tenantId": "root", "siteId": e.site, "poolId": e.pool, "name": name,
		"bmc": map[string]any{"address": m.bmc.URL, "username": "admin", "password": bmcPassword}})
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
	poll.Until(t, d, "machine "+id+" "+want, func() bool {
		st, reason := e.machineState(t, id)
		if st == "failed" && want != "failed" {
			t.Fatalf("machine %s failed: %s", id, reason)
		}
		return st == want
	})
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
// ready. The BMC password is in no log line, event or API answer.
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
	for _, m := range []*machine{m1, m2} {
		for _, d := range m.disks {
			if !zeroed(t, d) {
				t.Errorf("disk %s of %s not zeroed", d, m.mac)
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
	if got, _ := os.ReadFile(m1.disks[0]); !bytes.HasPrefix(got, image) {
		t.Errorf("disk %s does not hold the image", m1.disks[0])
	}

	// Release: back to ready, wiped again.
	e.call(t, "metal/release", map[string]any{"tenantId": "root", "machineId": id1})
	e.waitState(t, id1, "ready", 3*time.Minute)
	if !zeroed(t, m1.disks[0]) {
		t.Errorf("disk %s not zeroed after the release", m1.disks[0])
	}

	// Every transition is an event; the password is nowhere.
	var n int
	if err := e.db.QueryRow(t.Context(), `SELECT count(*) FROM outbox WHERE type = 'machine.state_changed' AND resource = $1`, id1).Scan(&n); err != nil {
		t.Logf("count events: %v", err)
	} else if n < 10 {
		t.Errorf("%d machine.state_changed events of %s, want every transition", n, id1)
	}
	get := e.call(t, "metal/get", map[string]any{"tenantId": "root", "machineId": id1})
	blob, _ := json.Marshal(get)
	for what, s := range map[string]string{"log": e.logs.String(), "metal.get": string(blob)} {
		if strings.Contains(s, bmcPassword) {
			t.Errorf("the BMC password is in the %s", what)
		}
	}
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
	m.bmc.BMC.FailNext(1 << 30)
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
