package gateway_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"io"
	"log/slog"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/site"
	"github.com/bettercompute/bettercompute/agent/state"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/jointoken"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/sites"
	"github.com/bettercompute/bettercompute/services/gateway"
	"github.com/bettercompute/bettercompute/services/joinservice"
)

// The site tests run the real site agent (agent/site) against the real
// joinservice and gateway over mutual TLS, with the real node CA, on a real
// PostgreSQL.

// siteLeaseTTL is the boot lease the agents ask for: short, so take-overs
// happen within the test.
const siteLeaseTTL = 2 * time.Second

type siteFixture struct {
	db   *pgxpool.Pool
	ca   *nodeca.CA
	key  *joinservice.Key
	gw   *gateway.Gateway
	addr string
	site sites.Site
	// logs are the gateway's and (with runWith) the agents' log lines.
	logs *logBuffer
}

// logBuffer is a log sink safe for concurrent writers.
type logBuffer struct {
	mu sync.Mutex
	b  []byte
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.b = append(l.b, p...)
	return len(p), nil
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return string(l.b)
}

func (l *logBuffer) logger() *slog.Logger {
	return slog.New(slog.NewTextHandler(l, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

func setupSite(t *testing.T, tune ...func(*gateway.Config)) *siteFixture {
	t.Helper()
	f := &siteFixture{db: pgtest.New(t), logs: &logBuffer{}}
	var err error
	if f.ca, err = nodeca.Open(nodeca.Config{TrustDomain: trustDomain, Dir: t.TempDir()}); err != nil {
		t.Fatal(err)
	}
	if f.key, err = joinservice.NewKey(); err != nil {
		t.Fatal(err)
	}
	svc, err := joinservice.New(joinservice.Config{DB: f.db, CA: f.ca, Key: f.key, RenewInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	gcfg := gateway.Config{
		ID: "gw-1", DB: f.db, Joiner: joinservice.NewJoiner(svc), TrustDomain: trustDomain,
		Revoked: func(ctx context.Context, serials []string) ([]string, error) {
			return nodeca.RevokedAmong(ctx, f.db, serials)
		},
		LivenessInterval: time.Hour, // rechecked by hand
		Logger:           f.logs.logger(),
	}
	for _, fn := range tune {
		fn(&gcfg)
	}
	f.gw, err = gateway.New(gcfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.gw.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	cert, err := f.ca.ServingCertificate("gw-1", []string{"127.0.0.1"}, 0)
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{
		Certificates: []tls.Certificate{cert}, ClientCAs: f.ca.Pool(), ClientAuth: tls.VerifyClientCertIfGiven, MinVersion: tls.VersionTLS13,
	})))
	agentv1.RegisterNodeServiceServer(gs, f.gw)
	agentv1.RegisterSiteAgentServiceServer(gs, f.gw.SiteService())
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f.addr = ln.Addr().String()
	go func() { _ = gs.Serve(ln) }()
	t.Cleanup(func() { f.gw.Stop(); gs.Stop() })
	if f.site, err = sites.Create(t.Context(), f.db, sites.Site{ID: sites.NewID(), TenantID: "root", Name: "fra1"}); err != nil {
		t.Fatal(err)
	}
	return f
}

// token mints a site token of uses for the harness's site.
func (f *siteFixture) token(t *testing.T, uses int) string {
	t.Helper()
	m := sites.MintToken()
	if _, err := sites.CreateToken(t.Context(), f.db, sites.Token{ID: m.ID, TenantID: "root", SiteID: f.site.ID, Uses: uses,
		ExpiresAt: time.Now().Add(time.Hour)}, m.Hash); err != nil {
		t.Fatal(err)
	}
	return m.Token
}

func (f *siteFixture) joinConfig(t *testing.T, token, hostname string) join.Config {
	t.Helper()
	st, err := state.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return join.Config{Gateway: f.addr, ServerName: "127.0.0.1", RootCAs: f.ca.Pool(), Token: token,
		JoinserviceKey: f.key.PublicKey(), JoinserviceKeyID: f.key.ID(), State: st, Claims: site.HostClaims{Hostname: hostname}}
}

// enroll runs `bcd site join`'s enrollment.
func (f *siteFixture) enroll(t *testing.T, token, hostname string) (site.Identity, *state.Store) {
	t.Helper()
	cfg := f.joinConfig(t, token, hostname)
	id, err := site.Join(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if id.SiteID != f.site.ID || id.Stored.NodeID != id.AgentID {
		t.Fatalf("enrolled %+v", id)
	}
	return id, cfg.State
}

// bootEvent is one Serve or Stop, when it happened.
type bootEvent struct {
	serve bool
	epoch int64
	at    time.Time
}

// recorder is a BootServer that records what it was told.
type recorder struct {
	mu     sync.Mutex
	events []bootEvent
	ends   []error // the sessions' ends
}

func (r *recorder) Serve(epoch int64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, bootEvent{serve: true, epoch: epoch, at: time.Now()})
	return nil
}

func (r *recorder) Stop() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, bootEvent{at: time.Now()})
}

func (r *recorder) ended(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ends = append(r.ends, err)
}

// serving reports whether the last event was a Serve, and its epoch.
func (r *recorder) serving() (bool, int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if n := len(r.events); n > 0 && r.events[n-1].serve {
		return true, r.events[n-1].epoch
	}
	return false, 0
}

func (r *recorder) snapshot() ([]bootEvent, []error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]bootEvent(nil), r.events...), append([]error(nil), r.ends...)
}

