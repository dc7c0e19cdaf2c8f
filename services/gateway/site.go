package gateway

import (
	"context"
	"crypto/x509"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/credseal"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	"github.com/bettercompute/bettercompute/pkg/sites"
	"github.com/bettercompute/bettercompute/pkg/sitetasks"
)

// Site sessions.
//
// A site agent (`bcd site`) holds one SiteAgentService.Session on the same
// mutual-TLS listener as the nodes. Only a site agent certificate
// (spiffe://<trust domain>/site/<site id>/agent/<agent id>) opens one — a
// node certificate is PERMISSION_DENIED here, as a site certificate is on
// NodeService.Session — and only while neither the certificate nor the
// agent is revoked: both are checked at the start and at every liveness
// tick ([Gateway.RecheckCertificates]), which closes the session of a
// revoked agent PERMISSION_DENIED. Every LeaseRequest is one
// sites.AcquireLease (the ttl bounded by sites.MaxLeaseTTL, 0 meaning
// sites.DefaultLeaseTTL) answered with the LeaseState; heartbeats mark the
// agent seen (sites.Touch, at most once per SiteTouchInterval). A session
// that ends leaves the lease alone: its agent may still be serving until its
// own deadline, so a standby takes over only once the lease lapses.
//
// Hello carries the session's seal key (a public JWK, proto/credseal),
// stored as the agent's (sitetasks.SetSealKey): the control plane seals site
// tasks' secrets to it. While the session holds the boot lease, the gateway
// delivers the site's tasks to it (see site_tasks.go).

// SiteTouchInterval is how often a site session's heartbeats are written
// as site_agents.last_seen_at.
const SiteTouchInterval = 30 * time.Second

// Bounds on a site agent's Hello.
const (
	maxSiteAgentID  = 64
	maxSiteVersion  = 64
	maxSiteHostname = 253
	maxSiteSealKey  = credseal.MaxJWK
)

// errAgentRevoked ends the session of a site agent revoked while it was
// open.
var errAgentRevoked = errors.New("site agent revoked")

type siteSession struct {
	agentID, siteID string
	cancel          context.CancelCauseFunc
	serial          string
	notAfter        time.Time
	// kid is the id of the session's seal key ("" when it said none).
	kid string

	sendMu sync.Mutex // a gRPC stream takes one sender at a time
	stream agentv1.SiteAgentService_SessionServer

	// held and epoch are the boot lease as the session's last LeaseState
	// answer said, guarded by mu.
	mu    sync.Mutex
	held  bool
	epoch int64
}

// send sends m on the session's stream.
func (s *siteSession) send(m *agentv1.SiteAgentServiceSessionResponse) error {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	return s.stream.Send(m)
}

// holder returns the session as a task claimer, and whether it holds the
// lease.
func (s *siteSession) holder() (sitetasks.Holder, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return sitetasks.Holder{SiteID: s.siteID, AgentID: s.agentID, Epoch: s.epoch, SessionKID: s.kid}, s.held
}

// setLease records a LeaseState answer; it reports whether the session
// newly holds the lease (or holds it at a new epoch).
func (s *siteSession) setLease(ls *agentv1.LeaseState) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	gained := ls.GetHeld() && (!s.held || s.epoch != ls.GetEpoch())
	s.held, s.epoch = ls.GetHeld(), ls.GetEpoch()
	return gained
}

// siteSessions are the gateway's site sessions by agent id.
type siteSessions struct {
	mu sync.Mutex
	m  map[string]*siteSession
}

// SiteService is SiteAgentService on a gateway (see [Gateway.SiteService]).
type SiteService struct {
	agentv1.UnimplementedSiteAgentServiceServer
	g *Gateway
}

// SiteService returns the gateway's SiteAgentService, to register on the
// gateway's listener beside the NodeService.
func (g *Gateway) SiteService() *SiteService { return &SiteService{g: g} }

// SiteSessions returns how many site sessions the gateway holds.
func (g *Gateway) SiteSessions() int {
	g.sites.mu.Lock()
	defer g.sites.mu.Unlock()
	return len(g.sites.m)
}

