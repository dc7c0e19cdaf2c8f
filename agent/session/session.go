// Package session is the node's side of NodeService.Session: it dials the
// gateway over mutual TLS with the node certificate, says Hello, waits for
// Welcome, heartbeats at the interval the Welcome sets, answers inventory
// requests, converges on every DesiredState it receives (package converge)
// and reports how far it got (Observed), and reconnects with jittered exponential back-off until its
// context ends. Alongside, it renews the node certificate through
// NodeService.Renew once less than a third of its lifetime is left.
//
// The gateway is authenticated by standard TLS server verification against
// the node's trust bundle: its certificate must chain to the bundle, carry
// the server-auth extended key usage and name Config.ServerName (by default
// the host of Config.Gateway) in a DNS or IP SAN. It must also carry the
// SPIFFE id spiffe://<trust-domain>/gateway/<name>, in the node's own trust
// domain, so that no other certificate of the CA can pose as a gateway.
//
// Desired state is converged on its own goroutine, so heartbeats never wait
// for it. States that arrive while one is being applied are coalesced: only
// the newest is applied next. After each converge the node sends
// Observed{generation, observed_generation, sections}; the newest desired
// state is also re-converged every ReconvergeInterval (a failed section is
// retried, drift is repaired) and Observed is sent again when it changed.
// Hello carries the persisted observed generation, so after a restart the
// control plane knows whether to send the full spec again.
//
// Commands (SessionResponse.command and .cancel) go to the command
// executor (package command), which is told the observed generation after
// every converge; its CommandUpdates, and the inventory reports
// inventory.refresh collects, are queued and sent by the session loop, so
// neither side waits for the other.
//
// Alongside, the GPU health checks run every check interval of the health
// section (healthLoop); when a GPU's health changed since the control
// plane last heard it, an InventoryReport of the GPUs is queued. Updates produced while disconnected
// are sent on the next session; the gateway also re-sends in-flight
// commands on reconnect and the journal answers them with their state.
//
// OpenTunnel opens a Tunnel stream on the same connection, to a target the
// node's tunnels section allows (see tunnel.go); tunnels end with their
// session.
package session

