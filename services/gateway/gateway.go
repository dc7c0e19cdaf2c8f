// Package gateway is the `gateway` role: it terminates the node daemons'
// mutual-TLS connections and holds their Session streams in memory.
//
// A gateway holds no CA and no signing key. It checks each client
// certificate's chain (against the trust bundle), its revocation, and that
// its SPIFFE ID (spiffe://<trust-domain>/node/<id>) names the node in Hello;
// it relays Join and Renew to joinservice; it bumps the node's session epoch
// on every new session (so an older session, here or on another gateway, is
// superseded and its late messages are ignored); it asks for inventory after
// Hello and hands reports to the inventory controller through the work queue;
// it writes liveness for all its sessions in one statement per interval; and
// it delivers commands (see commands.go) — to a session whose certificate
// has role ramdisk (bcd ramdisk) only the commissioning flow's kinds. It also holds the site agents'
// SiteAgentService sessions and their boot leases (see site.go), and the
// nodes' Tunnel streams (see tunnels.go).
package gateway

import (
	"cmp"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/durationpb"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/spiffepath"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/fault"
	invstore "github.com/bettercompute/bettercompute/pkg/inventory"
	"github.com/bettercompute/bettercompute/pkg/lifecycle"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	nodestore "github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/startstop"
	"github.com/bettercompute/bettercompute/pkg/wake"
)

// Joiner is joinservice as the gateway sees it.
type Joiner interface {
	Join(ctx context.Context, req *agentv1.JoinRequest) (*agentv1.JoinResponse, error)
	Renew(ctx context.Context, chain []*x509.Certificate, req *agentv1.RenewRequest) (*agentv1.RenewResponse, error)
}

// Config configures a Gateway.
type Config struct {
	// ID names this gateway in nodes.gateway_id; required.
	ID string
	// DB is the pool; required.
	DB *pgxpool.Pool
	// Joiner handles Join and Renew; required.
	Joiner Joiner
	// Revoked returns which of the certificate serials (lowercase hex)
	// must be refused — revoked, or unknown to the CA; nil means none is.
	// It is asked at every session start and, for every session held, at
	// every liveness tick, so a revocation closes open sessions too.
	Revoked func(ctx context.Context, serials []string) ([]string, error)
	// TrustDomain the node SPIFFE IDs must be in; required.
	TrustDomain string
	// Waker sends the wakes of the gateway's transactions (the inventory
	// controller's after a report); nil leaves them to the loops' resync.
	Waker *wake.Waker
	// HeartbeatInterval is what Welcome asks of nodes; default 10s.
	HeartbeatInterval time.Duration
	// LivenessInterval is how often liveness is written; default 5s.
	LivenessInterval time.Duration
	// BusUp says whether the bus carries command wakes now (the process's
	// NATS connection is up); nil means it never does. While it is up the
	// gateway resyncs commands every LivenessInterval, a safety net under
	// the wakes; while it is down every CommandPollBusDown, so a command
	// reaches its node within about that long with no bus.
	BusUp func() bool
	// CommandPollBusDown is the command resync period without the bus;
	// default 500ms.
	CommandPollBusDown time.Duration
	// Kinds is the command kinds registry; nil means commands.Builtin().
	// The gateway sends each command with the signature stored when it was
	// queued and holds no signing key: it cannot sign, so it cannot forge,
	// a destructive command.
	Kinds *commands.Registry
	// Logger; nil discards.
	Logger *slog.Logger
	// ObservedKinds are work kinds enqueued with the node id, in the same
	// transaction, whenever a node's observed generation is stored (and
	// poked after commit): capacity's bind check.
	ObservedKinds []ObservedKind
	// AdmitRate bounds the sessions opened per second, AdmitBurst how many
	// may open at once above it, AdmitWait how long one waits for its turn
	// before it is told to retry later (see admission). A zero AdmitRate
	// admits every session at once.
	AdmitRate  float64
	AdmitBurst int
	AdmitWait  time.Duration
	// OldestAgent and NewestAgent are the version-skew window (semantic
	// versions, either may be empty: open): a Hello whose agent version is
	// outside it is refused AGENT_TOO_OLD or AGENT_TOO_NEW before the
	// session opens. With either end set, a version that is not a semantic
	// version ("dev") is refused AGENT_TOO_OLD: nothing says it is new
	// enough.
	OldestAgent, NewestAgent string
}

