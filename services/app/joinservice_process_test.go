package app_test

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/sim"
	"github.com/bettercompute/bettercompute/agent/state"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
)

// syncBuffer is a process's output, read while it is written.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// proc is a better-compute process the test started.
type proc struct {
	cmd    *exec.Cmd
	log    *syncBuffer
	exited chan struct{}
}

func startProc(t *testing.T, bin string, env []string, args ...string) *proc {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), append([]string{"BC_CONFIG=", "BC_LOG_LEVEL=warn", "BC_NATS_URL="}, env...)...)
	log := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{cmd: cmd, log: log, exited: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(p.exited) }()
	t.Cleanup(p.kill)
	return p
}

// kill SIGKILLs the process and waits for it.
func (p *proc) kill() {
	_ = p.cmd.Process.Kill()
	<-p.exited
}

// waitListening waits until addr accepts connections.
func waitListening(t *testing.T, addr string, p *proc) {
	t.Helper()
	poll.UntilNil(t, time.Minute, addr+" listening", func() error {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			select {
			case <-p.exited:
				t.Fatalf("the process exited:\n%s", p.log.String())
			default:
			}
			time.Sleep(50 * time.Millisecond) // between dials, not an assertion
			return err
		}
		return c.Close()
	})
}

// TestJoinThroughSeparateProcesses runs the built better-compute binary as
// two OS processes, `serve --roles joinservice` and `serve --roles gateway`
// with gateway.joinService, configured only through the environment: a
// simulated node joins through the gateway and renews; joinservice
// SIGKILLed, a Join is UNAVAILABLE naming it; restarted, the Join succeeds.
func TestJoinThroughSeparateProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	t.Parallel()
	bin := filepath.Join(t.TempDir(), "better-compute")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/bettercompute/bettercompute/services/cmd/better-compute").CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	url := pgtest.NewDB(t)
	db, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	p := makePKI(t, "gw-proc")
	jsAddr, gwAddr := freeAddr(t), freeAddr(t)
	jsEnv := []string{"BC_DATABASE_URL=" + url, "BC_JOIN_SERVICE_CA_CERT_FILE=" + p.caFile, "BC_JOIN_SERVICE_CA_KEY_FILE=" + p.caFile,
		"BC_JOIN_SERVICE_HPKE_KEY_FILE=" + p.hpkeFile, "BC_JOIN_SERVICE_LISTEN=" + jsAddr}
	js := startProc(t, bin, jsEnv, "serve", "--roles", "joinservice", "--port", "0", "--no-migrate")
	waitListening(t, jsAddr, js)
	// The gateway's environment has no key material but its own
	// certificate: no CA, no HPKE key, no signing key.
	gw := startProc(t, bin, []string{"BC_DATABASE_URL=" + url, "BC_GATEWAY_LISTEN=" + gwAddr, "BC_GATEWAY_ID=gw-proc",
		"BC_GATEWAY_JOIN_SERVICE=" + jsAddr, "BC_GATEWAY_TLS_CERT_FILE=" + p.gwCert, "BC_GATEWAY_TLS_KEY_FILE=" + p.gwKey,
		"BC_GATEWAY_TLS_CA_FILE=" + p.bundleFile}, "serve", "--roles", "gateway", "--port", "0", "--no-migrate")
	waitListening(t, gwAddr, gw)

	ctx := t.Context()
	token := joinToken(t, db, 3)
	simRoot := t.TempDir()
	fleet, err := sim.Start(ctx, sim.Config{Gateway: gwAddr, ServerName: "127.0.0.1", RootCAs: p.ca.Pool(), Token: token,
		JoinserviceKey: p.key.PublicKey(), Root: simRoot, NoLogFiles: true}, 1)
	if err != nil {
		t.Fatalf("join through the gateway process: %v\ngateway:\n%s\njoinservice:\n%s", err, gw.log.String(), js.log.String())
	}
	t.Cleanup(fleet.Stop)
	nodeID := fleet.Nodes()[0]
	poll.UntilNil(t, 30*time.Second, "the node's session on gw-proc", func() error {
		var gateway *string
		if err := db.QueryRow(ctx, `SELECT gateway_id FROM nodes WHERE id = $1`, nodeID).Scan(&gateway); err != nil {
			return err
		}
		if gateway == nil || *gateway != "gw-proc" {
			return status.Error(codes.NotFound, "no session yet")
		}
		return nil
	})
	st, err := state.Open(sim.NodeDir(simRoot, 0))
	if err != nil {
		t.Fatal(err)
	}
	renewVia(t, gwAddr, st)

	js.kill()
	joinOnce := func(dir string) error {
		st, err := state.OpenUnsynced(dir)
		if err != nil {
			t.Fatal(err)
		}
		inv, err := inventory.Open(inventory.Config{Backend: inventory.BackendMock, Hostname: "proc-2", MachineID: "proc-2-machine", SystemSerial: "proc-2-serial"})
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = inv.Close() }()
		_, err = join.Join(ctx, join.Config{Gateway: gwAddr, ServerName: "127.0.0.1", RootCAs: p.ca.Pool(), Token: token,
			JoinserviceKey: p.key.PublicKey(), State: st, Claims: inv, Timeout: 20 * time.Second})
		return err
	}
	dir := t.TempDir()
	if err := joinOnce(dir); status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), jsAddr) {
		t.Fatalf("Join with joinservice killed: %v, want UNAVAILABLE naming %s", err, jsAddr)
	}
	js = startProc(t, bin, jsEnv, "serve", "--roles", "joinservice", "--port", "0", "--no-migrate")
	waitListening(t, jsAddr, js)
	poll.UntilNil(t, 30*time.Second, "a Join once joinservice is back", func() error {
		err := joinOnce(dir)
		if status.Code(err) == codes.Unavailable {
			time.Sleep(100 * time.Millisecond) // the node's retry back-off, not an assertion
			return err
		}
		if err != nil {
			t.Fatalf("Join after joinservice came back: %v", err)
		}
		return nil
	})
}
