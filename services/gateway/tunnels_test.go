package gateway_test

import (
	"context"
	"crypto/tls"
	"io"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/gateway"
)

// readySession opens node id's session and waits until it is ready.
func readySession(t *testing.T, f *harness, id string) (agentv1.NodeServiceClient, agentv1.NodeService_SessionClient) {
	t.Helper()
	f.addNode(t, id)
	cert := f.ca.node(t, id)
	c := f.client(t, f.addr, &cert)
	stream, _ := open(t, c, id)
	poll.Until(t, 10*time.Second, "the session of "+id+" to be ready", func() bool { return f.gw.Ready(id) })
	return c, stream
}

// nextOpen reads the session until an OpenTunnel arrives.
func nextOpen(t *testing.T, s agentv1.NodeService_SessionClient) *agentv1.OpenTunnel {
	t.Helper()
	for {
		m, err := s.Recv()
		if err != nil {
			t.Fatalf("session: %v", err)
		}
		if o := m.GetOpenTunnel(); o != nil {
			return o
		}
	}
}

type opened struct {
	tun *gateway.Tunnel
	err error
}

func openAsync(f *harness, node, id, target string) chan opened {
	ch := make(chan opened, 1)
	go func() {
		tun, err := f.gw.OpenTunnel(context.Background(), node, id, target)
		ch <- opened{tun, err}
	}()
	return ch
}