// ObservedKind is a work kind that waits on nodes' convergence.
type ObservedKind struct {
	Kind string
	// Waiting, when set, returns which of nodeIDs have work of the kind
	// waiting on their convergence, read in the transaction that stores
	// their reports; only those are enqueued. Nil enqueues every node.
	Waiting func(ctx context.Context, tx pgx.Tx, nodeIDs []string) ([]string, error)
}

// Gateway implements agentv1.NodeServiceServer.
type Gateway struct {
	agentv1.UnimplementedNodeServiceServer
	cfg   Config
	log   *slog.Logger
	kinds *commands.Registry

	life startstop.Once
	mu   sync.Mutex
	// sessions, by node id, and started (the report writer runs) are
	// guarded by mu; stop is closed, under mu, by Stop.
	sessions map[string]*session
	// draining is set, under mu, by Drain: no session is admitted.
	draining bool
	// opened and ended count sessions opened (after Hello was accepted)
	// and ended, for the metrics.
	opened, ended atomic.Int64
	stop          chan struct{}
	done          chan struct{}
	started       bool

	// reports feeds the batch writer of sessions' reports.
	reports     chan *report
	reportsDone chan struct{}
	// commandsDone is closed when the command resync loop has ended.
	commandsDone chan struct{}
	admission    *admission
	skew         skewWindow

	// sites are the site agents' sessions (see site.go).
	sites     siteSessions
	siteWakes siteWakes

	// tunnels are the tunnels opening (see tunnels.go).
	tunnels tunnelTable
}

type session struct {
	nodeID string
	epoch  int64
	seen   bool // a message arrived since the last liveness write
	cancel context.CancelCauseFunc
	// ctx ends with the session (its tunnels end with it).
	ctx context.Context

	// serial and notAfter are the session's certificate's, rechecked
	// every liveness tick.
	serial   string
	notAfter time.Time
	// agentVersion is the bcd version its Hello reported.
	agentVersion string
	// ramdisk: the certificate has role ramdisk (bcd ramdisk, a machine in
	// commissioning): the session is sent only the commissioning flow's
	// commands (see commands.go).
	ramdisk bool

	sendMu    sync.Mutex // a gRPC stream takes one sender at a time
	stream    agentv1.NodeService_SessionServer
	delivered int64 // the highest desired-state generation sent
	// ready is set once the session has been sent what was due at its
	// start (desired state, commands) and reads the daemon's messages.
	ready atomic.Bool
}

// send sends m on the session's stream.
func (s *session) send(m *agentv1.SessionResponse) error {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	return s.stream.Send(m)
}

// Holds reports whether this gateway holds a session of nodeID.
func (g *Gateway) Holds(nodeID string) bool {
	g.mu.Lock()
	_, ok := g.sessions[nodeID]
	g.mu.Unlock()
	return ok
}

// errSuperseded ends a session that a newer one of the same node replaced.
var errSuperseded = errors.New("superseded by a newer session of this node")

// errDraining ends the sessions of a gateway that drains (Drain).
var errDraining = errors.New("gateway draining: reconnect to another gateway")

// DrainJitter bounds the retry delay a draining gateway gives each of its
// daemons, drawn uniformly, so they do not all reach the survivors in the
// same instant (the survivors' admission rate paces the rest).
const DrainJitter = 2 * time.Second

// drainingStatus is what a daemon of a draining gateway is told: UNAVAILABLE
// with a jittered RetryInfo; the daemon moves to the next gateway of its
// list.
func drainingStatus() error {
	st, err := status.New(codes.Unavailable, errDraining.Error()).
		WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(rand.N(DrainJitter))})
	if err != nil {
		return status.Error(codes.Unavailable, errDraining.Error())
	}
	return st.Err()
}

