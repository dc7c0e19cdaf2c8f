package gateway

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"google.golang.org/protobuf/types/known/timestamppb"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/sites"
	"github.com/bettercompute/bettercompute/pkg/sitetasks"
	"github.com/bettercompute/bettercompute/pkg/wake"
)

// Site tasks (pkg/sitetasks) go to the session of the agent holding the
// site's boot lease, and only to it: a claim is made under the lease epoch
// and the session's seal key the session last heard, and
// sitetasks.Claim checks both (sites.CheckFence) in its transaction. The
// gateway claims and sends on a poke (bc.sitetasks.<site>,
// [Gateway.DispatchSite]), when a session gains the lease, and every
// liveness interval on each held session (the resync: no bus needed); the
// resync also expires the site's tasks past their deadline. A TaskResult is
// stored under the claim it answers (sitetasks.Complete or Fail: the same
// agent, epoch, session and attempt, while the lease is held), so an old
// holder's late result is refused. A task claimed but not sent, or sent to
// a session that ended, is claimed again by the next holder's session.

// maxTaskError bounds a TaskResult's error.
const maxTaskError = sitetasks.MaxError

// expireBatch bounds the tasks one resync expires.
const expireBatch = 1000

// DispatchSite sends site's due tasks to the lease holder's session if this
// gateway holds it: the handler of the poke bc.sitetasks.<site>. Without
// such a session here it does nothing.
func (g *Gateway) DispatchSite(ctx context.Context, siteID string) error {
	var errs []error
	for _, s := range g.siteSessionsOf(siteID) {
		if _, held := s.holder(); held {
			errs = append(errs, g.dispatchSite(ctx, s))
		}
	}
	return errors.Join(errs...)
}

// ResyncSiteTasks expires the tasks past their deadline of every site whose
// lease holder's session this gateway holds and sends them their due
// tasks: delivery without the bus. Each held session runs it for itself
// every liveness interval; tests call it by hand.
func (g *Gateway) ResyncSiteTasks(ctx context.Context) error {
	g.sites.mu.Lock()
	held := make([]*siteSession, 0, len(g.sites.m))
	for _, s := range g.sites.m {
		held = append(held, s)
	}
	g.sites.mu.Unlock()
	var errs []error
	for _, s := range held {
		errs = append(errs, g.resyncSiteSession(ctx, s))
	}
	return errors.Join(errs...)
}

// ListenSiteTasks subscribes the gateway, on nc, to the site task wakes
// (wake.SubscribeSiteTasks) of the sites whose agents' sessions it holds,
// for as long as it holds one: a wake reaches only those gateways. Without
// it, the liveness tick's resync dispatches.
func (g *Gateway) ListenSiteTasks(nc *nats.Conn) {
	g.siteWakes.mu.Lock()
	defer g.siteWakes.mu.Unlock()
	g.siteWakes.nc = nc
	for site, w := range g.siteWakes.m {
		if w.sub == nil {
			w.sub = g.subscribeSite(site)
		}
	}
}

// siteWakes are the gateway's subscriptions to site task wakes, one per
// site with a session held, counted by session.
type siteWakes struct {
	mu sync.Mutex
	nc *nats.Conn
	m  map[string]*siteWake
}

type siteWake struct {
	sessions int
	sub      *nats.Subscription // nil until the gateway listens
}

// holdSite notes a session of site opened; the first subscribes.
func (g *Gateway) holdSite(siteID string) {
	g.siteWakes.mu.Lock()
	defer g.siteWakes.mu.Unlock()
	w := g.siteWakes.m[siteID]
	if w == nil {
		w = &siteWake{}
		g.siteWakes.m[siteID] = w
	}
	w.sessions++
	if w.sub == nil && g.siteWakes.nc != nil {
		w.sub = g.subscribeSite(siteID)
	}
}

// releaseSite notes a session of site closed; the last unsubscribes.
func (g *Gateway) releaseSite(siteID string) {
	g.siteWakes.mu.Lock()
	defer g.siteWakes.mu.Unlock()
	w := g.siteWakes.m[siteID]
	if w == nil {
		return
	}
	if w.sessions--; w.sessions > 0 {
		return
	}
	if w.sub != nil {
		_ = w.sub.Unsubscribe()
	}
	delete(g.siteWakes.m, siteID)
}

func (g *Gateway) subscribeSite(siteID string) *nats.Subscription {
	sub, err := wake.SubscribeSiteTasks(g.siteWakes.nc, siteID, func() {
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), max(g.cfg.LivenessInterval, 10*time.Second))
			defer cancel()
			if err := g.DispatchSite(ctx, siteID); err != nil {
				g.log.Warn("dispatch site tasks", "site", siteID, "err", err)
			}
		}()
	})
	if err != nil {
		g.log.Warn("no site task wakes; dispatch relies on the database resync", "site", siteID, "err", err)
	}
	return sub
}

