// Package site is the site agent, `bcd site`: it enrolls with a site token
// ([Join]: NodeService.Join with role "site"), then holds one
// SiteAgentService.Session with a gateway over mutual TLS with its site
// certificate (SPIFFE id spiffe://<trust-domain>/site/<site id>/agent/<agent
// id>), reconnecting with jittered exponential back-off, renewing the
// certificate through NodeService.Renew once less than a third of its
// lifetime is left, and keeping the site's boot lease.
//
// # The boot lease
//
// One site agent per site serves PXE: the one holding the site's boot lease.
// The agent asks for it (LeaseRequest) on every session at once and then
// every third of its ttl. The control plane grants it for ttl from when it
// handles the request, which is after the agent sent it, so the agent holds
// it at least until sentAt + ttl on its own monotonic clock; it counts on
// less, sentAt + ttl − SafetyMargin (the local deadline), to absorb clock
// rate differences. [BootServer.Serve] is called with the lease's epoch (its
// fencing token) when the lease is held; [BootServer.Stop] when it is lost
// (the answer names another holder, or a new epoch), when the local deadline
// passes without a renewal (the gateway cannot be reached, or does not
// answer), when the session is refused for good (the agent or its
// certificate was revoked), and when Run returns. So a partitioned agent
// stops serving before its lease lapses and a standby can take it over.
//
// A session that drops for any other reason does not stop the boot server:
// the agent goes on serving until its local deadline while it reconnects,
// so a gateway restart does not interrupt PXE.
//
// # Site tasks
//
// Every session makes a fresh P-256 key (proto/credseal) and says its
// public half in Hello; the control plane seals site tasks' secrets to it.
// The lease holder runs the SiteTasks it is sent (see tasks.go): BMC tasks
// through agent/site/redfish, pxe.arm and pxe.disarm into Config.PXE, the
// table the boot server answers from.
//
// The identity is kept in an agent/state Store (its own root directory):
// the key, the agent id (in the node id file), the certificate chain and
// the trust bundle pinned at enrollment.
package site

import (
	"cmp"
	"context"
	"crypto/ecdsa"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/bettercompute/bettercompute/agent/internal/retry"
	"github.com/bettercompute/bettercompute/agent/join"
	"github.com/bettercompute/bettercompute/agent/site/pxe"
	"github.com/bettercompute/bettercompute/agent/state"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/credseal"
	"github.com/bettercompute/bettercompute/proto/spiffepath"
)

// Lease defaults (the control plane's: sites.DefaultLeaseTTL and
// sites.MaxLeaseTTL).
const (
	// DefaultLeaseTTL is the boot lease asked for unless Config says.
	DefaultLeaseTTL = 15 * time.Second
	// MaxLeaseTTL is the longest the control plane grants.
	MaxLeaseTTL = 5 * time.Minute
)

// BootServer is what serves the site's machines (proxy DHCP, TFTP, iPXE):
// Run starts it while the agent holds the boot lease and stops it when it
// may no longer. Serve and Stop are called from one goroutine at a time,
// never concurrently, and must return promptly; they must not call back
// into Run.
type BootServer interface {
	// Serve starts serving under the lease's epoch (the fencing token every
	// write made on the boot server's behalf names). It is called again with
	// a new epoch only after Stop.
	Serve(epoch int64) error
	// Stop stops serving. It is called only after a Serve.
	Stop()
}