import (
	"cmp"
	"context"
	"crypto"
	"crypto/ed25519"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/status"

	"github.com/bettercompute/bettercompute/agent/cdi"
	"github.com/bettercompute/bettercompute/agent/command"
	"github.com/bettercompute/bettercompute/agent/converge"
	"github.com/bettercompute/bettercompute/agent/internal/gateways"
	"github.com/bettercompute/bettercompute/agent/internal/retry"
	"github.com/bettercompute/bettercompute/agent/inventory"
	"github.com/bettercompute/bettercompute/agent/state"
	"github.com/bettercompute/bettercompute/agent/vps"
	"github.com/bettercompute/bettercompute/proto/agentrelease"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// Inventory answers inventory requests (an *inventory.Collector).
type Inventory interface {
	Report(ctx context.Context, sections []string) (*agentv1.InventoryReport, error)
}

// Config is one node's session. Gateway, State, Inventory and BootID are
// required; zero durations take the defaults noted.
type Config struct {
	// Gateway is the gateways' host:port, comma-separated: the daemon
	// starts at a random one and moves to the next when a dial or a
	// session fails (internal/gateways); a DNS name may have several
	// records.
	Gateway string
	// ServerName is the name every gateway's certificate must carry; empty
	// means the host of the entry dialed.
	ServerName string
	// State holds the node key and identity (the node must have joined);
	// renewed certificates are stored there.
	State *state.Store
	// Inventory answers InventoryRequests.
	Inventory Inventory
	// BootID identifies this boot (state.BootID).
	BootID string
	// AgentVersion goes into Hello.
	AgentVersion string
	// Logger logs reconnects and renewals; nil means slog.Default().
	Logger *slog.Logger
	// MinBackoff is the first reconnect delay; 0.5 s by default. Delays
	// double up to MaxBackoff, are jittered by ±50 %, and start over after a
	// session that was welcomed.
	MinBackoff time.Duration
	// MaxBackoff caps the reconnect delay; 30 s by default.
	MaxBackoff time.Duration
	// WelcomeTimeout bounds the wait for Welcome after Hello; 30 s by
	// default.
	WelcomeTimeout time.Duration
	// DefaultHeartbeat is used when a Welcome names no interval; 10 s by
	// default.
	DefaultHeartbeat time.Duration
	// Agent wires the agent section: the running version, the release
	// installer and the handover (converge.Agent).
	Agent converge.Agent
	// OnSession, when set, is called with true when the gateway welcomes a
	// session and with false when that session ends (simulators count
	// sessions with it).
	OnSession func(up bool)
	// OnObserved, when set, is called after an Observed report was sent
	// with the observed generation it carried (simulators time
	// convergence with it).
	OnObserved func(observedGeneration int64)
	// OnReport, when set, is called after a report (an inventory report or
	// an Observed) was sent on a welcomed session: a build on trial says
	// with it that it is up (docs/agent-upgrades.md).
	OnReport func()
	// CDI writes the devices section's CDI spec; nil means one under the
	// state root (converge.CDISpecFile), as simulated nodes keep it.
	CDI *cdi.Writer
	// DriftCheckInterval is how often the CDI spec is checked for a hand
	// edit or removal, and the driver version and minor numbers for a
	// change (converge.Converger.DevicesStale), which converges the newest
	// desired state at once; 5 s by default.
	DriftCheckInterval time.Duration
	// OnSection, when set, hears each section's converge duration and
	// state (converge.Config.OnSection).
	OnSection func(section, state string, d time.Duration)
	// OnCommandUpdate, when set, sees every command update as it is queued
	// for the control plane (the daemon counts outcomes with it). It must
	// not block.
	OnCommandUpdate func(*agentv1.CommandUpdate)
	// ReconvergeInterval is how often the newest desired state is converged
	// again (retrying failed sections); one minute by default.
	ReconvergeInterval time.Duration

	// CommandKey is the control plane's command-signing public key;
	// without it every destructive command is rejected BAD_SIGNATURE.
	CommandKey ed25519.PublicKey
	// DenyKinds are command kinds this daemon refuses (UNSUPPORTED).
	DenyKinds []string
	// RebootHook reboots the machine for node.reboot; nil disallows the
	// kind (see command.Config.RebootHook).
	RebootHook func(ctx context.Context, reason string) error
	// LogFile is the daemon's own log for logs.collect; empty means
	// command.LogPath(State.Root()).
	LogFile string
	// LogSources says where logs.collect reads the kernel's ring buffer and
	// the journal; zero values mean /dev/kmsg and journalctl on PATH.
	LogSources command.LogSources
	// CommandExecutors replace built-in command kinds' executors (tests).
	CommandExecutors map[string]command.Func

	// VPS, when set, runs the NodeSpec's instances section on this host
	// (a vps-host) and restarts instances for instance.reboot; nil means
	// the node runs no VPS runtime (the section is FAILED_TERMINAL unless
	// empty, instance.reboot UNSUPPORTED).
	VPS *vps.Reconciler
	// Site is where the NodeSpec's site section goes: its system files'
	// root, the daemon's log level, and who follows the settings (the
	// telemetry exporter). The zero value only records the section.
	Site converge.Site
	// Runtime is where the runtime section's engine files and CDI
	// directories go and how the engines are checked
	// (converge.Config.Runtime); the zero value puts them under the state
	// root and checks no engine.
	Runtime converge.Runtime

	// Key, when set, is the key the stored identity's certificate binds,
	// used instead of State's node key: bcd ramdisk's Ed25519 key, held in
	// memory only.
	Key crypto.Signer
	// Ramdisk runs the commissioning kinds (command.Config.Ramdisk); nil
	// refuses them.
	Ramdisk command.Ramdisk
	// ResultKey signs the final update of every command run
	// (command.Config.ResultKey): bcd ramdisk's key.
	ResultKey ed25519.PrivateKey
	// NoRenew turns certificate renewal off: a ramdisk's certificate is
	// never renewed (it lives at most 2 hours).
	NoRenew bool

	// HealthCheckInterval, when set, replaces the health section's
	// check_interval (tests, simulators).
	HealthCheckInterval time.Duration
	// OnHealthCheck, when set, is called after every pass of the GPU
	// health checks with whether it queued a report (tests count passes).
	OnHealthCheck func(reported bool)
}

// Run holds the node's session until ctx ends, reconnecting forever, and
// renews the certificate in the background. It returns an error only when
// it cannot start (a missing or inconsistent identity); it returns nil once
// ctx ends.
func Run(ctx context.Context, cfg Config) error {
	if cfg.Gateway == "" || cfg.State == nil || cfg.Inventory == nil || cfg.BootID == "" {
		return errors.New("session: gateway, state, inventory and boot id are required")
	}
	gws, err := gateways.Parse(cfg.Gateway, cfg.ServerName)
	if err != nil {
		return fmt.Errorf("session: %w", err)
	}
	cfg.Logger = cmp.Or(cfg.Logger, slog.Default())
	cfg.MinBackoff = cmp.Or(cfg.MinBackoff, 500*time.Millisecond)
	cfg.MaxBackoff = max(cmp.Or(cfg.MaxBackoff, 30*time.Second), cfg.MinBackoff)
	cfg.WelcomeTimeout = cmp.Or(cfg.WelcomeTimeout, 30*time.Second)
	cfg.DefaultHeartbeat = cmp.Or(cfg.DefaultHeartbeat, 10*time.Second)
	cfg.ReconvergeInterval = cmp.Or(cfg.ReconvergeInterval, time.Minute)
	cfg.DriftCheckInterval = cmp.Or(cfg.DriftCheckInterval, 5*time.Second)

	key := cfg.Key
	if key == nil {
		k, err := cfg.State.Key()
		if err != nil {
			return err
		}
		key = k
	}
	id, err := cfg.State.Identity()
	if err != nil {
		return err
	}
	if err := id.Verify(key); err != nil {
		return fmt.Errorf("session: %w", err)
	}
	journalID, err := cfg.State.JournalID()
	if err != nil {
		return err
	}
	log := cfg.Logger.With("node", id.NodeID)
	var minors func(context.Context) (map[string]int, error)
	if m, ok := cfg.Inventory.(interface {
		Minors(context.Context) (map[string]int, error)
	}); ok {
		minors = m.Minors
	}
	var driver func(context.Context) (string, error)
	if d, ok := cfg.Inventory.(interface {
		DriverVersion(context.Context) (string, error)
	}); ok {
		driver = d.DriverVersion
	}
	agent := cfg.Agent
	agent.Version = cmp.Or(agent.Version, cfg.AgentVersion)
	var migs converge.MIG
	var migDevices func(context.Context) (map[string]inventory.MIGDevice, error)
	if m, ok := cfg.Inventory.(converge.MIG); ok {
		migs = m
	}
	if m, ok := cfg.Inventory.(interface {
		MIGDevices(context.Context) (map[string]inventory.MIGDevice, error)
	}); ok {
		migDevices = m.MIGDevices
	}
	conv, err := converge.New(converge.Config{Root: cfg.State.Root(), NodeID: id.NodeID, GPUs: gpuUUIDs(cfg.Inventory), Minors: minors,
		Logger: log, Write: cfg.State.WriteAtomic, VPS: cfg.VPS, CDI: cfg.CDI, Site: cfg.Site, OnSection: cfg.OnSection,
		Runtime: cfg.Runtime, Driver: driver, MIG: migs, MIGDevices: migDevices, Agent: agent})
	if err != nil {
		return fmt.Errorf("session: %w", err)
	}
	r := &runner{
		cfg: cfg, gws: gws, key: key, journalID: journalID, log: log, conv: conv,
		desiredReady: make(chan struct{}, 1), resultReady: make(chan struct{}, 1), outReady: make(chan struct{}, 1), reconverge: make(chan struct{}, 1),
		sentCh: make(chan struct{}),
	}
	if err := r.setIdentity(id); err != nil {
		return err
	}
	var rebooter command.InstanceRebooter
	if cfg.VPS != nil {
		rebooter = cfg.VPS
	}
	cmds, err := command.New(command.Config{
		Root: cfg.State.Root(), NodeID: id.NodeID, BootID: cfg.BootID,
		Send: func(u *agentv1.CommandUpdate) {
			if cfg.OnCommandUpdate != nil {
				cfg.OnCommandUpdate(u)
			}
			r.queue(&agentv1.SessionRequest{Body: &agentv1.SessionRequest_CommandUpdate{CommandUpdate: u}})
		},
		WaitSent:  r.waitSent,
		Upgrade:   upgradeNow(agent),
		Inventory: cfg.Inventory,
		OnInventory: func(rep *agentv1.InventoryReport) {
			r.health.note(rep)
			r.queue(&agentv1.SessionRequest{Body: &agentv1.SessionRequest_Inventory{Inventory: rep}})
			// A command changed the GPUs (gpu.reset) or read them again:
			// converge now, so a GPU whose MIG mode waited for the reset
			// is laid out without waiting for ReconvergeInterval.
			r.kickConverge()
		},
		LogFile: cfg.LogFile, Logs: cfg.LogSources, CommandKey: cfg.CommandKey, TrustDomain: trustDomain(id), DenyKinds: cfg.DenyKinds, RebootHook: cfg.RebootHook,
		Executors: cfg.CommandExecutors, Logger: log, Ramdisk: cfg.Ramdisk, ResultKey: cfg.ResultKey, Instances: rebooter,
	})
	if err != nil {
		return fmt.Errorf("session: %w", err)
	}
	defer cmds.Close()
	cmds.SetApplied(conv.ObservedGeneration())
	r.cmds = cmds

	var wg sync.WaitGroup
	if !cfg.NoRenew {
		wg.Go(func() { r.renewLoop(ctx) })
	}
	wg.Go(func() { r.convergeLoop(ctx) })
	wg.Go(func() { r.healthLoop(ctx) })
	if d, ok := cfg.Inventory.(converge.Diagnoser); ok {
		// The health section's background diagnostics, on unbooked GPUs;
		// each run is the section's status reason from the next converge.
		wg.Go(func() {
			conv.RunDiagnostics(ctx, d, func(run *converge.Diagnostics) {
				log.InfoContext(ctx, "background GPU diagnostics", "summary", run.Summary)
			})
		})
	}
	r.sessionLoop(ctx)
	wg.Wait()
	return nil
}

// runner is one Run: the current identity (swapped on renewal) and the loops.
type runner struct {
	cfg       Config
	gws       *gateways.List
	key       crypto.Signer
	journalID string
	log       *slog.Logger

	mu   sync.Mutex
	id   state.Identity
	cert *tls.Certificate
	pool *x509.CertPool
	gw   gateways.Target // the gateway the session dials

	conv *converge.Converger
	// desiredReady signals a new desired state in desired; resultReady a
	// new Observed in result (both buffered, one slot: coalescing).
	desiredReady, resultReady chan struct{}
	// reconverge asks the converge loop for a pass over the newest
	// desired state now (kickConverge).
	reconverge chan struct{}
	slotMu     sync.Mutex
	desired    *agentv1.DesiredState
	highestGen int64 // highest generation received this run
	result     *agentv1.Observed

	cmds *command.Executor
	// health is the GPU health last reported (see healthLoop).
	health reported
	// outbox holds command updates and inventory reports to send;
	// outReady signals it is not empty.
	outMu    sync.Mutex
	outbox   []*agentv1.SessionRequest
	outReady chan struct{}
	// queued and sent count messages queued and sent (or dropped);
	// sentCh is closed and replaced whenever sent moves.
	queued, sent uint64
	sentCh       chan struct{}
	// tunnelCount is the tunnels open (see tunnel.go).
	tunnelCount atomic.Int64
}

// sessionLoop runs sessions until ctx ends, backing off between them.
func (r *runner) sessionLoop(ctx context.Context) {
	reconnect(ctx, retry.Backoff{Min: r.cfg.MinBackoff, Max: r.cfg.MaxBackoff}, r.session, func(err error, d time.Duration) {
		switch code := RefusalCode(err); code {
		case RefusedTooOld, RefusedTooNew:
			r.log.ErrorContext(ctx, "the gateway refuses this bcd's version (gateway.agentVersions); reconnecting", "code", code, "version", r.cfg.AgentVersion, "err", err, "in", d)
		default:
			r.log.WarnContext(ctx, "session ended; reconnecting", "err", err, "code", code, "in", d)
		}
	})
}

// reconnect runs session until ctx ends, waiting b's next delay after each
// (or longer, when the gateway's refusal says so); a welcomed session starts
// the back-off over. ended hears each session's end and the wait before
// the next.
func reconnect(ctx context.Context, b retry.Backoff, session func(context.Context) (welcomed bool, err error), ended func(err error, in time.Duration)) {
	for {
		welcomed, err := session(ctx)
		if ctx.Err() != nil {
			return
		}
		if welcomed {
			b.Reset()
		}
		d := b.Next()
		if retry := retryDelay(err); retry > d {
			d = retry // a gateway admitting a reconnect storm says when
		}
		ended(err, d)
		if !retry.Sleep(ctx, d) {
			return
		}
	}
}

// session runs one session; welcomed reports whether the gateway accepted
// it.
func (r *runner) session(ctx context.Context) (welcomed bool, err error) {
	tg := r.gws.Next()
	r.mu.Lock()
	r.gw = tg
	r.mu.Unlock()
	conn, err := r.dial(tg)
	if err != nil {
		return false, err
	}
	defer func() { _ = conn.Close() }()
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := agentv1.NewNodeServiceClient(conn).Session(sctx)
	if err != nil {
		return false, fmt.Errorf("session: open: %w", err)
	}
	id, _, _ := r.current()
	if err := stream.Send(&agentv1.SessionRequest{Body: &agentv1.SessionRequest_Hello{Hello: &agentv1.Hello{
		NodeId:             id.NodeID,
		BootId:             r.cfg.BootID,
		JournalId:          r.journalID,
		AgentVersion:       r.cfg.AgentVersion,
		ObservedGeneration: r.conv.ObservedGeneration(),
	}}}); err != nil {
		return false, fmt.Errorf("session: hello: %w", err)
	}

	msgs := make(chan *agentv1.SessionResponse)
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

	timer := time.NewTimer(r.cfg.WelcomeTimeout)
	defer timer.Stop()
	var welcome *agentv1.Welcome
	select {
	case m := <-msgs:
		if welcome = m.GetWelcome(); welcome == nil {
			return false, fmt.Errorf("session: got %T before Welcome", m.GetBody())
		}
	case err := <-recvErr:
		return false, fmt.Errorf("session: waiting for Welcome: %w", err)
	case <-timer.C:
		return false, errors.New("session: no Welcome in time")
	case <-ctx.Done():
		return false, ctx.Err()
	}
	interval := time.Duration(welcome.GetHeartbeatIntervalMs()) * time.Millisecond
	if interval <= 0 {
		interval = r.cfg.DefaultHeartbeat
	}
	r.log.InfoContext(ctx, "session established", "gateway", welcome.GetGatewayId(), "epoch", welcome.GetSessionEpoch(), "heartbeat", interval)
	if r.cfg.OnSession != nil {
		r.cfg.OnSession(true)
		defer r.cfg.OnSession(false)
	}

	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	var seq uint64
	if err := r.flushOutbox(stream); err != nil { // left from the last session
		return true, fmt.Errorf("session: outbox: %w", err)
	}
	for {
		select {
		case <-ctx.Done():
			return true, ctx.Err()
		case err := <-recvErr:
			return true, fmt.Errorf("session: %w", err)
		case <-ticker.C:
			seq++
			if err := stream.Send(&agentv1.SessionRequest{Body: &agentv1.SessionRequest_Heartbeat{Heartbeat: &agentv1.Heartbeat{Sequence: seq}}}); err != nil {
				return true, fmt.Errorf("session: heartbeat: %w", err)
			}
		case <-r.outReady:
			if err := r.flushOutbox(stream); err != nil {
				return true, fmt.Errorf("session: outbox: %w", err)
			}
		case <-r.resultReady:
			o := r.takeResult()
			if o == nil {
				continue
			}
			if err := stream.Send(&agentv1.SessionRequest{Body: &agentv1.SessionRequest_Observed{Observed: o}}); err != nil {
				r.putBackResult(o) // the next session reports it
				return true, fmt.Errorf("session: observed: %w", err)
			}
			if r.cfg.OnReport != nil {
				r.cfg.OnReport()
			}
			if r.cfg.OnObserved != nil {
				r.cfg.OnObserved(o.GetObservedGeneration())
			}
		case m := <-msgs:
			switch b := m.GetBody().(type) {
			case *agentv1.SessionResponse_DesiredState:
				r.offerDesired(ctx, b.DesiredState)
			case *agentv1.SessionResponse_Command:
				r.cmds.Handle(b.Command)
			case *agentv1.SessionResponse_Cancel:
				r.cmds.Cancel(b.Cancel)
			case *agentv1.SessionResponse_OpenTunnel:
				// On the session's own connection; it ends with the session.
				wg.Go(func() { r.openTunnel(sctx, conn, b.OpenTunnel) })
			case *agentv1.SessionResponse_InventoryRequest:
				rep, err := r.cfg.Inventory.Report(sctx, b.InventoryRequest.GetSections())
				if err != nil {
					// Say nothing rather than a partial report; the
					// control plane asks again on the next session.
					r.log.ErrorContext(ctx, "inventory", "err", err)
					continue
				}
				r.health.note(rep)
				if err := stream.Send(&agentv1.SessionRequest{Body: &agentv1.SessionRequest_Inventory{Inventory: rep}}); err != nil {
					return true, fmt.Errorf("session: inventory: %w", err)
				}
				if r.cfg.OnReport != nil {
					r.cfg.OnReport()
				}
			default:
				r.log.WarnContext(ctx, "ignoring unexpected session message", "type", fmt.Sprintf("%T", b))
			}
		}
	}
}

// maxRetryDelay caps the retry delay a gateway may ask for.
const maxRetryDelay = 5 * time.Minute

// retryDelay is the delay a gateway's refusal asks for (a RetryInfo
// detail, as a gateway admitting a reconnect storm sends with
// RESOURCE_EXHAUSTED), at most maxRetryDelay; 0 when it asks none.
// The gateway's refusals of a bcd outside its version-skew window.
const (
	RefusedTooOld = "AGENT_TOO_OLD"
	RefusedTooNew = "AGENT_TOO_NEW"
)

// RefusalCode is the stable code of a gateway's refusal (the reason of its
// ErrorInfo detail, such as AGENT_TOO_OLD), or "" when it carries none.
func RefusalCode(err error) string {
	st, ok := status.FromError(err)
	if !ok || err == nil {
		return ""
	}
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok {
			return ei.GetReason()
		}
	}
	return ""
}