// Drain stops the gateway taking sessions and moves its daemons away, as a
// gateway given SIGTERM does before it stops: a new session is refused
// UNAVAILABLE ("gateway draining", a jittered retry delay), each session it
// holds ends with the same status (the daemon, given several gateways,
// reconnects to the next at once), and Drain returns the number of
// sessions it ended once none is left or ctx ends. Nothing is lost:
// commands in flight stay in flight and go out again on the daemon's next
// session (its journal runs each once), its outcomes and reports go again
// from its outbox, and the next session gets the whole desired state.
// Site agents' sessions end too.
func (g *Gateway) Drain(ctx context.Context) int {
	g.mu.Lock()
	g.draining = true
	n := len(g.sessions)
	for _, s := range g.sessions {
		s.cancel(errDraining)
	}
	g.mu.Unlock()
	g.sites.mu.Lock()
	for _, s := range g.sites.m {
		s.cancel(errDraining)
	}
	g.sites.mu.Unlock()
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for g.Sessions() > 0 {
		select {
		case <-ctx.Done():
			return n
		case <-t.C:
		}
	}
	return n
}

func (g *Gateway) isDraining() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.draining
}

// errCertRevoked and errCertExpired end a session whose certificate was
// revoked, or expired, while it was open.
var (
	errCertRevoked = errors.New("certificate revoked")
	errCertExpired = errors.New("certificate expired")
)

// New returns a gateway; call Start to begin writing liveness.
func New(cfg Config) (*Gateway, error) {
	switch {
	case cfg.ID == "":
		return nil, errors.New("gateway: no ID")
	case cfg.DB == nil:
		return nil, errors.New("gateway: no DB")
	case cfg.Joiner == nil:
		return nil, errors.New("gateway: no Joiner")
	case cfg.TrustDomain == "":
		return nil, errors.New("gateway: no trust domain")
	}
	cfg.HeartbeatInterval = cmp.Or(cfg.HeartbeatInterval, 10*time.Second)
	cfg.LivenessInterval = cmp.Or(cfg.LivenessInterval, 5*time.Second)
	cfg.CommandPollBusDown = cmp.Or(cfg.CommandPollBusDown, 500*time.Millisecond)
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	skew, err := newSkewWindow(cfg.OldestAgent, cfg.NewestAgent)
	if err != nil {
		return nil, err
	}
	kinds := cfg.Kinds
	if kinds == nil {
		kinds = commands.Builtin()
	}
	return &Gateway{cfg: cfg, log: cfg.Logger, kinds: kinds, sessions: map[string]*session{}, stop: make(chan struct{}), done: make(chan struct{}),
		reports: make(chan *report, maxReportBatch), reportsDone: make(chan struct{}), commandsDone: make(chan struct{}),
		admission: newAdmission(cfg.AdmitRate, cfg.AdmitBurst, cmp.Or(cfg.AdmitWait, 10*time.Second)), skew: skew,
		sites: siteSessions{m: map[string]*siteSession{}}, siteWakes: siteWakes{m: map[string]*siteWake{}}}, nil
}

// Start runs the liveness writer and the report writer until Stop. A second
// Start, or one after Stop, is an error.
func (g *Gateway) Start(context.Context) error {
	err := g.life.Start(func() error {
		g.mu.Lock()
		g.started = true
		g.mu.Unlock()
		go g.livenessLoop()
		go g.reportLoop()
		go g.commandLoop()
		return nil
	})
	if err != nil {
		return fmt.Errorf("gateway: %w", err)
	}
	return nil
}

// Stop ends every session and the liveness writer, after a last write.
// It tolerates Stop before Start, a second Stop, and Stop concurrent with
// Start (it waits for Start).
func (g *Gateway) Stop() {
	g.life.Stop(func(started bool) {
		g.mu.Lock()
		close(g.stop)
		for _, s := range g.sessions {
			s.cancel(errors.New("gateway stopping"))
		}
		g.mu.Unlock()
		g.sites.mu.Lock()
		for _, s := range g.sites.m {
			s.cancel(errors.New("gateway stopping"))
		}
		g.sites.mu.Unlock()
		if started {
			<-g.done
			<-g.reportsDone
			<-g.commandsDone
		}
	})
}

// Sessions returns how many sessions the gateway holds.
func (g *Gateway) Sessions() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.sessions)
}

// Join relays to joinservice. It is the one method callable without a
// client certificate.
func (g *Gateway) Join(ctx context.Context, req *agentv1.JoinRequest) (*agentv1.JoinResponse, error) {
	resp, err := g.cfg.Joiner.Join(ctx, req)
	if err != nil {
		return nil, g.joinerErr(ctx, "Join", err)
	}
	return resp, nil
}

