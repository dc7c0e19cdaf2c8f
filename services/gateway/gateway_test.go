package gateway_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"io"
	"math/big"
	"net"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/gateway"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

const trustDomain = "test.bettercompute"

// testCA issues certificates for the test.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pool *x509.CertPool
}

func newCA(t testing.TB) *testCA {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return &testCA{cert: cert, key: key, pool: pool}
}

var serial atomic.Int64

func (ca *testCA) issue(t testing.TB, spiffe string, dns string, notAfter time.Time) tls.Certificate {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(100 + serial.Add(1)),
		NotBefore:    time.Now().Add(-time.Hour), NotAfter: notAfter,
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth},
	}
	if spiffe != "" {
		u, _ := url.Parse(spiffe)
		tmpl.URIs = []*url.URL{u}
	}
	if dns != "" {
		tmpl.DNSNames = []string{dns}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, _ := x509.ParseCertificate(der)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}
}

func (ca *testCA) node(t testing.TB, id string) tls.Certificate {
	return ca.issue(t, "spiffe://"+trustDomain+"/node/"+id, "", time.Now().Add(time.Hour))
}

// joiner answers Join with a fixed response; Renew echoes the chain's node.
type joiner struct{ renewedFor atomic.Value }

func (j *joiner) Join(context.Context, *agentv1.JoinRequest) (*agentv1.JoinResponse, error) {
	return &agentv1.JoinResponse{NodeId: "node_joined"}, nil
}

func (j *joiner) Renew(_ context.Context, chain []*x509.Certificate, _ *agentv1.RenewRequest) (*agentv1.RenewResponse, error) {
	j.renewedFor.Store(chain[0].URIs[0].String())
	return &agentv1.RenewResponse{}, nil
}

type harness struct {
	ca      *testCA
	db      *pgxpool.Pool
	gw      *gateway.Gateway
	addr    string
	joiner  *joiner
	revoked map[string]bool
	// signer is the command-signing key of the api side: harness.enqueue
	// signs with it, the gateway never sees it.
	signer *commands.Signer
	// tune, set before serve, changes the gateway's configuration.
	tune func(*gateway.Config)
	mu   sync.Mutex // guards revoked once serving
}

func setup(t testing.TB) *harness {
	t.Helper()
	_, key, _ := ed25519.GenerateKey(rand.Reader)
	f := &harness{ca: newCA(t), db: pgtest.New(t), joiner: &joiner{}, revoked: map[string]bool{}, signer: commands.NewSigner(key)}
	f.gw, f.addr = f.serve(t, "gw-1")
	return f
}

// serve runs a gateway over mTLS on a free port.
func (f *harness) serve(t testing.TB, id string) (*gateway.Gateway, string) {
	t.Helper()
	cfg := gateway.Config{
		ID: id, DB: f.db, Joiner: f.joiner, TrustDomain: trustDomain,
		Revoked: func(_ context.Context, serials []string) ([]string, error) {
			f.mu.Lock()
			defer f.mu.Unlock()
			var out []string
			for _, serial := range serials {
				if f.revoked[serial] {
					out = append(out, serial)
				}
			}
			return out, nil
		},
		// Liveness is flushed by hand in tests.
		LivenessInterval: time.Hour,
	}
	if f.tune != nil {
		f.tune(&cfg)
	}
	gw, err := gateway.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := gw.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	srvCert := f.ca.issue(t, "", "gateway.test", time.Now().Add(time.Hour))
	creds := credentials.NewTLS(&tls.Config{
		Certificates: []tls.Certificate{srvCert},
		ClientCAs:    f.ca.pool,
		ClientAuth:   tls.VerifyClientCertIfGiven,
		MinVersion:   tls.VersionTLS13,
	})
	gs := grpc.NewServer(grpc.Creds(creds))
	agentv1.RegisterNodeServiceServer(gs, gw)
	agentv1.RegisterGatewayServiceServer(gs, gw.RelayService())
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = gs.Serve(ln) }()
	t.Cleanup(func() { gw.Stop(); gs.Stop() })
	return gw, ln.Addr().String()
}

// revoke makes the harness's revocation check refuse serial.
func (f *harness) revoke(serial string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.revoked[serial] = true
}

// addNode adds node id, adopting (as a join leaves it), in a pool of its own.
func (f *harness) addNode(t testing.TB, id string) {
	t.Helper()
	fixture.Node(t, f.db, fixture.NodeOpts{ID: id})
}

