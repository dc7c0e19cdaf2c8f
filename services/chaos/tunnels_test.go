package chaos_test

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/coder/websocket"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/sim"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/chaos"
)

// TestTunnelsThroughProcesses: the api process relays a tunnel to the
// gateway process holding the node (GatewayService over internal mutual
// TLS); the gateway SIGKILLed ends its tunnels cleanly, the node's session
// comes back once it is back, and a new tunnel works.
func TestTunnelsThroughProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("starts the control plane as separate processes")
	}
	dbURL := pgtest.NewDB(t)
	db, err := pgxpool.New(t.Context(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	top := chaos.Start(t, chaos.Options{Bin: bin, DBURL: dbURL,
		Env: []string{"BC_GATEWAY_HEARTBEAT_INTERVAL=1s", "BC_GATEWAY_LIVENESS_INTERVAL=1s"}})
	s := &suite{t: t, top: top, db: db, runs: &runs{n: map[string]int{}}}
	s.join(1)
	node := s.nodes[0]
	var out map[string]any
	top.MustCall("pools/update", map[string]any{"tenantId": "root", "poolId": s.pool, "updateMask": "tunnels",
		"tunnels": map[string]any{"allow": []any{map[string]any{"cidr": "127.0.0.1/32", "portMin": 1024, "portMax": 65535}}}}, &out)
	poll.UntilNil(t, time.Minute, "the node to apply its tunnels section", func() error {
		var ok bool
		err := db.QueryRow(t.Context(), `SELECT spec ? 'tunnels' AND observed_generation = generation FROM nodes WHERE id = $1`, node).Scan(&ok)
		if err == nil && !ok {
			err = io.ErrNoProgress
		}
		return s.pause(err)
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ln.Close() }()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c); _ = c.Close() }()
		}
	}()
	apiURL := "ws://" + chaos.Addr(top.Proc("api").Port) + "/api/compute/tunnels/connect"
	connect := func() (*websocket.Conn, string) {
		var o struct {
			Tunnel       struct{ ID string }
			ConnectToken string
		}
		top.MustCall("tunnels/open", map[string]any{"tenantId": "root", "nodeId": node, "target": ln.Addr().String()}, &o)
		c, resp, err := websocket.Dial(t.Context(), apiURL, &websocket.DialOptions{HTTPHeader: http.Header{"X-Tunnel-Token": {o.ConnectToken}}})
		if resp != nil && resp.Body != nil {
			_ = resp.Body.Close()
		}
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := c.Read(t.Context()); err != nil {
			t.Fatalf("tunnel %s through the api process: %v\napi log:\n%s", o.Tunnel.ID, err, top.Proc("api").Log())
		}
		return c, o.Tunnel.ID
	}
	echoOnce := func(c *websocket.Conn, msg string) {
		t.Helper()
		if err := c.Write(t.Context(), websocket.MessageBinary, []byte(msg)); err != nil {
			t.Fatal(err)
		}
		if _, b, err := c.Read(t.Context()); err != nil || string(b) != msg {
			t.Fatalf("echo %q %v", b, err)
		}
	}
	c, id := connect()
	echoOnce(c, "through two processes")

	// SIGKILL the gateway: the tunnel ends at the caller, its row closes.
	var epoch int64
	_ = db.QueryRow(t.Context(), `SELECT session_epoch FROM nodes WHERE id = $1`, node).Scan(&epoch)
	_ = top.Proc("gateway").Signal(syscall.SIGKILL)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	for {
		if _, _, err := c.Read(ctx); err != nil {
			if ctx.Err() != nil {
				t.Fatal("the tunnel outlived its gateway")
			}
			break
		}
	}
	poll.UntilNil(t, time.Minute, "the tunnel's row closed", func() error {
		var closed bool
		err := db.QueryRow(t.Context(), `SELECT closed_at IS NOT NULL FROM tunnels WHERE id = $1`, id).Scan(&closed)
		if err == nil && !closed {
			err = io.ErrNoProgress
		}
		return s.pause(err)
	})
	// The gateway comes back; so does the node's session; a new tunnel works.
	top.Restart("gateway")
	poll.UntilNil(t, 2*time.Minute, "the node's session back", func() error {
		var now int64
		err := db.QueryRow(t.Context(), `SELECT session_epoch FROM nodes WHERE id = $1`, node).Scan(&now)
		if err == nil && now <= epoch {
			err = io.ErrNoProgress
		}
		return s.pause(err)
	})
	c, _ = connect()
	echoOnce(c, "after the gateway came back: "+strconv.Itoa(1))
	_ = c.Close(websocket.StatusNormalClosure, "")
}

