package client_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"math/big"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
	"github.com/bettercompute/bettercompute/proto/client"
)

// testSystem answers Version with the authorization metadata it received, and
// Health with an API error carrying an ErrorInfo, as the API's handlers do.
type testSystem struct {
	computev1.UnimplementedSystemServiceServer
}

func (testSystem) Version(ctx context.Context, _ *computev1.VersionRequest) (*computev1.VersionResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	return &computev1.VersionResponse{Version: "v1.2.3", Commit: strings.Join(md.Get("authorization"), ",")}, nil
}

func (testSystem) Health(context.Context, *computev1.HealthRequest) (*computev1.HealthResponse, error) {
	st, err := status.New(codes.InvalidArgument, "unknown field").WithDetails(&errdetails.ErrorInfo{
		Reason: "INVALID_INPUT", Domain: client.ErrorDomain, Metadata: map[string]string{"field": "bogus"},
	})
	if err != nil {
		return nil, err
	}
	return nil, st.Err()
}

// serve starts a gRPC server (TLS when creds is set) and returns its address.
func serve(t *testing.T, opts ...grpc.ServerOption) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer(opts...)
	computev1.RegisterSystemServiceServer(s, testSystem{})
	healthpb.RegisterHealthServer(s, health.NewServer())
	go func() { _ = s.Serve(lis) }()
	t.Cleanup(s.Stop)
	return lis.Addr().String()
}

// closedAddr returns an address nothing listens on.
func closedAddr(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	_ = lis.Close()
	return addr
}

func version(t *testing.T, conn *client.Conn) *computev1.VersionResponse {
	t.Helper()
	v, err := computev1.NewSystemServiceClient(conn).Version(t.Context(), &computev1.VersionRequest{})
	if err != nil {
		t.Fatalf("Version: %v", err)
	}
	return v
}

func TestPlaintextWithToken(t *testing.T) {
	t.Parallel()
	addr := serve(t)
	for _, tc := range []struct {
		name   string
		target string
		opts   []client.Option
	}{
		{"host:port and WithInsecure", addr, []client.Option{client.WithInsecure()}},
		{"http URL", "http://" + addr, nil},
		{"http URL with a slash", "http://" + addr + "/", nil},
		{"dns target", "dns:///" + addr, []client.Option{client.WithInsecure()}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			conn, err := client.Dial(t.Context(), tc.target, append(tc.opts, client.WithToken("bck_a.b"))...)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = conn.Close() }()
			if conn.Target() != tc.target || conn.ClientConn() == nil {
				t.Fatalf("Target = %q", conn.Target())
			}
			if v := version(t, conn); v.GetVersion() != "v1.2.3" || v.GetCommit() != "Bearer bck_a.b" {
				t.Fatalf("Version = %v", v)
			}
		})
	}

	t.Run("no token sends no authorization", func(t *testing.T) {
		t.Parallel()
		conn, err := client.New("http://"+addr, client.WithToken(""))
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = conn.Close() }()
		if v := version(t, conn); v.GetCommit() != "" {
			t.Fatalf("authorization sent: %q", v.GetCommit())
		}
	})

	t.Run("an API error carries the envelope", func(t *testing.T) {
		t.Parallel()
		conn, err := client.New(addr, client.WithInsecure())
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = conn.Close() }()
		_, err = computev1.NewSystemServiceClient(conn).Health(t.Context(), &computev1.HealthRequest{})
		want := client.Envelope{Code: client.CodeInvalidInput, Message: "unknown field", Field: "bogus"}
		if got := client.EnvelopeOf(err); got != want {
			t.Fatalf("EnvelopeOf = %+v, want %+v", got, want)
		}
	})
}

func TestTLS(t *testing.T) {
	t.Parallel()
	cert, roots := selfSigned(t)
	tlsAddr := serve(t, grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12})))
	plainAddr := serve(t)
	clientTLS := &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}

	for _, target := range []string{tlsAddr, "https://" + tlsAddr} {
		conn, err := client.Dial(t.Context(), target, client.WithTLSConfig(clientTLS), client.WithToken("bck_tls.secret"))
		if err != nil {
			t.Fatalf("%s: %v", target, err)
		}
		if v := version(t, conn); v.GetCommit() != "Bearer bck_tls.secret" {
			t.Fatalf("%s: Version = %v", target, v)
		}
		_ = conn.Close()
	}

	// A mismatched transport fails at Dial, naming the target.
	for _, tc := range []struct {
		target string
		opts   []client.Option
	}{
		{tlsAddr, []client.Option{client.WithInsecure()}},
		{plainAddr, []client.Option{client.WithTLSConfig(clientTLS)}},
		{"https://" + tlsAddr, nil}, // the system's roots do not know this certificate
	} {
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		conn, err := client.Dial(ctx, tc.target, tc.opts...)
		cancel()
		if err == nil {
			_ = conn.Close()
			t.Fatalf("%s: Dial succeeded", tc.target)
		}
		if !strings.Contains(err.Error(), "cannot reach "+tc.target) {
			t.Fatalf("%s: %v", tc.target, err)
		}
	}
}