func (g *Gateway) siteSessionsOf(siteID string) []*siteSession {
	g.sites.mu.Lock()
	defer g.sites.mu.Unlock()
	var out []*siteSession
	for _, s := range g.sites.m {
		if s.siteID == siteID {
			out = append(out, s)
		}
	}
	return out
}

// resyncSiteSession expires the site's overdue tasks and dispatches, if s
// holds the lease.
func (g *Gateway) resyncSiteSession(ctx context.Context, s *siteSession) error {
	if _, held := s.holder(); !held {
		return nil
	}
	err := reconcile.InTx(ctx, g.cfg.DB, g.cfg.Waker, func(tx pgx.Tx, q *reconcile.Queue) error {
		_, err := sitetasks.Expire(ctx, tx, q, s.siteID, expireBatch)
		return err
	})
	if err != nil {
		return err
	}
	return g.dispatchSite(ctx, s)
}

// dispatchSite claims the site's due tasks for s and sends them. A claim
// refused because s no longer holds the lease at its epoch sends nothing
// and is no error: the session's next LeaseState says so.
func (g *Gateway) dispatchSite(ctx context.Context, s *siteSession) error {
	h, held := s.holder()
	if !held {
		return nil
	}
	var claimed []sitetasks.Task
	err := reconcile.InTx(ctx, g.cfg.DB, g.cfg.Waker, func(tx pgx.Tx, q *reconcile.Queue) error {
		var err error
		claimed, err = sitetasks.Claim(ctx, tx, q, h)
		return err
	})
	if errors.Is(err, sites.ErrFenced) {
		return nil
	}
	if err != nil {
		return err
	}
	for _, t := range claimed {
		w, err := wireTask(t)
		if err != nil {
			// Stored by Enqueue, so it does not happen; the task expires.
			g.log.ErrorContext(ctx, "site task cannot be sent", "task", t.ID, "err", err)
			continue
		}
		if err := s.send(&agentv1.SiteAgentServiceSessionResponse{Body: &agentv1.SiteAgentServiceSessionResponse_Task{Task: w}}); err != nil {
			// In flight on a session that is going: the next session's
			// claim sends it again.
			return fmt.Errorf("send site task %s: %w", t.ID, err)
		}
		g.log.InfoContext(ctx, "site task sent", "site", t.SiteID, "agent", h.AgentID, "task", t.ID, "kind", t.Kind,
			"machine", t.MachineID, "attempt", t.Attempts, "epoch", h.Epoch)
	}
	return nil
}

// applyTaskResult stores a TaskResult under s's claim.
func (g *Gateway) applyTaskResult(ctx context.Context, s *siteSession, r *agentv1.TaskResult) error {
	h, _ := s.holder()
	if len(r.GetId()) > sitetasks.MaxIDLen {
		return fmt.Errorf("task result: id longer than %d bytes", sitetasks.MaxIDLen)
	}
	o := sitetasks.Outcome{ID: r.GetId(), Attempt: int(r.GetAttempt()), Error: r.GetError()}
	if len(o.Error) > maxTaskError {
		o.Error = o.Error[:maxTaskError]
	}
	ok := r.GetOk()
	if ok {
		res, err := resultOf(r)
		if err != nil {
			ok, o.Error = false, "the site agent's result: "+err.Error()
		}
		o.Result = res
	}
	// The BMC's certificate, success or not: the metal workflow pins it,
	// or fails the machine when it changed.
	if c := r.GetBmcCertificateSha256(); sitetasks.ValidSHA256(c) {
		if o.Result == nil {
			o.Result = &sitetasks.Result{}
		}
		o.Result.BMCCertificateSHA256 = c
	}
	var t sitetasks.Task
	err := reconcile.InTx(ctx, g.cfg.DB, g.cfg.Waker, func(tx pgx.Tx, q *reconcile.Queue) error {
		var err error
		if ok {
			t, err = sitetasks.Complete(ctx, tx, q, h, o)
		} else {
			t, err = sitetasks.Fail(ctx, tx, q, h, o)
		}
		return err
	})
	if fault.CodeOf(err) == fault.Conflict {
		g.log.InfoContext(ctx, "site task result refused", "site", s.siteID, "agent", s.agentID, "task", o.ID,
			"attempt", o.Attempt, "epoch", h.Epoch, "why", err)
		return nil
	}
	if err != nil {
		return err
	}
	g.log.InfoContext(ctx, "site task finished", "site", s.siteID, "agent", s.agentID, "task", t.ID, "kind", t.Kind,
		"machine", t.MachineID, "state", string(t.State), "attempt", t.Attempts)
	return nil
}

