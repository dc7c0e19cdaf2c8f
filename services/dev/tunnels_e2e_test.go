package dev_test

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/coder/websocket"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/api"
	"github.com/bettercompute/bettercompute/services/app"
	"github.com/bettercompute/bettercompute/services/cli"
	"github.com/bettercompute/bettercompute/services/dev"
)

// tunnelEnv starts a control plane with one simulated node whose pool
// allows loopback ports 1024-65535, converged, and returns it, its
// database and the node.
func tunnelEnv(t testing.TB, mods ...func(*config.Config)) (*dev.Env, *pgxpool.Pool, string) {
	t.Helper()
	var env *dev.Env
	var db *pgxpool.Pool
	if len(mods) == 0 {
		env, db = commandEnv(t, "")
	} else {
		dbURL := pgtest.NewDB(t)
		port, none := 0, 0
		cfg := &config.Config{
			Database: config.Database{URL: dbURL},
			Server:   config.Server{Host: "127.0.0.1", Port: &port},
			Dev:      config.Dev{DataDir: t.TempDir(), SimNodes: &none},
			Gateway:  config.Gateway{Listen: "127.0.0.1:0", HeartbeatInterval: config.Duration(100 * time.Millisecond), LivenessInterval: config.Duration(100 * time.Millisecond)},
		}
		for _, m := range mods {
			m(cfg)
		}
		cfg.Defaults()
		var err error
		if env, err = dev.StartWith(context.Background(), cfg, app.Options{}); err != nil {
			t.Fatal(err)
		}
		if db, err = pgxpool.New(context.Background(), dbURL); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(db.Close)
	}
	t.Cleanup(func() { env.Stop(context.Background()) })
	f := simFleet(t, env, db, "tun", 1, nil)
	node := f.Nodes()[0]
	var pool string
	if err := db.QueryRow(t.Context(), `SELECT pool_id FROM nodes WHERE id = $1`, node).Scan(&pool); err != nil {
		t.Fatal(err)
	}
	var out map[string]any
	call(t, env, "pools/update", map[string]any{"tenantId": "root", "poolId": pool, "updateMask": "tunnels",
		"tunnels": map[string]any{"allow": []any{map[string]any{"cidr": "127.0.0.1/32", "portMin": 1024, "portMax": 65535}}}}, &out)
	poll.Until(t, time.Minute, "the node to apply its tunnels section", func() bool {
		var ok bool
		err := db.QueryRow(t.Context(), `SELECT spec ? 'tunnels' AND observed_generation = generation FROM nodes WHERE id = $1`, node).Scan(&ok)
		return err == nil && ok
	})
	return env, db, node
}

// echo listens on loopback and echoes each connection until its EOF.
func echo(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				_, _ = io.Copy(c, c)
				_ = c.(*net.TCPConn).CloseWrite()
				_ = c.Close()
			}()
		}
	}()
	return ln.Addr().(*net.TCPAddr).Port
}

// The node's session ending (here: its certificates revoked) closes its
// tunnels at both ends.
func TestTunnelEndsWithTheNodesSession(t *testing.T) {
	t.Parallel()
	env, db, node := tunnelEnv(t)
	o := openTunnel(t, env, node, "127.0.0.1:"+strconv.Itoa(echo(t)), 0)
	c, err := dialTunnel(t, env, o.ConnectToken)
	if err != nil {
		t.Fatal(err)
	}
	var out map[string]any
	call(t, env, "nodes/revoke", map[string]any{"tenantId": "root", "nodeId": node, "reason": "e2e"}, &out)
	if _, err := readUntilClosed(t.Context(), c); websocket.CloseStatus(err) != websocket.StatusInternalError {
		t.Errorf("closed with %v", err)
	}
	if ev := closedEvent(t, db, o.Tunnel.ID); ev["closeReason"] != "session_ended" {
		t.Errorf("tunnel.closed %v, want session_ended", ev)
	}
}

type openedTunnel struct {
	Tunnel       struct{ ID string }
	ConnectToken string
}

func openTunnel(t testing.TB, env *dev.Env, node, target string, secs int) openedTunnel {
	t.Helper()
	var o openedTunnel
	call(t, env, "tunnels/open", map[string]any{"tenantId": "root", "nodeId": node, "target": target, "reason": "e2e", "notAfterSeconds": secs}, &o)
	return o
}