// Config is one site agent's Run. Gateway, State and Boot are required;
// zero values take the defaults noted.
type Config struct {
	// Gateway is the gateway's host:port.
	Gateway string
	// ServerName is the name the gateway's certificate must carry; empty
	// means the host of Gateway.
	ServerName string
	// State holds the agent's key and identity (from [Join]); renewed
	// certificates are stored there.
	State *state.Store
	// Boot is started and stopped with the boot lease.
	Boot BootServer
	// Version goes into Hello.
	Version string
	// Hostname goes into Hello; empty means os.Hostname.
	Hostname string
	// LeaseTTL is the boot lease asked for; DefaultLeaseTTL by default, at
	// most MaxLeaseTTL. It is renewed every third of it.
	LeaseTTL time.Duration
	// SafetyMargin is how long before the lease's end, as the agent counts
	// it, it stops serving; LeaseTTL/5 by default, less than LeaseTTL/3.
	SafetyMargin time.Duration
	// HeartbeatInterval is how often the agent says it is alive; 10 s by
	// default.
	HeartbeatInterval time.Duration
	// MinBackoff is the first reconnect delay; 0.5 s by default. Delays
	// double up to MaxBackoff (30 s by default), are jittered by ±50 %, and
	// start over after a session that got its SiteSpec.
	MinBackoff, MaxBackoff time.Duration
	// Logger; nil means slog.Default().
	Logger *slog.Logger
	// OnSessionEnd, when set, hears every session's end (tests, simulators).
	OnSessionEnd func(err error)
	// OnLease, when set, hears every LeaseState the control plane sent.
	OnLease func(*agentv1.LeaseState)
	// PXE is the table the boot server answers from; pxe.arm and
	// pxe.disarm tasks change it. Nil: PXE is off and those tasks fail.
	PXE *pxe.Table
	// TaskTimeout bounds one site task (and its task's not_after does); 10
	// minutes by default.
	TaskTimeout time.Duration
	// OnTask, when set, is called before each site task runs, with the
	// task's context (tests: a holder that dies mid-task).
	OnTask func(context.Context, *agentv1.SiteTask)
}

// Identity is an enrolled site agent's identity.
type Identity struct {
	// SiteID and AgentID are the certificate's.
	SiteID, AgentID string
	// TrustDomain is the certificate's SPIFFE trust domain.
	TrustDomain string
	// Stored is what the state Store holds (Stored.NodeID is the agent id).
	Stored state.Identity
}

// LoadIdentity reads and checks the identity stored in st: a certificate
// for st's key whose SPIFFE id is a site agent's. state.ErrNotJoined when
// the agent has not enrolled.
func LoadIdentity(st *state.Store) (Identity, error) {
	key, err := st.Key()
	if err != nil {
		return Identity{}, err
	}
	stored, err := st.Identity()
	if err != nil {
		return Identity{}, err
	}
	return identityOf(stored, key)
}

func identityOf(stored state.Identity, key *ecdsa.PrivateKey) (Identity, error) {
	leaf, err := stored.Leaf()
	if err != nil {
		return Identity{}, err
	}
	for _, u := range leaf.URIs {
		if u.Scheme != "spiffe" || u.Host == "" {
			continue
		}
		siteID, agentID, ok := spiffepath.SiteAgentIDs(u.Path)
		if !ok || agentID != stored.NodeID {
			continue
		}
		if err := stored.VerifyPath(key, u.Path); err != nil {
			return Identity{}, fmt.Errorf("site: %w", err)
		}
		return Identity{SiteID: siteID, AgentID: agentID, TrustDomain: u.Host, Stored: stored}, nil
	}
	return Identity{}, fmt.Errorf("site: the certificate in %s is not a site agent's (spiffe://<trust-domain>/site/<site>/agent/%s): enroll with bcd site join", "the state directory", stored.NodeID)
}

// HostClaims are what a site agent says about itself when it enrolls: its
// host name.
type HostClaims struct{ Hostname string }

// Claims implements join.Claimer.
func (h HostClaims) Claims(context.Context) (*agentv1.HardwareClaims, error) {
	name := h.Hostname
	if name == "" {
		name, _ = os.Hostname()
	}
	return &agentv1.HardwareClaims{Hostname: name}, nil
}

// Join enrolls a site agent: cfg.Token is a site token (bcst_…), sealed and
// sent as join.Join does, with role "site"; cfg.Claims nil means
// [HostClaims] of this host. The identity is stored in cfg.State.
func Join(ctx context.Context, cfg join.Config) (Identity, error) {
	cfg.Role = join.RoleSite
	if cfg.Claims == nil {
		cfg.Claims = HostClaims{}
	}
	if _, err := join.Join(ctx, cfg); err != nil {
		return Identity{}, err
	}
	return LoadIdentity(cfg.State)
}

