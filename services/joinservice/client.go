package joinservice

import (
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// ClientConfig configures a [Client].
type ClientConfig struct {
	// Addrs are joinservice's internal addresses (host:port); at least one.
	Addrs []string
	// Certificate is the gateway's: presented to joinservice, whose
	// listener accepts only gateway identities.
	Certificate tls.Certificate
	// RootCAs is the node CA's trust bundle: joinservice's certificate must
	// chain to it and carry spiffe://<TrustDomain>/joinservice.
	RootCAs *x509.CertPool
	// TrustDomain is the installation's; required.
	TrustDomain string
	// Timeout bounds one call to one address; default 10s.
	Timeout time.Duration
	// Logger; nil discards.
	Logger *slog.Logger
}

// Client relays Join and Renew to a standalone joinservice: the gateway's
// Joiner when gateway.joinService is set. Each call starts at the next
// address (round robin), tries the ones with a ready connection first, and
// moves on to the next address when one cannot be reached; an answer of
// joinservice's own (a refusal, its database down) is returned as it came.
// When no address answers, the error is UNAVAILABLE naming them.
type Client struct {
	addrs   []string
	conns   []*grpc.ClientConn
	clients []agentv1.NodeServiceClient
	timeout time.Duration
	log     *slog.Logger
	next    atomic.Uint64
}

// NewClient returns a Client; it connects lazily, so joinservice may be down
// when the gateway starts.
func NewClient(cfg ClientConfig) (*Client, error) {
	if len(cfg.Addrs) == 0 {
		return nil, errors.New("joinservice client: no address")
	}
	td, err := spiffeid.TrustDomainFromString(cfg.TrustDomain)
	if err != nil {
		return nil, fmt.Errorf("joinservice client: trust domain: %w", err)
	}
	want, err := spiffeid.FromSegments(td, JoinServicePath)
	if err != nil {
		return nil, err
	}
	c := &Client{addrs: cfg.Addrs, timeout: cmp.Or(cfg.Timeout, 10*time.Second), log: cfg.Logger}
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	for _, addr := range cfg.Addrs {
		host, _, err := net.SplitHostPort(addr)
		if err != nil {
			c.Close()
			return nil, fmt.Errorf("joinservice client: address %q: %w", addr, err)
		}
		tc := &tls.Config{
			Certificates: []tls.Certificate{cfg.Certificate},
			RootCAs:      cfg.RootCAs,
			ServerName:   host,
			MinVersion:   tls.VersionTLS13,
			// The chain and the name are verified by crypto/tls; the
			// identity must be joinservice's, not another service's
			// certificate of the same CA (a gateway's).
			VerifyConnection: func(cs tls.ConnectionState) error {
				if len(cs.PeerCertificates) == 0 {
					return errors.New("joinservice presented no certificate")
				}
				id, err := x509svid.IDFromCert(cs.PeerCertificates[0])
				if err != nil {
					return fmt.Errorf("joinservice certificate: %w", err)
				}
				if id != want {
					return fmt.Errorf("%s is not joinservice (%s)", id, want)
				}
				return nil
			},
		}
		// A joinservice back from an outage is dialled again within
		// seconds, not after gRPC's default back-off of up to two minutes.
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(tc)),
			grpc.WithConnectParams(grpc.ConnectParams{
				Backoff:           backoff.Config{BaseDelay: 200 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 5 * time.Second},
				MinConnectTimeout: c.timeout,
			}))
		if err != nil {
			c.Close()
			return nil, fmt.Errorf("joinservice client: %s: %w", addr, err)
		}
		c.conns = append(c.conns, conn)
		c.clients = append(c.clients, agentv1.NewNodeServiceClient(conn))
	}
	return c, nil
}

// Close closes the connections.
func (c *Client) Close() {
	for _, conn := range c.conns {
		_ = conn.Close()
	}
}

// Join relays a node's Join.
func (c *Client) Join(ctx context.Context, req *agentv1.JoinRequest) (*agentv1.JoinResponse, error) {
	// A fresh outgoing context: nothing of the node's call is forwarded
	// but the request.
	ctx = metadata.NewOutgoingContext(ctx, metadata.MD{})
	return call(ctx, c, "Join", func(ctx context.Context, nc agentv1.NodeServiceClient) (*agentv1.JoinResponse, error) {
		return nc.Join(ctx, req)
	})
}

// Renew relays a node's Renew with the chain it presented to the gateway
// (leaf first) in [ChainMetadata]; joinservice verifies it again.
func (c *Client) Renew(ctx context.Context, chain []*x509.Certificate, req *agentv1.RenewRequest) (*agentv1.RenewResponse, error) {
	md := metadata.MD{}
	for _, cert := range chain {
		md.Append(ChainMetadata, string(cert.Raw))
	}
	ctx = metadata.NewOutgoingContext(ctx, md)
	return call(ctx, c, "Renew", func(ctx context.Context, nc agentv1.NodeServiceClient) (*agentv1.RenewResponse, error) {
		return nc.Renew(ctx, req)
	})
}

// order is the addresses' indexes for one call: from the next in turn, those
// whose connection is ready first, then the others (idle, connecting), then
// those failing.
func (c *Client) order() []int {
	n := len(c.conns)
	start := int(c.next.Add(1)-1) % n
	var ready, other, failing []int
	for k := range n {
		i := (start + k) % n
		switch c.conns[i].GetState() {
		case connectivity.Ready:
			ready = append(ready, i)
		case connectivity.TransientFailure, connectivity.Shutdown:
			failing = append(failing, i)
		default:
			other = append(other, i)
		}
	}
	return append(append(ready, other...), failing...)
}

func call[T any](ctx context.Context, c *Client, method string, fn func(context.Context, agentv1.NodeServiceClient) (T, error)) (T, error) {
	var zero T
	var tried []string
	for _, i := range c.order() {
		actx, cancel := context.WithTimeout(ctx, c.timeout)
		resp, err := fn(actx, c.clients[i])
		cancel()
		if err == nil {
			return resp, nil
		}
		st := status.Convert(err)
		if answered(st) || ctx.Err() != nil {
			return zero, err
		}
		c.log.WarnContext(ctx, "joinservice unreachable", "method", method, "addr", c.addrs[i], "code", st.Code(), "err", st.Message())
		tried = append(tried, fmt.Sprintf("%s (%s)", c.addrs[i], st.Code()))
		if st.Code() != codes.Unavailable {
			// A deadline or a cancel: the call may have been served, so it
			// is not sent again to another address (a Join spends a use of
			// its token).
			break
		}
	}
	return zero, status.Errorf(codes.Unavailable, "joinservice is unavailable (tried %s); retry later", strings.Join(tried, ", "))
}

// answered reports whether st is joinservice's own answer (its handlers
// and its interceptor answer in the API's envelope, an ErrorInfo of
// fault.ErrorDomain) rather than the transport's.
func answered(st *status.Status) bool {
	for _, d := range st.Details() {
		if ei, ok := d.(interface{ GetDomain() string }); ok && ei.GetDomain() == fault.ErrorDomain {
			return true
		}
	}
	return false
}
