package chaos_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/coder/websocket"
	"github.com/jackc/pgx/v5/pgxpool"

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