// Run holds the site agent's session until ctx ends, reconnecting forever,
// renews its certificate, and starts and stops cfg.Boot with the boot lease
// (see the package documentation). It returns an error only when it cannot
// start (a missing or inconsistent identity, a bad configuration); it
// returns nil once ctx ends, after stopping the boot server.
func Run(ctx context.Context, cfg Config) error {
	if cfg.Gateway == "" || cfg.State == nil || cfg.Boot == nil {
		return errors.New("site: gateway, state and boot server are required")
	}
	cfg.ServerName = cmp.Or(cfg.ServerName, retry.HostOf(cfg.Gateway))
	cfg.Logger = cmp.Or(cfg.Logger, slog.Default())
	cfg.LeaseTTL = cmp.Or(cfg.LeaseTTL, DefaultLeaseTTL)
	if cfg.LeaseTTL < 0 || cfg.LeaseTTL > MaxLeaseTTL {
		return fmt.Errorf("site: lease ttl %s: want up to %s", cfg.LeaseTTL, MaxLeaseTTL)
	}
	cfg.SafetyMargin = cmp.Or(cfg.SafetyMargin, cfg.LeaseTTL/5)
	if cfg.SafetyMargin < 0 || cfg.SafetyMargin >= cfg.LeaseTTL/3 {
		return fmt.Errorf("site: safety margin %s: want less than a third of the lease ttl %s", cfg.SafetyMargin, cfg.LeaseTTL)
	}
	cfg.HeartbeatInterval = cmp.Or(cfg.HeartbeatInterval, 10*time.Second)
	cfg.MinBackoff = cmp.Or(cfg.MinBackoff, 500*time.Millisecond)
	cfg.MaxBackoff = max(cmp.Or(cfg.MaxBackoff, 30*time.Second), cfg.MinBackoff)
	if cfg.Hostname == "" {
		cfg.Hostname, _ = os.Hostname()
	}
	key, err := cfg.State.Key()
	if err != nil {
		return err
	}
	stored, err := cfg.State.Identity()
	if err != nil {
		return err
	}
	id, err := identityOf(stored, key)
	if err != nil {
		return err
	}
	r := &runner{cfg: cfg, key: key, log: cfg.Logger.With("site", id.SiteID, "agent", id.AgentID)}
	r.lease.boot, r.lease.log = cfg.Boot, r.log
	r.tasks = newTasks(r.log, cfg.PXE, cmp.Or(cfg.TaskTimeout, defaultTaskTimeout), cfg.OnTask)
	if err := r.setIdentity(id); err != nil {
		return err
	}
	var wg sync.WaitGroup
	wg.Go(func() { r.renewLoop(ctx) })
	r.sessionLoop(ctx)
	wg.Wait()
	r.tasks.wait()
	r.lease.stop("shutting down")
	return nil
}

// runner is one Run.
type runner struct {
	cfg Config
	key *ecdsa.PrivateKey
	log *slog.Logger

	mu   sync.Mutex
	id   Identity
	cert *tls.Certificate
	pool *x509.CertPool

	lease keeper
	tasks *tasks
}

func (r *runner) setIdentity(id Identity) error {
	leaf, err := id.Stored.Leaf()
	if err != nil {
		return err
	}
	pool, err := id.Stored.Pool()
	if err != nil {
		return err
	}
	r.mu.Lock()
	r.id, r.cert, r.pool = id, &tls.Certificate{Certificate: id.Stored.Chain, PrivateKey: r.key, Leaf: leaf}, pool
	r.mu.Unlock()
	return nil
}

func (r *runner) current() (Identity, *tls.Certificate, *x509.CertPool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.id, r.cert, r.pool
}

// dial opens a connection with the current certificate, verifying the
// gateway against the pinned trust bundle and its SPIFFE id
// spiffe://<trust-domain>/gateway/<name>.
func (r *runner) dial() (*grpc.ClientConn, error) {
	id, _, pool := r.current()
	creds := credentials.NewTLS(&tls.Config{
		MinVersion: tls.VersionTLS12,
		RootCAs:    pool,
		ServerName: r.cfg.ServerName,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			_, c, _ := r.current()
			return c, nil
		},
		VerifyConnection: func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) == 0 {
				return errors.New("site: the gateway sent no certificate")
			}
			for _, u := range cs.PeerCertificates[0].URIs {
				if u.Scheme == "spiffe" && u.Host == id.TrustDomain && strings.HasPrefix(u.Path, spiffepath.GatewayPrefix) && len(u.Path) > len(spiffepath.GatewayPrefix) {
					return nil
				}
			}
			return fmt.Errorf("site: the gateway's certificate has no SPIFFE id spiffe://%s/gateway/<name>", id.TrustDomain)
		},
	})
	conn, err := grpc.NewClient(r.cfg.Gateway, grpc.WithTransportCredentials(creds))
	if err != nil {
		return nil, fmt.Errorf("site: dial %s: %w", r.cfg.Gateway, err)
	}
	return conn, nil
}

