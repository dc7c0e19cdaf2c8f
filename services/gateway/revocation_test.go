package gateway_test

import (
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// TestARevokedCertificateLosesItsOpenSession: revocation was checked only at
// session start, so a revoked node kept its session and kept receiving
// commands. The next recheck (every liveness tick) closes it
// PERMISSION_DENIED, and the node cannot open another.
func TestARevokedCertificateLosesItsOpenSession(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.addNode(t, "node_a")
	f.addNode(t, "node_b")
	certA, certB := f.ca.node(t, "node_a"), f.ca.node(t, "node_b")
	streamA, _ := open(t, f.client(t, f.addr, &certA), "node_a")
	streamB, _ := open(t, f.client(t, f.addr, &certB), "node_b")

	f.revoke(certA.Leaf.SerialNumber.Text(16))
	if err := f.gw.RecheckCertificates(t.Context()); err != nil {
		t.Fatal(err)
	}
	if code := endOf(t, streamA); code != codes.PermissionDenied {
		t.Fatalf("the revoked node's session ended %s, want PermissionDenied", code)
	}
	if f.gw.Sessions() != 1 {
		t.Fatalf("%d sessions held, want node_b's alone", f.gw.Sessions())
	}
	// The other node's session is untouched.
	if err := streamB.Send(hello("node_b")); err != nil {
		t.Fatalf("node_b's session: %v", err)
	}
	again, err := f.client(t, f.addr, &certA).Session(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	_ = again.Send(hello("node_a"))
	if code := endOf(t, again); code != codes.PermissionDenied {
		t.Fatalf("a new session of the revoked certificate: %s, want PermissionDenied", code)
	}
}

// TestAnExpiredCertificateLosesItsOpenSession: a certificate that expires
// while its session is open ends it UNAUTHENTICATED at the next recheck.
func TestAnExpiredCertificateLosesItsOpenSession(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.addNode(t, "node_a")
	cert := f.ca.issue(t, "spiffe://"+trustDomain+"/node/node_a", "", time.Now().Add(1500*time.Millisecond))
	stream, _ := open(t, f.client(t, f.addr, &cert), "node_a")
	// The certificate must really expire: the wait is the behaviour under test.
	time.Sleep(time.Until(cert.Leaf.NotAfter) + 100*time.Millisecond)
	if err := f.gw.RecheckCertificates(t.Context()); err != nil {
		t.Fatal(err)
	}
	if code := endOf(t, stream); code != codes.Unauthenticated {
		t.Fatalf("the expired session ended %s, want Unauthenticated", code)
	}
}

// endOf reads a session's stream until it ends and returns its code.
func endOf(t *testing.T, stream agentv1.NodeService_SessionClient) codes.Code {
	t.Helper()
	for {
		if _, err := stream.Recv(); err != nil {
			return status.Code(err)
		}
	}
}