// dialTunnel connects a tunnel's WebSocket; the error is the node's
// refusal, if any.
func dialTunnel(t testing.TB, env *dev.Env, token string) (*websocket.Conn, error) {
	t.Helper()
	c, resp, err := websocket.Dial(t.Context(), "ws://"+env.App.Addr()+api.TunnelConnectPath,
		&websocket.DialOptions{HTTPHeader: http.Header{api.TunnelTokenHeader: {token}}})
	if resp != nil && resp.Body != nil {
		_ = resp.Body.Close()
	}
	if err != nil {
		t.Fatal(err)
	}
	c.SetReadLimit(64 << 10)
	typ, b, err := c.Read(t.Context())
	if err != nil {
		return nil, err
	}
	if typ != websocket.MessageText || !json.Valid(b) {
		t.Fatalf("first message %v %q", typ, b)
	}
	return c, nil
}

// closedEvent waits for the tunnel's tunnel.closed event and returns its
// payload.
func closedEvent(t *testing.T, db *pgxpool.Pool, id string) map[string]any {
	t.Helper()
	var raw []byte
	poll.Until(t, time.Minute, "tunnel.closed of "+id, func() bool {
		err := db.QueryRow(context.Background(), `SELECT payload FROM outbox WHERE type = 'tunnel.closed' AND payload->>'id' = $1`, id).Scan(&raw)
		return err == nil
	})
	var p map[string]any
	if err := json.Unmarshal(raw, &p); err != nil {
		t.Fatal(err)
	}
	return p
}

// readUntilClosed reads a tunnel's WebSocket to its end and returns the
// data and the close error.
func readUntilClosed(ctx context.Context, c *websocket.Conn) ([]byte, error) {
	var got []byte
	for {
		_, b, err := c.Read(ctx)
		if err != nil {
			return got, err
		}
		got = append(got, b...)
	}
}

