// Package testcontrol is a fake control plane for the agent's tests: a real
// gRPC NodeService over real TLS with its own test CA. Join opens the
// HPKE-sealed token with its private key and signs a SPIFFE certificate;
// Renew and Session require the node certificate (mutual TLS). Tests watch
// what the agent sends through channels (including CommandUpdates), send
// commands and cancels to open sessions, and can close sessions.
package testcontrol

import (
	"context"
	"crypto/ecdh"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/hpke"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/bettercompute/bettercompute/agent/join"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// TrustDomain is the fake control plane's SPIFFE trust domain.
const TrustDomain = "test.bettercompute"

// ServerName is the DNS name on the gateway certificate (besides 127.0.0.1).
const ServerName = "gateway.test"

// Hello is a Hello as the fake gateway saw it, with the serial of the client
// certificate that carried it.
type Hello struct {
	*agentv1.Hello
	// Serial is the client certificate's serial number.
	Serial *big.Int
}

// Server is the fake control plane. Set the exported knobs before the
// agent calls.
type Server struct {
	agentv1.UnimplementedNodeServiceServer

	// Addr is the listener's 127.0.0.1:port.
	Addr string
	// CA signs the gateway and node certificates.
	CA *x509.Certificate
	// Bundle is the trust bundle (the CA), DER.
	Bundle [][]byte
	// Token is the join token Join accepts.
	Token string
	// PublicKey is the HPKE (X25519) public key, raw; KeyID its id.
	PublicKey []byte
	// KeyID is join.KeyID(PublicKey).
	KeyID string

	// Hellos receives every Hello (buffered).
	Hellos chan Hello
	// Reports receives every InventoryReport (buffered).
	Reports chan *agentv1.InventoryReport
	// Renewed receives every certificate Renew issued (buffered).
	Renewed chan *x509.Certificate
	// Observed receives every Observed report (buffered).
	Observed chan *agentv1.Observed
	// Updates receives every CommandUpdate but output chunks (buffered).
	Updates chan *agentv1.CommandUpdate
	// Outputs receives the CommandUpdates that carry an output chunk
	// (buffered; dropped when full, as no test reads them all).
	Outputs chan *agentv1.CommandUpdate
	// Tunnels receives every Tunnel stream a daemon opens (buffered); the
	// stream stays open until Done is closed or the daemon ends it.
	Tunnels chan TunnelStream
	// Heartbeats counts heartbeats.
	Heartbeats atomic.Int64
	// Joins counts successful joins; JoinAttempts every Join call.
	Joins        atomic.Int64
	JoinAttempts atomic.Int64

	caKey   *ecdsa.PrivateKey
	hpkeKey hpke.PrivateKey
	stop    func()

	mu          sync.Mutex
	failJoins   int
	failCode    codes.Code
	joinTTL     func() (notBefore, notAfter time.Time)
	heartbeatMS uint32
	nextNode    int
	epoch       int64
	sessions    map[chan struct{}]chan *agentv1.SessionResponse
	desired     *agentv1.DesiredState
}

// Option changes how New builds the fake control plane.
type Option func(*options)

type options struct{ gatewayPath string }

// WithGatewayPath sets the path of the gateway certificate's SPIFFE id
// (default "/gateway/gw-test"); "" leaves the SPIFFE id out.
func WithGatewayPath(p string) Option { return func(o *options) { o.gatewayPath = p } }

// New starts a fake control plane on 127.0.0.1 and stops it with the test.
func New(t testing.TB, opts ...Option) *Server {
	t.Helper()
	o := options{gatewayPath: "/gateway/gw-test"}
	for _, opt := range opts {
		opt(&o)
	}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "test CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	hk, err := hpke.DHKEM(ecdh.X25519()).GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	s := &Server{
		CA: ca, Bundle: [][]byte{caDER}, Token: "bcjt_test.secret",
		PublicKey: hk.PublicKey().Bytes(), KeyID: join.KeyID(hk.PublicKey().Bytes()),
		Hellos: make(chan Hello, 100), Reports: make(chan *agentv1.InventoryReport, 100), Renewed: make(chan *x509.Certificate, 100),
		Observed: make(chan *agentv1.Observed, 100), Updates: make(chan *agentv1.CommandUpdate, 100),
		Outputs: make(chan *agentv1.CommandUpdate, 1000), Tunnels: make(chan TunnelStream, 16),
		caKey: caKey, hpkeKey: hk, heartbeatMS: 20, sessions: map[chan struct{}]chan *agentv1.SessionResponse{},
	}

	s.serve(t, o)
	return s
}

