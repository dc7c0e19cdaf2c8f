// Package client is the Go client of the Better Compute API over gRPC.
//
// [Dial] (or [New]) connects; [NewClient] gives one typed client per API
// group of package computev1 — [Client.Pools], [Client.JoinTokens],
// [Client.Nodes], [Client.Reservations], [Client.Commands] and every other
// group — the generated interfaces themselves, so requests and responses
// are the API's own messages:
//
//	conn, err := client.Dial(ctx, os.Getenv("BETTER_COMPUTE_URL"), client.WithToken(os.Getenv("BETTER_COMPUTE_TOKEN")))
//	if err != nil { … }
//	defer conn.Close()
//	c := client.NewClient(conn)
//	v, err := c.System.Version(ctx, &computev1.VersionRequest{})
//	if err != nil {
//		env := client.EnvelopeOf(err) // {Code: "NOT_FOUND", Message: "…", Field: "…"}
//	}
//
// A [*Conn] is a [grpc.ClientConnInterface], so the generated
// computev1.New<Group>ServiceClient constructors take it as well.
//
// The target is the API server's address: "host:port", any gRPC target
// ("dns:///host:port", "unix:///path"), or an http:// or https:// URL without a
// path, so the REST base URL (BETTER_COMPUTE_URL) works as is. gRPC and REST
// share one port. Transport security is TLS with the system's roots unless the
// target is an http:// URL or [WithInsecure] is given (plaintext HTTP/2, h2c,
// as `better-compute dev` serves).
//
// Every failed call carries the API's error envelope — a stable code, a message
// and the offending field — as a google.rpc.ErrorInfo status detail;
// [EnvelopeOf] reads it back.
//
// Work the API does in the background has Wait helpers that poll its read
// method until it settles, honouring ctx: [Client.WaitCommand] (a command
// run on a node until succeeded, failed, expired or cancelled),
// [Client.WaitReservation] (until bound, or finished) and
// [Client.WaitSchedulable] (until a pool has n nodes placement can use, as
// after a join token let them in). Example_workflow shows the main workflow:
// join token → node joins → reservation → command; services/dev's
// Example_clientWorkflow runs it against a real control plane.
//
// The package depends on grpc and protobuf only.
package client

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// Option configures [New] and [Dial].
type Option func(*options)

type options struct {
	token     string
	insecure  bool
	tlsConfig *tls.Config
	dialOpts  []grpc.DialOption
}

// WithToken sends token as `authorization: Bearer <token>` metadata on every
// call (an API key, bck_<id>.<secret>). An empty token sends no credential, so
// WithToken(os.Getenv("BETTER_COMPUTE_TOKEN")) is safe when the variable is
// unset.
func WithToken(token string) Option {
	return func(o *options) { o.token = token }
}

// WithInsecure uses plaintext HTTP/2 (h2c) instead of TLS, for a server
// without TLS such as `better-compute dev`. A token, if any, then travels in
// the clear. An http:// target implies it.
func WithInsecure() Option {
	return func(o *options) { o.insecure = true }
}

// WithTLSConfig sets the TLS configuration (a private CA, a client
// certificate, a server name). Without it the system's roots are used.
func WithTLSConfig(cfg *tls.Config) Option {
	return func(o *options) { o.tlsConfig = cfg }
}

// WithDialOptions adds grpc dial options (interceptors, stats handlers,
// message size limits, a user agent). They are applied after this package's
// own, so they may override the transport credentials.
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(o *options) { o.dialOpts = append(o.dialOpts, opts...) }
}

// Conn is a connection to the API server. It is a [grpc.ClientConnInterface]
// for the generated computev1.New<Group>ServiceClient constructors and is safe
// for concurrent use; close it when done.
type Conn struct {
	cc     *grpc.ClientConn
	target string
}

var _ grpc.ClientConnInterface = (*Conn)(nil)

