package app

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"os"
	"slices"
	"strings"

	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc"

	"github.com/bettercompute/bettercompute/proto/spiffepath"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/services/joinservice"
)

// joinServer is the joinservice role: the Service, and its internal
// listener when it has one.
type joinServer struct {
	svc  *joinservice.Service
	grpc *grpc.Server
	ln   net.Listener
	done chan struct{}
}

// resolveJoinService settles where joinservice runs, after the gateway's
// place is known: a gateway that does not relay hosts it in process (and
// the role is listed); the joinservice role named explicitly listens on
// joinService.listen (default :8444); `all` listens only where
// joinService.listen is set, and otherwise runs the role only inside its
// gateway. It returns the roles.
func resolveJoinService(cfg *config.Config, roles []config.Role) []config.Role {
	explicit := !slices.Equal(cfg.Roles, nil) && !slices.Contains(cfg.Roles, string(config.RoleAll))
	gatewayHosts := slices.Contains(roles, config.RoleGateway) && !cfg.RelaysJoins()
	if !slices.Contains(roles, config.RoleJoinService) || cfg.JoinService.Listen != "" {
		return roles
	}
	switch {
	case explicit:
		cfg.JoinService.Listen = config.DefaultJoinServiceListen
	case !gatewayHosts:
		roles = slices.DeleteFunc(roles, func(r config.Role) bool { return r == config.RoleJoinService })
	}
	return roles
}

// needsJoinService reports whether this process holds joinservice (and so
// the node CA and the HPKE key): it runs the role, or a gateway that does
// not relay.
func (a *App) needsJoinService() bool {
	return slices.Contains(a.roles, config.RoleJoinService) ||
		(slices.Contains(a.roles, config.RoleGateway) && !a.cfg.RelaysJoins())
}

// startJoinService opens joinservice when this process holds it, and serves
// its internal listener when joinService.listen is set.
func (a *App) startJoinService(context.Context) error {
	if !a.needsJoinService() {
		return nil
	}
	svc, err := joinservice.Open(a.cfg.JoinService, a.pool, a.logger.With("role", "joinservice"))
	if err != nil {
		return err
	}
	j := &joinServer{svc: svc}
	a.joinSvc = j
	js := a.cfg.JoinService
	if !slices.Contains(a.roles, config.RoleJoinService) || js.Listen == "" {
		return nil
	}
	var cert *tls.Certificate
	if js.TLS.CertFile != "" {
		c, err := tls.LoadX509KeyPair(js.TLS.CertFile, js.TLS.KeyFile)
		if err != nil {
			return fault.Wrap(err, fault.InvalidConfig, "joinService.tls.certFile", "cannot load joinservice's certificate: %v", err)
		}
		cert = &c
	}
	gs, err := joinservice.NewInternalServer(svc, joinservice.InternalConfig{Certificate: cert, Hosts: js.Hosts})
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", js.Listen)
	if err != nil {
		return fault.Wrap(err, fault.Unavailable, "joinService.listen", "cannot listen on %s: %v", js.Listen, err)
	}
	j.grpc, j.ln, j.done = gs, ln, make(chan struct{})
	go func() {
		defer close(j.done)
		if err := gs.Serve(ln); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			a.logger.Error("joinservice stopped", "err", err)
		}
	}()
	a.logger.Info("joinservice serving gateways", "addr", ln.Addr().String(), "trustDomain", svc.CA().TrustDomain().Name(), "hpkeKeyId", svc.Key().ID())
	return nil
}

// stop ends the internal listener, draining calls until ctx ends.
func (j *joinServer) stop(ctx context.Context) {
	if j.grpc == nil {
		return
	}
	stopped := make(chan struct{})
	go func() { j.grpc.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-ctx.Done():
		j.grpc.Stop()
	}
	<-j.done
}

// JoinServiceAddr returns joinservice's internal listener address, or ""
// when the process serves none.
func (a *App) JoinServiceAddr() string {
	if a.joinSvc == nil || a.joinSvc.ln == nil {
		return ""
	}
	return a.joinSvc.ln.Addr().String()
}

// JoinService returns the process's joinservice (the role's, or the one
// inside its gateway), or nil: a gateway that relays holds none.
func (a *App) JoinService() *joinservice.Service {
	if a.joinSvc == nil {
		return nil
	}
	return a.joinSvc.svc
}

// gatewayIdentity loads gateway.tls: the gateway's certificate, which must
// carry a gateway SPIFFE ID of the trust domain (joinservice admits no
// other), and the trust bundle.
func (a *App) gatewayIdentity() (tls.Certificate, *x509.CertPool, error) {
	t, gc := a.cfg.Gateway.TLS, a.cfg.Gateway
	cert, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
	if err != nil {
		return tls.Certificate{}, nil, fault.Wrap(err, fault.InvalidConfig, "gateway.tls.certFile", "cannot load the gateway's certificate: %v", err)
	}
	if cert.Leaf == nil {
		if cert.Leaf, err = x509.ParseCertificate(cert.Certificate[0]); err != nil {
			return tls.Certificate{}, nil, fault.Wrap(err, fault.InvalidConfig, "gateway.tls.certFile", "cannot parse the gateway's certificate: %v", err)
		}
	}
	id, err := x509svid.IDFromCert(cert.Leaf)
	if err != nil {
		return tls.Certificate{}, nil, fault.New(fault.InvalidConfig, "gateway.tls.certFile", "the gateway's certificate has no SPIFFE ID: %v", err)
	}
	name, ok := strings.CutPrefix(id.Path(), spiffepath.GatewayPrefix)
	if id.TrustDomain().Name() != a.cfg.JoinService.TrustDomain || !ok || name == "" {
		return tls.Certificate{}, nil, fault.New(fault.InvalidConfig, "gateway.tls.certFile", "the certificate is for %s, not a gateway of %s", id, a.cfg.JoinService.TrustDomain)
	}
	if name != gc.ID {
		a.logger.Warn("the gateway's certificate names another gateway", "certificate", id.String(), "gateway.id", gc.ID)
	}
	b, err := os.ReadFile(t.CAFile)
	if err != nil {
		return tls.Certificate{}, nil, fault.Wrap(err, fault.InvalidConfig, "gateway.tls.caFile", "cannot read the trust bundle: %v", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(b) {
		return tls.Certificate{}, nil, fault.New(fault.InvalidConfig, "gateway.tls.caFile", "no PEM certificate in %s", t.CAFile)
	}
	return cert, pool, nil
}