// Twin starts a second fake gateway of the same control plane: the same
// CA, trust bundle, token and joinservice key (a node joined through one
// holds a certificate the other accepts), its own listener, sessions and
// channels. Tests of a node moving between gateways use it.
func (s *Server) Twin(t testing.TB) *Server {
	t.Helper()
	o := &Server{
		CA: s.CA, Bundle: s.Bundle, Token: s.Token, PublicKey: s.PublicKey, KeyID: s.KeyID,
		Hellos: make(chan Hello, 100), Reports: make(chan *agentv1.InventoryReport, 100), Renewed: make(chan *x509.Certificate, 100),
		Observed: make(chan *agentv1.Observed, 100), Updates: make(chan *agentv1.CommandUpdate, 100),
		Outputs: make(chan *agentv1.CommandUpdate, 1000),
		caKey:   s.caKey, hpkeKey: s.hpkeKey, heartbeatMS: 20, sessions: map[chan struct{}]chan *agentv1.SessionResponse{},
		nextNode: 1000,
	}
	o.serve(t, options{gatewayPath: "/gateway/gw-twin"})
	return o
}

// Stop stops the fake gateway at once, as a killed process would: its
// listener closes and its sessions end.
func (s *Server) Stop() { s.stop() }

// serve issues the gateway's certificate and serves on 127.0.0.1.
func (s *Server) serve(t testing.TB, o options) {
	t.Helper()
	caKey, ca := s.caKey, s.CA
	gwKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	var gwURIs []*url.URL
	if o.gatewayPath != "" {
		gwURIs = []*url.URL{{Scheme: "spiffe", Host: TrustDomain, Path: o.gatewayPath}}
	}
	gwDER, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
		SerialNumber: big.NewInt(2),
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		DNSNames:     []string{ServerName},
		URIs:         gwURIs,
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}, ca, &gwKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	tlsCfg := &tls.Config{
		MinVersion:   tls.VersionTLS12,
		Certificates: []tls.Certificate{{Certificate: [][]byte{gwDER}, PrivateKey: gwKey}},
		ClientAuth:   tls.VerifyClientCertIfGiven, // Join comes without one
		ClientCAs:    pool,
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s.Addr = lis.Addr().String()
	gs := grpc.NewServer(grpc.Creds(credentials.NewTLS(tlsCfg)))
	agentv1.RegisterNodeServiceServer(gs, s)
	go func() { _ = gs.Serve(lis) }()
	s.stop = gs.Stop
	t.Cleanup(gs.Stop)
}

// RootCAs is the CA as a pool, for the agent's join.
func (s *Server) RootCAs() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(s.CA)
	return p
}

// SetJoinValidity makes Join issue certificates valid from notBefore to
// notAfter, computed at each join (by default: now to now+24h).
func (s *Server) SetJoinValidity(f func() (notBefore, notAfter time.Time)) {
	s.mu.Lock()
	s.joinTTL = f
	s.mu.Unlock()
}

// SetDesired makes ds the node's desired state, as the gateway would: it is
// sent at once on every open session, and after Welcome on every later
// session whose Hello reports an observed generation below ds's.
func (s *Server) SetDesired(ds *agentv1.DesiredState) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.desired = ds
	for _, ch := range s.sessions {
		ch <- &agentv1.SessionResponse{Body: &agentv1.SessionResponse_DesiredState{DesiredState: ds}}
	}
}

// OpenSessions is how many sessions are open: a daemon that just
// reconnected may briefly have its old one too, until the server notices
// that stream's end.
func (s *Server) OpenSessions() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.sessions)
}

// SendCommand sends c on every open session (after its Welcome) and
// reports how many sessions it went to.
func (s *Server) SendCommand(c *agentv1.Command) int {
	return s.broadcast(&agentv1.SessionResponse{Body: &agentv1.SessionResponse_Command{Command: c}})
}

// TunnelStream is one daemon Tunnel stream; close Done to end it.
type TunnelStream struct {
	agentv1.NodeService_TunnelServer
	Done chan struct{}
}

// SendOpenTunnel sends o on every open session and reports how many.
func (s *Server) SendOpenTunnel(o *agentv1.OpenTunnel) int {
	return s.broadcast(&agentv1.SessionResponse{Body: &agentv1.SessionResponse_OpenTunnel{OpenTunnel: o}})
}