// verifiedSiteAgent returns the caller's verified chain, site and agent,
// checking the SPIFFE ID's role and the certificate's revocation.
func (g *Gateway) verifiedSiteAgent(ctx context.Context) ([]*x509.Certificate, string, string, error) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return nil, "", "", status.Error(codes.Unauthenticated, "no peer")
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(ti.State.VerifiedChains) == 0 || len(ti.State.VerifiedChains[0]) == 0 {
		return nil, "", "", status.Error(codes.Unauthenticated, "a site agent certificate is required")
	}
	chain := ti.State.VerifiedChains[0]
	id, err := x509svid.IDFromCert(chain[0])
	if err != nil {
		return nil, "", "", status.Errorf(codes.Unauthenticated, "certificate has no SPIFFE ID: %v", err)
	}
	site, agent, ok := nodeca.ParseSiteAgentPath(id.Path())
	if id.TrustDomain().Name() != g.cfg.TrustDomain || !ok {
		return nil, "", "", status.Errorf(codes.PermissionDenied, "%s is not a site agent identity of %s", id, g.cfg.TrustDomain)
	}
	if g.cfg.Revoked != nil {
		revoked, err := g.cfg.Revoked(ctx, []string{chain[0].SerialNumber.Text(16)})
		if err != nil {
			return nil, "", "", status.Errorf(codes.Unavailable, "revocation check: %v", err)
		}
		if len(revoked) > 0 {
			return nil, "", "", status.Error(codes.PermissionDenied, "certificate revoked")
		}
	}
	return chain, site, agent, nil
}

