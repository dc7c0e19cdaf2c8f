// Package chaos is the multi-process chaos suite's harness: it runs the
// control plane as compose.yaml does — every deployable (api, joinservice,
// gateway, nodespec-controller, controllers, placer, command-sweeper,
// outbox-relay, metal, vps) as its own OS process of the built better-compute binary,
// configured only through BC_* environment variables, with the PKI made by
// `better-compute pki init` — against one PostgreSQL database and a real
// nats-server process, and lets a test SIGKILL, SIGSTOP and SIGCONT each of
// them and restart it on the port it had.
//
// Ports come from a range below the kernel's ephemeral range
// (/proc/sys/net/ipv4/ip_local_port_range starts at 32768 by default), so a
// port this harness frees while it restarts a process is never the one
// another test's listener on port 0 (natstest, freePort) is handed, and no
// such listener can take a port a process here is about to bind again.
//
// Every process's output is kept and printed when the test fails.
package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/poll"
)

// Port range of the harness: below Linux's default ephemeral range, above
// the well-known ports and the usual fixed ones.
const (
	portLow  = 20000
	portHigh = 32000
)

var (
	portMu   sync.Mutex
	portUsed = map[int]bool{}
)

// Port returns a port on 127.0.0.1 in the harness's range that nothing
// listens on now and that this test binary has not handed out before.
func Port(t testing.TB) int {
	t.Helper()
	portMu.Lock()
	defer portMu.Unlock()
	for range 1000 {
		p := portLow + rand.IntN(portHigh-portLow)
		if portUsed[p] {
			continue
		}
		ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			continue
		}
		_ = ln.Close()
		portUsed[p] = true
		return p
	}
	t.Fatal("chaos: no free port in the harness's range")
	return 0
}

// Addr is 127.0.0.1:port.
func Addr(port int) string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(port)) }

// logBuffer is a process's output, read while it is written.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// Proc is one OS process of the harness. Its log spans every start.
type Proc struct {
	Name string
	// Port is the port its health endpoints (/readyz) are served on; 0 for
	// nats-server.
	Port int
	bin  string
	args []string
	env  []string
	log  *logBuffer

	mu     sync.Mutex
	cmd    *exec.Cmd
	exited chan struct{}
	starts int
}

// Log returns everything the process wrote, over all its starts.
func (p *Proc) Log() string { return p.log.String() }

// Starts is how many times the process was started.
func (p *Proc) Starts() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.starts
}

func (p *Proc) start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	cmd := exec.Command(p.bin, p.args...)
	cmd.Env = p.env
	dieWithParent(cmd)
	cmd.Stdout, cmd.Stderr = p.log, p.log
	p.starts++
	fmt.Fprintf(p.log, "---- chaos: start %d of %s\n", p.starts, p.Name)
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", p.Name, err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	p.cmd, p.exited = cmd, exited
	return nil
}

// Signal sends sig to the running process.
func (p *Proc) Signal(sig syscall.Signal) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return fmt.Errorf("%s is not running", p.Name)
	}
	fmt.Fprintf(p.log, "---- chaos: %s\n", sig)
	return p.cmd.Process.Signal(sig)
}

// Kill SIGKILLs the process (a stopped one too) and waits for it to exit.
// Killing a dead process does nothing.
func (p *Proc) Kill() {
	p.mu.Lock()
	cmd, exited := p.cmd, p.exited
	p.cmd = nil
	p.mu.Unlock()
	if cmd == nil {
		return
	}
	fmt.Fprintf(p.log, "---- chaos: SIGKILL\n")
	_ = cmd.Process.Kill()
	<-exited
}

// Exited reports whether the last start has exited.
func (p *Proc) Exited() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.exited == nil {
		return true
	}
	select {
	case <-p.exited:
		return true
	default:
		return false
	}
}

// Topology is a running control plane: its processes, database, bus and
// PKI, and a root credential for its API.
type Topology struct {
	t     testing.TB
	Bin   string
	Dir   string
	DBURL string
	// Token is a root API key (`better-compute bootstrap`).
	Token string
	// PKI is the directory `pki init` wrote; Public what `pki export`
	// wrote (ca.pem, joinservice.pub, command-signing.pub).
	PKI, Public string
	// GatewayAddr is where daemons reach the gateway.
	GatewayAddr string
	// ExtraGateways are where daemons reach the extra gateways of
	// Options.Extra (roles "gateway"), by name; each is also its gateway id.
	ExtraGateways map[string]string
	// NATSPort is nats-server's port, kept across restarts.
	NATSPort int

	procs    map[string]*Proc
	order    []string
	natsRuns int
}

