package tunnels_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/tunnels"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func open(t *testing.T, q db.Beginner, a tunnels.OpenArgs, now time.Time) (tunnels.Opened, error) {
	t.Helper()
	var o tunnels.Opened
	err := db.InTx(t.Context(), q, db.TxOptions{}, func(tx pgx.Tx) error {
		var err error
		o, err = tunnels.Open(t.Context(), tx, a, now)
		return err
	})
	return o, err
}

func TestOpenConnectCloseLimitsPrune(t *testing.T) {
	t.Parallel()
	pool := pgtest.New(t)
	ctx := context.Background()
	n := fixture.Node(t, pool, fixture.NodeOpts{})
	now := time.Now()
	a := tunnels.OpenArgs{TenantID: n.TenantID, NodeID: n.ID, Target: "127.0.0.1:22", OpenedBy: "idn_x", NotAfter: now.Add(time.Hour), PerNode: 2}
	o, err := open(t, pool, a, now)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tunnels.Connect(ctx, pool, o.Token+"x", "api-1", now); fault.CodeOf(err) != fault.Unauthenticated {
		t.Errorf("bad token: %v", err)
	}
	tun, err := tunnels.Connect(ctx, pool, o.Token, "api-1", now)
	if err != nil || tun.ID != o.Tunnel.ID || tun.RelayProcess != "api-1" {
		t.Fatalf("connect: %+v %v", tun, err)
	}
	if _, err := tunnels.Connect(ctx, pool, o.Token, "api-2", now); fault.CodeOf(err) != fault.Unauthenticated {
		t.Errorf("a spent token connected again: %v", err)
	}
	// A token past its TTL does not connect.
	o2, err := open(t, pool, a, now)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tunnels.Connect(ctx, pool, o2.Token, "api-1", now.Add(tunnels.TokenTTL+time.Second)); fault.CodeOf(err) != fault.Unauthenticated {
		t.Errorf("an expired token connected: %v", err)
	}
	// The node's limit.
	if _, err := open(t, pool, a, now); fault.CodeOf(err) != fault.RateLimited {
		t.Errorf("third tunnel on a node limited to 2: %v", err)
	}
	unused, err := tunnels.Unused(ctx, pool, now.Add(tunnels.TokenTTL+time.Second), 10)
	if err != nil || len(unused) != 1 || unused[0] != o2.Tunnel.ID {
		t.Errorf("unused %v %v", unused, err)
	}
	// Expiry and an explicit close are seen by Doomed.
	doomed, err := tunnels.Doomed(ctx, pool, []string{o.Tunnel.ID, o2.Tunnel.ID}, now.Add(2*time.Hour))
	if err != nil || doomed[o.Tunnel.ID] != tunnels.ClosedExpired {
		t.Errorf("doomed %v %v", doomed, err)
	}
	if doomed, _ := tunnels.Doomed(ctx, pool, []string{o.Tunnel.ID}, now); len(doomed) != 0 {
		t.Errorf("a live tunnel doomed: %v", doomed)
	}
	if err := tunnels.AddBytes(ctx, pool, o.Tunnel.ID, 10, 20); err != nil {
		t.Fatal(err)
	}
	c, closed, err := tunnels.Close(ctx, pool, o.Tunnel.ID, tunnels.ClosedByCaller, 1, 2, now)
	if err != nil || !closed || c.BytesIn != 11 || c.BytesOut != 22 || c.CloseReason != tunnels.ClosedByCaller {
		t.Fatalf("close %+v %v %v", c, closed, err)
	}
	if _, closed, _ := tunnels.Close(ctx, pool, o.Tunnel.ID, tunnels.ClosedExpired, 0, 0, now); closed {
		t.Error("closed twice")
	}
	live, err := tunnels.List(ctx, pool, tunnels.ListFilter{TenantID: n.TenantID, Limit: 10})
	if err != nil || len(live) != 1 || live[0].ID != o2.Tunnel.ID {
		t.Errorf("live %v %v", live, err)
	}
	if got, _ := tunnels.List(ctx, pool, tunnels.ListFilter{TenantID: "other", All: true, Limit: 10}); len(got) != 0 {
		t.Errorf("another tenant lists %v", got)
	}
	if p, err := tunnels.Prune(ctx, pool, now.Add(time.Second), 10); err != nil || p != 1 {
		t.Errorf("pruned %d %v", p, err)
	}
}

func TestDoomedByRevocationAndRetirement(t *testing.T) {
	t.Parallel()
	pool := pgtest.New(t)
	ctx := context.Background()
	n := fixture.Node(t, pool, fixture.NodeOpts{})
	if _, err := pool.Exec(ctx, `INSERT INTO identities (id, tenant_id, kind, name) VALUES ('idn_t', $1, 'user', 't')`, n.TenantID); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	o, err := open(t, pool, tunnels.OpenArgs{TenantID: n.TenantID, NodeID: n.ID, Target: "127.0.0.1:22", OpenedBy: "idn_t", NotAfter: now.Add(time.Hour)}, now)
	if err != nil {
		t.Fatal(err)
	}
	ids := []string{o.Tunnel.ID}
	if d, err := tunnels.Doomed(ctx, pool, ids, now); err != nil || len(d) != 0 {
		t.Fatalf("doomed %v %v", d, err)
	}
	if err := nodes.SetState(ctx, pool, n.ID, nodes.StateRetired, []nodes.Condition{}); err != nil {
		t.Fatal(err)
	}
	if d, _ := tunnels.Doomed(ctx, pool, ids, now); d[o.Tunnel.ID] != tunnels.ClosedRetired {
		t.Errorf("retired node: %v", d)
	}
	if _, err := pool.Exec(ctx, `UPDATE identities SET revoked_at = now() WHERE id = 'idn_t'`); err != nil {
		t.Fatal(err)
	}
	if d, _ := tunnels.Doomed(ctx, pool, ids, now); d[o.Tunnel.ID] != tunnels.ClosedRevoked {
		t.Errorf("revoked identity: %v", d)
	}
}