// Tunnel implements agentv1.NodeServiceServer: it hands the stream to
// Tunnels.
func (s *Server) Tunnel(stream agentv1.NodeService_TunnelServer) error {
	ts := TunnelStream{NodeService_TunnelServer: stream, Done: make(chan struct{})}
	select {
	case s.Tunnels <- ts:
	case <-stream.Context().Done():
		return stream.Context().Err()
	}
	select {
	case <-ts.Done:
		return nil
	case <-stream.Context().Done():
		return stream.Context().Err()
	}
}

// SendCancel sends cc on every open session and reports how many.
func (s *Server) SendCancel(cc *agentv1.CommandCancel) int {
	return s.broadcast(&agentv1.SessionResponse{Body: &agentv1.SessionResponse_Cancel{Cancel: cc}})
}

func (s *Server) broadcast(m *agentv1.SessionResponse) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, ch := range s.sessions {
		ch <- m
	}
	return len(s.sessions)
}

// KickSessions ends every open session from the server side and reports
// how many it ended.
func (s *Server) KickSessions() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for ch := range s.sessions {
		close(ch)
		delete(s.sessions, ch)
		n++
	}
	return n
}

// FailJoins makes the next n Join calls fail with code, before they look
// at the request (a gateway whose joinservice is down answers UNAVAILABLE).
func (s *Server) FailJoins(n int, code codes.Code) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failJoins, s.failCode = n, code
}

// Join implements agentv1.NodeServiceServer.
func (s *Server) Join(_ context.Context, req *agentv1.JoinRequest) (*agentv1.JoinResponse, error) {
	s.JoinAttempts.Add(1)
	s.mu.Lock()
	if s.failJoins > 0 {
		s.failJoins--
		code := s.failCode
		s.mu.Unlock()
		return nil, status.Errorf(code, "testcontrol: join refused (%s) as asked", code)
	}
	s.mu.Unlock()
	if req.GetJoinserviceKeyId() != s.KeyID {
		return nil, status.Error(codes.InvalidArgument, "unknown joinservice key")
	}
	r, err := hpke.NewRecipient(req.GetEncapsulatedKey(), s.hpkeKey, hpke.HKDFSHA256(), hpke.AES128GCM(), []byte(join.Info))
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, "bad encapsulated key")
	}
	tok, err := r.Open(join.AAD(req.GetCsr()), req.GetSealedToken())
	if err != nil || string(tok) != s.Token {
		return nil, status.Error(codes.Unauthenticated, "invalid join token")
	}
	csr, err := x509.ParseCertificateRequest(req.GetCsr())
	if err != nil || csr.CheckSignature() != nil {
		return nil, status.Error(codes.InvalidArgument, "bad CSR")
	}
	if len(req.GetClaims().GetGpus()) == 0 {
		return nil, status.Error(codes.InvalidArgument, "no GPUs claimed")
	}
	s.mu.Lock()
	s.nextNode++
	nodeID := fmt.Sprintf("node_%d", s.nextNode)
	nb, na := time.Now(), time.Now().Add(24*time.Hour)
	if s.joinTTL != nil {
		nb, na = s.joinTTL()
	}
	s.mu.Unlock()
	der, err := s.issue(nodeID, csr.PublicKey, nb, na)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	s.Joins.Add(1)
	resp := &agentv1.JoinResponse{NodeId: nodeID, CertificateChain: [][]byte{der}, TrustBundle: s.Bundle, SpiffeId: spiffeID(nodeID).String()}
	if req.GetRole() == "ramdisk" {
		resp.Role = "ramdisk" // bcd ramdisk: the node's SPIFFE ID, its Ed25519 key
	}
	return resp, nil
}

// Renew implements agentv1.NodeServiceServer: a 24-hour certificate for the
// CSR's key, which must be the caller's.
func (s *Server) Renew(ctx context.Context, req *agentv1.RenewRequest) (*agentv1.RenewResponse, error) {
	leaf, nodeID, err := clientNode(ctx)
	if err != nil {
		return nil, err
	}
	csr, err := x509.ParseCertificateRequest(req.GetCsr())
	if err != nil || csr.CheckSignature() != nil {
		return nil, status.Error(codes.InvalidArgument, "bad CSR")
	}
	if pk, ok := csr.PublicKey.(*ecdsa.PublicKey); !ok || !pk.Equal(leaf.PublicKey) {
		return nil, status.Error(codes.PermissionDenied, "CSR key is not the node key")
	}
	der, err := s.issue(nodeID, csr.PublicKey, time.Now(), time.Now().Add(24*time.Hour))
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	c, _ := x509.ParseCertificate(der)
	s.Renewed <- c
	return &agentv1.RenewResponse{CertificateChain: [][]byte{der}, TrustBundle: s.Bundle}, nil
}