// sessionLoop runs sessions until ctx ends, backing off between them.
func (r *runner) sessionLoop(ctx context.Context) {
	b := retry.Backoff{Min: r.cfg.MinBackoff, Max: r.cfg.MaxBackoff}
	for {
		welcomed, err := r.session(ctx)
		if ctx.Err() != nil {
			return
		}
		if r.cfg.OnSessionEnd != nil {
			r.cfg.OnSessionEnd(err)
		}
		if refusedForGood(err) {
			// Revoked (or expired): serving must end now, not at the
			// deadline; the agent keeps asking, in case it was a mistake
			// put right, at the longest back-off.
			r.lease.stop("the session was refused: " + status.Convert(err).Message())
			b.Longest()
		} else if welcomed {
			b.Reset()
		}
		d := b.Next()
		r.log.WarnContext(ctx, "site session ended; reconnecting", "err", err, "in", d)
		if !retry.Sleep(ctx, d) {
			return
		}
	}
}

// refusedForGood reports whether err is the gateway refusing the agent's
// identity (a revoked agent or certificate, an expired certificate).
func refusedForGood(err error) bool {
	switch status.Code(err) {
	case codes.PermissionDenied, codes.Unauthenticated:
		return true
	}
	return false
}

// session runs one session; welcomed reports whether it got its SiteSpec.
func (r *runner) session(ctx context.Context) (welcomed bool, err error) {
	conn, err := r.dial()
	if err != nil {
		return false, err
	}
	defer func() { _ = conn.Close() }()
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := agentv1.NewSiteAgentServiceClient(conn).Session(sctx)
	if err != nil {
		return false, fmt.Errorf("site: open: %w", err)
	}
	id, _, _ := r.current()
	// A key for this session only: what is sealed to it opens nowhere else.
	sealKey, err := credseal.NewKey()
	if err != nil {
		return false, err
	}
	jwk, err := credseal.PublicJWK(sealKey)
	if err != nil {
		return false, err
	}
	if err := stream.Send(&agentv1.SiteAgentServiceSessionRequest{Body: &agentv1.SiteAgentServiceSessionRequest_Hello{Hello: &agentv1.SiteHello{
		AgentId: id.AgentID, Version: r.cfg.Version, Hostname: r.cfg.Hostname, SealKey: jwk,
	}}}); err != nil {
		return false, fmt.Errorf("site: hello: %w", err)
	}
	msgs := make(chan *agentv1.SiteAgentServiceSessionResponse)
	recvErr := make(chan error, 1)
	var wg sync.WaitGroup
	defer wg.Wait() // after cancel (deferred later, run first) ends Recv
	defer cancel()
	wg.Go(func() {
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
	})

	// sent are the LeaseRequests in flight, by sequence: when each was
	// sent, on the monotonic clock.
	sent := map[uint64]time.Time{}
	var seq, beats uint64
	ask := func() error {
		seq++
		sent[seq] = time.Now()
		return stream.Send(&agentv1.SiteAgentServiceSessionRequest{Body: &agentv1.SiteAgentServiceSessionRequest_LeaseRequest{LeaseRequest: &agentv1.LeaseRequest{
			TtlMs: r.cfg.LeaseTTL.Milliseconds(), Sequence: seq,
		}}})
	}
	if err := ask(); err != nil {
		return false, fmt.Errorf("site: lease request: %w", err)
	}
	renew := time.NewTicker(r.cfg.LeaseTTL / 3)
	defer renew.Stop()
	heartbeat := time.NewTicker(r.cfg.HeartbeatInterval)
	defer heartbeat.Stop()
	for {
		select {
		case <-ctx.Done():
			return welcomed, ctx.Err()
		case err := <-recvErr:
			return welcomed, fmt.Errorf("site: %w", err)
		case <-renew.C:
			if err := ask(); err != nil {
				return welcomed, fmt.Errorf("site: lease request: %w", err)
			}
		case <-r.tasks.wake:
			for _, res := range r.tasks.take() {
				if err := stream.Send(&agentv1.SiteAgentServiceSessionRequest{Body: &agentv1.SiteAgentServiceSessionRequest_TaskResult{TaskResult: res}}); err != nil {
					// Lost with the session: the control plane sends the
					// task again and the answer comes from memory.
					return welcomed, fmt.Errorf("site: task result: %w", err)
				}
			}
		case <-heartbeat.C:
			beats++
			if err := stream.Send(&agentv1.SiteAgentServiceSessionRequest{Body: &agentv1.SiteAgentServiceSessionRequest_Heartbeat{Heartbeat: &agentv1.Heartbeat{Sequence: beats}}}); err != nil {
				return welcomed, fmt.Errorf("site: heartbeat: %w", err)
			}
		case m := <-msgs:
			switch b := m.GetBody().(type) {
			case *agentv1.SiteAgentServiceSessionResponse_Spec:
				if !welcomed {
					r.log.InfoContext(ctx, "site session established", "generation", b.Spec.GetGeneration())
				}
				welcomed = true
			case *agentv1.SiteAgentServiceSessionResponse_Task:
				// ctx, not sctx: a task outlives the session it came on.
				r.tasks.handle(ctx, b.Task, sealKey)
			case *agentv1.SiteAgentServiceSessionResponse_Lease:
				ls := b.Lease
				at, ok := sent[ls.GetSequence()]
				if !ok {
					r.log.WarnContext(ctx, "ignoring a lease answer to no request", "sequence", ls.GetSequence())
					continue
				}
				for s := range sent {
					if s <= ls.GetSequence() {
						delete(sent, s)
					}
				}
				if r.cfg.OnLease != nil {
					r.cfg.OnLease(ls)
				}
				r.lease.answer(at, ls, r.cfg.SafetyMargin)
			}
		}
	}
}