// wireTask is t as the site agent receives it: the sealed secret goes in
// the body's sealed field.
func wireTask(t sitetasks.Task) (*agentv1.SiteTask, error) {
	w := &agentv1.SiteTask{Id: t.ID, Kind: t.Kind, MachineId: t.MachineID, LeaseEpoch: t.LeaseEpoch,
		Attempt: int32(t.Attempts), NotAfter: timestamppb.New(t.NotAfter)}
	p := t.Payload
	bmc := func() *agentv1.Bmc {
		if p.BMC == nil {
			return nil
		}
		return &agentv1.Bmc{Address: p.BMC.Address, SealedCredentials: t.Sealed, CaPem: p.BMC.CAPEM, Insecure: p.BMC.Insecure,
			CertificateSha256: p.BMC.CertificateSHA256, TrustOnFirstUse: p.BMC.TrustOnFirstUse}
	}
	image := func(i *sitetasks.Image) *agentv1.BootImage {
		if i == nil {
			return nil
		}
		return &agentv1.BootImage{Url: i.URL, Sha256: i.SHA256}
	}
	switch t.Kind {
	case sitetasks.KindBMCInspect:
		w.Body = &agentv1.SiteTask_BmcInspect{BmcInspect: &agentv1.BmcInspect{Bmc: bmc()}}
	case sitetasks.KindBMCPower:
		w.Body = &agentv1.SiteTask_BmcPower{BmcPower: &agentv1.BmcPower{Bmc: bmc(), Action: p.PowerAction}}
	case sitetasks.KindBMCBoot:
		w.Body = &agentv1.SiteTask_BmcBoot{BmcBoot: &agentv1.BmcBoot{Bmc: bmc(), Target: p.BootTarget}}
	case sitetasks.KindPXEArm:
		w.Body = &agentv1.SiteTask_PxeArm{PxeArm: &agentv1.PxeArm{Macs: p.MACs, Decision: p.Decision, Kernel: image(p.Kernel),
			Initrd: image(p.Initrd), Args: p.Args, SealedBootToken: t.Sealed}}
	case sitetasks.KindPXEDisarm:
		w.Body = &agentv1.SiteTask_PxeDisarm{PxeDisarm: &agentv1.PxeDisarm{Macs: p.MACs}}
	default:
		return nil, fmt.Errorf("unknown kind %q", t.Kind)
	}
	return w, nil
}

// Bounds on a result's lists and strings.
const (
	maxResultItems  = 1024
	maxResultString = 256
)

// resultOf translates a successful TaskResult's result.
func resultOf(r *agentv1.TaskResult) (*sitetasks.Result, error) {
	switch b := r.GetResult().(type) {
	case nil:
		return nil, nil
	case *agentv1.TaskResult_Power:
		if len(b.Power.GetState()) > maxResultString {
			return nil, errors.New("power state too long")
		}
		return &sitetasks.Result{PowerState: b.Power.GetState()}, nil
	case *agentv1.TaskResult_Inventory:
		in := b.Inventory
		if len(in.GetNics()) > maxResultItems || len(in.GetDisks()) > maxResultItems {
			return nil, fmt.Errorf("inventory: at most %d NICs and %d disks", maxResultItems, maxResultItems)
		}
		for _, s := range []string{in.GetManufacturer(), in.GetModel(), in.GetSerialNumber(), in.GetUuid(), in.GetPowerState(), in.GetCpuModel()} {
			if len(s) > maxResultString {
				return nil, fmt.Errorf("inventory: strings are at most %d bytes", maxResultString)
			}
		}
		inv := &sitetasks.Inventory{Manufacturer: in.GetManufacturer(), Model: in.GetModel(), SerialNumber: in.GetSerialNumber(),
			UUID: in.GetUuid(), PowerState: in.GetPowerState(), CPUCount: int(in.GetCpuCount()), CPUModel: in.GetCpuModel(),
			CPUCores: int(in.GetCpuCores()), MemoryMiB: in.GetMemoryMib(), NICs: []sitetasks.NIC{}, Disks: []sitetasks.Disk{}}
		for _, n := range in.GetNics() {
			if len(n.GetId()) > maxResultString || len(n.GetMac()) > maxResultString {
				return nil, fmt.Errorf("inventory: NIC strings are at most %d bytes", maxResultString)
			}
			inv.NICs = append(inv.NICs, sitetasks.NIC{ID: n.GetId(), MAC: n.GetMac(), SpeedMbps: int(n.GetSpeedMbps())})
		}
		for _, d := range in.GetDisks() {
			if len(d.GetId()) > maxResultString || len(d.GetModel()) > maxResultString || len(d.GetSerialNumber()) > maxResultString ||
				len(d.GetMediaType()) > maxResultString {
				return nil, fmt.Errorf("inventory: disk strings are at most %d bytes", maxResultString)
			}
			inv.Disks = append(inv.Disks, sitetasks.Disk{ID: d.GetId(), Model: d.GetModel(), SerialNumber: d.GetSerialNumber(),
				CapacityBytes: d.GetCapacityBytes(), MediaType: d.GetMediaType()})
		}
		return &sitetasks.Result{Inventory: inv}, nil
	}
	return nil, errors.New("unknown result")
}
