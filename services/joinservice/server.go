package joinservice

import (
	"context"
	"crypto/x509"
	"log/slog"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/services/api"
)

// Server adapts a [Service] to agentv1.NodeServiceServer for Join and Renew,
// with errors in the API's envelope. Session is the gateway's: Server
// answers it Unimplemented, so the gateway embeds Server in its own
// NodeServiceServer and overrides Session.
type Server struct {
	agentv1.UnimplementedNodeServiceServer
	svc    *Service
	logger *slog.Logger
}

// NewServer returns the adapter for svc.
func NewServer(svc *Service) *Server { return &Server{svc: svc, logger: svc.logger} }

// Join implements agentv1.NodeServiceServer.
func (s *Server) Join(ctx context.Context, req *agentv1.JoinRequest) (*agentv1.JoinResponse, error) {
	resp, err := s.svc.Join(ctx, req)
	return resp, s.status(ctx, "Join", err)
}

// Renew implements agentv1.NodeServiceServer: the node's certificate is the
// one its mutual TLS connection presented.
func (s *Server) Renew(ctx context.Context, req *agentv1.RenewRequest) (*agentv1.RenewResponse, error) {
	resp, err := s.svc.Renew(ctx, PeerCertificates(ctx), req)
	return resp, s.status(ctx, "Renew", err)
}

// PeerCertificates returns the client certificate chain of the TLS
// connection carrying ctx's call, leaf first, or nil.
func PeerCertificates(ctx context.Context) []*x509.Certificate {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return nil
	}
	info, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok {
		return nil
	}
	return info.State.PeerCertificates
}

func (s *Server) status(ctx context.Context, method string, err error) error {
	if err == nil {
		return nil
	}
	if fault.CodeOf(err) == fault.Internal {
		s.logger.ErrorContext(ctx, "node call failed", "method", method, "err", err)
	}
	return api.ToStatus(err).Err()
}