func retryDelay(err error) time.Duration {
	st, ok := status.FromError(err)
	if !ok || err == nil {
		return 0
	}
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok && ri.GetRetryDelay().IsValid() {
			return min(ri.GetRetryDelay().AsDuration(), maxRetryDelay)
		}
	}
	return 0
}

// gpuUUIDs reads the GPU UUIDs from the inventory, for the devices section.
func gpuUUIDs(inv Inventory) func(ctx context.Context) ([]string, error) {
	return func(ctx context.Context) ([]string, error) {
		rep, err := inv.Report(ctx, []string{inventory.SectionGPUs})
		if err != nil {
			return nil, err
		}
		uuids := make([]string, 0, len(rep.GetGpus()))
		for _, g := range rep.GetGpus() {
			uuids = append(uuids, g.GetUuid())
		}
		return uuids, nil
	}
}

// GPUAddresses returns the PCI address of each of inv's GPUs by UUID, for
// vps.Config.GPUs: the devices an instance's GPUs are passed through by.
func GPUAddresses(inv Inventory) func(ctx context.Context) (map[string]string, error) {
	return func(ctx context.Context) (map[string]string, error) {
		rep, err := inv.Report(ctx, []string{inventory.SectionGPUs})
		if err != nil {
			return nil, err
		}
		out := make(map[string]string, len(rep.GetGpus()))
		for _, g := range rep.GetGpus() {
			out[g.GetUuid()] = g.GetPciBusId()
		}
		return out, nil
	}
}

// upgradeNow is agent.upgrade's stage for the executor (command.Config.
// Upgrade): nil without a release installer. It clears the UpgradeFailed
// latch first when asked (nodes.clearUpgrade); no manifest, or one of the
// running version, has nothing to hand over.
func upgradeNow(agent converge.Agent) func(context.Context, *agentv1.AgentUpgrade) (func(), error) {
	if agent.Installer == nil {
		return nil
	}
	return func(ctx context.Context, p *agentv1.AgentUpgrade) (func(), error) {
		if p.GetClearUpgradeFailed() {
			if _, err := agent.Installer.Clear(); err != nil {
				return nil, err
			}
		}
		if len(p.GetReleaseManifest()) == 0 {
			if !p.GetClearUpgradeFailed() {
				return nil, errors.New("no release manifest")
			}
			return nil, nil
		}
		m, err := agentrelease.Parse(p.GetReleaseManifest())
		if err != nil {
			return nil, err
		}
		if m.Version == agent.Version {
			return nil, nil
		}
		st, err := agent.Installer.Stage(ctx, m)
		if err != nil {
			return nil, err
		}
		if agent.Handover == nil {
			return nil, nil
		}
		return func() { agent.Handover(st) }, nil
	}
}