func TestTunnel_RelaysBothWaysAndEndsWithTheSession(t *testing.T) {
	t.Parallel()
	f := setup(t)
	c, sess := readySession(t, f, "node_t")
	res := openAsync(f, "node_t", "tun_1", "127.0.0.1:2222")
	o := nextOpen(t, sess)
	if o.GetTunnelId() != "tun_1" || o.GetTarget() != "127.0.0.1:2222" {
		t.Fatalf("open %v", o)
	}
	ts, err := c.Tunnel(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if err := ts.Send(&agentv1.TunnelRequest{TunnelId: "tun_1"}); err != nil {
		t.Fatal(err)
	}
	r := <-res
	if r.err != nil {
		t.Fatal(r.err)
	}
	tun := r.tun
	if _, err := tun.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	if f, err := ts.Recv(); err != nil || string(f.GetData()) != "ping" {
		t.Fatalf("node got %v, %v", f, err)
	}
	if err := ts.Send(&agentv1.TunnelRequest{Data: []byte("pong"), CloseWrite: true}); err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(tun)
	if err != nil || string(b) != "pong" {
		t.Fatalf("caller got %q, %v", b, err)
	}
	// The node's session ends: so does the tunnel, at both ends.
	if err := sess.CloseSend(); err != nil {
		t.Fatal(err)
	}
	<-tun.Done()
	if tun.Cause() == nil {
		t.Error("no cause for a tunnel ended by its session")
	}
	for {
		if _, err := ts.Recv(); err != nil {
			if status.Code(err) != codes.Aborted {
				t.Errorf("node's stream ended with %v, want ABORTED", err)
			}
			break
		}
	}
}

func TestTunnel_RefusalAndForgedStreams(t *testing.T) {
	t.Parallel()
	f := setup(t)
	c, sess := readySession(t, f, "node_r")
	other, _ := readySession(t, f, "node_x")

	// The node refuses: the caller hears the node's reason.
	res := openAsync(f, "node_r", "tun_r", "10.0.0.1:22")
	nextOpen(t, sess)
	ts, err := c.Tunnel(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if err := ts.Send(&agentv1.TunnelRequest{TunnelId: "tun_r", Error: "target 10.0.0.1:22 is not in the node's tunnels allowlist"}); err != nil {
		t.Fatal(err)
	}
	r := <-res
	if fault.CodeOf(r.err) != fault.AccessDenied {
		t.Fatalf("refusal: %v", r.err)
	}

	// Another node cannot answer for a tunnel, and an unknown id is refused.
	res = openAsync(f, "node_r", "tun_s", "127.0.0.1:2222")
	nextOpen(t, sess)
	for _, forged := range []struct {
		c  agentv1.NodeServiceClient
		id string
	}{{other, "tun_s"}, {c, "tun_unknown"}} {
		fs, err := forged.c.Tunnel(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if err := fs.Send(&agentv1.TunnelRequest{TunnelId: forged.id}); err != nil {
			t.Fatal(err)
		}
		if _, err := fs.Recv(); status.Code(err) != codes.NotFound {
			t.Errorf("forged stream %s: %v, want NOT_FOUND", forged.id, err)
		}
	}
	// The right node still can.
	ts, err = c.Tunnel(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if err := ts.Send(&agentv1.TunnelRequest{TunnelId: "tun_s"}); err != nil {
		t.Fatal(err)
	}
	r = <-res
	if r.err != nil {
		t.Fatal(r.err)
	}
	r.tun.Close(nil)
	if _, err := ts.Recv(); err == nil {
		t.Error("the node's stream stayed open after Close")
	}

	// No session: UNAVAILABLE.
	if _, err := f.gw.OpenTunnel(t.Context(), "node_none", "tun_n", "127.0.0.1:2222"); fault.CodeOf(err) != fault.Unavailable {
		t.Errorf("no session: %v", err)
	}
}

// relayClient is GatewayService as a caller holding cert sees it.
func (f *harness) relayClient(t *testing.T, cert tls.Certificate) agentv1.GatewayServiceClient {
	t.Helper()
	cfg := &tls.Config{RootCAs: f.ca.pool, ServerName: "gateway.test", MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cert}}
	conn, err := grpc.NewClient(f.addr, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return agentv1.NewGatewayServiceClient(conn)
}

// GatewayService.Relay takes gateway-class certificates only, and relays
// to the node the gateway holds.
func TestRelay_ControlPlaneOnly(t *testing.T) {
	t.Parallel()
	f := setup(t)
	c, sess := readySession(t, f, "node_rl")
	node := f.ca.node(t, "node_rl")
	st, err := f.relayClient(t, node).Relay(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	_ = st.Send(&agentv1.RelayRequest{TunnelId: "tun_x", NodeId: "node_rl", Target: "127.0.0.1:2222"})
	if _, err := st.Recv(); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("a node's certificate: %v, want PERMISSION_DENIED", err)
	}

	api := f.ca.issue(t, "spiffe://"+trustDomain+"/gateway/api-1", "", time.Now().Add(time.Hour))
	st, err = f.relayClient(t, api).Relay(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&agentv1.RelayRequest{TunnelId: "tun_rl", NodeId: "node_rl", Target: "127.0.0.1:2222"}); err != nil {
		t.Fatal(err)
	}
	nextOpen(t, sess)
	ts, err := c.Tunnel(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	_ = ts.Send(&agentv1.TunnelRequest{TunnelId: "tun_rl"})
	if m, err := st.Recv(); err != nil || !m.GetOpened() {
		t.Fatalf("opened %v %v", m, err)
	}
	_ = st.Send(&agentv1.RelayRequest{Data: []byte("hi")})
	if fr, err := ts.Recv(); err != nil || string(fr.GetData()) != "hi" {
		t.Fatalf("node got %v %v", fr, err)
	}
	_ = ts.Send(&agentv1.TunnelRequest{Data: []byte("yo"), CloseWrite: true})
	if m, err := st.Recv(); err != nil || string(m.GetData()) != "yo" {
		t.Fatalf("caller got %v %v", m, err)
	}

	// The node's refusal comes back as its code.
	st, _ = f.relayClient(t, api).Relay(t.Context())
	_ = st.Send(&agentv1.RelayRequest{TunnelId: "tun_no", NodeId: "node_rl", Target: "10.0.0.1:22"})
	nextOpen(t, sess)
	ts, _ = c.Tunnel(t.Context())
	_ = ts.Send(&agentv1.TunnelRequest{TunnelId: "tun_no", Error: "not in the allowlist"})
	if m, err := st.Recv(); err != nil || m.GetOpened() || m.GetErrorCode() != string(fault.AccessDenied) {
		t.Fatalf("refusal %v %v", m, err)
	}
}