// Session holds one site agent's stream. See the comment above.
func (ss *SiteService) Session(stream agentv1.SiteAgentService_SessionServer) error {
	g := ss.g
	ctx := stream.Context()
	if p, ok := peer.FromContext(ctx); !ok || !hasChain(p) {
		return status.Error(codes.Unauthenticated, "a site agent certificate is required")
	}
	if g.isDraining() {
		return drainingStatus()
	}
	if err := g.admission.admit(ctx, g.stop); err != nil {
		return err
	}
	chain, siteID, agentID, err := g.verifiedSiteAgent(ctx)
	if err != nil {
		return err
	}
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	hello := first.GetHello()
	switch {
	case hello == nil:
		return status.Error(codes.FailedPrecondition, "the first message of a site session must be Hello")
	case len(hello.GetAgentId()) > maxSiteAgentID || len(hello.GetVersion()) > maxSiteVersion || len(hello.GetHostname()) > maxSiteHostname ||
		len(hello.GetSealKey()) > maxSiteSealKey:
		return status.Errorf(codes.InvalidArgument, "Hello: agent id, version, hostname and seal key are at most %d, %d, %d and %d bytes",
			maxSiteAgentID, maxSiteVersion, maxSiteHostname, maxSiteSealKey)
	case hello.GetAgentId() != agentID:
		return status.Errorf(codes.PermissionDenied, "certificate is for site agent %s, Hello says %s", agentID, hello.GetAgentId())
	}
	// The version-skew window applies to site agents too (they are bcd),
	// before the session writes anything.
	if err := g.skew.admitAs(hello.GetVersion(), "hello.version"); err != nil {
		g.log.WarnContext(ctx, "site session refused: agent version outside the skew window", "site", siteID, "agent", agentID, "version", hello.GetVersion(), "err", err)
		return err.Status().Err()
	}
	agent, err := sites.GetAgent(ctx, g.cfg.DB, agentID)
	switch {
	case fault.CodeOf(err) == fault.NotFound:
		return status.Errorf(codes.PermissionDenied, "site agent %s does not exist", agentID)
	case err != nil:
		return status.Errorf(codes.Unavailable, "read site agent: %v", err)
	case agent.RevokedAt != nil:
		return status.Error(codes.PermissionDenied, errAgentRevoked.Error())
	case agent.SiteID != siteID:
		return status.Errorf(codes.PermissionDenied, "site agent %s is not an agent of %s", agentID, siteID)
	}
	site, err := sites.Get(ctx, g.cfg.DB, agent.TenantID, siteID)
	if err != nil {
		return status.Errorf(codes.Unavailable, "read site: %v", err)
	}
	var kid string
	if key := hello.GetSealKey(); key != "" {
		if kid, err = credseal.KeyID(key); err != nil {
			return status.Errorf(codes.InvalidArgument, "Hello: seal_key: %v", err)
		}
	}
	// This session's key replaces the last one's: tasks sealed to that
	// are resealed before they are sent here.
	if err := sitetasks.SetSealKey(ctx, g.cfg.DB, agentID, hello.GetSealKey()); err != nil {
		return status.Errorf(codes.Unavailable, "store seal key: %v", err)
	}

	sctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	s := &siteSession{agentID: agentID, siteID: siteID, cancel: cancel, serial: chain[0].SerialNumber.Text(16), notAfter: chain[0].NotAfter,
		kid: kid, stream: stream}
	g.sites.mu.Lock()
	select {
	case <-g.stop:
		g.sites.mu.Unlock()
		return status.Error(codes.Unavailable, "gateway stopping")
	default:
	}
	if old, ok := g.sites.m[agentID]; ok {
		old.cancel(errSuperseded)
	}
	g.sites.m[agentID] = s
	g.sites.mu.Unlock()
	g.holdSite(siteID)
	defer func() {
		g.sites.mu.Lock()
		if g.sites.m[agentID] == s {
			delete(g.sites.m, agentID)
		}
		g.sites.mu.Unlock()
		g.releaseSite(siteID)
	}()
	log := g.log.With("site", siteID, "agent", agentID)
	log.InfoContext(ctx, "site session opened", "version", hello.GetVersion(), "hostname", hello.GetHostname())
	if err := sites.Touch(ctx, g.cfg.DB, agentID); err != nil {
		log.WarnContext(ctx, "touch site agent", "err", err)
	}
	lastTouch := time.Now()
	if err := s.send(&agentv1.SiteAgentServiceSessionResponse{Body: &agentv1.SiteAgentServiceSessionResponse_Spec{Spec: &agentv1.SiteSpec{
		SiteId: siteID, Generation: site.Generation,
	}}}); err != nil {
		return err
	}
	// The task resync: without the bus, tasks reach the holder within an
	// interval.
	resync := time.NewTicker(g.cfg.LivenessInterval)
	defer resync.Stop()

	msgs := make(chan *agentv1.SiteAgentServiceSessionRequest)
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
			log.InfoContext(ctx, "site session closed", "cause", cause)
			switch {
			case errors.Is(cause, errSuperseded):
				return status.Error(codes.Aborted, errSuperseded.Error())
			case errors.Is(cause, errCertRevoked), errors.Is(cause, errAgentRevoked):
				return status.Error(codes.PermissionDenied, cause.Error())
			case errors.Is(cause, errCertExpired):
				return status.Error(codes.Unauthenticated, errCertExpired.Error())
			case errors.Is(cause, errDraining):
				return drainingStatus()
			}
			return status.FromContextError(sctx.Err()).Err()
		case err := <-recvErr:
			log.InfoContext(ctx, "site session ended", "err", err)
			return nil
		case <-resync.C:
			if err := g.resyncSiteSession(sctx, s); err != nil {
				log.WarnContext(ctx, "resync site tasks", "err", err)
			}
		case m := <-msgs:
			switch b := m.GetBody().(type) {
			case *agentv1.SiteAgentServiceSessionRequest_LeaseRequest:
				ls, err := g.acquireLease(sctx, siteID, agentID, b.LeaseRequest)
				if err != nil {
					if fault.CodeOf(err) == fault.NotFound {
						return status.Errorf(codes.NotFound, "site %s does not exist", siteID)
					}
					// No answer: the agent's own deadline stops it serving
					// if this lasts.
					log.WarnContext(ctx, "acquire boot lease", "err", err)
					continue
				}
				if err := s.send(&agentv1.SiteAgentServiceSessionResponse{Body: &agentv1.SiteAgentServiceSessionResponse_Lease{Lease: ls}}); err != nil {
					return err
				}
				if s.setLease(ls) {
					// Newly the holder: what waits for the site is its now.
					if err := g.dispatchSite(sctx, s); err != nil {
						log.WarnContext(ctx, "dispatch site tasks", "err", err)
					}
				}
			case *agentv1.SiteAgentServiceSessionRequest_TaskResult:
				if err := g.applyTaskResult(sctx, s, b.TaskResult); err != nil {
					log.WarnContext(ctx, "store site task result", "task", b.TaskResult.GetId(), "err", err)
				}
			case *agentv1.SiteAgentServiceSessionRequest_Heartbeat:
				if time.Since(lastTouch) >= SiteTouchInterval {
					if err := sites.Touch(sctx, g.cfg.DB, agentID); err != nil {
						log.WarnContext(ctx, "touch site agent", "err", err)
					} else {
						lastTouch = time.Now()
					}
				}
			case *agentv1.SiteAgentServiceSessionRequest_Hello:
				return status.Error(codes.FailedPrecondition, "Hello comes once, first")
			}
		}
	}
}

