package app

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/nats-io/nats.go"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
	"github.com/bettercompute/bettercompute/services/gateway"
	"github.com/bettercompute/bettercompute/services/joinservice"
)

// gatewayServer is the gateway role's listener.
type gatewayServer struct {
	sub    *nats.Subscription
	cmdSub *nats.Subscription
	gw     *gateway.Gateway
	js     *joinservice.Service
	grpc   *grpc.Server
	ln     net.Listener
	done   chan struct{}
}

// startGateway runs the gateway role: daemon sessions over mutual TLS on
// gateway.listen, with joinservice constructed in the same process from the
// shared configuration (this release's host for Join and Renew).
func (a *App) startGateway(context.Context) error {
	js, err := joinservice.Open(a.cfg.JoinService, a.pool, a.logger)
	if err != nil {
		return err
	}
	gc := a.cfg.Gateway
	ca := js.CA()
	cert, err := ca.ServingCertificate(gc.ID, gc.Hosts, 0)
	if err != nil {
		return fmt.Errorf("gateway serving certificate: %w", err)
	}
	gw, err := gateway.New(gateway.Config{
		ID: gc.ID, DB: a.pool, Joiner: joinservice.NewJoiner(js), TrustDomain: ca.TrustDomain().Name(),
		Revoked: func(ctx context.Context, serials []string) ([]string, error) {
			return nodeca.RevokedAmong(ctx, a.pool, serials)
		},
		Poker:             &workqueue.Poker{NC: a.nc},
		HeartbeatInterval: gc.HeartbeatInterval.Std(),
		LivenessInterval:  gc.LivenessInterval.Std(),
		AdmitRate:         gc.AdmitRate,
		AdmitBurst:        gc.AdmitBurst,
		AdmitWait:         gc.AdmitWait.Std(),
		Logger:            a.logger.With("role", "gateway"),
		ObservedKinds:     observedKinds,
		Kinds:             a.kinds,
	})
	if err != nil {
		return err
	}
	creds := credentials.NewTLS(&tls.Config{
		Certificates: []tls.Certificate{cert},
		ClientCAs:    ca.Pool(),
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
	ln, err := net.Listen("tcp", gc.Listen)
	if err != nil {
		return fault.Wrap(err, fault.Unavailable, "gateway.listen", "cannot listen on %s: %v", gc.Listen, err)
	}
	g := &gatewayServer{gw: gw, js: js, grpc: gs, ln: ln, done: make(chan struct{})}
	gw.Start()
	a.localGW.Store(gw)
	a.specRouter.SetLocal(gw)
	if a.nc != nil {
		// Pokes from nodespec controllers in other processes.
		sub, err := gw.SubscribeSpecPokes(a.nc)
		if err != nil {
			a.logger.Warn("no spec pokes; delivery relies on the database resync", "err", err)
		}
		g.sub = sub
		if g.cmdSub, err = a.subscribeCommandPokes(gw); err != nil {
			a.logger.Warn("no command pokes; dispatch relies on the database resync", "err", err)
		}
	}
	go func() {
		defer close(g.done)
		if err := gs.Serve(ln); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			a.logger.Error("gateway stopped", "err", err)
		}
	}()
	a.gateway = g
	a.logger.Info("gateway serving", "addr", ln.Addr().String(), "id", gc.ID, "trustDomain", ca.TrustDomain().Name())
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
}

// GatewayAddr returns the gateway's listen address, or "" when the process
// runs no gateway.
func (a *App) GatewayAddr() string {
	if a.gateway == nil {
		return ""
	}
	return a.gateway.ln.Addr().String()
}

// JoinService returns the in-process joinservice of the gateway role, or nil.
func (a *App) JoinService() *joinservice.Service {
	if a.gateway == nil {
		return nil
	}
	return a.gateway.js
}

// GatewaySessions returns how many daemon sessions the process's gateway
// holds; 0 when it runs no gateway.
func (a *App) GatewaySessions() int {
	if gw := a.localGW.Load(); gw != nil {
		return gw.Sessions()
	}
	return 0
}
