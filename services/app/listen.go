package app

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/reflection"
	reflectionv1 "google.golang.org/grpc/reflection/grpc_reflection_v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// serverTLS is the API listener's TLS configuration (server.tls), or nil
// when it serves plain HTTP/1.1 and h2c.
func (a *App) serverTLS() (*tls.Config, error) {
	t := a.cfg.Server.TLS
	if t.CertFile == "" {
		return nil, nil
	}
	cert, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
	if err != nil {
		return nil, fault.Wrap(err, fault.InvalidConfig, "server.tls.certFile", "cannot load the serving certificate: %v", err)
	}
	cfg := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12, NextProtos: []string{"h2", "http/1.1"}}
	if t.ClientCAFile != "" {
		pem, err := os.ReadFile(t.ClientCAFile)
		if err != nil {
			return nil, fault.Wrap(err, fault.InvalidConfig, "server.tls.clientCAFile", "cannot read the client CAs: %v", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fault.New(fault.InvalidConfig, "server.tls.clientCAFile", "no PEM certificate in %s", t.ClientCAFile)
		}
		cfg.ClientCAs, cfg.ClientAuth = pool, tls.RequireAndVerifyClientCert
	}
	return cfg, nil
}

// newHTTPServer is the API listener's server: HTTP/1.1 and HTTP/2 (h2c, or
// h2 over TLS), with header, read and idle timeouts — no write timeout,
// which would cut the event streams.
func (a *App) newHTTPServer(handler http.Handler, tlsCfg *tls.Config) *http.Server {
	var protocols http.Protocols
	protocols.SetHTTP1(true)
	if tlsCfg != nil {
		protocols.SetHTTP2(true)
	} else {
		protocols.SetUnencryptedHTTP2(true)
	}
	return &http.Server{
		Handler:           handler,
		Protocols:         &protocols,
		TLSConfig:         tlsCfg,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       a.cfg.Server.ReadTimeout.Std(),
		IdleTimeout:       a.cfg.Server.IdleTimeout.Std(),
		ErrorLog:          slog.NewLogLogger(a.logger.Handler(), slog.LevelWarn),
	}
}

// withGRPC serves gRPC requests (HTTP/2, application/grpc) with gs and the
// rest with h; a nil gs leaves everything to h.
func withGRPC(gs *grpc.Server, h http.Handler) http.Handler {
	if gs == nil {
		return h
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ProtoMajor == 2 && strings.HasPrefix(r.Header.Get("Content-Type"), "application/grpc") {
			gs.ServeHTTP(w, r)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// adminServer is the admin listener (server.adminAddr, loopback by
// default): /metrics, /debug/pprof/ and gRPC reflection of the API's
// services, none of which the API port then serves. Only
// server.adminAddr "api" puts them back on the API port, and there is no
// admin listener.
type adminServer struct {
	srv    *http.Server
	ln     net.Listener
	grpc   *grpc.Server
	served chan struct{}
}

func (a *App) startAdmin() error {
	addr, onAPI := a.cfg.Server.Admin()
	if onAPI {
		return nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fault.Wrap(err, fault.Unavailable, "server.adminAddr", "cannot listen on %s: %v", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(a.reg, promhttp.HandlerOpts{Registry: a.reg}))
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	as := &adminServer{ln: ln, served: make(chan struct{})}
	if a.api != nil {
		as.grpc = grpc.NewServer()
		reflectionv1.RegisterServerReflectionServer(as.grpc, reflection.NewServerV1(reflection.ServerOptions{Services: a.api.GRPC()}))
	}
	as.srv = a.newHTTPServer(withGRPC(as.grpc, mux), nil)
	go func() {
		defer close(as.served)
		if err := as.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			a.logger.Error("admin server stopped", "err", err)
		}
	}()
	a.admin = as
	a.logger.Info("admin listener serving metrics, pprof and reflection", "addr", ln.Addr().String())
	return nil
}

func (as *adminServer) stop() {
	_ = as.srv.Close()
	if as.grpc != nil {
		as.grpc.Stop()
	}
	<-as.served
}

// AdminAddr returns the admin listener's address, or "" when there is none.
func (a *App) AdminAddr() string {
	if a.admin == nil {
		return ""
	}
	return a.admin.ln.Addr().String()
}