// acquireLease takes or renews site's boot lease for agent as req asks.
func (g *Gateway) acquireLease(ctx context.Context, siteID, agentID string, req *agentv1.LeaseRequest) (*agentv1.LeaseState, error) {
	ttl := time.Duration(req.GetTtlMs()) * time.Millisecond
	switch {
	case ttl <= 0:
		ttl = sites.DefaultLeaseTTL
	case ttl > sites.MaxLeaseTTL:
		ttl = sites.MaxLeaseTTL
	}
	l, err := sites.AcquireLease(ctx, g.cfg.DB, siteID, agentID, ttl)
	if err != nil {
		return nil, err
	}
	ls := &agentv1.LeaseState{HolderAgentId: l.Holder, Epoch: l.Epoch, Held: l.Held(agentID), Sequence: req.GetSequence(), TtlMs: ttl.Milliseconds()}
	if !l.ExpiresAt.IsZero() {
		ls.ExpireTime = timestamppb.New(l.ExpiresAt)
	}
	return ls, nil
}

// recheckSites closes every site session whose certificate expired, or
// whose certificate or agent was revoked, since it opened: one revocation
// lookup for all certificates (g.cfg.Revoked) and one for all agents.
func (g *Gateway) recheckSites(ctx context.Context) error {
	now := time.Now()
	g.sites.mu.Lock()
	held := make([]*siteSession, 0, len(g.sites.m))
	for _, s := range g.sites.m {
		if now.After(s.notAfter) {
			s.cancel(errCertExpired)
			continue
		}
		held = append(held, s)
	}
	g.sites.mu.Unlock()
	if len(held) == 0 {
		return nil
	}
	serials := make([]string, len(held))
	agents := make([]string, len(held))
	for i, s := range held {
		serials[i], agents[i] = s.serial, s.agentID
	}
	refused := map[string]error{}
	if g.cfg.Revoked != nil {
		revoked, err := g.cfg.Revoked(ctx, serials)
		if err != nil {
			return errors.Join(errors.New("recheck site certificates"), err)
		}
		for _, serial := range revoked {
			refused[serial] = errCertRevoked
		}
	}
	revokedAgents, err := sites.RevokedAgents(ctx, g.cfg.DB, agents)
	if err != nil {
		return errors.Join(errors.New("recheck site agents"), err)
	}
	for _, s := range held {
		cause := refused[s.serial]
		if slices.Contains(revokedAgents, s.agentID) {
			cause = errAgentRevoked
		}
		if cause != nil {
			g.log.Warn("closing the session of a revoked site agent", "site", s.siteID, "agent", s.agentID, "serial", s.serial, "cause", cause)
			s.cancel(cause)
		}
	}
	return nil
}