// joinerErr passes on a gRPC status (joinservice.NewJoiner maps its errors
// to them) and answers anything else INTERNAL with a generic message, the
// cause logged: a caller of Join is not yet authenticated.
func (g *Gateway) joinerErr(ctx context.Context, method string, err error) error {
	if _, ok := status.FromError(err); ok {
		return err
	}
	g.log.ErrorContext(ctx, "node call failed", "method", method, "err", err)
	return status.Error(codes.Internal, "internal error")
}

// Renew relays to joinservice with the caller's verified chain: a node's,
// or a site agent's (joinservice renews each as what it is).
func (g *Gateway) Renew(ctx context.Context, req *agentv1.RenewRequest) (*agentv1.RenewResponse, error) {
	chain, _, err := g.verifiedNode(ctx)
	if status.Code(err) == codes.PermissionDenied {
		if siteChain, _, _, siteErr := g.verifiedSiteAgent(ctx); siteErr == nil {
			chain, err = siteChain, nil
		}
	}
	if err != nil {
		return nil, err
	}
	resp, err := g.cfg.Joiner.Renew(ctx, chain, req)
	if err != nil {
		return nil, g.joinerErr(ctx, "Renew", err)
	}
	return resp, nil
}

// hasChain reports whether p presented a certificate the TLS layer verified.
func hasChain(p *peer.Peer) bool {
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	return ok && len(ti.State.VerifiedChains) > 0 && len(ti.State.VerifiedChains[0]) > 0
}

// verifiedNode returns the caller's verified chain and node id, checking the
// SPIFFE ID and revocation.
func (g *Gateway) verifiedNode(ctx context.Context) ([]*x509.Certificate, string, error) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return nil, "", status.Error(codes.Unauthenticated, "no peer")
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(ti.State.VerifiedChains) == 0 || len(ti.State.VerifiedChains[0]) == 0 {
		return nil, "", status.Error(codes.Unauthenticated, "a node certificate is required")
	}
	chain := ti.State.VerifiedChains[0]
	leaf := chain[0]
	id, err := x509svid.IDFromCert(leaf)
	if err != nil {
		return nil, "", status.Errorf(codes.Unauthenticated, "certificate has no SPIFFE ID: %v", err)
	}
	nodeID, ok := spiffepath.NodeID(id.Path())
	if id.TrustDomain().Name() != g.cfg.TrustDomain || !ok {
		return nil, "", status.Errorf(codes.PermissionDenied, "%s is not a node identity of %s", id, g.cfg.TrustDomain)
	}
	if g.cfg.Revoked != nil {
		revoked, err := g.cfg.Revoked(ctx, []string{leaf.SerialNumber.Text(16)})
		if err != nil {
			return nil, "", status.Errorf(codes.Unavailable, "revocation check: %v", err)
		}
		if len(revoked) > 0 {
			return nil, "", status.Error(codes.PermissionDenied, "certificate revoked")
		}
	}
	return chain, nodeID, nil
}

// maxAgentVersion bounds a Hello's agent_version (stored in
// nodes.agent_version).
const maxAgentVersion = 64