// agent is a running site agent.
type agent struct {
	id     site.Identity
	boot   *recorder
	cancel context.CancelFunc
	done   chan struct{}
}

// run starts site.Run for the agent in st, dialing addr.
func (f *siteFixture) run(t *testing.T, id site.Identity, st *state.Store, addr string) *agent {
	t.Helper()
	return f.runWith(t, id, st, addr, nil)
}

// runWith is run with edit applied to the agent's Config.
func (f *siteFixture) runWith(t *testing.T, id site.Identity, st *state.Store, addr string, edit func(*site.Config)) *agent {
	t.Helper()
	a := &agent{id: id, boot: &recorder{}, done: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	a.cancel = cancel
	cfg := site.Config{
		Gateway: addr, ServerName: "127.0.0.1", State: st, Boot: a.boot, Version: "test", LeaseTTL: siteLeaseTTL,
		MinBackoff: 50 * time.Millisecond, MaxBackoff: 200 * time.Millisecond, HeartbeatInterval: 200 * time.Millisecond,
		Logger: slog.New(slog.DiscardHandler), OnSessionEnd: a.boot.ended,
	}
	if edit != nil {
		edit(&cfg)
	}
	go func() {
		defer close(a.done)
		err := site.Run(ctx, cfg)
		if err != nil {
			t.Errorf("site.Run: %v", err)
		}
	}()
	t.Cleanup(func() { a.stop() })
	return a
}

// stop cancels the agent's Run and waits for it.
func (a *agent) stop() {
	a.cancel()
	<-a.done
}

// TestOneSiteAgentServesAndAStandbyTakesOver: two agents enrolled with one
// 2-use token; exactly one serves; when it crashes the standby serves once
// the lease lapsed, under the next epoch, and the old epoch is fenced.
func TestOneSiteAgentServesAndAStandbyTakesOver(t *testing.T) {
	t.Parallel()
	f := setupSite(t)
	ctx := t.Context()
	tok := f.token(t, 2)
	idA, stA := f.enroll(t, tok, "pxe-a")
	idB, stB := f.enroll(t, tok, "pxe-b")
	if _, err := site.Join(ctx, f.joinConfig(t, tok, "pxe-c")); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("a third enrollment with a 2-use token: %v, want Unauthenticated", err)
	}
	a, b := f.run(t, idA, stA, f.addr), f.run(t, idB, stB, f.addr)

	var holder, standby *agent
	poll.Until(t, 30*time.Second, "one agent serving", func() bool {
		sa, _ := a.boot.serving()
		sb, _ := b.boot.serving()
		switch {
		case sa && !sb:
			holder, standby = a, b
		case sb && !sa:
			holder, standby = b, a
		}
		return holder != nil
	})
	// Several renewals later, still only the holder has ever served.
	lease, err := sites.ReadLease(ctx, f.db, f.site.ID)
	if err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 30*time.Second, "the holder's lease renewed", func() bool {
		l, err := sites.ReadLease(ctx, f.db, f.site.ID)
		return err == nil && l.ExpiresAt.After(lease.ExpiresAt.Add(siteLeaseTTL))
	})
	if ev, _ := standby.boot.snapshot(); len(ev) != 0 {
		t.Fatalf("the standby was told %+v while the holder held the lease", ev)
	}
	_, epoch := holder.boot.serving()
	lease, err = sites.ReadLease(ctx, f.db, f.site.ID)
	if err != nil || lease.Holder != holder.id.AgentID || lease.Epoch != epoch {
		t.Fatalf("lease %+v (%v), want %s at epoch %d", lease, err, holder.id.AgentID, epoch)
	}

	holder.stop() // a crash, as far as the lease goes: it is not released
	lapsed, err := sites.ReadLease(ctx, f.db, f.site.ID)
	if err != nil || lapsed.Holder != holder.id.AgentID {
		t.Fatalf("lease after the holder stopped: %+v %v", lapsed, err)
	}
	poll.Until(t, 30*time.Second, "the standby serving", func() bool {
		ok, _ := standby.boot.serving()
		return ok
	})
	ev, _ := standby.boot.snapshot()
	if ev[0].epoch != epoch+1 {
		t.Fatalf("the standby serves at epoch %d, want %d", ev[0].epoch, epoch+1)
	}
	if !ev[0].at.After(lapsed.ExpiresAt) {
		t.Fatalf("the standby served at %s, before the holder's lease lapsed at %s", ev[0].at, lapsed.ExpiresAt)
	}
	if err := sites.CheckFence(ctx, f.db, f.site.ID, holder.id.AgentID, epoch); !errors.Is(err, sites.ErrFenced) {
		t.Fatalf("the old holder's epoch: %v, want ErrFenced", err)
	}
	if err := sites.CheckFence(ctx, f.db, f.site.ID, standby.id.AgentID, epoch+1); err != nil {
		t.Fatalf("the new holder's epoch: %v", err)
	}
}

