package joinservice

import (
	"context"
	"crypto/x509"
	"errors"
	"log/slog"

	"github.com/jackc/pgx/v5/pgconn"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
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

// Joiner is a [Service] as the gateway relays Join and Renew to it (the
// gateway verifies the caller's chain itself and hands it over), with the
// errors mapped as Server maps them.
type Joiner struct{ s *Server }

// NewJoiner returns svc with its errors mapped for the gateway.
func NewJoiner(svc *Service) Joiner { return Joiner{s: NewServer(svc)} }

// Join is [Service.Join] with its error mapped to a gRPC status.
func (j Joiner) Join(ctx context.Context, req *agentv1.JoinRequest) (*agentv1.JoinResponse, error) {
	resp, err := j.s.svc.Join(ctx, req)
	if err != nil {
		return nil, j.s.status(ctx, "Join", err)
	}
	return resp, nil
}

// Renew is [Service.Renew] with its error mapped to a gRPC status.
func (j Joiner) Renew(ctx context.Context, chain []*x509.Certificate, req *agentv1.RenewRequest) (*agentv1.RenewResponse, error) {
	resp, err := j.s.svc.Renew(ctx, chain, req)
	if err != nil {
		return nil, j.s.status(ctx, "Renew", err)
	}
	return resp, nil
}

// status maps err for a caller who may be unauthenticated: a fault keeps
// its code, message and field; anything else (a database failure, a bug)
// is logged and answered INTERNAL, or UNAVAILABLE when the database is
// unreachable, with a generic message — its text never leaves the process.
func (s *Server) status(ctx context.Context, method string, err error) error {
	if err == nil {
		return nil
	}
	if _, ok := fault.As(err); !ok {
		s.logger.ErrorContext(ctx, "node call failed", "method", method, "err", err)
		if unreachable(ctx, err) {
			err = fault.New(fault.Unavailable, "", "the node service is unavailable; retry later")
		} else {
			err = fault.New(fault.Internal, "", "internal error")
		}
	} else if fault.CodeOf(err) == fault.Internal {
		s.logger.ErrorContext(ctx, "node call failed", "method", method, "err", err)
		err = fault.New(fault.Internal, "", "internal error")
	}
	return fault.ToStatus(err).Err()
}

// unreachable reports whether err is the database (or the call's context)
// giving out rather than a bug: worth a retry.
func unreachable(ctx context.Context, err error) bool {
	var ce *pgconn.ConnectError
	return errors.As(err, &ce) || ctx.Err() != nil || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)
}
