package api_test

import (
	"errors"
	"io"
	"testing"
	"time"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/api"
)

// tunnelNode adds an adopted node of tenant, visible to policies.
func tunnelNode(t *testing.T, h *harness, tenant string) string {
	t.Helper()
	n := fixture.Node(t, h.db, fixture.NodeOpts{Tenant: tenant, State: nodes.StateAdopted})
	if err := authz.Put(t.Context(), h.db, authz.Resource{Type: authz.TypeNode, ID: n.ID, TenantID: tenant, PoolID: n.PoolID}); err != nil {
		t.Fatal(err)
	}
	return n.ID
}

func TestTunnels_TenantsValidationLimitsAndTokens(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	c := computev1.NewTunnelsServiceClient(h.conn)
	_, acme := h.member(t, "acme", "ops")
	h.policy(t, "acme", "members", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)
	_, zed := h.member(t, "zed", "ops")
	h.policy(t, "zed", "members", `permit (principal in Tenant::"zed", action, resource in Tenant::"zed");`)
	node := tunnelNode(t, h, "acme")
	tunnelNode(t, h, "zed")

	for _, bad := range []struct {
		req   *computev1.TunnelsServiceOpenRequest
		field string
	}{
		{&computev1.TunnelsServiceOpenRequest{TenantId: "acme", NodeId: node, Target: "nohost"}, "target"},
		{&computev1.TunnelsServiceOpenRequest{TenantId: "acme", NodeId: node, Target: "unix:relative"}, "target"},
		{&computev1.TunnelsServiceOpenRequest{TenantId: "acme", NodeId: node, Target: "127.0.0.1:22", NotAfterSeconds: 8*3600 + 1}, "notAfterSeconds"},
		{&computev1.TunnelsServiceOpenRequest{TenantId: "acme", Target: "127.0.0.1:22"}, "nodeId"},
	} {
		_, err := c.Open(as(acme), bad.req)
		wantCode(t, err, fault.InvalidInput, bad.field)
	}
	// Another tenant's node is not found; another tenant's caller is
	// refused before any lookup.
	_, err := c.Open(as(zed), &computev1.TunnelsServiceOpenRequest{TenantId: "zed", NodeId: node, Target: "127.0.0.1:22"})
	wantCode(t, err, fault.NotFound, "nodeId")
	_, err = c.Open(as(zed), &computev1.TunnelsServiceOpenRequest{TenantId: "acme", NodeId: node, Target: "127.0.0.1:22"})
	wantCode(t, err, fault.AccessDenied, "tenantId")

	o, err := c.Open(as(acme), &computev1.TunnelsServiceOpenRequest{TenantId: "acme", NodeId: node, Target: "127.0.0.1:2222", Reason: "debug", NotAfterSeconds: 600})
	if err != nil || o.GetConnectToken() == "" || o.GetTunnel().GetId() == "" || o.GetTunnel().GetOpenedBy() == "" {
		t.Fatalf("open: %v %v", o, err)
	}
	if n := h.count(t, `SELECT count(*) FROM outbox WHERE type = 'tunnel.opened' AND resource_id = $1 AND payload->>'id' = $2 AND payload::text NOT LIKE '%bctt_%'`, node, o.GetTunnel().GetId()); n != 1 {
		t.Errorf("tunnel.opened events without the token: %d", n)
	}
	if n := h.count(t, `SELECT count(*) FROM audit WHERE action = 'compute:nodes:tunnel' AND decision = 'allow'`); n != 1 {
		t.Errorf("open audit rows: %d", n)
	}

	// zed can neither list nor close acme's tunnels.
	_, err = c.List(as(zed), &computev1.TunnelsServiceListRequest{TenantId: "acme"})
	wantCode(t, err, fault.AccessDenied, "tenantId")
	l, err := c.List(as(zed), &computev1.TunnelsServiceListRequest{TenantId: "zed", IncludeClosed: true})
	if err != nil || len(l.GetTunnels()) != 0 {
		t.Fatalf("zed lists %v %v", l, err)
	}
	_, err = c.Close(as(zed), &computev1.TunnelsServiceCloseRequest{TenantId: "zed", TunnelId: o.GetTunnel().GetId()})
	wantCode(t, err, fault.NotFound, "tunnelId")
	_, err = c.Close(as(zed), &computev1.TunnelsServiceCloseRequest{TenantId: "acme", TunnelId: o.GetTunnel().GetId()})
	wantCode(t, err, fault.AccessDenied, "tenantId")
	l, err = c.List(as(acme), &computev1.TunnelsServiceListRequest{TenantId: "acme"})
	if err != nil || len(l.GetTunnels()) != 1 || l.GetTunnels()[0].GetTarget() != "127.0.0.1:2222" {
		t.Fatalf("acme lists %v %v", l, err)
	}

	// The node holds no session: connecting spends the token and closes
	// the tunnel as unroutable; the token is then spent.
	st, err := c.Connect(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&computev1.TunnelsServiceConnectRequest{ConnectToken: o.GetConnectToken()}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); err == nil || errors.Is(err, io.EOF) {
		t.Fatalf("connect to a node without a session: %v", err)
	}
	if n := h.count(t, `SELECT count(*) FROM outbox WHERE type = 'tunnel.closed' AND payload->>'id' = $1 AND payload->>'closeReason' = 'unroutable'`, o.GetTunnel().GetId()); n != 1 {
		t.Errorf("unroutable tunnel.closed events: %d", n)
	}
	st, err = c.Connect(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	_ = st.Send(&computev1.TunnelsServiceConnectRequest{ConnectToken: o.GetConnectToken()})
	_, err = st.Recv()
	wantCode(t, err, fault.Unauthenticated, "token")

	// The node's limit (16 by default) answers RATE_LIMITED.
	for i := range 16 {
		if _, err := c.Open(as(acme), &computev1.TunnelsServiceOpenRequest{TenantId: "acme", NodeId: node, Target: "127.0.0.1:2222"}); err != nil {
			t.Fatalf("open %d: %v", i, err)
		}
	}
	_, err = c.Open(as(acme), &computev1.TunnelsServiceOpenRequest{TenantId: "acme", NodeId: node, Target: "127.0.0.1:2222"})
	wantCode(t, err, fault.RateLimited, "nodeId")

	// tunnels.close of one nobody connected to: closed, once.
	l, _ = c.List(as(acme), &computev1.TunnelsServiceListRequest{TenantId: "acme", PageSize: 1})
	id := l.GetTunnels()[0].GetId()
	cl, err := c.Close(as(acme), &computev1.TunnelsServiceCloseRequest{TenantId: "acme", TunnelId: id})
	if err != nil || cl.GetTunnel().GetCloseReason() != "tunnels.close" || cl.GetTunnel().GetCloseTime() == nil {
		t.Fatalf("close: %v %v", cl, err)
	}
	if _, err := c.Close(as(acme), &computev1.TunnelsServiceCloseRequest{TenantId: "acme", TunnelId: id}); err != nil {
		t.Fatal(err)
	}
	if n := h.count(t, `SELECT count(*) FROM outbox WHERE type = 'tunnel.closed' AND payload->>'id' = $1`, id); n != 1 {
		t.Errorf("tunnel.closed events for one close: %d", n)
	}

	// Tokens nobody spent expire, and their tunnels close: the node's
	// limit frees itself.
	h.clock.Advance(2 * time.Minute)
	poll.Until(t, time.Minute, "unused tunnels closed", func() bool {
		return h.count(t, `SELECT count(*) FROM tunnels WHERE node_id = $1 AND closed_at IS NULL`, node) == 0
	})
	if n := h.count(t, `SELECT count(*) FROM tunnels WHERE node_id = $1 AND close_reason = 'token_expired'`, node); n != 15 {
		t.Errorf("%d tunnels closed token_expired, want 15", n)
	}
	if _, err := c.Open(as(acme), &computev1.TunnelsServiceOpenRequest{TenantId: "acme", NodeId: node, Target: "127.0.0.1:2222"}); err != nil {
		t.Errorf("open after the unused ones closed: %v", err)
	}
}