// Session holds one node's stream. See the package comment.
func (g *Gateway) Session(stream agentv1.NodeService_SessionServer) error {
	ctx := stream.Context()
	// A caller with no verified certificate takes no one's turn.
	if p, ok := peer.FromContext(ctx); !ok || !hasChain(p) {
		return status.Error(codes.Unauthenticated, "a node certificate is required")
	}
	if g.isDraining() {
		return drainingStatus()
	}
	if err := g.admission.admit(ctx, g.stop); err != nil {
		return err
	}
	chain, certNode, err := g.verifiedNode(ctx)
	if err != nil {
		return err
	}
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	hello := first.GetHello()
	if hello == nil {
		return status.Error(codes.FailedPrecondition, "the first message of a session must be Hello")
	}
	if hello.GetNodeId() != certNode {
		return status.Errorf(codes.PermissionDenied, "certificate is for %s, Hello says %s", certNode, hello.GetNodeId())
	}
	if len(hello.GetAgentVersion()) > maxAgentVersion {
		return status.Errorf(codes.InvalidArgument, "Hello: agent_version is at most %d bytes", maxAgentVersion)
	}
	if err := g.skew.admit(hello.GetAgentVersion()); err != nil {
		g.log.WarnContext(ctx, "session refused: agent version outside the skew window", "node", certNode, "agent", hello.GetAgentVersion(), "err", err)
		return err.Status().Err()
	}
	// The certificate's recorded role decides what the session is sent: a
	// ramdisk's (same SPIFFE ID as the node's) gets only the flow's kinds.
	// (An unrecorded one is Revoked's to refuse; it is no ramdisk's.)
	role, err := nodeca.CertificateRole(ctx, g.cfg.DB, chain[0].SerialNumber.Text(16))
	if errors.Is(err, nodeca.ErrUnknownCertificate) {
		role, err = nodeca.RoleNode, nil
	}
	if err != nil {
		return status.Errorf(codes.Unavailable, "certificate role: %v", err)
	}

	// The epoch bump and the reconnect rules for in-flight commands
	// (a new boot, a new journal) commit together.
	var epoch, observed int64
	err = reconcile.InTx(ctx, g.cfg.DB, g.cfg.Waker, func(tx pgx.Tx, q *reconcile.Queue) error {
		opened, err := nodestore.OpenSession(ctx, tx, certNode, g.cfg.ID, hello.GetBootId(), hello.GetJournalId(), hello.GetAgentVersion())
		if err != nil {
			return err
		}
		epoch, observed = opened.Epoch, opened.ObservedGeneration
		if opened.PrevAgentVersion != hello.GetAgentVersion() {
			// Another build than last session's (an upgrade, a
			// rollback): it gets its desired state again and reports
			// every section as this build sees it (the agent section
			// converged on its new version, or its UpgradeFailed).
			observed = 0
		}
		return g.kinds.Reconnect(ctx, tx, q, certNode, opened.PrevBootID, opened.PrevJournalID, hello.GetBootId(), hello.GetJournalId())
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return status.Errorf(codes.NotFound, "node %s does not exist", certNode)
	}
	if err != nil {
		return status.Errorf(codes.Unavailable, "open session: %v", err)
	}

	sctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	// The node has what it says it observed, but a generation the database
	// does not show as observed counts as not delivered: the node's report
	// of it may have been lost with its last session (sent as that session
	// ended), and the daemon reports only after a converge, so it is sent
	// again and the node reports it on this session.
	s := &session{nodeID: certNode, epoch: epoch, cancel: cancel, ctx: sctx, stream: stream, delivered: min(hello.GetObservedGeneration(), observed),
		serial: chain[0].SerialNumber.Text(16), notAfter: chain[0].NotAfter, ramdisk: role == nodeca.RoleRamdisk,
		agentVersion: hello.GetAgentVersion()}
	g.mu.Lock()
	select {
	case <-g.stop:
		g.mu.Unlock()
		return status.Error(codes.Unavailable, "gateway stopping")
	default:
	}
	if old, ok := g.sessions[certNode]; ok {
		old.cancel(errSuperseded)
	}
	g.sessions[certNode] = s
	g.mu.Unlock()
	g.opened.Add(1)
	defer func() {
		g.ended.Add(1)
		g.mu.Lock()
		if g.sessions[certNode] == s {
			delete(g.sessions, certNode)
		}
		g.mu.Unlock()
	}()
	log := g.log.With("node", certNode, "epoch", epoch)
	log.InfoContext(ctx, "session opened", "boot", hello.GetBootId(), "journal", hello.GetJournalId(), "agent", hello.GetAgentVersion(), "role", role)

	if err := s.send(&agentv1.SessionResponse{Body: &agentv1.SessionResponse_Welcome{Welcome: &agentv1.Welcome{
		SessionEpoch: epoch, HeartbeatIntervalMs: uint32(g.cfg.HeartbeatInterval.Milliseconds()), GatewayId: g.cfg.ID,
	}}}); err != nil {
		return err
	}
	if err := s.send(&agentv1.SessionResponse{Body: &agentv1.SessionResponse_InventoryRequest{InventoryRequest: &agentv1.InventoryRequest{}}}); err != nil {
		return err
	}
	// A node behind its generation gets the full spec right after Welcome.
	if err := g.deliver(sctx, []*session{s}); err != nil {
		log.WarnContext(ctx, "deliver desired state", "err", err)
	}
	// Then the commands: in-flight ones again (the daemon's journal dedupes
	// them), and the due pending ones.
	if err := g.dispatch(sctx, s, true); err != nil {
		log.WarnContext(ctx, "dispatch commands", "err", err)
	}
	s.ready.Store(true)

	msgs := make(chan *agentv1.SessionRequest)
	recvErr := make(chan error, 1)
	go func() {
		for {
			m, err := stream.Recv()
			if err != nil {
				recvErr <- err
				return
			}
			select {
			case msgs <- m:
			case <-sctx.Done():
				return
			}
		}
	}()
	for {
		select {
		case <-sctx.Done():
			cause := context.Cause(sctx)
			log.InfoContext(ctx, "session closed", "cause", cause)
			switch {
			case errors.Is(cause, errSuperseded):
				return status.Error(codes.Aborted, errSuperseded.Error())
			case errors.Is(cause, errCertRevoked):
				return status.Error(codes.PermissionDenied, errCertRevoked.Error())
			case errors.Is(cause, errCertExpired):
				return status.Error(codes.Unauthenticated, errCertExpired.Error())
			case errors.Is(cause, errDraining):
				return drainingStatus()
			}
			return status.FromContextError(sctx.Err()).Err()
		case err := <-recvErr:
			log.InfoContext(ctx, "session ended", "err", err)
			return nil
		case m := <-msgs:
			g.markSeen(s)
			var err error
			if inv := m.GetInventory(); inv != nil {
				if err = g.storeInventory(sctx, s, inv); err != nil {
					log.WarnContext(ctx, "store inventory", "err", err)
				}
			}
			if obs := m.GetObserved(); obs != nil && !lostReport(err) {
				if err = g.storeObserved(sctx, s, obs); err != nil {
					log.WarnContext(ctx, "store observed generation", "err", err)
				}
			}
			if u := m.GetCommandUpdate(); u != nil && !lostReport(err) {
				if err = g.applyUpdate(sctx, s, u); err != nil {
					log.WarnContext(ctx, "apply command update", "command", u.GetId(), "err", err)
				}
			}
			if lostReport(err) && sctx.Err() == nil {
				return status.Errorf(codes.Unavailable, "the gateway could not store the node's report (%v); reconnect to report again", err)
			}
		}
	}
}

func (g *Gateway) markSeen(s *session) {
	g.mu.Lock()
	s.seen = true
	g.mu.Unlock()
}

// storeInventory keeps the latest report, if the session is still the
// node's current one, and enqueues the inventory controller, through the
// batch writer (a reconnecting fleet's inventories commit in batches).
// lostReport reports whether err, from storing a node's report, lost the
// report (a terminated database connection, a failed commit): the session
// then ends with UNAVAILABLE, so the daemon reconnects and reports again —
// its Hello carries the generation it observed and its inventory, and a
// command whose outcome was lost is dispatched again under the new session
// and answered from the daemon's journal. Only logging it would leave the
// node's observedGeneration, or the command's outcome, behind until the
// node's next change. A report the gateway refused (a *fault.Error other
// than INTERNAL or UNAVAILABLE) is only logged: sending it again changes
// nothing.
func lostReport(err error) bool {
	if err == nil {
		return false
	}
	switch fault.CodeOf(err) {
	case fault.Internal, fault.Unavailable:
		return true
	}
	return false
}

func (g *Gateway) storeInventory(ctx context.Context, s *session, inv *agentv1.InventoryReport) error {
	report, err := protojson.Marshal(inv)
	if err != nil {
		return err
	}
	return g.submit(ctx, s.nodeID, func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) error {
		stored, err := invstore.Store(ctx, tx, s.nodeID, s.epoch, report)
		if err != nil {
			return err
		}
		if !stored {
			return nil // a newer session owns the node: ignore this late report
		}
		return q.Enqueue(ctx, lifecycle.KindInventory, s.nodeID)
	})
}

