package gateway_test

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	agentinv "github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/session"
	"github.com/bettercompute/bettercompute/agent/site"
	"github.com/bettercompute/bettercompute/agent/state"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/jointoken"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/gateway"
)

// TestSkewWindowRefusesAgentsOutside: with gateway.agentVersions set, a
// Hello from a bcd older than the oldest is refused AGENT_TOO_OLD, newer
// than the newest AGENT_TOO_NEW (FAILED_PRECONDITION with the code and the
// field hello.agent_version as ErrorInfo), a version that is not a release
// AGENT_TOO_OLD, before any session opens; one inside is welcomed.
func TestSkewWindowRefusesAgentsOutside(t *testing.T) {
	t.Parallel()
	f := &harness{ca: newCA(t), db: pgtest.New(t), joiner: &joiner{}, revoked: map[string]bool{},
		tune: func(c *gateway.Config) { c.OldestAgent, c.NewestAgent = "v0.3.0", "v0.4.0" }}
	_, addr := f.serve(t, "gw-skew")
	f.addNode(t, "node_s")
	cert := f.ca.node(t, "node_s")
	c := f.client(t, addr, &cert)

	session := func(version string) error {
		stream, err := c.Session(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if err := stream.Send(&agentv1.SessionRequest{Body: &agentv1.SessionRequest_Hello{Hello: &agentv1.Hello{
			NodeId: "node_s", BootId: "boot-1", JournalId: "journal-1", AgentVersion: version}}}); err != nil {
			t.Fatal(err)
		}
		m, err := stream.Recv()
		if err == nil && m.GetWelcome() == nil {
			t.Fatalf("%s: first message %v", version, m)
		}
		return err
	}
	for version, want := range map[string]fault.Code{
		"v0.2.9": fault.AgentTooOld, "v0.3.0-rc.1": fault.AgentTooOld, "dev": fault.AgentTooOld,
		"v0.4.1": fault.AgentTooNew, "v1.0.0": fault.AgentTooNew,
	} {
		err := session(version)
		st, _ := status.FromError(err)
		var info *errdetails.ErrorInfo
		for _, d := range st.Details() {
			if i, ok := d.(*errdetails.ErrorInfo); ok {
				info = i
			}
		}
		if st.Code() != codes.FailedPrecondition || info == nil || info.GetReason() != string(want) || info.GetMetadata()["field"] != "hello.agent_version" {
			t.Errorf("%s: %v (%v), want %s", version, err, info, want)
		}
	}
	var gw string
	if err := f.db.QueryRow(t.Context(), `SELECT coalesce(gateway_id, '') FROM nodes WHERE id = 'node_s'`).Scan(&gw); err != nil {
		t.Fatal(err)
	}
	if gw != "" {
		t.Fatalf("a refused agent opened a session: gateway %q", gw)
	}
	for _, version := range []string{"v0.3.0", "v0.3.7", "v0.4.0", "v0.4.0+build.9"} {
		if err := session(version); err != nil {
			t.Errorf("%s: %v, want a Welcome", version, err)
		}
	}
}

// syncBuffer is a log sink the agent writes while the test reads.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestSkewWindowRefusesTheRealAgent runs the real agent (join, then its
// session) against the real joinservice and gateway: as v0.1.0, below
// gateway.agentVersions.oldest, its sessions are refused and it logs
// AGENT_TOO_OLD while the gateway never holds it; as v0.3.0 (what an
// upgrade would bring) it is held.
func TestSkewWindowRefusesTheRealAgent(t *testing.T) {
	t.Parallel()
	f := setupRamdisk(t, func(c *gateway.Config) { c.OldestAgent = "v0.2.0" })
	st, err := state.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	inv, err := agentinv.Open(agentinv.Config{Backend: agentinv.BackendMock, Hostname: "skew-1"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = inv.Close() })
	s := jointoken.Mint()
	if _, err := jointoken.Create(t.Context(), f.db, jointoken.Token{ID: s.ID, TenantID: "root", PoolID: "pool_metal", Uses: 1,
		Role: jointoken.RoleNode, ExpiresAt: new(time.Now().Add(time.Hour))}, s.Hash); err != nil {
		t.Fatal(err)
	}
	id, err := join.Join(t.Context(), join.Config{Gateway: f.addr, ServerName: "127.0.0.1", RootCAs: f.ca.Pool(), Token: s.Token,
		JoinserviceKey: f.key.PublicKey(), JoinserviceKeyID: f.key.ID(), State: st, Claims: inv})
	if err != nil {
		t.Fatal(err)
	}
	run := func(version string, logs io.Writer) *running {
		sc := session.Config{Gateway: f.addr, ServerName: "127.0.0.1", State: st, Inventory: inv, BootID: "boot-skew",
			AgentVersion: version, MinBackoff: 20 * time.Millisecond, MaxBackoff: 100 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(logs, nil))}
		ctx, cancel := context.WithCancel(context.Background())
		r := &running{cancel: cancel, done: make(chan error, 1)}
		go func() { r.done <- session.Run(ctx, sc) }()
		return r
	}
	var logs syncBuffer
	old := run("v0.1.0", &logs)
	poll.Until(t, 30*time.Second, "the agent to be refused AGENT_TOO_OLD", func() bool {
		return strings.Contains(logs.String(), "code=AGENT_TOO_OLD") && strings.Contains(logs.String(), "version=v0.1.0")
	})
	if f.gw.Holds(id.NodeID) {
		t.Fatal("the gateway holds a refused agent's session")
	}
	old.stop(t)
	upgraded := run("v0.3.0", io.Discard)
	defer upgraded.stop(t)
	poll.Until(t, 30*time.Second, "the upgraded agent's session to open", func() bool { return f.gw.Holds(id.NodeID) })
}

