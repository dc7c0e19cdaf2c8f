package session

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

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

// dial opens a client connection authenticated with the current
// certificate and verifying the gateway against the current trust bundle.
func (r *runner) dial() (*grpc.ClientConn, error) {
	_, _, pool := r.current()
	creds := credentials.NewTLS(&tls.Config{
		MinVersion: tls.VersionTLS12,
		RootCAs:    pool,
		ServerName: r.cfg.ServerName,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			_, c, _ := r.current()
			return c, nil
		},
		VerifyConnection: r.verifyGateway,
	})
	conn, err := grpc.NewClient(r.cfg.Gateway, grpc.WithTransportCredentials(creds))
	if err != nil {
		return nil, fmt.Errorf("session: dial %s: %w", r.cfg.Gateway, err)
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
