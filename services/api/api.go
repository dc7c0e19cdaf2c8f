// Package api assembles the `api` role: the gRPC services of
// bettercompute.compute.v1, their REST mapping through grpc-gateway
// (POST /api/compute/{group}/{method}, proto3 JSON bodies), the OpenAPI
// document, gRPC health and reflection, and one error envelope for both
// transports.
//
// Handlers return *fault.Error; this package alone turns them into gRPC
// statuses and REST bodies.
package api

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"
	"google.golang.org/protobuf/encoding/protojson"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
	"github.com/bettercompute/bettercompute/proto/openapi"
)

// OpenAPIPath serves the generated OpenAPI document.
const OpenAPIPath = "/api/compute/openapi.json"

// Prefix is where every REST method lives.
const Prefix = "/api/compute/"

// MaxRequestBytes bounds a request body (REST) or message (gRPC).
const MaxRequestBytes = 4 << 20

// Services are the API groups this process serves.
type Services struct {
	System computev1.SystemServiceServer
}

// Server is the API role's gRPC server and REST gateway.
type Server struct {
	logger *slog.Logger
	grpc   *grpc.Server
	health *health.Server
	conn   *grpc.ClientConn
}

// New builds the gRPC server with every service registered. Serve it with
// [Server.GRPC] and mount [Server.Gateway] once the listener's address is
// known.
func New(logger *slog.Logger, svc Services) *Server {
	gs := grpc.NewServer(
		grpc.StatsHandler(otelgrpc.NewServerHandler()),
		grpc.ChainUnaryInterceptor(unaryErrors(logger)),
		grpc.MaxRecvMsgSize(MaxRequestBytes),
	)
	computev1.RegisterSystemServiceServer(gs, svc.System)
	hs := health.NewServer()
	healthpb.RegisterHealthServer(gs, hs)
	reflection.Register(gs)
	return &Server{logger: logger, grpc: gs, health: hs}
}

// GRPC returns the gRPC server, to be served over HTTP/2.
func (s *Server) GRPC() *grpc.Server { return s.grpc }

// SetServing marks every service SERVING or NOT_SERVING in gRPC health.
func (s *Server) SetServing(ok bool) {
	if ok {
		s.health.Resume()
	} else {
		s.health.Shutdown()
	}
}

// Gateway returns the REST handler (every method under [Prefix] plus the
// OpenAPI document), which forwards to the gRPC server at addr so that REST
// and gRPC share interceptors, limits and errors.
func (s *Server) Gateway(ctx context.Context, addr string) (http.Handler, error) {
	conn, err := grpc.NewClient("passthrough:///"+addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithStatsHandler(otelgrpc.NewClientHandler()),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(MaxRequestBytes)),
	)
	if err != nil {
		return nil, fmt.Errorf("dial own gRPC server: %w", err)
	}
	s.conn = conn
	mux := runtime.NewServeMux(
		runtime.WithErrorHandler(gatewayErrorHandler),
		runtime.WithRoutingErrorHandler(routingErrorHandler),
		runtime.WithMarshalerOption(runtime.MIMEWildcard, &runtime.JSONPb{
			MarshalOptions:   protojson.MarshalOptions{EmitUnpopulated: true},
			UnmarshalOptions: protojson.UnmarshalOptions{DiscardUnknown: false},
		}),
	)
	if err := computev1.RegisterSystemServiceHandler(ctx, mux, conn); err != nil {
		return nil, fmt.Errorf("register system gateway: %w", err)
	}
	h := http.NewServeMux()
	h.HandleFunc("GET "+OpenAPIPath, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", openapi.ContentType)
		_, _ = w.Write(openapi.Document())
	})
	h.Handle(Prefix, http.MaxBytesHandler(mux, MaxRequestBytes))
	return h, nil
}

// Stop stops the gRPC server at once (the HTTP server drains first) and
// closes the gateway's connection. It is safe to call more than once.
func (s *Server) Stop() {
	s.health.Shutdown()
	s.grpc.Stop()
	if s.conn != nil {
		_ = s.conn.Close()
	}
}