func (g *Gateway) livenessLoop() {
	defer close(g.done)
	t := time.NewTicker(g.cfg.LivenessInterval)
	defer t.Stop()
	for {
		select {
		case <-g.stop:
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_ = g.FlushLiveness(ctx)
			cancel()
			return
		case <-t.C:
			// Each step has its own deadline, so a slow liveness write
			// under load does not starve the resyncs that follow it. A
			// tick that overruns the interval only delays the next (the
			// ticker drops ticks).
			step := max(g.cfg.LivenessInterval, 2*time.Second)
			for _, s := range []struct {
				what string
				fn   func(context.Context) error
			}{
				{"write liveness", g.FlushLiveness},
				{"recheck certificates", g.RecheckCertificates},
				{"resync desired state", g.Resync},
			} {
				ctx, cancel := context.WithTimeout(context.Background(), step)
				if err := s.fn(ctx); err != nil {
					g.log.Warn(s.what, "err", err)
				}
				cancel()
			}
		}
	}
}

// commandLoop resyncs commands (ResyncCommands): every LivenessInterval
// while the bus is up (the wakes deliver at once; this is the net under
// them), every CommandPollBusDown while it is down.
func (g *Gateway) commandLoop() {
	defer close(g.commandsDone)
	t := time.NewTicker(min(g.cfg.CommandPollBusDown, g.cfg.LivenessInterval))
	defer t.Stop()
	// Each session dispatches what is queued when it opens: the first
	// resync is due an interval after the start.
	last := time.Now()
	for {
		select {
		case <-g.stop:
			return
		case now := <-t.C:
			if g.cfg.BusUp != nil && g.cfg.BusUp() && now.Sub(last) < g.cfg.LivenessInterval {
				continue
			}
			last = now
			ctx, cancel := context.WithTimeout(context.Background(), max(g.cfg.LivenessInterval, 2*time.Second))
			if err := g.ResyncCommands(ctx); err != nil {
				g.log.Warn("resync commands", "err", err)
			}
			cancel()
		}
	}
}

