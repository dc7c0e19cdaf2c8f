package app

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/gateways"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	"github.com/bettercompute/bettercompute/services/api"
	"github.com/bettercompute/bettercompute/services/gateway"
	"github.com/bettercompute/bettercompute/services/joinservice"
)

// gatewayServer is the gateway role's listener.
type gatewayServer struct {
	sub    *nats.Subscription
	cmdSub *nats.Subscription
	gw     *gateway.Gateway
	relay  *joinservice.Client // nil: joinservice is in process
	grpc   *grpc.Server
	ln     net.Listener
	done   chan struct{}
}

// startGateway runs the gateway role: daemon sessions over mutual TLS on
// gateway.listen. With gateway.joinService set it relays Join and Renew to
// those joinservice addresses, presenting its gateway.tls certificate, and
// holds no node CA, no HPKE key and no signing key; without, joinservice
// runs in this process (startJoinService) and its CA signs the gateway's
// serving certificate unless gateway.tls names one.
func (a *App) startGateway(ctx context.Context) error {
	gc := a.cfg.Gateway
	var (
		cert   tls.Certificate
		bundle *x509.CertPool
		joiner gateway.Joiner
		relay  *joinservice.Client
		err    error
	)
	if gc.TLS.CertFile != "" {
		if cert, bundle, err = a.gatewayIdentity(); err != nil {
			return err
		}
	}
	if a.cfg.RelaysJoins() {
		if a.cfg.JoinService.CAKeyFile != "" || a.cfg.JoinService.HPKEKeyFile != "" || a.cfg.JoinService.KeyDir != "" {
			a.logger.Warn("gateway.joinService is set: this gateway relays to joinservice and reads none of joinService's keys")
		}
		relay, err = joinservice.NewClient(joinservice.ClientConfig{
			Addrs: gc.JoinService, Certificate: cert, RootCAs: bundle, TrustDomain: a.cfg.JoinService.TrustDomain,
			Timeout: gc.JoinServiceTimeout.Std(), Logger: a.logger.With("role", "gateway"),
		})
		if err != nil {
			return fault.Wrap(err, fault.InvalidConfig, "gateway.joinService", "%v", err)
		}
		joiner = relay
	} else {
		js := a.JoinService()
		if js == nil {
			return errors.New("gateway: no joinservice in process")
		}
		joiner = joinservice.NewJoiner(js)
		if gc.TLS.CertFile == "" {
			if cert, err = js.CA().ServingCertificate(gc.ID, gc.Hosts, 0); err != nil {
				return fmt.Errorf("gateway serving certificate: %w", err)
			}
			bundle = js.CA().Pool()
		}
	}
	td := a.cfg.JoinService.TrustDomain
	closeRelay := func() {
		if relay != nil {
			relay.Close()
		}
	}
	var busUp func() bool
	if nc := a.nc; nc != nil {
		busUp = nc.IsConnected
	}
	gw, err := gateway.New(gateway.Config{
		ID: gc.ID, DB: a.pool, Joiner: joiner, TrustDomain: td, BusUp: busUp,
		Revoked: func(ctx context.Context, serials []string) ([]string, error) {
			return nodeca.RevokedAmong(ctx, a.pool, serials)
		},
		Waker:             a.waker,
		HeartbeatInterval: gc.HeartbeatInterval.Std(),
		LivenessInterval:  gc.LivenessInterval.Std(),
		AdmitRate:         gc.AdmitRate,
		AdmitBurst:        gc.AdmitBurst,
		AdmitWait:         gc.AdmitWait.Std(),
		OldestAgent:       gc.AgentVersions.Oldest,
		NewestAgent:       gc.AgentVersions.Newest,
		Logger:            a.logger.With("role", "gateway"),
		ObservedKinds:     observedKinds,
		Kinds:             a.kinds,
	})
	if err != nil {
		closeRelay()
		return err
	}
	creds := credentials.NewTLS(&tls.Config{
		Certificates: []tls.Certificate{cert},
		ClientCAs:    bundle,
		// Join is the one call made without a client certificate; every
		// other method checks the verified chain itself.
		ClientAuth: tls.VerifyClientCertIfGiven,
		MinVersion: tls.VersionTLS13,
	})
	gs := grpc.NewServer(grpc.Creds(creds),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: 30 * time.Second, Timeout: 10 * time.Second}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
	)
	agentv1.RegisterNodeServiceServer(gs, gw)
	agentv1.RegisterSiteAgentServiceServer(gs, gw.SiteService())
	// Tunnels relayed from API processes elsewhere (gateway-class
	// certificates only).
	agentv1.RegisterGatewayServiceServer(gs, gw.RelayService())
	// bettercompute_gateway_sessions, what the gateway's autoscaler reads.
	if err := a.reg.Register(gw.Collector()); err != nil {
		closeRelay()
		return err
	}
	ln, err := net.Listen("tcp", gc.Listen)
	if err != nil {
		closeRelay()
		return fault.Wrap(err, fault.Unavailable, "gateway.listen", "cannot listen on %s: %v", gc.Listen, err)
	}
	if err := gateways.Register(ctx, a.pool, gc.ID, advertise(gc.Advertise, ln.Addr().String())); err != nil {
		_ = ln.Close()
		closeRelay()
		return fmt.Errorf("gateway: register its address: %w", err)
	}
	g := &gatewayServer{gw: gw, relay: relay, grpc: gs, ln: ln, done: make(chan struct{})}
	if err := gw.Start(ctx); err != nil {
		_ = ln.Close()
		closeRelay()
		return err
	}
	a.localGW.Store(gw)
	a.waker.SetGateway(gw)
	if a.nc != nil {
		// Pokes from nodespec controllers in other processes.
		sub, err := gw.SubscribeSpecPokes(a.nc)
		if err != nil {
			a.logger.Warn("no spec pokes; delivery relies on the database resync", "err", err)
		}
		g.sub = sub
		if g.cmdSub, err = gw.SubscribeCommands(a.nc); err != nil {
			a.logger.Warn("no command wakes; dispatch relies on the database resync", "err", err)
		}
		gw.ListenSiteTasks(a.nc)
	}
	go func() {
		defer close(g.done)
		if err := gs.Serve(ln); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			a.logger.Error("gateway stopped", "err", err)
		}
	}()
	a.gateway = g
	a.logger.Info("gateway serving", "addr", ln.Addr().String(), "id", gc.ID, "trustDomain", td, "joinService", strings.Join(gc.JoinService, ","))
	return nil
}