func (f *harness) client(t testing.TB, addr string, cert *tls.Certificate) agentv1.NodeServiceClient {
	t.Helper()
	cfg := &tls.Config{RootCAs: f.ca.pool, ServerName: "gateway.test", MinVersion: tls.VersionTLS13}
	if cert != nil {
		cfg.Certificates = []tls.Certificate{*cert}
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return agentv1.NewNodeServiceClient(conn)
}

func hello(id string) *agentv1.SessionRequest {
	return &agentv1.SessionRequest{Body: &agentv1.SessionRequest_Hello{Hello: &agentv1.Hello{NodeId: id, BootId: "boot-1", JournalId: "journal-1", AgentVersion: "test"}}}
}

func inventory() *agentv1.SessionRequest {
	return &agentv1.SessionRequest{Body: &agentv1.SessionRequest_Inventory{Inventory: &agentv1.InventoryReport{
		Sections: []string{"gpus"}, Gpus: []*agentv1.GPU{{Index: 0, Uuid: "GPU-1", Model: "NVIDIA H200", Healthy: true}},
	}}}
}

// open starts a session and returns the stream after Welcome and the
// inventory request.
func open(t testing.TB, c agentv1.NodeServiceClient, id string) (agentv1.NodeService_SessionClient, *agentv1.Welcome) {
	t.Helper()
	stream, err := c.Session(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(hello(id)); err != nil {
		t.Fatal(err)
	}
	m, err := stream.Recv()
	if err != nil {
		t.Fatalf("no Welcome: %v", err)
	}
	w := m.GetWelcome()
	if w == nil {
		t.Fatalf("first message %v", m)
	}
	m, err = stream.Recv()
	if err != nil || m.GetInventoryRequest() == nil {
		t.Fatalf("no inventory request: %v %v", m, err)
	}
	return stream, w
}

func TestSession(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.addNode(t, "node_a")
	cert := f.ca.node(t, "node_a")
	c := f.client(t, f.addr, &cert)

	stream, w := open(t, c, "node_a")
	if w.GetSessionEpoch() != 1 || w.GetGatewayId() != "gw-1" || w.GetHeartbeatIntervalMs() == 0 {
		t.Fatalf("welcome %v", w)
	}
	var gw, boot string
	_ = f.db.QueryRow(t.Context(), `SELECT gateway_id, boot_id FROM nodes WHERE id = 'node_a'`).Scan(&gw, &boot)
	if gw != "gw-1" || boot != "boot-1" {
		t.Fatalf("routing not recorded: gateway %q boot %q", gw, boot)
	}

	if err := stream.Send(inventory()); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 15*time.Second, "the report to be stored and the controller enqueued", func() bool {
		var n int
		_ = f.db.QueryRow(t.Context(), `SELECT count(*) FROM node_inventory i JOIN work_queue w ON w.kind = 'inventory' AND w.key = i.node_id WHERE i.node_id = 'node_a' AND i.report->'gpus'->0->>'uuid' = 'GPU-1'`).Scan(&n)
		return n == 1
	})

	// Liveness: one write for every session heard from.
	if _, err := f.db.Exec(t.Context(), `UPDATE nodes SET last_seen_at = now() - interval '1 hour'`); err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&agentv1.SessionRequest{Body: &agentv1.SessionRequest_Heartbeat{Heartbeat: &agentv1.Heartbeat{Sequence: 1}}}); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 15*time.Second, "liveness to be written", func() bool {
		if err := f.gw.FlushLiveness(t.Context()); err != nil {
			t.Fatal(err)
		}
		var fresh bool
		_ = f.db.QueryRow(t.Context(), `SELECT last_seen_at > now() - interval '1 minute' FROM nodes WHERE id = 'node_a'`).Scan(&fresh)
		return fresh
	})
}

