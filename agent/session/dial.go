package session

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/bettercompute/bettercompute/agent/internal/gateways"
	"github.com/bettercompute/bettercompute/agent/state"
	"github.com/bettercompute/bettercompute/proto/spiffepath"
)

func (r *runner) setIdentity(id state.Identity) error {
	leaf, err := id.Leaf()
	if err != nil {
		return err
	}
	pool, err := id.Pool()
	if err != nil {
		return err
	}
	cert := &tls.Certificate{Certificate: id.Chain, PrivateKey: r.key, Leaf: leaf}
	r.mu.Lock()
	r.id, r.cert, r.pool = id, cert, pool
	r.mu.Unlock()
	return nil
}

func (r *runner) current() (state.Identity, *tls.Certificate, *x509.CertPool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.id, r.cert, r.pool
}

// target is the gateway the session last dialed (the renewal goes there
// too), else the next of the list.
func (r *runner) target() gateways.Target {
	r.mu.Lock()
	tg := r.gw
	r.mu.Unlock()
	if tg.Addr == "" {
		return r.gws.Next()
	}
	return tg
}

// dial opens a client connection to tg authenticated with the current
// certificate and verifying the gateway against the current trust bundle.
func (r *runner) dial(tg gateways.Target) (*grpc.ClientConn, error) {
	_, _, pool := r.current()
	creds := credentials.NewTLS(&tls.Config{
		MinVersion: tls.VersionTLS12,
		RootCAs:    pool,
		ServerName: tg.ServerName,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			_, c, _ := r.current()
			return c, nil
		},
		VerifyConnection: r.verifyGateway,
	})
	conn, err := grpc.NewClient(tg.Addr, grpc.WithTransportCredentials(creds), grpc.WithDefaultServiceConfig(gateways.ServiceConfig))
	if err != nil {
		return nil, fmt.Errorf("session: dial %s: %w", tg.Addr, err)
	}
	return conn, nil
}

// trustDomain is the trust domain of the node's SPIFFE id: the
// installation destructive commands must be signed for. It does not change
// on renewal.
func trustDomain(id state.Identity) string {
	leaf, err := id.Leaf()
	if err != nil {
		return ""
	}
	for _, u := range leaf.URIs {
		if u.Scheme == "spiffe" && u.Path == spiffepath.Node(id.NodeID) {
			return u.Host
		}
	}
	return ""
}

// verifyGateway runs after the standard chain and name verification: the
// gateway's certificate must name a gateway of the node's trust domain.
func (r *runner) verifyGateway(cs tls.ConnectionState) error {
	if len(cs.PeerCertificates) == 0 {
		return errors.New("session: the gateway sent no certificate")
	}
	_, own, _ := r.current()
	td := ""
	for _, u := range own.Leaf.URIs {
		if u.Scheme == "spiffe" {
			td = u.Host
		}
	}
	for _, u := range cs.PeerCertificates[0].URIs {
		if u.Scheme == "spiffe" && u.Host == td && strings.HasPrefix(u.Path, spiffepath.GatewayPrefix) && len(u.Path) > len(spiffepath.GatewayPrefix) {
			return nil
		}
	}
	return fmt.Errorf("session: the gateway's certificate has no SPIFFE id spiffe://%s/gateway/<name>", td)
}