func TestTunnelEndToEnd(t *testing.T) {
	t.Parallel()
	env, db, node := tunnelEnv(t)
	port := echo(t)
	target := "127.0.0.1:" + strconv.Itoa(port)

	t.Run("bytes both ways, counted exactly in tunnel.closed", func(t *testing.T) {
		o := openTunnel(t, env, node, target, 0)
		c, err := dialTunnel(t, env, o.ConnectToken)
		if err != nil {
			t.Fatal(err)
		}
		payload := bytes.Repeat([]byte("tunnel!"), 40000) // 280,000 bytes
		go func() {
			for i := 0; i < len(payload); i += 20000 {
				_ = c.Write(t.Context(), websocket.MessageBinary, payload[i:min(i+20000, len(payload))])
			}
			_ = c.Write(t.Context(), websocket.MessageBinary, nil) // all sent
		}()
		got, err := readUntilClosed(t.Context(), c)
		if websocket.CloseStatus(err) != websocket.StatusNormalClosure {
			t.Errorf("closed with %v", err)
		}
		if !bytes.Equal(got, payload) {
			t.Fatalf("echoed %d bytes, want %d equal", len(got), len(payload))
		}
		ev := closedEvent(t, db, o.Tunnel.ID)
		want := strconv.Itoa(len(payload))
		if ev["bytesIn"] != want || ev["bytesOut"] != want || ev["closeReason"] != "closed" {
			t.Errorf("tunnel.closed %v, want %s bytes each way, closed", ev, want)
		}
	})

	t.Run("the gRPC Connect stream carries a tunnel too", func(t *testing.T) {
		o := openTunnel(t, env, node, target, 0)
		conn, err := grpc.NewClient(env.App.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = conn.Close() }()
		st, err := computev1.NewTunnelsServiceClient(conn).Connect(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if err := st.Send(&computev1.TunnelsServiceConnectRequest{ConnectToken: o.ConnectToken}); err != nil {
			t.Fatal(err)
		}
		if m, err := st.Recv(); err != nil || m.GetTunnel().GetId() != o.Tunnel.ID {
			t.Fatalf("first message %v %v", m, err)
		}
		if err := st.Send(&computev1.TunnelsServiceConnectRequest{Data: []byte("over gRPC"), CloseWrite: true}); err != nil {
			t.Fatal(err)
		}
		var got []byte
		for {
			m, err := st.Recv()
			if err != nil {
				if !errors.Is(err, io.EOF) {
					t.Fatalf("stream ended with %v", err)
				}
				break
			}
			got = append(got, m.GetData()...)
		}
		if string(got) != "over gRPC" {
			t.Errorf("echoed %q", got)
		}
		if ev := closedEvent(t, db, o.Tunnel.ID); ev["bytesIn"] != "9" || ev["bytesOut"] != "9" {
			t.Errorf("tunnel.closed %v", ev)
		}
	})

	t.Run("a target outside the allowlist is refused by the node", func(t *testing.T) {
		o := openTunnel(t, env, node, "127.0.0.1:22", 0) // port 22 < 1024
		if _, err := dialTunnel(t, env, o.ConnectToken); err == nil || websocket.CloseStatus(err) != websocket.StatusInternalError {
			t.Fatalf("refused tunnel: %v", err)
		}
		if ev := closedEvent(t, db, o.Tunnel.ID); ev["closeReason"] != "refused" {
			t.Errorf("tunnel.closed %v, want refused", ev)
		}
	})

	t.Run("tunnels.close ends the stream", func(t *testing.T) {
		o := openTunnel(t, env, node, target, 0)
		c, err := dialTunnel(t, env, o.ConnectToken)
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Write(t.Context(), websocket.MessageBinary, []byte("hello")); err != nil {
			t.Fatal(err)
		}
		if _, b, err := c.Read(t.Context()); err != nil || string(b) != "hello" {
			t.Fatalf("echo %q %v", b, err)
		}
		var out map[string]map[string]any
		call(t, env, "tunnels/close", map[string]any{"tenantId": "root", "tunnelId": o.Tunnel.ID}, &out)
		if out["tunnel"]["closeReason"] != "tunnels.close" || out["tunnel"]["bytesIn"] != "5" {
			t.Errorf("closed %v", out)
		}
		if _, err := readUntilClosed(t.Context(), c); websocket.CloseStatus(err) == -1 {
			t.Errorf("the WebSocket did not close: %v", err)
		}
	})

	t.Run("revoking the opener's key ends the stream", func(t *testing.T) {
		var who struct{ IdentityID string }
		call(t, env, "system/whoAmI", map[string]any{}, &who)
		var key struct {
			APIKey struct{ ID string }
			Secret string
		}
		call(t, env, "apiKeys/create", map[string]any{"tenantId": "root", "identityId": who.IdentityID, "name": "tunnel-e2e"}, &key)
		if key.Secret == "" || key.APIKey.ID == "" {
			t.Fatalf("key %+v", key)
		}
		mine := *env
		mine.Credential = key.Secret
		o := openTunnel(t, &mine, node, target, 0)
		c, err := dialTunnel(t, env, o.ConnectToken)
		if err != nil {
			t.Fatal(err)
		}
		var out map[string]any
		call(t, env, "apiKeys/revoke", map[string]any{"tenantId": "root", "apiKeyId": key.APIKey.ID}, &out)
		if _, err := readUntilClosed(t.Context(), c); websocket.CloseStatus(err) != websocket.StatusInternalError {
			t.Errorf("closed with %v", err)
		}
		if ev := closedEvent(t, db, o.Tunnel.ID); ev["closeReason"] != "revoked" {
			t.Errorf("tunnel.closed %v, want revoked", ev)
		}
	})

	t.Run("a node narrows its pool's allowlist, never widens it", func(t *testing.T) {
		other := "127.0.0.1:" + strconv.Itoa(echo(t))
		var gen int64
		_ = db.QueryRow(t.Context(), `SELECT generation FROM nodes WHERE id = $1`, node).Scan(&gen)
		var out map[string]any
		call(t, env, "nodes/update", map[string]any{"tenantId": "root", "nodeId": node, "updateMask": "tunnels",
			"tunnels": map[string]any{"allow": []any{
				map[string]any{"cidr": "127.0.0.1/32", "portMin": port},
				map[string]any{"cidr": "10.0.0.0/8", "portMin": 22}, // outside the pool's: still refused
			}}}, &out)
		poll.Until(t, time.Minute, "the node to apply its narrowing", func() bool {
			var ok bool
			err := db.QueryRow(t.Context(), `SELECT spec->'tunnels' ? 'narrow' AND observed_generation = generation AND generation > $2
				FROM nodes WHERE id = $1`, node, gen).Scan(&ok)
			return err == nil && ok
		})
		for _, outside := range []string{other, "10.0.0.1:22"} {
			o := openTunnel(t, env, node, outside, 0)
			if _, err := dialTunnel(t, env, o.ConnectToken); err == nil {
				t.Fatalf("%s, outside the node's narrowing or its pool's allowlist, was reached", outside)
			}
		}
		o := openTunnel(t, env, node, target, 0)
		c, err := dialTunnel(t, env, o.ConnectToken)
		if err != nil {
			t.Fatalf("the narrowed-to target: %v", err)
		}
		_ = c.Close(websocket.StatusNormalClosure, "")
		// A bad rule never reaches a node.
		code, body := post(t, env, "pools/update", map[string]any{"tenantId": "root", "poolId": "x", "updateMask": "tunnels",
			"tunnels": map[string]any{"allow": []any{map[string]any{"cidr": "127.0.0.1/33", "portMin": 1}}}})
		if code != http.StatusBadRequest || !strings.Contains(string(body), "cidr") {
			t.Errorf("bad rule: %d %s", code, body)
		}
		call(t, env, "nodes/update", map[string]any{"tenantId": "root", "nodeId": node, "updateMask": "tunnels"}, &out)
	})

	t.Run("expiry ends the stream", func(t *testing.T) {
		o := openTunnel(t, env, node, target, 1)
		c, err := dialTunnel(t, env, o.ConnectToken)
		if err != nil {
			if ev := closedEvent(t, db, o.Tunnel.ID); ev["closeReason"] == "expired" {
				return // it expired before the connect finished
			}
			t.Fatal(err)
		}
		if _, err := readUntilClosed(t.Context(), c); errors.Is(err, context.Canceled) {
			t.Fatal(err)
		}
		if ev := closedEvent(t, db, o.Tunnel.ID); ev["closeReason"] != "expired" {
			t.Errorf("tunnel.closed %v, want expired", ev)
		}
	})
}

// asCLI makes this test binary the better-compute CLI (see TestMain).
const asCLI = "BETTER_COMPUTE_TEST_AS_CLI"

// TestTunnelOpenSSH runs Debian's OpenSSH client through `better-compute
// ssh` (its ProxyCommand `better-compute tunnel --stdio`) to an sshd
// listening on loopback on the simulated node's host: a command runs and
// its output comes back.
func TestTunnelOpenSSH(t *testing.T) {
	sshd := "/usr/sbin/sshd"
	if _, err := os.Stat(sshd); err != nil {
		t.Skip("no OpenSSH server (Debian's openssh-server; tools/scripts/test-deps.sh installs it)")
	}
	if _, err := exec.LookPath("ssh"); err != nil {
		t.Skip("no OpenSSH client (openssh-client)")
	}
	if os.Geteuid() == 0 {
		// sshd's privilege separation directory.
		if err := os.MkdirAll("/run/sshd", 0o755); err != nil {
			t.Skipf("sshd needs /run/sshd: %v", err)
		}
	}
	dir := t.TempDir()
	for _, k := range []string{"host", "client"} {
		if out, err := exec.Command("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", filepath.Join(dir, k)).CombinedOutput(); err != nil {
			t.Fatalf("ssh-keygen: %v %s", err, out)
		}
	}
	pub, err := os.ReadFile(filepath.Join(dir, "client.pub"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "authorized_keys"), pub, 0o600); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	_ = ln.Close()
	cfg := fmt.Sprintf("Port %d\nListenAddress 127.0.0.1\nHostKey %s\nPidFile %s\nAuthorizedKeysFile %s\n"+
		"PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPermitRootLogin yes\n",
		port, filepath.Join(dir, "host"), filepath.Join(dir, "sshd.pid"), filepath.Join(dir, "authorized_keys"))
	if err := os.WriteFile(filepath.Join(dir, "sshd_config"), []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	var sshdLog bytes.Buffer
	d := exec.Command(sshd, "-D", "-e", "-f", filepath.Join(dir, "sshd_config"))
	d.Stdout, d.Stderr = &sshdLog, &sshdLog
	if err := d.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Process.Kill(); _ = d.Wait() })
	target := "127.0.0.1:" + strconv.Itoa(port)
	poll.Until(t, 30*time.Second, "sshd to listen", func() bool {
		c, err := net.Dial("tcp", target)
		if err == nil {
			_ = c.Close()
		}
		return err == nil
	})

	env, db, node := tunnelEnv(t)
	u, err := user.Current()
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv(asCLI, "1") // the ProxyCommand is this binary
	var stdout, stderr bytes.Buffer
	code := cli.Main([]string{"ssh", "--url", env.BaseURL(), "--token", env.Credential, "--target", target, "--reason", "e2e ssh",
		u.Username + "@" + node, "-n", "-i", filepath.Join(dir, "client"), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
		"-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "echo", "hello-from", "$(hostname)"}, &stdout, &stderr)
	if code != 0 || !strings.HasPrefix(stdout.String(), "hello-from ") {
		t.Fatalf("better-compute ssh: exit %d, stdout %q, stderr %q; sshd: %s", code, stdout.String(), stderr.String(), sshdLog.String())
	}
	// It went through a tunnel, audited with its bytes.
	poll.Until(t, time.Minute, "the ssh tunnel's tunnel.closed", func() bool {
		var n int
		err := db.QueryRow(context.Background(), `SELECT count(*) FROM outbox WHERE type = 'tunnel.closed' AND resource_id = $1
			AND payload->>'target' = $2 AND (payload->>'bytesIn')::bigint > 0 AND (payload->>'bytesOut')::bigint > 0`, node, target).Scan(&n)
		return err == nil && n == 1
	})
}

// syncBuffer is a bytes.Buffer safe for a writer and a reader.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
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

// `better-compute tunnel --local` forwards each accepted connection
// through its own tunnel, like kubectl port-forward.
func TestTunnelCLILocal(t *testing.T) {
	t.Parallel()
	env, db, node := tunnelEnv(t)
	target := "127.0.0.1:" + strconv.Itoa(echo(t))
	var stdout, stderr syncBuffer
	root := cli.NewRoot(&stdout, &stderr)
	root.SetArgs([]string{"tunnel", node, "--url", env.BaseURL(), "--token", env.Credential, "--target", target, "--local", "127.0.0.1:0"})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- root.ExecuteContext(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("tunnel: %v; stderr %s", err, stderr.String())
		}
	}()
	var local string
	re := regexp.MustCompile(`Forwarding (127\.0\.0\.1:\d+) -> `)
	poll.Until(t, 30*time.Second, "the CLI to listen", func() bool {
		if m := re.FindStringSubmatch(stdout.String()); m != nil {
			local = m[1]
		}
		return local != ""
	})
	for i := range 2 {
		c, err := net.Dial("tcp", local)
		if err != nil {
			t.Fatal(err)
		}
		msg := fmt.Sprintf("through the CLI, connection %d", i)
		if _, err := c.Write([]byte(msg)); err != nil {
			t.Fatal(err)
		}
		_ = c.(*net.TCPConn).CloseWrite()
		got, err := io.ReadAll(c)
		_ = c.Close()
		if err != nil || string(got) != msg {
			t.Fatalf("connection %d: %q %v; stderr %s", i, got, err, stderr.String())
		}
	}
	poll.Until(t, time.Minute, "two tunnels closed", func() bool {
		var n int
		err := db.QueryRow(context.Background(), `SELECT count(*) FROM tunnels WHERE node_id = $1 AND target = $2 AND close_reason = 'closed'`, node, target).Scan(&n)
		return err == nil && n == 2
	})
}

// tunnels.nodeBytesPerSecond shapes a node's tunnels: 192 KiB echoed at
// 64 KiB/s each way (a 64 KiB burst) cannot take less than two seconds —
// a lower bound the token bucket guarantees, whatever the machine's load.
func TestTunnelBandwidthShaped(t *testing.T) {
	t.Parallel()
	const rate = 64 << 10
	env, _, node := tunnelEnv(t, func(c *config.Config) { c.Tunnels.NodeBytesPerSecond = rate })
	o := openTunnel(t, env, node, "127.0.0.1:"+strconv.Itoa(echo(t)), 0)
	c, err := dialTunnel(t, env, o.ConnectToken)
	if err != nil {
		t.Fatal(err)
	}
	payload := bytes.Repeat([]byte{'s'}, 3*rate)
	start := time.Now()
	go func() {
		for i := 0; i < len(payload); i += 16 << 10 {
			_ = c.Write(t.Context(), websocket.MessageBinary, payload[i:i+16<<10])
		}
		_ = c.Write(t.Context(), websocket.MessageBinary, nil)
	}()
	got, err := readUntilClosed(t.Context(), c)
	took := time.Since(start)
	if !bytes.Equal(got, payload) || websocket.CloseStatus(err) != websocket.StatusNormalClosure {
		t.Fatalf("echoed %d bytes (%v)", len(got), err)
	}
	if took < 2*time.Second {
		t.Errorf("%d bytes at %d B/s took %s: not shaped", len(payload), rate, took)
	}
}

// An API process without a gateway relays a tunnel to the gateway holding
// the node, in another process, over internal mutual TLS (GatewayService,
// a gateway-class certificate), routed by nodes.gateway_id and the
// gateways table.
func TestTunnelAcrossProcesses(t *testing.T) {
	t.Parallel()
	env, db, node := tunnelEnv(t) // process G: the gateway holding the node
	// Process A: the api role alone, presenting a certificate G's CA issued.
	cert, err := env.App.JoinService().CA().ServingCertificate("api-a", []string{"127.0.0.1"}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	var certPEM []byte
	for _, der := range cert.Certificate {
		certPEM = append(certPEM, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})...)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(cert.PrivateKey)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile := filepath.Join(dir, "api.pem"), filepath.Join(dir, "api.key")
	if err := os.WriteFile(certFile, certPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		t.Fatal(err)
	}
	port := 0
	cfg := &config.Config{Roles: []string{"api"}, Database: config.Database{URL: env.Database},
		Server:  config.Server{Host: "127.0.0.1", Port: &port, NoMigrate: true},
		Gateway: config.Gateway{ID: "api-a", TLS: config.GatewayTLS{CertFile: certFile, KeyFile: keyFile, CAFile: env.CAFile}}}
	cfg.Defaults()
	a, err := app.New(cfg, app.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Stop(context.Background()) })
	if a.GatewayAddr() != "" {
		t.Fatal("process A runs a gateway")
	}
	viaA := *env
	viaA.App = a

	target := "127.0.0.1:" + strconv.Itoa(echo(t))
	o := openTunnel(t, &viaA, node, target, 0)
	c, err := dialTunnel(t, &viaA, o.ConnectToken)
	if err != nil {
		t.Fatal(err)
	}
	payload := bytes.Repeat([]byte("across "), 20000)
	go func() {
		for i := 0; i < len(payload); i += 30000 {
			_ = c.Write(t.Context(), websocket.MessageBinary, payload[i:min(i+30000, len(payload))])
		}
		_ = c.Write(t.Context(), websocket.MessageBinary, nil)
	}()
	got, err := readUntilClosed(t.Context(), c)
	if !bytes.Equal(got, payload) || websocket.CloseStatus(err) != websocket.StatusNormalClosure {
		t.Fatalf("echoed %d bytes of %d (%v)", len(got), len(payload), err)
	}
	ev := closedEvent(t, db, o.Tunnel.ID)
	if want := strconv.Itoa(len(payload)); ev["bytesIn"] != want || ev["bytesOut"] != want {
		t.Errorf("tunnel.closed %v", ev)
	}
	var relayedBy string
	if err := db.QueryRow(t.Context(), `SELECT relay_process FROM tunnels WHERE id = $1`, o.Tunnel.ID).Scan(&relayedBy); err != nil || relayedBy == "" {
		t.Errorf("relay_process %q %v", relayedBy, err)
	}

	// The node still decides: a target outside its allowlist is refused
	// through the other process too.
	o = openTunnel(t, &viaA, node, "127.0.0.1:22", 0)
	if _, err := dialTunnel(t, &viaA, o.ConnectToken); err == nil {
		t.Fatal("a refused target was reached through the other process")
	}
	if ev := closedEvent(t, db, o.Tunnel.ID); ev["closeReason"] != "refused" {
		t.Errorf("tunnel.closed %v, want refused", ev)
	}
}
