package app

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"

	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/spiffepath"
	"github.com/bettercompute/bettercompute/proto/tunnelspec"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// remoteTunnel is a tunnel relayed through another process's gateway
// (GatewayService.Relay) as an api.TunnelConn. It owns its connection,
// closed with it.
type remoteTunnel struct {
	conn    *grpc.ClientConn
	stream  agentv1.GatewayService_RelayClient
	cancel  context.CancelFunc
	sendMu  sync.Mutex
	pending []byte
	eof     bool
	done    chan struct{}
	once    sync.Once
	cause   error
}

// dialRemoteTunnel opens first's tunnel through the gateway at addr.
func dialRemoteTunnel(ctx context.Context, addr, trustDomain string, cert tls.Certificate, bundle *x509.CertPool, first *agentv1.RelayRequest) (*remoteTunnel, error) {
	creds := credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS13,
		// The gateway is verified by its chain and SPIFFE id, not by the
		// host name: its advertised address (a pod's) may be in no
		// certificate.
		InsecureSkipVerify: true, //nolint:gosec // VerifyConnection verifies the chain against the bundle
		VerifyConnection:   verifyGateway(bundle, trustDomain),
	})
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		return nil, fault.New(fault.Unavailable, "nodeId", "gateway at %s: %v", addr, err)
	}
	sctx, cancel := context.WithCancel(context.Background()) // outlives the dial
	stop := context.AfterFunc(ctx, cancel)                   // until it opened
	fail := func(err error) (*remoteTunnel, error) {
		cancel()
		_ = conn.Close()
		return nil, err
	}
	stream, err := agentv1.NewGatewayServiceClient(conn).Relay(sctx)
	if err != nil {
		return fail(fault.New(fault.Unavailable, "nodeId", "gateway at %s: %v", addr, err))
	}
	if err := stream.Send(first); err != nil {
		return fail(fault.New(fault.Unavailable, "nodeId", "gateway at %s: %v", addr, err))
	}
	m, err := stream.Recv()
	if err != nil {
		return fail(fault.New(fault.Unavailable, "nodeId", "gateway at %s: %v", addr, err))
	}
	if !stop() {
		return fail(ctx.Err())
	}
	if !m.GetOpened() {
		code := fault.Code(m.GetErrorCode())
		if _, ok := fault.Lookup(code); !ok {
			code = fault.Unavailable
		}
		return fail(fault.New(code, "target", "%s", m.GetError()))
	}
	return &remoteTunnel{conn: conn, stream: stream, cancel: cancel, done: make(chan struct{})}, nil
}

// verifyGateway accepts a peer whose chain verifies against bundle for
// server authentication and whose leaf names a gateway of trustDomain
// (spiffe://<trustDomain>/gateway/<name>).
func verifyGateway(bundle *x509.CertPool, trustDomain string) func(tls.ConnectionState) error {
	return func(cs tls.ConnectionState) error {
		if len(cs.PeerCertificates) == 0 {
			return errors.New("the gateway sent no certificate")
		}
		inter := x509.NewCertPool()
		for _, c := range cs.PeerCertificates[1:] {
			inter.AddCert(c)
		}
		leaf := cs.PeerCertificates[0]
		if _, err := leaf.Verify(x509.VerifyOptions{Roots: bundle, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
			return fmt.Errorf("the gateway's certificate: %w", err)
		}
		id, err := x509svid.IDFromCert(leaf)
		if err != nil || id.TrustDomain().Name() != trustDomain || !strings.HasPrefix(id.Path(), spiffepath.GatewayPrefix) {
			return fmt.Errorf("the peer's certificate names no gateway of %s", trustDomain)
		}
		return nil
	}
}

func (t *remoteTunnel) Read(p []byte) (int, error) {
	for len(t.pending) == 0 {
		if t.eof {
			return 0, io.EOF
		}
		m, err := t.stream.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				err = errors.New("the gateway ended the tunnel")
			}
			t.Close(err) // the node's side ended
			return 0, err
		}
		if len(m.GetData()) > tunnelspec.MaxFrame {
			err := errors.New("the gateway sent a frame over the maximum size")
			t.Close(err)
			return 0, err
		}
		t.pending, t.eof = m.GetData(), m.GetCloseWrite()
	}
	n := copy(p, t.pending)
	t.pending = t.pending[n:]
	return n, nil
}

func (t *remoteTunnel) Write(p []byte) (int, error) {
	t.sendMu.Lock()
	defer t.sendMu.Unlock()
	written := 0
	for len(p) > 0 {
		n := min(len(p), tunnelspec.MaxFrame)
		if err := t.stream.Send(&agentv1.RelayRequest{Data: p[:n]}); err != nil {
			return written, fmt.Errorf("relay: %w", err)
		}
		written += n
		p = p[n:]
	}
	return written, nil
}

func (t *remoteTunnel) CloseWrite() error {
	t.sendMu.Lock()
	defer t.sendMu.Unlock()
	return t.stream.Send(&agentv1.RelayRequest{CloseWrite: true})
}

// Close ends the relay (and so the tunnel at the node) and the connection.
func (t *remoteTunnel) Close(cause error) {
	t.once.Do(func() {
		t.cause = cause
		t.cancel()
		_ = t.conn.Close()
		close(t.done)
	})
}

func (t *remoteTunnel) Done() <-chan struct{} { return t.done }

func (t *remoteTunnel) Cause() error {
	select {
	case <-t.done:
		return t.cause
	default:
		return nil
	}
}