func TestSessionRefusesBadIdentities(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.addNode(t, "node_a")
	f.addNode(t, "node_b")

	expect := func(t *testing.T, c agentv1.NodeServiceClient, id string, want codes.Code) {
		t.Helper()
		stream, err := c.Session(t.Context())
		if err == nil {
			err = stream.Send(hello(id))
		}
		if err == nil || errors.Is(err, io.EOF) {
			// A stream the server already ended says why on Recv.
			_, err = stream.Recv()
		}
		if status.Code(err) != want {
			t.Fatalf("session as %s: %v, want %s", id, err, want)
		}
	}

	t.Run("a certificate for A saying Hello as B", func(t *testing.T) {
		cert := f.ca.node(t, "node_a")
		expect(t, f.client(t, f.addr, &cert), "node_b", codes.PermissionDenied)
	})
	t.Run("no certificate", func(t *testing.T) {
		expect(t, f.client(t, f.addr, nil), "node_a", codes.Unauthenticated)
	})
	t.Run("a revoked certificate", func(t *testing.T) {
		cert := f.ca.node(t, "node_a")
		f.revoke(cert.Leaf.SerialNumber.Text(16))
		expect(t, f.client(t, f.addr, &cert), "node_a", codes.PermissionDenied)
	})
	t.Run("another trust domain", func(t *testing.T) {
		cert := f.ca.issue(t, "spiffe://evil.example/node/node_a", "", time.Now().Add(time.Hour))
		expect(t, f.client(t, f.addr, &cert), "node_a", codes.PermissionDenied)
	})
	t.Run("not a node identity", func(t *testing.T) {
		cert := f.ca.issue(t, "spiffe://"+trustDomain+"/gateway/gw-1", "", time.Now().Add(time.Hour))
		expect(t, f.client(t, f.addr, &cert), "node_a", codes.PermissionDenied)
	})
	t.Run("an expired certificate fails the handshake", func(t *testing.T) {
		cert := f.ca.issue(t, "spiffe://"+trustDomain+"/node/node_a", "", time.Now().Add(-time.Minute))
		expect(t, f.client(t, f.addr, &cert), "node_a", codes.Unavailable)
	})
	t.Run("a node that does not exist", func(t *testing.T) {
		cert := f.ca.node(t, "node_gone")
		expect(t, f.client(t, f.addr, &cert), "node_gone", codes.NotFound)
	})
	t.Run("Join needs no certificate; Renew does", func(t *testing.T) {
		c := f.client(t, f.addr, nil)
		if r, err := c.Join(t.Context(), &agentv1.JoinRequest{}); err != nil || r.GetNodeId() != "node_joined" {
			t.Fatalf("join: %v %v", r, err)
		}
		if _, err := c.Renew(t.Context(), &agentv1.RenewRequest{}); status.Code(err) != codes.Unauthenticated {
			t.Fatalf("renew without a certificate: %v", err)
		}
		cert := f.ca.node(t, "node_a")
		if _, err := f.client(t, f.addr, &cert).Renew(t.Context(), &agentv1.RenewRequest{}); err != nil {
			t.Fatal(err)
		}
		if got := f.joiner.renewedFor.Load(); got != "spiffe://"+trustDomain+"/node/node_a" {
			t.Fatalf("renew relayed for %v", got)
		}
	})
}

func TestNewerSessionSupersedesOlder(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.addNode(t, "node_a")
	cert := f.ca.node(t, "node_a")

	t.Run("on the same gateway the older stream is closed", func(t *testing.T) {
		c := f.client(t, f.addr, &cert)
		old, w1 := open(t, c, "node_a")
		_, w2 := open(t, c, "node_a")
		if w2.GetSessionEpoch() != w1.GetSessionEpoch()+1 {
			t.Fatalf("epochs %d then %d", w1.GetSessionEpoch(), w2.GetSessionEpoch())
		}
		if _, err := old.Recv(); status.Code(err) != codes.Aborted {
			t.Fatalf("the older session got %v, want Aborted", err)
		}
		poll.Until(t, 15*time.Second, "one session", func() bool { return f.gw.Sessions() == 1 })
		// The counters: two sessions opened, the superseded one ended.
		got := gatewayMetrics(t, f.gw)
		if got[gateway.SessionsMetric] != 1 || got[gateway.SessionsOpenedMetric] != 2 || got[gateway.SessionsEndedMetric] != 1 {
			t.Fatalf("metrics %v, want 1 session held, 2 opened, 1 ended", got)
		}
	})

	t.Run("on another gateway the older session's late messages are ignored", func(t *testing.T) {
		gw2, addr2 := f.serve(t, "gw-2")
		old, _ := open(t, f.client(t, f.addr, &cert), "node_a")
		_, wNew := open(t, f.client(t, addr2, &cert), "node_a")
		if _, err := f.db.Exec(t.Context(), `DELETE FROM node_inventory; DELETE FROM work_queue`); err != nil {
			t.Fatal(err)
		}
		if err := old.Send(inventory()); err != nil {
			t.Fatal(err)
		}
		// The old gateway learns of the newer session at its next liveness
		// write and closes the stream; the late report changed nothing.
		if err := f.gw.FlushLiveness(t.Context()); err != nil {
			t.Fatal(err)
		}
		if _, err := old.Recv(); status.Code(err) != codes.Aborted && !errors.Is(err, context.Canceled) {
			t.Fatalf("the superseded session got %v", err)
		}
		var n int
		_ = f.db.QueryRow(t.Context(), `SELECT count(*) FROM node_inventory`).Scan(&n)
		if n != 0 {
			t.Fatal("a superseded session's report was stored")
		}
		var gw string
		var epoch int64
		_ = f.db.QueryRow(t.Context(), `SELECT gateway_id, session_epoch FROM nodes WHERE id = 'node_a'`).Scan(&gw, &epoch)
		if gw != "gw-2" || epoch != wNew.GetSessionEpoch() || gw2.Sessions() != 1 {
			t.Fatalf("routing %s epoch %d", gw, epoch)
		}
	})
}

