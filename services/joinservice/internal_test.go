package joinservice_test

import (
	"context"
	"crypto/tls"
	"net"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/jointoken"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	"github.com/bettercompute/bettercompute/services/joinservice"
)

// serveInternal runs the internal listener of f's joinservice on loopback,
// with cert (nil: one the CA mints) and returns its address.
func serveInternal(t *testing.T, f *harness, cert *tls.Certificate) string {
	t.Helper()
	gs, err := joinservice.NewInternalServer(f.svc, joinservice.InternalConfig{Certificate: cert, Hosts: []string{"127.0.0.1"}})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = gs.Serve(ln) }()
	t.Cleanup(gs.Stop)
	return ln.Addr().String()
}

// deadAddr is a loopback address nothing listens on.
func deadAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return addr
}

func gatewayCert(t *testing.T, ca *nodeca.CA, name string) tls.Certificate {
	t.Helper()
	c, err := ca.ServingCertificate(name, []string{"127.0.0.1"}, 0)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func relayClient(t *testing.T, f *harness, cert tls.Certificate, addrs ...string) *joinservice.Client {
	t.Helper()
	c, err := joinservice.NewClient(joinservice.ClientConfig{Addrs: addrs, Certificate: cert, RootCAs: f.ca.Pool(), TrustDomain: trustDomain})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

// dialInternal dials the internal listener directly, presenting certs.
func dialInternal(t *testing.T, f *harness, addr string, certs ...tls.Certificate) agentv1.NodeServiceClient {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{
		RootCAs: f.ca.Pool(), ServerName: "127.0.0.1", Certificates: certs, MinVersion: tls.VersionTLS13,
	})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return agentv1.NewNodeServiceClient(conn)
}

// TestInternalListener: a gateway's relay (the Client) joins and renews
// through the internal listener, past an unreachable address; the relayed
// chain is verified again; only gateway identities are served.
func TestInternalListener(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := context.Background()
	addr := serveInternal(t, f, nil)
	gw := gatewayCert(t, f.ca, "gw-1")
	dead := deadAddr(t)
	relay := relayClient(t, f, gw, dead, addr)
	tok := f.token(t, jointoken.Token{Uses: 3})

	// Round robin: one of the two calls starts at the dead address and
	// moves on.
	k1, k2 := newKey(t), newKey(t)
	j1, err := relay.Join(ctx, f.request(t, tok, "SN-I1", k1))
	if err != nil {
		t.Fatalf("relayed Join: %v", err)
	}
	if _, err := relay.Join(ctx, f.request(t, tok, "SN-I2", k2)); err != nil {
		t.Fatalf("second relayed Join: %v", err)
	}
	chain := parseChain(t, j1.GetCertificateChain())

	t.Run("Renew with the node's chain", func(t *testing.T) {
		resp, err := relay.Renew(ctx, chain, &agentv1.RenewRequest{Csr: csrFor(t, k1)})
		if err != nil {
			t.Fatal(err)
		}
		if id, err := f.ca.VerifyNode(ctx, f.db, parseChain(t, resp.GetCertificateChain())); err != nil || id != j1.GetNodeId() {
			t.Fatalf("renewed: %q %v", id, err)
		}
	})

	t.Run("a chain of another CA is refused: joinservice verifies it again", func(t *testing.T) {
		other, err := nodeca.Open(nodeca.Config{TrustDomain: trustDomain, Dir: t.TempDir()})
		if err != nil {
			t.Fatal(err)
		}
		tx, err := f.db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		forged, err := other.IssueNode(ctx, tx, j1.GetNodeId(), k1.Public())
		_ = tx.Rollback(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := relay.Renew(ctx, forged, &agentv1.RenewRequest{Csr: csrFor(t, k1)}); status.Code(err) != codes.Unauthenticated {
			t.Fatalf("forged chain: %v, want Unauthenticated", err)
		}
		if _, err := relay.Renew(ctx, nil, &agentv1.RenewRequest{Csr: csrFor(t, k1)}); status.Code(err) != codes.Unauthenticated {
			t.Fatalf("no chain: %v, want Unauthenticated", err)
		}
	})

	t.Run("a relayed chain has a maximum", func(t *testing.T) {
		md := metadata.MD{}
		for range 9 {
			md.Append(joinservice.ChainMetadata, string(chain[0].Raw))
		}
		_, err := dialInternal(t, f, addr, gw).Renew(metadata.NewOutgoingContext(ctx, md), &agentv1.RenewRequest{Csr: csrFor(t, k1)})
		if status.Code(err) != codes.InvalidArgument {
			t.Fatalf("nine certificates: %v, want InvalidArgument", err)
		}
	})

	t.Run("only gateways are served", func(t *testing.T) {
		node := tls.Certificate{Certificate: j1.GetCertificateChain(), PrivateKey: k1}
		// A node's own certificate, with its own chain in the metadata.
		md := metadata.Pairs(joinservice.ChainMetadata, string(chain[0].Raw))
		_, err := dialInternal(t, f, addr, node).Renew(metadata.NewOutgoingContext(ctx, md), &agentv1.RenewRequest{Csr: csrFor(t, k1)})
		if status.Code(err) != codes.PermissionDenied {
			t.Fatalf("a node calling joinservice directly: %v, want PermissionDenied", err)
		}
		if _, err := dialInternal(t, f, addr, node).Join(ctx, f.request(t, tok, "SN-I3", newKey(t))); status.Code(err) != codes.PermissionDenied {
			t.Fatalf("a node's Join on the internal listener: %v, want PermissionDenied", err)
		}
		if _, err := dialInternal(t, f, addr).Join(ctx, f.request(t, tok, "SN-I3", newKey(t))); err == nil {
			t.Fatal("a caller without a certificate was served")
		}
		// A gateway certificate of another trust domain's CA does not even
		// complete the handshake.
		foreign, err := nodeca.Open(nodeca.Config{TrustDomain: "elsewhere.test", Dir: t.TempDir()})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := dialInternal(t, f, addr, gatewayCert(t, foreign, "gw-x")).Join(ctx, f.request(t, tok, "SN-I3", newKey(t))); err == nil {
			t.Fatal("a foreign gateway was served")
		}
		var left int
		if err := f.db.QueryRow(ctx, `SELECT uses_left FROM join_tokens`).Scan(&left); err != nil || left != 1 {
			t.Fatalf("uses left %d (%v), want 1: a refused caller spent a use", left, err)
		}
	})

	t.Run("the relay refuses a listener that is not joinservice's", func(t *testing.T) {
		// Another gateway's certificate of the same CA, posing as joinservice.
		impostor := gatewayCert(t, f.ca, "gw-2")
		fake := serveInternal(t, f, &impostor)
		_, err := relayClient(t, f, gw, fake).Join(ctx, f.request(t, tok, "SN-I4", newKey(t)))
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), fake) {
			t.Fatalf("impostor: %v, want Unavailable naming %s", err, fake)
		}
	})

	t.Run("no address reachable is UNAVAILABLE naming each", func(t *testing.T) {
		d2 := deadAddr(t)
		_, err := relayClient(t, f, gw, dead, d2).Join(ctx, f.request(t, tok, "SN-I5", newKey(t)))
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), dead) || !strings.Contains(err.Error(), d2) {
			t.Fatalf("all down: %v, want Unavailable naming %s and %s", err, dead, d2)
		}
	})
}