// stop ends every session, then the listener.
func (g *gatewayServer) stop(ctx context.Context) {
	if g.sub != nil {
		_ = g.sub.Unsubscribe()
	}
	if g.cmdSub != nil {
		_ = g.cmdSub.Unsubscribe()
	}
	g.gw.Stop()
	stopped := make(chan struct{})
	go func() { g.grpc.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-ctx.Done():
		g.grpc.Stop()
	}
	<-g.done
	if g.relay != nil {
		g.relay.Close()
	}
}

// GatewayAddr returns the gateway's listen address, or "" when the process
// runs no gateway.
func (a *App) GatewayAddr() string {
	if a.gateway == nil {
		return ""
	}
	return a.gateway.ln.Addr().String()
}

// GatewaySessions returns how many daemon sessions the process's gateway
// holds; 0 when it runs no gateway.
func (a *App) GatewaySessions() int {
	if gw := a.localGW.Load(); gw != nil {
		return gw.Sessions()
	}
	return 0
}

// advertise is the address other processes reach the gateway at:
// gateway.advertise, or the listener's with the host name in place of an
// unspecified host.
func advertise(configured, listened string) string {
	if configured != "" {
		return configured
	}
	host, port, err := net.SplitHostPort(listened)
	if err != nil {
		return listened
	}
	if ip := net.ParseIP(host); ip == nil || ip.IsUnspecified() {
		if h, err := os.Hostname(); err == nil {
			host = h
		}
	}
	return net.JoinHostPort(host, port)
}

// tunnelDialer opens tunnels for the API (api.TunnelDialer): through this
// process's gateway when it holds the node, otherwise through the gateway
// holding it (nodes.gateway_id, its address in the gateways table) over
// internal mutual TLS, presenting a gateway-class certificate: gateway.tls,
// or one this process's joinservice issues.
type tunnelDialer struct{ a *App }

func (d tunnelDialer) DialTunnel(ctx context.Context, nodeID, gatewayID, tunnelID, target string) (api.TunnelConn, error) {
	if gw := d.a.localGW.Load(); gw != nil && gatewayID == d.a.cfg.Gateway.ID {
		t, err := gw.OpenTunnel(ctx, nodeID, tunnelID, target)
		if err != nil {
			return nil, err
		}
		return t, nil
	}
	addr, err := gateways.Address(ctx, d.a.pool, gatewayID)
	if err != nil {
		return nil, err
	}
	cert, bundle, err := d.identity()
	if err != nil {
		return nil, err
	}
	return dialRemoteTunnel(ctx, addr, d.a.cfg.JoinService.TrustDomain, cert, bundle, &agentv1.RelayRequest{TunnelId: tunnelID, NodeId: nodeID, Target: target})
}

// identity is the certificate this process presents to other gateways.
func (d tunnelDialer) identity() (tls.Certificate, *x509.CertPool, error) {
	a := d.a
	if a.cfg.Gateway.TLS.CertFile != "" {
		return a.gatewayIdentity()
	}
	if js := a.JoinService(); js != nil {
		cert, err := js.CA().ServingCertificate(a.cfg.Gateway.ID, a.cfg.Gateway.Hosts, 0)
		if err != nil {
			return tls.Certificate{}, nil, err
		}
		return cert, js.CA().Pool(), nil
	}
	return tls.Certificate{}, nil, fault.New(fault.Unsupported, "nodeId",
		"this API process has no certificate to relay tunnels to another process's gateway: set gateway.tls (better-compute pki gateway-cert)")
}