// RecheckCertificates closes every session whose certificate has expired or
// been revoked since it opened: the revocation lookup for all of them is one
// call. The liveness loop runs it every interval, so a revoked node loses its
// session (and the commands it would receive) within one interval. Site
// agents' sessions are rechecked the same way, with their agents'
// revocation.
func (g *Gateway) RecheckCertificates(ctx context.Context) error {
	return errors.Join(g.recheckNodes(ctx), g.recheckSites(ctx))
}

func (g *Gateway) recheckNodes(ctx context.Context) error {
	now := time.Now()
	g.mu.Lock()
	bySerial := make(map[string][]*session, len(g.sessions))
	serials := make([]string, 0, len(g.sessions))
	for _, s := range g.sessions {
		if now.After(s.notAfter) {
			s.cancel(errCertExpired)
			continue
		}
		if _, ok := bySerial[s.serial]; !ok {
			serials = append(serials, s.serial)
		}
		bySerial[s.serial] = append(bySerial[s.serial], s)
	}
	g.mu.Unlock()
	if g.cfg.Revoked == nil || len(serials) == 0 {
		return nil
	}
	revoked, err := g.cfg.Revoked(ctx, serials)
	if err != nil {
		return errors.Join(errors.New("recheck certificates"), err)
	}
	for _, serial := range revoked {
		for _, s := range bySerial[serial] {
			g.log.Warn("closing the session of a revoked certificate", "node", s.nodeID, "serial", serial)
			s.cancel(errCertRevoked)
		}
	}
	return nil
}

// FlushLiveness writes last_seen_at for every session heard from since the
// last write, and finds every session a newer session of the same node has
// superseded (its epoch is no longer the node's), in one statement; it closes
// the superseded ones.
func (g *Gateway) FlushLiveness(ctx context.Context) error {
	g.mu.Lock()
	live := make([]nodestore.Liveness, 0, len(g.sessions))
	for _, s := range g.sessions {
		live = append(live, nodestore.Liveness{NodeID: s.nodeID, Epoch: s.epoch, Seen: s.seen})
		s.seen = false
	}
	g.mu.Unlock()
	if len(live) == 0 {
		return nil
	}
	stale, err := nodestore.WriteLiveness(ctx, g.cfg.DB, live)
	if err != nil {
		return err
	}
	g.mu.Lock()
	for _, st := range stale {
		if s, ok := g.sessions[st.NodeID]; ok && s.epoch == st.Epoch {
			s.cancel(errSuperseded)
		}
	}
	g.mu.Unlock()
	return nil
}