// New returns a connection to target without connecting: the first call
// connects, and a target that cannot be reached fails that call with
// UNAVAILABLE. It fails only on a malformed target or conflicting options.
func New(target string, opts ...Option) (*Conn, error) {
	o := options{}
	for _, opt := range opts {
		opt(&o)
	}
	grpcTarget, secure, err := parseTarget(target, &o)
	if err != nil {
		return nil, err
	}
	for _, r := range o.token {
		if r < 0x20 || r == 0x7f {
			return nil, fmt.Errorf("client: the token contains a control character")
		}
	}
	dial := make([]grpc.DialOption, 0, 2+len(o.dialOpts))
	if secure {
		cfg := &tls.Config{MinVersion: tls.VersionTLS12}
		if o.tlsConfig != nil {
			cfg = o.tlsConfig.Clone()
		}
		dial = append(dial, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	} else {
		dial = append(dial, grpc.WithTransportCredentials(insecure.NewCredentials()))
	}
	if o.token != "" {
		dial = append(dial, grpc.WithPerRPCCredentials(bearer{token: o.token, secure: secure}))
	}
	dial = append(dial, o.dialOpts...)
	cc, err := grpc.NewClient(grpcTarget, dial...)
	if err != nil {
		return nil, fmt.Errorf("client: %s: %w", target, err)
	}
	return &Conn{cc: cc, target: target}, nil
}

// Dial is [New] followed by one gRPC health check (grpc.health.v1), so that
// an unreachable target — a refused connection, an unknown host, TLS against a
// plaintext server or the reverse — fails here with an error naming the
// target instead of at the first call. Any answer from the server, even an
// error status such as UNIMPLEMENTED or UNAUTHENTICATED, counts as reached.
// ctx bounds the wait.
func Dial(ctx context.Context, target string, opts ...Option) (*Conn, error) {
	c, err := New(target, opts...)
	if err != nil {
		return nil, err
	}
	_, err = healthpb.NewHealthClient(c.cc).Check(ctx, &healthpb.HealthCheckRequest{})
	if err == nil {
		return c, nil
	}
	if ctx.Err() != nil {
		_ = c.Close()
		return nil, fmt.Errorf("client: cannot reach %s: %w", target, ctx.Err())
	}
	if st, ok := status.FromError(err); ok && st.Code() != codes.Unavailable && st.Code() != codes.DeadlineExceeded {
		return c, nil
	}
	_ = c.Close()
	return nil, fmt.Errorf("client: cannot reach %s: %s", target, status.Convert(err).Message())
}

// Invoke performs a unary RPC; it implements [grpc.ClientConnInterface].
func (c *Conn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	return c.cc.Invoke(ctx, method, args, reply, opts...)
}

// NewStream begins a streaming RPC; it implements [grpc.ClientConnInterface].
func (c *Conn) NewStream(ctx context.Context, desc *grpc.StreamDesc, method string, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	return c.cc.NewStream(ctx, desc, method, opts...)
}

// Close closes the connection; calls in flight fail with CANCELED.
func (c *Conn) Close() error { return c.cc.Close() }

// Target returns the target the connection was made for, as given.
func (c *Conn) Target() string { return c.target }

// ClientConn returns the underlying gRPC connection, for its connectivity
// state or APIs that need a *grpc.ClientConn.
func (c *Conn) ClientConn() *grpc.ClientConn { return c.cc }

// parseTarget turns an http:// or https:// URL into host:port and decides the
// transport: TLS unless the URL is http:// or the options ask for plaintext.
func parseTarget(target string, o *options) (grpcTarget string, secure bool, err error) {
	if target == "" {
		return "", false, errors.New("client: empty target")
	}
	scheme, _, isURL := strings.Cut(target, "://")
	if !isURL || (scheme != "http" && scheme != "https") {
		if o.insecure && o.tlsConfig != nil {
			return "", false, fmt.Errorf("client: %s: WithInsecure and WithTLSConfig conflict", target)
		}
		return target, !o.insecure, nil
	}
	u, err := url.Parse(target)
	if err != nil {
		return "", false, fmt.Errorf("client: %s: %w", target, err)
	}
	if u.Host == "" || u.User != nil || (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.Fragment != "" {
		return "", false, fmt.Errorf("client: %s: a gRPC target is a URL with a host and an optional port only (no path, user, query or fragment)", target)
	}
	host := u.Host
	if u.Port() == "" {
		port := "443"
		if u.Scheme == "http" {
			port = "80"
		}
		host = net.JoinHostPort(u.Hostname(), port)
	}
	switch {
	case u.Scheme == "http" && o.tlsConfig != nil:
		return "", false, fmt.Errorf("client: %s: an http:// target is plaintext; WithTLSConfig needs https://", target)
	case u.Scheme == "https" && o.insecure:
		return "", false, fmt.Errorf("client: %s: an https:// target uses TLS; WithInsecure needs http://", target)
	}
	return "dns:///" + host, u.Scheme == "https", nil
}

// bearer is the per-RPC credential of [WithToken].
type bearer struct {
	token  string
	secure bool
}

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + b.token}, nil
}

// RequireTransportSecurity is false only when the caller chose plaintext.
func (b bearer) RequireTransportSecurity() bool { return b.secure }