// Session implements agentv1.NodeServiceServer: Hello (matching the
// certificate's node id) first, then Welcome and an InventoryRequest for all
// sections, then the desired state (SetDesired) when the Hello is behind it;
// heartbeats are counted, reports and Observed passed on, and desired states
// set meanwhile sent, until the session is kicked or the node goes away.
func (s *Server) Session(stream agentv1.NodeService_SessionServer) error {
	leaf, nodeID, err := clientNode(stream.Context())
	if err != nil {
		return err
	}
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	hello := first.GetHello()
	if hello == nil {
		return status.Error(codes.FailedPrecondition, "Hello must come first")
	}
	if hello.GetNodeId() != nodeID {
		return status.Error(codes.PermissionDenied, "certificate is for another node")
	}
	kick := make(chan struct{})
	send := make(chan *agentv1.SessionResponse, 100)
	s.mu.Lock()
	s.epoch++
	epoch, hb, desired := s.epoch, s.heartbeatMS, s.desired
	s.sessions[kick] = send
	s.mu.Unlock()
	// Registered first, so a test that saw the Hello can send commands.
	s.Hellos <- Hello{Hello: hello, Serial: leaf.SerialNumber}
	defer func() {
		s.mu.Lock()
		delete(s.sessions, kick)
		s.mu.Unlock()
	}()
	if err := stream.Send(&agentv1.SessionResponse{Body: &agentv1.SessionResponse_Welcome{Welcome: &agentv1.Welcome{SessionEpoch: epoch, HeartbeatIntervalMs: hb, GatewayId: "gw-test"}}}); err != nil {
		return err
	}
	if err := stream.Send(&agentv1.SessionResponse{Body: &agentv1.SessionResponse_InventoryRequest{InventoryRequest: &agentv1.InventoryRequest{}}}); err != nil {
		return err
	}
	if desired != nil && hello.GetObservedGeneration() < desired.GetGeneration() {
		if err := stream.Send(&agentv1.SessionResponse{Body: &agentv1.SessionResponse_DesiredState{DesiredState: desired}}); err != nil {
			return err
		}
	}
	errc := make(chan error, 1)
	go func() {
		for {
			m, err := stream.Recv()
			if err != nil {
				errc <- err
				return
			}
			switch {
			case m.GetHeartbeat() != nil:
				s.Heartbeats.Add(1)
			case m.GetInventory() != nil:
				s.Reports <- m.GetInventory()
			case m.GetObserved() != nil:
				s.Observed <- m.GetObserved()
			case m.GetCommandUpdate().GetOutput() != nil:
				select {
				case s.Outputs <- m.GetCommandUpdate():
				default:
				}
			case m.GetCommandUpdate() != nil:
				s.Updates <- m.GetCommandUpdate()
			}
		}
	}()
	for {
		select {
		case <-kick:
			return status.Error(codes.Unavailable, "session closed by the test")
		case err := <-errc:
			return err
		case m := <-send:
			if err := stream.Send(m); err != nil {
				return err
			}
		}
	}
}

func (s *Server) issue(nodeID string, pub any, notBefore, notAfter time.Time) ([]byte, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 64))
	if err != nil {
		return nil, err
	}
	return x509.CreateCertificate(rand.Reader, &x509.Certificate{
		SerialNumber: serial,
		NotBefore:    notBefore,
		NotAfter:     notAfter,
		URIs:         []*url.URL{spiffeID(nodeID)},
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}, s.CA, pub, s.caKey)
}

func spiffeID(nodeID string) *url.URL {
	return &url.URL{Scheme: "spiffe", Host: TrustDomain, Path: "/node/" + nodeID}
}

// clientNode returns the verified client certificate and the node id in its
// SPIFFE id.
func clientNode(ctx context.Context) (*x509.Certificate, string, error) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return nil, "", status.Error(codes.Unauthenticated, "no peer")
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(ti.State.VerifiedChains) == 0 {
		return nil, "", status.Error(codes.Unauthenticated, "a node certificate is required")
	}
	leaf := ti.State.VerifiedChains[0][0]
	for _, u := range leaf.URIs {
		if u.Scheme == "spiffe" && u.Host == TrustDomain {
			if id, ok := strings.CutPrefix(u.Path, "/node/"); ok && id != "" {
				return leaf, id, nil
			}
		}
	}
	return nil, "", status.Error(codes.PermissionDenied, "not a node certificate")
}