// TestSkewWindowRefusesATooOldSiteAgent: gateway.agentVersions applies to
// site agents' sessions too (their Hello's version): the real site agent
// as v0.1.0, below the oldest, is refused AGENT_TOO_OLD on hello.version
// (FAILED_PRECONDITION, before the session writes anything) and never
// serves; as v0.3.0 it serves.
func TestSkewWindowRefusesATooOldSiteAgent(t *testing.T) {
	t.Parallel()
	f := setupSite(t, func(c *gateway.Config) { c.OldestAgent, c.NewestAgent = "v0.3.0", "v0.4.0" })
	id, st := f.enroll(t, f.token(t, 1), "pxe-old")
	old := f.runWith(t, id, st, f.addr, func(c *site.Config) { c.Version = "v0.1.0" })
	poll.Until(t, 30*time.Second, "two refused sessions", func() bool {
		_, ends := old.boot.snapshot()
		n := 0
		for _, err := range ends {
			st, _ := status.FromError(err)
			for _, d := range st.Details() {
				if i, ok := d.(*errdetails.ErrorInfo); ok && st.Code() == codes.FailedPrecondition &&
					i.GetReason() == string(fault.AgentTooOld) && i.GetMetadata()["field"] == "hello.version" {
					n++
				}
			}
		}
		return n >= 2
	})
	if ok, _ := old.boot.serving(); ok || f.gw.SiteSessions() != 0 {
		t.Fatalf("a too-old site agent serves (%v) or holds a session (%d)", ok, f.gw.SiteSessions())
	}
	var seal string
	if err := f.db.QueryRow(t.Context(), `SELECT coalesce(seal_key, '') FROM site_agents WHERE id = $1`, id.AgentID).Scan(&seal); err != nil {
		t.Fatal(err)
	}
	if seal != "" {
		t.Fatalf("a refused site session stored its seal key %q", seal)
	}
	old.stop()
	cur := f.runWith(t, id, st, f.addr, func(c *site.Config) { c.Version = "v0.3.0" })
	poll.Until(t, 30*time.Second, "the v0.3.0 agent serving", func() bool {
		ok, _ := cur.boot.serving()
		return ok && f.gw.SiteSessions() == 1
	})
}