func TestDialUnreachable(t *testing.T) {
	t.Parallel()
	addr := closedAddr(t)
	_, err := client.Dial(t.Context(), "http://"+addr)
	if err == nil || !strings.Contains(err.Error(), "cannot reach http://"+addr) || !strings.Contains(err.Error(), "refused") {
		t.Fatalf("Dial = %v", err)
	}

	// New does not connect; the first call fails UNAVAILABLE.
	conn, err := client.New(addr, client.WithInsecure())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	_, err = computev1.NewSystemServiceClient(conn).Version(t.Context(), &computev1.VersionRequest{})
	if env := client.EnvelopeOf(err); env.Code != client.CodeUnavailable || env.Message == "" {
		t.Fatalf("EnvelopeOf(%v) = %+v", err, env)
	}

	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := client.Dial(ctx, "http://"+addr); !errors.Is(err, context.Canceled) {
		t.Fatalf("Dial with a canceled context = %v", err)
	}
}

func TestNewRejectsBadTargets(t *testing.T) {
	t.Parallel()
	tlsCfg := &tls.Config{MinVersion: tls.VersionTLS12}
	for _, tc := range []struct {
		target string
		opts   []client.Option
		want   string
	}{
		{"", nil, "empty target"},
		{"http://host:80/api", nil, "no path"},
		{"https://user@host", nil, "no path, user"},
		{"http://host?x=1", nil, "no path"},
		{"http:///", nil, "with a host"},
		{"http://host", []client.Option{client.WithTLSConfig(tlsCfg)}, "needs https://"},
		{"https://host", []client.Option{client.WithInsecure()}, "needs http://"},
		{"host:1", []client.Option{client.WithInsecure(), client.WithTLSConfig(tlsCfg)}, "conflict"},
		{"host:1", []client.Option{client.WithToken("bck_a\nb")}, "control character"},
	} {
		conn, err := client.New(tc.target, tc.opts...)
		if err == nil {
			_ = conn.Close()
			t.Errorf("New(%q) succeeded", tc.target)
			continue
		}
		if !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New(%q) = %v, want %q", tc.target, err, tc.want)
		}
	}
}

func TestEnvelopeOf(t *testing.T) {
	t.Parallel()
	withInfo := func(c codes.Code, msg string, ei *errdetails.ErrorInfo) error {
		st, err := status.New(c, msg).WithDetails(ei)
		if err != nil {
			t.Fatal(err)
		}
		return st.Err()
	}
	for _, tc := range []struct {
		name string
		err  error
		want client.Envelope
	}{
		{"nil", nil, client.Envelope{}},
		{"ErrorInfo with a field",
			withInfo(codes.InvalidArgument, "expected a UUID", &errdetails.ErrorInfo{Reason: "INVALID_INPUT", Domain: client.ErrorDomain, Metadata: map[string]string{"field": "nodeId"}}),
			client.Envelope{Code: client.CodeInvalidInput, Message: "expected a UUID", Field: "nodeId"}},
		{"ErrorInfo without a field wins over the gRPC code",
			withInfo(codes.ResourceExhausted, "no GPU free", &errdetails.ErrorInfo{Reason: "NO_CAPACITY", Domain: client.ErrorDomain}),
			client.Envelope{Code: client.CodeNoCapacity, Message: "no GPU free"}},
		{"another domain's ErrorInfo is ignored",
			withInfo(codes.PermissionDenied, "nope", &errdetails.ErrorInfo{Reason: "X", Domain: "example.com"}),
			client.Envelope{Code: client.CodeAccessDenied, Message: "nope"}},
		{"wrapped", fmt.Errorf("calling: %w", withInfo(codes.NotFound, "no such pool", &errdetails.ErrorInfo{Reason: "NOT_FOUND", Domain: client.ErrorDomain, Metadata: map[string]string{"field": "poolId"}})),
			client.Envelope{Code: client.CodeNotFound, Message: "calling: rpc error: code = NotFound desc = no such pool", Field: "poolId"}},
		{"plain status", status.Error(codes.Unimplemented, "unknown method"), client.Envelope{Code: client.CodeUnsupported, Message: "unknown method"}},
		{"already exists", status.Error(codes.AlreadyExists, "x"), client.Envelope{Code: client.CodeConflict, Message: "x"}},
		{"unauthenticated", status.Error(codes.Unauthenticated, "x"), client.Envelope{Code: client.CodeUnauthenticated, Message: "x"}},
		{"out of range", status.Error(codes.OutOfRange, "x"), client.Envelope{Code: client.CodeInvalidInput, Message: "x"}},
		{"resource exhausted", status.Error(codes.ResourceExhausted, "x"), client.Envelope{Code: client.CodeRateLimited, Message: "x"}},
		{"unknown", status.Error(codes.Unknown, "x"), client.Envelope{Code: client.CodeInternal, Message: "x"}},
		{"deadline", fmt.Errorf("call: %w", context.DeadlineExceeded), client.Envelope{Code: client.CodeUnavailable, Message: "call: context deadline exceeded"}},
		{"canceled", context.Canceled, client.Envelope{Code: client.CodeUnavailable, Message: "context canceled"}},
		{"not a status", errors.New("boom"), client.Envelope{Code: client.CodeInternal, Message: "boom"}},
	} {
		if got := client.EnvelopeOf(tc.err); got != tc.want {
			t.Errorf("%s: EnvelopeOf = %+v, want %+v", tc.name, got, tc.want)
		}
	}

	if s := (client.Envelope{Code: client.CodeConflict, Message: "taken"}).String(); s != "CONFLICT: taken" {
		t.Errorf("String = %q", s)
	}
	if len(client.Codes) != 12 {
		t.Errorf("Codes has %d codes", len(client.Codes))
	}
}

// selfSigned returns a certificate for 127.0.0.1 and a pool that trusts it.
func selfSigned(t *testing.T) (tls.Certificate, *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "better-compute test"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(leaf)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, pool
}