// Options configure [Start].
type Options struct {
	// Bin is the built better-compute binary.
	Bin string
	// DBURL is the (migrated or empty) database every process shares.
	DBURL string
	// NATSServer is the nats-server binary; default /usr/sbin/nats-server.
	NATSServer string
	// Env is added to every control-plane process's environment (short
	// leases, intervals).
	Env []string
	// Extra are more processes: name → roles, e.g. a second
	// nodespec-controller.
	Extra map[string]string
}

// Roles of each deployable, as compose.yaml runs them.
var composeRoles = []struct{ name, roles string }{
	{"api", "api"},
	{"joinservice", "joinservice"},
	{"gateway", "gateway"},
	{"nodespec-controller", "nodespec-controller"},
	{"controllers", "worker"},
	{"placer", "placer"},
	{"command-sweeper", "command-sweeper"},
	{"outbox-relay", "outbox-relay"},
	{"metal", "metal"},
	{"vps", "vps"},
}

var tokenRE = regexp.MustCompile(`bck_[A-Za-z0-9_.-]+`)

// Start makes the PKI, migrates, bootstraps a root credential, starts
// nats-server and every deployable, and waits until each is ready. Every
// process is killed when t ends; every log is printed if t failed.
func Start(t testing.TB, o Options) *Topology {
	t.Helper()
	if o.NATSServer == "" {
		o.NATSServer = "/usr/sbin/nats-server"
	}
	if _, err := os.Stat(o.NATSServer); err != nil {
		t.Skipf("chaos: no nats-server binary: %v", err)
	}
	dir := t.TempDir()
	top := &Topology{t: t, Bin: o.Bin, Dir: dir, DBURL: o.DBURL, PKI: filepath.Join(dir, "pki"), Public: filepath.Join(dir, "pki-public"),
		procs: map[string]*Proc{}}
	t.Cleanup(func() {
		for i := len(top.order) - 1; i >= 0; i-- {
			top.procs[top.order[i]].Kill()
		}
		if t.Failed() {
			top.DumpLogs()
		}
	})
	gwTLS := filepath.Join(dir, "gateway-tls")
	const td = "bettercompute.local"
	top.oneShot("pki", nil, "pki", "init", "--dir", top.PKI, "--trust-domain", td)
	top.oneShot("pki-export", nil, "pki", "export", "--dir", top.PKI, "--out", top.Public)
	top.oneShot("gateway-cert", nil, "pki", "gateway-cert", "--dir", top.PKI, "--id", "gw-chaos", "--host", "127.0.0.1", "--host", "localhost", "--out", gwTLS)
	top.oneShot("migrate", []string{"DATABASE_URL=" + appURL(o.DBURL, "chaos-migrate")}, "migrate", "up")
	out := top.oneShot("bootstrap", []string{"DATABASE_URL=" + appURL(o.DBURL, "chaos-bootstrap")}, "bootstrap")
	top.Token = tokenRE.FindString(out)
	if top.Token == "" {
		t.Fatalf("chaos: bootstrap printed no credential:\n%s", out)
	}

	top.NATSPort = Port(t)
	nats := &Proc{Name: "nats-server", bin: o.NATSServer, log: &logBuffer{}, env: os.Environ()}
	top.add(nats)
	top.setNATSStore()
	if err := nats.start(); err != nil {
		t.Fatal(err)
	}
	top.waitDial(nats, Addr(top.NATSPort))

	jsAddr := Addr(Port(t))
	top.GatewayAddr = Addr(Port(t))
	natsURL := "nats://" + Addr(top.NATSPort)
	// A SIGSTOPped process may be inside a transaction: the server ends
	// it after 10 s idle, so its row locks block no one for longer.
	common := append([]string{"BC_CONFIG=", "BC_LOG_LEVEL=warn", "BC_SERVER_HOST=127.0.0.1", "BC_SERVER_ADMIN_ADDR=127.0.0.1:0", "NATS_URL=" + natsURL,
		"BC_DATABASE_IDLE_IN_TRANSACTION_TIMEOUT=10s"}, o.Env...)
	signing := []string{"BC_JOIN_SERVICE_TRUST_DOMAIN=" + td,
		"BC_COMMANDS_SIGNING_KEY_FILE=" + filepath.Join(top.PKI, "command-signing.key"),
		"BC_AUDIT_SIGNING_KEY_FILE=" + filepath.Join(top.PKI, "audit.key")}
	secretsKey := "BC_SECRETS_KEY_FILE=" + filepath.Join(top.PKI, "secrets.key")
	envOf := map[string][]string{
		// The api process presents the gateway's certificate to relay
		// tunnels to the gateway process (GatewayService).
		"api": append(slices.Clone(signing), secretsKey,
			"BC_GATEWAY_TLS_CERT_FILE="+filepath.Join(gwTLS, "gateway.crt"),
			"BC_GATEWAY_TLS_KEY_FILE="+filepath.Join(gwTLS, "gateway.key"),
			"BC_GATEWAY_TLS_CA_FILE="+filepath.Join(gwTLS, "ca.pem")),
		"controllers": append(slices.Clone(signing), secretsKey),
		"metal":       append(slices.Clone(signing), secretsKey),
		"vps":         {secretsKey},
		"joinservice": {"BC_JOIN_SERVICE_TRUST_DOMAIN=" + td,
			"BC_JOIN_SERVICE_CA_CERT_FILE=" + filepath.Join(top.PKI, "node-ca.crt"),
			"BC_JOIN_SERVICE_CA_KEY_FILE=" + filepath.Join(top.PKI, "node-ca.key"),
			"BC_JOIN_SERVICE_HPKE_KEY_FILE=" + filepath.Join(top.PKI, "joinservice-hpke.pem"),
			"BC_JOIN_SERVICE_LISTEN=" + jsAddr, "BC_JOIN_SERVICE_HOSTS=localhost,127.0.0.1"},
		"gateway": {"BC_JOIN_SERVICE_TRUST_DOMAIN=" + td, "BC_GATEWAY_LISTEN=" + top.GatewayAddr, "BC_GATEWAY_ID=gw-chaos",
			"BC_GATEWAY_HOSTS=localhost,127.0.0.1", "BC_GATEWAY_JOIN_SERVICE=" + jsAddr,
			"BC_GATEWAY_TLS_CERT_FILE=" + filepath.Join(gwTLS, "gateway.crt"),
			"BC_GATEWAY_TLS_KEY_FILE=" + filepath.Join(gwTLS, "gateway.key"),
			"BC_GATEWAY_TLS_CA_FILE=" + filepath.Join(gwTLS, "ca.pem")},
	}
	type spec struct{ name, roles string }
	specs := make([]spec, 0, len(composeRoles)+len(o.Extra))
	for _, r := range composeRoles {
		specs = append(specs, spec{r.name, r.roles})
	}
	for name, roles := range o.Extra {
		specs = append(specs, spec{name, roles})
	}
	for _, s := range specs {
		env := envOf[s.roles]
		if s.roles == "worker" {
			env = envOf["controllers"]
		}
		if _, extra := o.Extra[s.name]; extra && s.roles == "gateway" {
			// Its own listener and id (the last value of a variable wins).
			addr := Addr(Port(t))
			if top.ExtraGateways == nil {
				top.ExtraGateways = map[string]string{}
			}
			top.ExtraGateways[s.name] = addr
			env = append(slices.Clone(env), "BC_GATEWAY_LISTEN="+addr, "BC_GATEWAY_ID="+s.name)
		}
		port := Port(t)
		p := &Proc{Name: s.name, Port: port, bin: o.Bin, log: &logBuffer{},
			args: []string{"serve", "--roles", s.roles, "--port", strconv.Itoa(port), "--no-migrate"},
			env:  append(append(append(os.Environ(), common...), env...), "DATABASE_URL="+appURL(o.DBURL, "chaos-"+s.name))}
		top.add(p)
		if err := p.start(); err != nil {
			t.Fatal(err)
		}
	}
	for _, s := range specs {
		top.WaitReady(s.name)
	}
	top.waitDial(top.procs["gateway"], top.GatewayAddr)
	// A step stuck past the go test -timeout would end in a panic that runs
	// no cleanup, so nothing would say what the processes were doing: 30 s
	// before the deadline, write their logs to stderr. Every process has
	// started by now, so top.order no longer changes.
	if d, ok := t.(interface{ Deadline() (time.Time, bool) }); ok {
		if deadline, set := d.Deadline(); set {
			wd := time.AfterFunc(time.Until(deadline)-30*time.Second, func() {
				fmt.Fprintf(os.Stderr, "chaos: %s is about to time out; the processes' logs:\n", t.Name())
				for _, name := range top.order {
					fmt.Fprintf(os.Stderr, "==== %s (started %d times)\n%s\n", name, top.procs[name].Starts(), top.procs[name].Log())
				}
			})
			t.Cleanup(func() { wd.Stop() })
		}
	}
	return top
}