// keeper starts and stops the boot server with the lease.
type keeper struct {
	boot BootServer
	log  *slog.Logger

	mu       sync.Mutex
	serving  bool
	epoch    int64
	deadline time.Time // monotonic: from a request's send time
	timer    *time.Timer
}

// answer applies a LeaseState answering a request sent at sentAt.
func (k *keeper) answer(sentAt time.Time, ls *agentv1.LeaseState, margin time.Duration) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if !ls.GetHeld() {
		if k.serving {
			k.stopLocked("the boot lease is held by " + ls.GetHolderAgentId())
		}
		return
	}
	ttl := time.Duration(ls.GetTtlMs()) * time.Millisecond
	deadline := sentAt.Add(ttl - margin)
	if time.Until(deadline) <= 0 {
		if k.serving {
			k.stopLocked("the lease answer came too late to count on")
		}
		return
	}
	if k.serving && k.epoch != ls.GetEpoch() {
		// Someone may have held it in between: start over under the new
		// fencing token.
		k.stopLocked(fmt.Sprintf("the boot lease moved from epoch %d to %d", k.epoch, ls.GetEpoch()))
	}
	if k.serving && deadline.Before(k.deadline) {
		deadline = k.deadline // an earlier request's answer, arriving late
	}
	k.deadline = deadline
	if k.timer == nil {
		k.timer = time.AfterFunc(time.Until(deadline), k.expire)
	} else {
		k.timer.Reset(time.Until(deadline))
	}
	if !k.serving {
		if err := k.boot.Serve(ls.GetEpoch()); err != nil {
			k.log.Error("the boot server did not start", "epoch", ls.GetEpoch(), "err", err)
			return
		}
		k.serving, k.epoch = true, ls.GetEpoch()
		k.log.Info("serving under the boot lease", "epoch", ls.GetEpoch(), "expires", ls.GetExpireTime().AsTime())
	}
}

// expire stops the boot server when the local deadline passed without a
// renewal.
func (k *keeper) expire() {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.serving && !time.Now().Before(k.deadline) {
		k.stopLocked("the boot lease was not renewed in time")
	}
}

// stop stops the boot server now, if it serves.
func (k *keeper) stop(why string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.timer != nil {
		k.timer.Stop()
	}
	if k.serving {
		k.stopLocked(why)
	}
}

func (k *keeper) stopLocked(why string) {
	k.boot.Stop()
	k.serving = false
	k.log.Warn("stopped serving", "epoch", k.epoch, "why", why)
}