func TestDesiredStateDeliveryAndObserved(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.addNode(t, "node_a")
	spec := `{"identity": {"nodeId": "node_a"}, "site": {"logLevel": "debug"}}`
	if _, err := f.db.Exec(t.Context(), `UPDATE nodes SET state = 'adopted', generation = 2, spec = $1 WHERE id = 'node_a'`, spec); err != nil {
		t.Fatal(err)
	}
	cert := f.ca.node(t, "node_a")
	stream, _ := open(t, f.client(t, f.addr, &cert), "node_a")

	recvDesired := func(t *testing.T) *agentv1.DesiredState {
		t.Helper()
		m, err := stream.Recv()
		if err != nil || m.GetDesiredState() == nil {
			t.Fatalf("want a DesiredState, got %v %v", m, err)
		}
		return m.GetDesiredState()
	}
	ds := recvDesired(t)
	if ds.GetGeneration() != 2 || ds.GetSpec().GetSite().GetLogLevel() != "debug" || ds.GetSpec().GetIdentity().GetNodeId() != "node_a" {
		t.Fatalf("a node behind gets its full spec after Welcome: %v", ds)
	}

	observed := func(t *testing.T, gen, obs int64, state agentv1.SectionState) {
		t.Helper()
		err := stream.Send(&agentv1.SessionRequest{Body: &agentv1.SessionRequest_Observed{Observed: &agentv1.Observed{
			Generation: gen, ObservedGeneration: obs,
			Sections: []*agentv1.SectionStatus{{Section: "site", State: state, Generation: gen}},
		}}})
		if err != nil {
			t.Fatal(err)
		}
	}
	stored := func() (obs int64, events int) {
		_ = f.db.QueryRow(t.Context(), `SELECT observed_generation FROM nodes WHERE id = 'node_a'`).Scan(&obs)
		_ = f.db.QueryRow(t.Context(), `SELECT count(*) FROM outbox WHERE type = 'node.converged'`).Scan(&events)
		return obs, events
	}
	observed(t, 2, 2, agentv1.SectionState_SECTION_STATE_CONVERGED)
	poll.Until(t, 15*time.Second, "the observed generation and a node.converged event", func() bool { o, e := stored(); return o == 2 && e == 1 })

	t.Run("a late report cannot lower the observed generation", func(t *testing.T) {
		observed(t, 1, 1, agentv1.SectionState_SECTION_STATE_CONVERGED)
		if err := stream.Send(&agentv1.SessionRequest{Body: &agentv1.SessionRequest_Heartbeat{Heartbeat: &agentv1.Heartbeat{}}}); err != nil {
			t.Fatal(err)
		}
		poll.Until(t, 15*time.Second, "the late report to be processed", func() bool {
			var status string
			_ = f.db.QueryRow(t.Context(), `SELECT section_status->0->>'generation' FROM nodes WHERE id = 'node_a'`).Scan(&status)
			return status == "1"
		})
		if o, _ := stored(); o != 2 {
			t.Fatalf("observed generation went back to %d", o)
		}
	})

	t.Run("a change reaches the node by the database resync, without any poke", func(t *testing.T) {
		if _, err := f.db.Exec(t.Context(), `UPDATE nodes SET generation = 3, spec = '{"site": {"logLevel": "info"}}' WHERE id = 'node_a'`); err != nil {
			t.Fatal(err)
		}
		if err := f.gw.Resync(t.Context()); err != nil {
			t.Fatal(err)
		}
		if ds := recvDesired(t); ds.GetGeneration() != 3 || ds.GetSpec().GetSite().GetLogLevel() != "info" {
			t.Fatalf("resync sent %v", ds)
		}
		// Sent once: a second resync or a poke sends nothing new.
		if err := f.gw.Resync(t.Context()); err != nil {
			t.Fatal(err)
		}
		if err := f.gw.Deliver(t.Context(), "node_a"); err != nil {
			t.Fatal(err)
		}
		observed(t, 3, 2, agentv1.SectionState_SECTION_STATE_FAILED)
		poll.Until(t, 15*time.Second, "a node.convergence_failed event", func() bool {
			var n int
			_ = f.db.QueryRow(t.Context(), `SELECT count(*) FROM outbox WHERE type = 'node.convergence_failed'`).Scan(&n)
			return n == 1
		})
		// A terminal failure still lets the generation count as observed,
		// and the failure stays visible.
		observed(t, 3, 3, agentv1.SectionState_SECTION_STATE_FAILED_TERMINAL)
		poll.Until(t, 15*time.Second, "the terminal failure to be stored with the generation observed", func() bool {
			var obs int64
			var state string
			_ = f.db.QueryRow(t.Context(), `SELECT observed_generation, section_status->0->>'state' FROM nodes WHERE id = 'node_a'`).Scan(&obs, &state)
			return obs == 3 && state == "SECTION_STATE_FAILED_TERMINAL"
		})
	})

	t.Run("a node that reconnects up to date is sent nothing", func(t *testing.T) {
		c := f.client(t, f.addr, &cert)
		s2, err := c.Session(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		h := hello("node_a")
		h.GetHello().ObservedGeneration = 3
		if err := s2.Send(h); err != nil {
			t.Fatal(err)
		}
		for range 2 { // Welcome, InventoryRequest
			if _, err := s2.Recv(); err != nil {
				t.Fatal(err)
			}
		}
		if err := s2.CloseSend(); err != nil {
			t.Fatal(err)
		}
		m, err := s2.Recv()
		if m.GetDesiredState() != nil {
			t.Fatalf("an up-to-date node was sent %v (%v)", m, err)
		}
	})

	// A node applies generation 3 and reports it as its gateway stops: the
	// report is lost, so the database still says 2. The node reconnects
	// saying it observed 3; it is sent generation 3 again, so that it
	// reports it on this session, rather than nothing (the control plane
	// would never learn it converged).
	t.Run("a node whose Observed report was lost is sent its generation again", func(t *testing.T) {
		if _, err := f.db.Exec(t.Context(), `UPDATE nodes SET observed_generation = 2 WHERE id = 'node_a'`); err != nil {
			t.Fatal(err)
		}
		c := f.client(t, f.addr, &cert)
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second) // a node sent nothing fails, not hangs
		defer cancel()
		s3, err := c.Session(ctx)
		if err != nil {
			t.Fatal(err)
		}
		h := hello("node_a")
		h.GetHello().ObservedGeneration = 3
		if err := s3.Send(h); err != nil {
			t.Fatal(err)
		}
		for range 2 { // Welcome, InventoryRequest
			if _, err := s3.Recv(); err != nil {
				t.Fatal(err)
			}
		}
		m, err := s3.Recv()
		if ds := m.GetDesiredState(); ds.GetGeneration() != 3 || ds.GetSpec().GetSite().GetLogLevel() != "info" {
			t.Fatalf("a node whose report was lost was sent %v (%v), want generation 3", m, err)
		}
		if err := s3.Send(&agentv1.SessionRequest{Body: &agentv1.SessionRequest_Observed{Observed: &agentv1.Observed{Generation: 3, ObservedGeneration: 3}}}); err != nil {
			t.Fatal(err)
		}
		poll.Until(t, 15*time.Second, "the re-sent generation observed", func() bool {
			var obs int64
			_ = f.db.QueryRow(t.Context(), `SELECT observed_generation FROM nodes WHERE id = 'node_a'`).Scan(&obs)
			return obs == 3
		})
	})
}

// gatewayMetrics gathers gw's collector: each metric's value by name.
func gatewayMetrics(t *testing.T, gw *gateway.Gateway) map[string]float64 {
	t.Helper()
	reg := prometheus.NewRegistry()
	reg.MustRegister(gw.Collector())
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			out[mf.GetName()] += m.GetGauge().GetValue() + m.GetCounter().GetValue()
		}
	}
	return out
}