// appURL is url with application_name=name, so that pg_stat_activity (and
// the suite's write log) tells the processes apart.
func appURL(url, name string) string {
	sep := "?"
	if strings.Contains(url, "?") {
		sep = "&"
	}
	return url + sep + "application_name=" + name
}

func (top *Topology) add(p *Proc) {
	top.procs[p.Name] = p
	top.order = append(top.order, p.Name)
}

// oneShot runs a better-compute command to completion and returns its
// output.
func (top *Topology) oneShot(name string, env []string, args ...string) string {
	top.t.Helper()
	cmd := exec.Command(top.Bin, args...)
	cmd.Env = append(append(os.Environ(), "BC_CONFIG=", "BC_LOG_LEVEL=warn"), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		top.t.Fatalf("chaos: %s (%s): %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// setNATSStore points nats-server at a new, empty store directory.
func (top *Topology) setNATSStore() {
	top.natsRuns++
	p := top.procs["nats-server"]
	p.args = []string{"-a", "127.0.0.1", "-p", strconv.Itoa(top.NATSPort), "-js", "-sd", filepath.Join(top.Dir, fmt.Sprintf("nats-%d", top.natsRuns))}
}

// Proc returns the named process.
func (top *Topology) Proc(name string) *Proc {
	p, ok := top.procs[name]
	if !ok {
		top.t.Fatalf("chaos: no process %q", name)
	}
	return p
}

// Kill SIGKILLs the named process.
func (top *Topology) Kill(name string) { top.Proc(name).Kill() }

// Signal sends sig to the named process.
func (top *Topology) Signal(name string, sig syscall.Signal) {
	top.t.Helper()
	if err := top.Proc(name).Signal(sig); err != nil {
		top.t.Fatal(err)
	}
}

// Restart kills the named process if it runs and starts it again with the
// same configuration and ports, and waits until it is ready.
func (top *Topology) Restart(name string) {
	top.t.Helper()
	p := top.Proc(name)
	p.Kill()
	if err := p.start(); err != nil {
		top.t.Fatal(err)
	}
	top.WaitReady(name)
}

// RestartNATSEmpty SIGKILLs nats-server if it runs and starts it again on
// its port with a new, empty store directory: a bus that lost its disk.
func (top *Topology) RestartNATSEmpty() {
	top.t.Helper()
	p := top.Proc("nats-server")
	p.Kill()
	top.setNATSStore()
	if err := p.start(); err != nil {
		top.t.Fatal(err)
	}
	top.waitDial(p, Addr(top.NATSPort))
}

// WaitReady waits until the named process's /readyz answers 200.
func (top *Topology) WaitReady(name string) {
	top.t.Helper()
	p := top.Proc(name)
	if p.Port == 0 {
		top.waitDial(p, Addr(top.NATSPort))
		return
	}
	url := "http://" + Addr(p.Port) + "/readyz"
	poll.UntilNil(top.t, 2*time.Minute, name+" ready", func() error {
		if p.Exited() {
			top.t.Fatalf("chaos: %s exited:\n%s", name, p.Log())
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			time.Sleep(100 * time.Millisecond) // between probes, not an assertion
			return err
		}
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			time.Sleep(100 * time.Millisecond)
			return fmt.Errorf("readyz %d", resp.StatusCode)
		}
		return nil
	})
}

func (top *Topology) waitDial(p *Proc, addr string) {
	top.t.Helper()
	poll.UntilNil(top.t, 2*time.Minute, p.Name+" listening on "+addr, func() error {
		if p.Exited() {
			top.t.Fatalf("chaos: %s exited:\n%s", p.Name, p.Log())
		}
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			time.Sleep(50 * time.Millisecond) // between dials, not an assertion
			return err
		}
		return c.Close()
	})
}

// DumpLogs writes every process's log to the test log.
func (top *Topology) DumpLogs() {
	for _, name := range top.order {
		top.t.Logf("==== %s (started %d times)\n%s", name, top.procs[name].Starts(), top.procs[name].Log())
	}
}

// APIError is a non-200 answer of the API.
type APIError struct {
	Status int
	Body   string
}

func (e *APIError) Error() string { return fmt.Sprintf("HTTP %d: %s", e.Status, e.Body) }

// Call posts body to the API's REST method ("pools/create") with the root
// credential and decodes the answer into out.
func (top *Topology) Call(method string, body, out any) error {
	b, err := json.Marshal(body)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+Addr(top.Proc("api").Port)+"/api/compute/"+method, bytes.NewReader(b))
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+top.Token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer func() { _ = resp.Body.Close() }()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return &APIError{Status: resp.StatusCode, Body: string(raw)}
	}
	if out == nil {
		return nil
	}
	if err := json.Unmarshal(raw, out); err != nil {
		return errors.Join(fmt.Errorf("%s: decode %s", method, raw), err)
	}
	return nil
}

// MustCall is [Topology.Call] that fails the test on an error.
func (top *Topology) MustCall(method string, body, out any) {
	top.t.Helper()
	if err := top.Call(method, body, out); err != nil {
		top.t.Fatalf("%s: %v", method, err)
	}
}
