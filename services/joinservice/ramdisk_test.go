package joinservice_test

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"testing"
	"time"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/jointoken"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/services/joinservice"
)

func ramdiskKey(t *testing.T) ed25519.PrivateKey {
	t.Helper()
	_, k, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func certRole(t *testing.T, f *harness, serial string) string {
	t.Helper()
	role, err := nodeca.CertificateRole(context.Background(), f.db, serial)
	if err != nil {
		t.Fatal(err)
	}
	return role
}

// TestRamdiskJoin: a ramdisk token names its node; the ramdisk joins as it
// with a restricted certificate, the node commissioning; the installed
// system's node token naming the node takes it back as a node.
func TestRamdiskJoin(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := context.Background()
	const nodeX = "node_machine1"

	t.Run("a ramdisk token needs a named node", func(t *testing.T) {
		s := jointoken.Mint()
		_, err := jointoken.Create(ctx, f.db, jointoken.Token{ID: s.ID, TenantID: "root", PoolID: f.pool, Uses: 1, Role: jointoken.RoleRamdisk}, s.Hash)
		wantFault(t, err, fault.InvalidInput, "nodeId")
	})

	t.Run("a non-Ed25519 CSR is refused before a use is spent", func(t *testing.T) {
		tok := f.token(t, jointoken.Token{NodeID: nodeX, Role: jointoken.RoleRamdisk})
		req := f.request(t, tok, "SN-X", newKey(t))
		req.Role = joinservice.RoleRamdisk
		_, err := f.svc.Join(ctx, req)
		wantFault(t, err, fault.InvalidInput, "csr")
		// The token still works.
		req = f.request(t, tok, "SN-X", ramdiskKey(t))
		req.Role = joinservice.RoleRamdisk
		if _, err := f.svc.Join(ctx, req); err != nil {
			t.Fatalf("the token was spent by the refused join: %v", err)
		}
	})

	t.Run("roles must match the token", func(t *testing.T) {
		tok := f.token(t, jointoken.Token{NodeID: nodeX, Role: jointoken.RoleRamdisk})
		_, err := f.svc.Join(ctx, f.request(t, tok, "SN-X", ramdiskKey(t))) // role node
		wantFault(t, err, fault.InvalidInput, "role")
		plain := f.token(t, jointoken.Token{})
		req := f.request(t, plain, "SN-Y", ramdiskKey(t))
		req.Role = joinservice.RoleRamdisk
		_, err = f.svc.Join(ctx, req)
		wantFault(t, err, fault.InvalidInput, "role")
	})

	var ramdiskChain [][]byte
	t.Run("the ramdisk joins as the named node, commissioning, with a 2 h ramdisk certificate", func(t *testing.T) {
		tok := f.token(t, jointoken.Token{NodeID: nodeX, Role: jointoken.RoleRamdisk})
		req := f.request(t, tok, "SN-X", ramdiskKey(t))
		req.Role = joinservice.RoleRamdisk
		resp, err := f.svc.Join(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if resp.GetNodeId() != nodeX || resp.GetRole() != joinservice.RoleRamdisk || resp.GetSpiffeId() != "spiffe://"+trustDomain+"/node/"+nodeX {
			t.Fatalf("joined %v", resp)
		}
		leaf := parseChain(t, resp.GetCertificateChain())[0]
		if d := leaf.NotAfter.Sub(f.clock.Now()); d > nodeca.RamdiskValidity || d < nodeca.RamdiskValidity-time.Second {
			t.Fatalf("valid for %s, want %s", d, nodeca.RamdiskValidity)
		}
		if role := certRole(t, f, nodeca.Serial(leaf.SerialNumber)); role != nodeca.RoleRamdisk {
			t.Fatalf("recorded role %q", role)
		}
		n, err := nodes.Lookup(ctx, f.db, nodeX)
		if err != nil || n.State != nodes.StateCommissioning {
			t.Fatalf("node %+v %v", n, err)
		}
		// The earlier ramdisk boot's certificate is revoked.
		var live int
		_ = f.db.QueryRow(ctx, `SELECT count(*) FROM node_certificates WHERE node_id = $1 AND revoked_at IS NULL`, nodeX).Scan(&live)
		if live != 1 {
			t.Fatalf("%d live certificates, want 1", live)
		}
		ramdiskChain = resp.GetCertificateChain()
		if _, err := f.svc.Renew(ctx, parseChain(t, ramdiskChain), nil); fault.CodeOf(err) != fault.AccessDenied {
			t.Fatalf("Renew of a ramdisk certificate: %v, want ACCESS_DENIED", err)
		}
	})

	t.Run("the installed system's token naming the node takes it back as a node", func(t *testing.T) {
		tok := f.token(t, jointoken.Token{NodeID: nodeX})
		k := newKey(t)
		resp, err := f.svc.Join(ctx, f.request(t, tok, "SN-X-installed", k))
		if err != nil {
			t.Fatal(err)
		}
		if resp.GetNodeId() != nodeX || resp.GetRole() != joinservice.RoleNode {
			t.Fatalf("joined %v", resp)
		}
		leaf := parseChain(t, resp.GetCertificateChain())[0]
		if role := certRole(t, f, nodeca.Serial(leaf.SerialNumber)); role != nodeca.RoleNode {
			t.Fatalf("recorded role %q", role)
		}
		if d := leaf.NotAfter.Sub(f.clock.Now()); d < 24*time.Hour-time.Second {
			t.Fatalf("valid for %s, want 24h", d)
		}
		n, err := nodes.Lookup(ctx, f.db, nodeX)
		if err != nil || n.State != nodes.StateAdopting {
			t.Fatalf("node %+v %v", n, err)
		}
		if _, err := f.ca.VerifyNode(ctx, f.db, parseChain(t, ramdiskChain)); err == nil {
			t.Fatal("the ramdisk's certificate outlived the installed system's join")
		}
	})

	t.Run("a named token cannot take a node of another tenant or hardware of another node", func(t *testing.T) {
		tok := f.token(t, jointoken.Token{NodeID: "node_other"})
		// SN-A is a plain node of the tenant.
		if _, err := f.svc.Join(ctx, f.request(t, f.token(t, jointoken.Token{}), "SN-A", newKey(t))); err != nil {
			t.Fatal(err)
		}
		_, err := f.svc.Join(ctx, f.request(t, tok, "SN-A", newKey(t)))
		wantFault(t, err, fault.Conflict, "claims")
	})
}