// TestARevokedSiteAgentLosesItsSession: revoking an agent closes its open
// session at the next recheck, stops its boot server, and it cannot open
// another.
func TestARevokedSiteAgentLosesItsSession(t *testing.T) {
	t.Parallel()
	f := setupSite(t)
	id, st := f.enroll(t, f.token(t, 1), "pxe-a")
	a := f.run(t, id, st, f.addr)
	poll.Until(t, 30*time.Second, "the agent serving", func() bool {
		ok, _ := a.boot.serving()
		return ok && f.gw.SiteSessions() == 1
	})
	if _, err := sites.RevokeAgent(t.Context(), f.db, f.site.ID, id.AgentID); err != nil {
		t.Fatal(err)
	}
	if err := f.gw.RecheckCertificates(t.Context()); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 30*time.Second, "two refused sessions", func() bool {
		_, ends := a.boot.snapshot()
		n := 0
		for _, err := range ends {
			if status.Code(err) == codes.PermissionDenied {
				n++
			}
		}
		return n >= 2 // the closed session and a refused reconnect
	})
	if ok, _ := a.boot.serving(); ok {
		t.Fatal("the revoked agent still serves")
	}
	if n := f.gw.SiteSessions(); n != 0 {
		t.Fatalf("the gateway holds %d site sessions, want 0", n)
	}
}

// TestSiteAndNodeIdentitiesDoNotCross: a site certificate cannot open a
// node session nor a node certificate a site session; a join token does not
// enroll a site agent nor a site token join a node.
func TestSiteAndNodeIdentitiesDoNotCross(t *testing.T) {
	t.Parallel()
	f := setupSite(t)
	ctx := t.Context()
	id, st := f.enroll(t, f.token(t, 1), "pxe-a")
	key, err := st.Key()
	if err != nil {
		t.Fatal(err)
	}
	siteCert := tls.Certificate{Certificate: id.Stored.Chain, PrivateKey: key}

	// A node, with a recorded certificate of the same CA.
	fixture.Pool(t, f.db, fixture.PoolOpts{ID: "pool_p"})
	fixture.Node(t, f.db, fixture.NodeOpts{ID: "node_a", Pool: "pool_p"})
	nodeKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	chain, err := f.ca.IssueNode(ctx, f.db, "node_a", nodeKey.Public())
	if err != nil {
		t.Fatal(err)
	}
	nodeCert := tls.Certificate{Certificate: [][]byte{chain[0].Raw}, PrivateKey: nodeKey}

	dial := func(cert tls.Certificate) *grpc.ClientConn {
		conn, err := grpc.NewClient(f.addr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{
			RootCAs: f.ca.Pool(), ServerName: "127.0.0.1", Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS13,
		})))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = conn.Close() })
		return conn
	}

	t.Run("a node certificate cannot open a site session", func(t *testing.T) {
		s, err := agentv1.NewSiteAgentServiceClient(dial(nodeCert)).Session(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_ = s.Send(&agentv1.SiteAgentServiceSessionRequest{Body: &agentv1.SiteAgentServiceSessionRequest_Hello{Hello: &agentv1.SiteHello{AgentId: "node_a"}}})
		if _, err := s.Recv(); status.Code(err) != codes.PermissionDenied {
			t.Fatalf("got %v, want PermissionDenied", err)
		}
	})

	t.Run("a site certificate cannot open a node session", func(t *testing.T) {
		s, err := agentv1.NewNodeServiceClient(dial(siteCert)).Session(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_ = s.Send(hello(id.AgentID))
		if _, err := s.Recv(); status.Code(err) != codes.PermissionDenied {
			t.Fatalf("got %v, want PermissionDenied", err)
		}
	})

	t.Run("the site certificate renews as a site certificate", func(t *testing.T) {
		csr, err := st.CSR()
		if err != nil {
			t.Fatal(err)
		}
		resp, err := agentv1.NewNodeServiceClient(dial(siteCert)).Renew(ctx, &agentv1.RenewRequest{Csr: csr})
		if err != nil {
			t.Fatal(err)
		}
		fresh := state.Identity{NodeID: id.AgentID, Chain: resp.GetCertificateChain(), Bundle: id.Stored.Bundle}
		if err := fresh.VerifyPath(key, "/site/"+f.site.ID+"/agent/"+id.AgentID); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("a join token does not enroll a site agent", func(t *testing.T) {
		s := jointoken.Mint()
		if _, err := jointoken.Create(ctx, f.db, jointoken.Token{ID: s.ID, TenantID: "root", PoolID: "pool_p", Uses: 1}, s.Hash); err != nil {
			t.Fatal(err)
		}
		_, err := site.Join(ctx, f.joinConfig(t, s.Token, "pxe-x"))
		if st := status.Convert(errors.Unwrap(err)); st.Code() != codes.InvalidArgument {
			t.Fatalf("got %v, want InvalidArgument", err)
		}
	})

	t.Run("a site token does not join a node", func(t *testing.T) {
		cfg := f.joinConfig(t, f.token(t, 1), "gpu-x")
		cfg.Role = ""
		_, err := join.Join(ctx, cfg)
		if st := status.Convert(errors.Unwrap(err)); st.Code() != codes.InvalidArgument {
			t.Fatalf("got %v, want InvalidArgument", err)
		}
		var left int
		if err := f.db.QueryRow(ctx, `SELECT count(*) FROM site_tokens WHERE uses_left = uses`).Scan(&left); err != nil || left != 1 {
			t.Fatalf("%d unspent site tokens (%v), want the refused one", left, err)
		}
	})
}

// proxy forwards TCP to a backend until cut.
type proxy struct {
	ln      net.Listener
	backend string
	mu      sync.Mutex
	conns   []net.Conn
	cut     bool
}

func newProxy(t *testing.T, backend string) *proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{ln: ln, backend: backend}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", backend)
			if err != nil {
				_ = c.Close()
				continue
			}
			p.mu.Lock()
			if p.cut {
				p.mu.Unlock()
				_ = c.Close()
				_ = up.Close()
				continue
			}
			p.conns = append(p.conns, c, up)
			p.mu.Unlock()
			go func() { _, _ = io.Copy(up, c); _ = up.Close() }()
			go func() { _, _ = io.Copy(c, up); _ = c.Close() }()
		}
	}()
	t.Cleanup(p.partition)
	return p
}

