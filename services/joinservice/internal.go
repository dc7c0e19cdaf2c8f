package joinservice

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"strings"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/spiffepath"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// The internal listener.
//
// A standalone joinservice (`serve --roles joinservice`) serves
// agentv1.NodeService's Join and Renew on a listener of its own, over mutual
// TLS, to gateways only: a caller must present a certificate that chains to
// the node CA and whose SPIFFE ID is spiffe://<trust domain>/gateway/<id>.
// A gateway relays a node's Join as it came (the token is sealed to
// joinservice's key, so the gateway cannot read it), and a node's Renew with
// the certificate chain the node presented to the gateway in the
// [ChainMetadata] metadata. joinservice reads that metadata only from an
// authenticated gateway, on this listener, and verifies the chain again
// against the CA (chain, validity, SPIFFE ID, revocation) before it
// renews; the CSR must still be for the key of that certificate, so a
// gateway can renew only a certificate for a key the node holds.

// ChainMetadata is the binary gRPC metadata key carrying, on a relayed Renew,
// the node's certificate chain (one DER certificate per value, leaf first).
const ChainMetadata = "bc-node-chain-bin"

// Bounds on the relayed chain: what a node's chain is (a leaf and the CA's
// chain) with room to spare, and no more.
const (
	maxChainCerts = 8
	maxCertBytes  = 16 << 10
)

// JoinServicePath is the SPIFFE ID path of joinservice's internal listener
// certificate: spiffe://<trust domain>/joinservice.
const JoinServicePath = "joinservice"

// InternalConfig configures the internal listener's gRPC server.
type InternalConfig struct {
	// Certificate is the listener's; nil mints one from the CA for Hosts
	// (URI SAN spiffe://<trust domain>/joinservice).
	Certificate *tls.Certificate
	// Hosts are the names gateways dial, for a minted certificate.
	Hosts []string
}

// NewInternalServer returns the gRPC server of the internal listener:
// mutual TLS requiring a gateway certificate of the CA's trust domain, and
// agentv1.NodeService with Join and Renew ([InternalServer]).
func NewInternalServer(svc *Service, cfg InternalConfig) (*grpc.Server, error) {
	cert := cfg.Certificate
	if cert == nil {
		c, err := svc.ca.ServiceCertificate(JoinServicePath, cfg.Hosts, 0, JoinServicePath)
		if err != nil {
			return nil, fmt.Errorf("joinservice serving certificate: %w", err)
		}
		cert = &c
	}
	creds := credentials.NewTLS(&tls.Config{
		Certificates: []tls.Certificate{*cert},
		ClientCAs:    svc.ca.Pool(),
		ClientAuth:   tls.RequireAndVerifyClientCert,
		MinVersion:   tls.VersionTLS13,
	})
	is := &InternalServer{Server: NewServer(svc), td: svc.ca.TrustDomain()}
	gs := grpc.NewServer(grpc.Creds(creds),
		grpc.MaxRecvMsgSize(1<<20),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: 30 * time.Second, Timeout: 10 * time.Second}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
		grpc.UnaryInterceptor(is.authorize),
		grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
			if _, err := is.gatewayOf(ss.Context()); err != nil {
				return err
			}
			return h(srv, ss)
		}),
	)
	agentv1.RegisterNodeServiceServer(gs, is)
	return gs, nil
}

// InternalServer is agentv1.NodeService on the internal listener: Join as
// [Server.Join]; Renew with the node's chain from [ChainMetadata]; Session
// Unimplemented. Its interceptor refuses every caller but a gateway.
type InternalServer struct {
	*Server
	td spiffeid.TrustDomain
}

func (s *InternalServer) authorize(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	if _, err := s.gatewayOf(ctx); err != nil {
		return nil, err
	}
	return h(ctx, req)
}

// gatewayOf returns the gateway id of the caller's verified certificate, or
// a PERMISSION_DENIED (UNAUTHENTICATED without one) status.
func (s *InternalServer) gatewayOf(ctx context.Context) (string, error) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return "", fault.New(fault.Unauthenticated, "certificate", "a gateway certificate is required").Status().Err()
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(ti.State.VerifiedChains) == 0 || len(ti.State.VerifiedChains[0]) == 0 {
		return "", fault.New(fault.Unauthenticated, "certificate", "a gateway certificate is required").Status().Err()
	}
	id, err := x509svid.IDFromCert(ti.State.VerifiedChains[0][0])
	if err != nil {
		return "", fault.New(fault.Unauthenticated, "certificate", "the certificate has no SPIFFE ID").Status().Err()
	}
	name, ok := strings.CutPrefix(id.Path(), spiffepath.GatewayPrefix)
	if id.TrustDomain() != s.td || !ok || name == "" || strings.Contains(name, "/") {
		return "", fault.New(fault.AccessDenied, "certificate", "%s is not a gateway of %s", id, s.td).Status().Err()
	}
	return name, nil
}

// Renew implements agentv1.NodeServiceServer: the node's chain is the one
// the relaying gateway put in [ChainMetadata] (only a gateway gets here),
// verified again by [Service.Renew].
func (s *InternalServer) Renew(ctx context.Context, req *agentv1.RenewRequest) (*agentv1.RenewResponse, error) {
	chain, err := relayedChain(ctx)
	if err != nil {
		return nil, s.status(ctx, "Renew", err)
	}
	resp, err := s.svc.Renew(ctx, chain, req)
	return resp, s.status(ctx, "Renew", err)
}

// relayedChain parses [ChainMetadata] from ctx's incoming metadata.
func relayedChain(ctx context.Context) ([]*x509.Certificate, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	vals := md.Get(ChainMetadata)
	if len(vals) > maxChainCerts {
		return nil, fault.New(fault.InvalidInput, "certificate", "at most %d certificates in the relayed chain, got %d", maxChainCerts, len(vals))
	}
	chain := make([]*x509.Certificate, 0, len(vals))
	for _, v := range vals {
		if len(v) > maxCertBytes {
			return nil, fault.New(fault.InvalidInput, "certificate", "a relayed certificate is over %d bytes", maxCertBytes)
		}
		c, err := x509.ParseCertificate([]byte(v))
		if err != nil {
			return nil, fault.New(fault.Unauthenticated, "certificate", "the relayed node certificate does not parse: %v", err)
		}
		chain = append(chain, c)
	}
	return chain, nil
}