// apiCall calls an API method on the api process named proc.
func apiCall(t *testing.T, top *chaos.Topology, proc, method string, body, out any) {
	t.Helper()
	b, _ := json.Marshal(body)
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, "http://"+chaos.Addr(top.Proc(proc).Port)+"/api/compute/"+method, bytes.NewReader(b))
	req.Header.Set("Authorization", "Bearer "+top.Token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s on %s: %d %s", method, proc, resp.StatusCode, raw)
	}
	if err := json.Unmarshal(raw, out); err != nil {
		t.Fatal(err)
	}
}

// echoVia opens a tunnel to target on node through the api process proc
// and checks one message comes back.
func echoVia(t *testing.T, top *chaos.Topology, proc, node, target string) {
	t.Helper()
	var o struct {
		Tunnel       struct{ ID string }
		ConnectToken string
	}
	apiCall(t, top, proc, "tunnels/open", map[string]any{"tenantId": "root", "nodeId": node, "target": target}, &o)
	c, resp, err := websocket.Dial(t.Context(), "ws://"+chaos.Addr(top.Proc(proc).Port)+"/api/compute/tunnels/connect",
		&websocket.DialOptions{HTTPHeader: http.Header{"X-Tunnel-Token": {o.ConnectToken}}})
	if resp != nil && resp.Body != nil {
		_ = resp.Body.Close()
	}
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close(websocket.StatusNormalClosure, "") }()
	if _, _, err := c.Read(t.Context()); err != nil {
		t.Fatalf("tunnel to %s through %s: %v\n%s log:\n%s", node, proc, err, proc, top.Proc(proc).Log())
	}
	msg := "via " + proc + " to " + node
	if err := c.Write(t.Context(), websocket.MessageBinary, []byte(msg)); err != nil {
		t.Fatal(err)
	}
	if _, b, err := c.Read(t.Context()); err != nil || string(b) != msg {
		t.Fatalf("echo %q %v", b, err)
	}
}

// TestTunnelsRoutedToTheRightGateway: two api processes and two gateway
// processes, a node on each gateway; a tunnel to either node through
// either api process reaches the gateway holding that node.
func TestTunnelsRoutedToTheRightGateway(t *testing.T) {
	if testing.Short() {
		t.Skip("starts the control plane as separate processes")
	}
	dbURL := pgtest.NewDB(t)
	db, err := pgxpool.New(t.Context(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	top := chaos.Start(t, chaos.Options{Bin: bin, DBURL: dbURL,
		Env:   []string{"BC_GATEWAY_HEARTBEAT_INTERVAL=1s", "BC_GATEWAY_LIVENESS_INTERVAL=1s"},
		Extra: map[string]string{"gateway-b": "gateway", "api-b": "api"}})
	s := &suite{t: t, top: top, db: db, runs: &runs{n: map[string]int{}}}
	s.join(1)
	// A second node, on gateway-b.
	var tok struct{ Token string }
	top.MustCall("joinTokens/create", map[string]any{"tenantId": "root", "poolId": s.pool, "uses": 1, "idempotencyKey": "chaos-token-b"}, &tok)
	caPEM, _ := os.ReadFile(filepath.Join(top.Public, "ca.pem"))
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(caPEM)
	keyPEM, _ := os.ReadFile(filepath.Join(top.Public, "joinservice.pub"))
	pub, keyID, err := join.ParsePublicKey(keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	fb, err := sim.Start(t.Context(), sim.Config{Gateway: top.ExtraGateways["gateway-b"], ServerName: "127.0.0.1", RootCAs: roots, Token: tok.Token,
		JoinserviceKey: pub, JoinserviceKeyID: keyID, Root: t.TempDir(), Prefix: "chaosb", NoLogFiles: true, NoReboot: true}, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fb.Stop)
	nodes := map[string]string{s.nodes[0]: "gw-chaos", fb.Nodes()[0]: "gateway-b"}
	var out map[string]any
	top.MustCall("pools/update", map[string]any{"tenantId": "root", "poolId": s.pool, "updateMask": "tunnels",
		"tunnels": map[string]any{"allow": []any{map[string]any{"cidr": "127.0.0.1/32", "portMin": 1024, "portMax": 65535}}}}, &out)
	for node, gw := range nodes {
		poll.UntilNil(t, 2*time.Minute, node+" on "+gw+" with its tunnels section", func() error {
			var ok bool
			err := db.QueryRow(t.Context(), `SELECT gateway_id = $2 AND spec ? 'tunnels' AND observed_generation = generation
				FROM nodes WHERE id = $1`, node, gw).Scan(&ok)
			if err == nil && !ok {
				err = io.ErrNoProgress
			}
			return s.pause(err)
		})
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ln.Close() }()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c); _ = c.Close() }()
		}
	}()
	for _, proc := range []string{"api", "api-b"} {
		for node := range nodes {
			echoVia(t, top, proc, node, ln.Addr().String())
		}
	}
}