// partition cuts every connection and refuses new ones.
func (p *proxy) partition() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = true
	_ = p.ln.Close()
	for _, c := range p.conns {
		_ = c.Close()
	}
}

// TestAPartitionedHolderStopsBeforeItsLeaseLapses: the holder loses the
// gateway; it stops serving before its lease lapses in the database (its
// Stop's time against the boot_expires_at its last renewal left), so a
// standby, which can take over only after that, never serves at the same
// time.
func TestAPartitionedHolderStopsBeforeItsLeaseLapses(t *testing.T) {
	t.Parallel()
	f := setupSite(t)
	ctx := t.Context()
	tok := f.token(t, 2)
	idA, stA := f.enroll(t, tok, "pxe-a")
	idB, stB := f.enroll(t, tok, "pxe-b")
	p := newProxy(t, f.addr)
	a := f.run(t, idA, stA, p.ln.Addr().String())
	poll.Until(t, 30*time.Second, "the agent behind the proxy serving", func() bool {
		ok, _ := a.boot.serving()
		return ok
	})
	_, epoch := a.boot.serving()

	p.partition()
	poll.Until(t, 30*time.Second, "the partitioned holder stopping", func() bool {
		ok, _ := a.boot.serving()
		return !ok
	})
	evA, _ := a.boot.snapshot()
	stopped := evA[len(evA)-1]
	// Nothing renewed the lease since: its expiry is the last grant's.
	l, err := sites.ReadLease(ctx, f.db, f.site.ID)
	if err != nil || l.Holder != idA.AgentID || l.Epoch != epoch {
		t.Fatalf("lease %+v %v, want %s's at epoch %d", l, err, idA.AgentID, epoch)
	}
	if !stopped.at.Before(l.ExpiresAt) {
		t.Fatalf("the partitioned holder stopped at %s, not before its lease lapsed at %s", stopped.at, l.ExpiresAt)
	}

	b := f.run(t, idB, stB, f.addr)
	poll.Until(t, 30*time.Second, "the standby serving", func() bool {
		ok, _ := b.boot.serving()
		return ok
	})
	evB, _ := b.boot.snapshot()
	if evB[0].epoch != epoch+1 || !evB[0].at.After(l.ExpiresAt) {
		t.Fatalf("the standby served at epoch %d at %s, want epoch %d after %s", evB[0].epoch, evB[0].at, epoch+1, l.ExpiresAt)
	}
}
