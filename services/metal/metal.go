// Package metal is the metal role's reconciler: the level-triggered
// bare-metal workflow (DESIGN §13) that takes a machine (pkg/machines) from
// enrolled to ready, and from ready to a deployed node.
//
// Each run locks one machine, looks at its state and at what its current
// attempt of that step did — site tasks (pkg/sitetasks) for the BMC and the
// site's boot server, node commands (pkg/commands) for the ramdisk, the
// node's session — and acts once: queue the next task or command, move to
// the next state, start a new attempt, or fail. Nothing is remembered
// between runs but the machine's row: the attempt's start is its deadline
// minus the step's timeout, and the attempt's tasks are those created since
// (the attempt and its first tasks are written in one transaction, at one
// database now()); its commands carry an idempotency key naming the step's
// start and the attempt.
//
// Every task finishing, expiring or needing a reseal, and every owned
// command finishing, enqueues the machine's key ("metal", sitetasks
// ReconcileKind); a periodic key ("resync") enqueues every machine still
// in the flow, so the flow completes with the bus down.
//
// The steps, each with a deadline (metal.stepTimeouts) and at most
// metal.maxAttempts attempts (a timeout or a failed task or command is a
// failed attempt; past the last, the machine is failed with the step and
// the reason):
//
//   - enrolled → inspecting at once.
//   - inspecting: bmc.inspect (the BMC's credentials opened from
//     pkg/secrets and sealed to the boot lease holder's key; with no
//     holder the attempt waits, its deadline running) → inventory and MACs
//     stored → booting-ramdisk.
//   - booting-ramdisk (and deploying's first half): a one-time ramdisk join
//     token naming the machine's node (1 h), sealed to the site's key in
//     pxe.arm (decision ramdisk), then bmc.boot pxe, then bmc.power cycle
//     (on when off), each after the previous succeeded; done when the node
//     is commissioning with a session opened since the attempt started.
//     Then by purpose: commission → diagnosing, release → wiping, rescue →
//     rescue.
//   - diagnosing: diag.nvml, its node signature verified → wiping.
//   - wiping: disk.wipe (metal.wipeMethod) of every disk the latest
//     verified diag.nvml reported (one is run first when there is none),
//     signature verified, every disk wiped and verified → pxe.disarm and
//     bmc.power off → ready.
//   - deploying: the ramdisk as above, then image.deploy (signed) with the
//     image and cloud-init user data holding a single-use node join token
//     naming the machine's node (24 h) → rebooting.
//   - rebooting: pxe.arm decision local, bmc.boot disk, bmc.power cycle;
//     done when the node is adopting or adopted with a session opened since
//     the attempt started → joined.
//
// A result whose node signature does not verify (commands.
// VerifyNodeSignature) never advances the machine: the attempt fails,
// saying why. Every transition writes machine.state_changed, and a failure
// machine.failed.
package metal

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/credseal"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/jointoken"
	"github.com/bettercompute/bettercompute/pkg/machines"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/secrets"
	"github.com/bettercompute/bettercompute/pkg/sitetasks"
)

// Kind is the reconciler's kind in the work queue, keyed by machine id.
const Kind = sitetasks.ReconcileKind

// ResyncKey is the periodic key whose run enqueues every machine in the
// flow.
const ResyncKey = "resync"

// Token lifetimes.
const (
	// RamdiskTokenTTL is the ramdisk's boot token's.
	RamdiskTokenTTL = time.Hour
	// NodeTokenTTL is the installed system's join token's.
	NodeTokenTTL = 24 * time.Hour
)

// Sim ramdisk defaults: content-addressed names of files the simulated
// site never fetches (the simulated machine boots in process).
const (
	DefaultKernelURL = "http://images.invalid/bcd-ramdisk/vmlinuz"
	DefaultInitrdURL = "http://images.invalid/bcd-ramdisk/initrd.img"
	// The SHA-256 of the empty string.
	DefaultImageSHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
)

// Config configures the reconciler.
type Config struct {
	// Metal is the metal.* configuration (defaults filled).
	Metal config.Metal
	// Keyring opens BMC credentials (secrets.keyFile); nil fails the
	// inspect step with a clear reason.
	Keyring *secrets.Keyring
	// Kinds is the signing command registry (destructive kinds signed).
	Kinds *commands.Registry
	// Commands pokes the gateways of nodes after commit; Sites those of
	// sites. Both optional (the gateways resync).
	Commands *commands.Poker
	Sites    *sitetasks.Poker
	// TrustDomain verifies node signatures.
	TrustDomain string
	// Logger; nil discards.
	Logger *slog.Logger
	// TamperResult, a test hook, may change a finished command's result as
	// read before it is verified (a gateway faking a wipe).
	TamperResult func(c *commands.Command)
}

// Reconciler returns the metal reconciler, on the metal role's membership.
func Reconciler(cfg Config) (reconcile.Reconciler, error) {
	if cfg.Kinds == nil {
		return reconcile.Reconciler{}, errors.New("metal: a command registry is required")
	}
	if cfg.Metal.MaxAttempts <= 0 {
		cfg.Metal.MaxAttempts = 3
	}
	if cfg.Metal.WipeMethod == "" {
		cfg.Metal.WipeMethod = "zero"
	}
	every := cfg.Metal.Resync.Std()
	if every <= 0 {
		every = 5 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	w := &workflow{cfg: cfg}
	return reconcile.Reconciler{Name: Kind, ShardBy: reconcile.ShardByNode, Role: string(config.RoleMetal), Run: w.run,
		Periodic: []reconcile.Periodic{{Key: ResyncKey, Every: every}}}, nil
}

type workflow struct{ cfg Config }

// inFlow are the states with work to do.
var inFlow = machines.Steps()

func (w *workflow) run(ctx context.Context, rc *reconcile.RunContext, key string) (reconcile.Result, error) {
	if key == ResyncKey {
		return reconcile.Done, w.resync(ctx, rc)
	}
	var again bool
	err := rc.InTx(ctx, func(tx pgx.Tx, q *reconcile.Queue) error {
		p := &pass{w: w, tx: tx, q: q}
		var err error
		again, err = p.step(ctx, key)
		return err
	})
	if err != nil {
		return reconcile.Done, err
	}
	if again {
		return reconcile.SyncAgain, nil
	}
	return reconcile.Done, nil
}

// resync enqueues every machine still in the flow.
func (w *workflow) resync(ctx context.Context, rc *reconcile.RunContext) error {
	return rc.InTx(ctx, func(tx pgx.Tx, q *reconcile.Queue) error {
		after := ""
		for {
			ms, err := machines.List(ctx, tx, machines.Filter{States: inFlow, After: after, Limit: 500})
			if err != nil {
				return err
			}
			for _, m := range ms {
				if err := q.Enqueue(ctx, Kind, m.ID); err != nil {
					return err
				}
			}
			if len(ms) < 500 {
				return nil
			}
			after = ms[len(ms)-1].ID
		}
	})
}

// pass is one run's transaction.
type pass struct {
	w   *workflow
	tx  pgx.Tx
	q   *reconcile.Queue
	m   machines.Machine
	now time.Time // the transaction's now()
}

// step reconciles machine id once; true asks to run again soon.
func (p *pass) step(ctx context.Context, id string) (bool, error) {
	m, err := machines.Lock(ctx, p.tx, "", id)
	if fault.CodeOf(err) == fault.NotFound {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	p.m = m
	if err := p.tx.QueryRow(ctx, `SELECT now()`).Scan(&p.now); err != nil {
		return false, err
	}
	if !slices.Contains(inFlow, m.State) {
		return false, nil
	}
	if err := p.reseal(ctx); err != nil {
		return false, err
	}
	if m.State == machines.StateEnrolled {
		return true, p.move(ctx, machines.StateInspecting, machines.Change{}, "enrolled: inspect the BMC")
	}
	timeout := p.w.cfg.Metal.StepTimeout(string(m.State))
	if m.StepAttempts == 0 || m.StepDeadline == nil {
		return true, p.attempt(ctx, timeout, "")
	}
	start := m.StepDeadline.Add(-timeout)
	if !p.now.Before(*m.StepDeadline) {
		return true, p.attempt(ctx, timeout, fmt.Sprintf("%s: attempt %d timed out after %s", m.State, m.StepAttempts, timeout))
	}
	failure, err := p.act(ctx, start)
	if err != nil {
		return false, err
	}
	if failure != "" {
		return true, p.attempt(ctx, timeout, fmt.Sprintf("%s: attempt %d: %s", m.State, m.StepAttempts, failure))
	}
	return false, nil
}

// attempt starts a new attempt of the current step, or fails the machine
// with failure when it had its last.
func (p *pass) attempt(ctx context.Context, timeout time.Duration, failure string) error {
	m := p.m
	if failure != "" {
		p.w.cfg.Logger.Info("metal: attempt failed", "machine", m.ID, "state", m.State, "reason", failure)
	}
	if failure != "" && m.StepAttempts >= p.w.cfg.Metal.MaxAttempts {
		return p.fail(ctx, failure)
	}
	nm, err := machines.Attempt(ctx, p.tx, m.ID, m.State, p.now.Add(timeout))
	if err != nil {
		return err
	}
	p.m = nm
	if _, err := p.act(ctx, p.now); err != nil {
		return err
	}
	return nil
}

func (p *pass) fail(ctx context.Context, reason string) error {
	m := p.m
	nm, err := machines.Fail(ctx, p.tx, m.ID, m.State, reason)
	if err != nil {
		return err
	}
	p.m = nm
	if err := p.event(ctx, "machine.failed", map[string]any{"machineId": m.ID, "failedStep": string(m.State),
		"purpose": string(m.Purpose), "attempts": m.StepAttempts, "reason": nm.FailedReason}); err != nil {
		return err
	}
	return p.changed(ctx, m.State, nm, nm.FailedReason)
}

// move sets the next state and writes its event.
func (p *pass) move(ctx context.Context, to machines.State, c machines.Change, reason string) error {
	from := p.m.State
	nm, err := machines.SetState(ctx, p.tx, p.m.ID, []machines.State{from}, to, c)
	if err != nil {
		return err
	}
	p.m = nm
	p.w.cfg.Logger.Info("metal: machine moved", "machine", nm.ID, "from", from, "to", to, "reason", reason)
	if err := p.changed(ctx, from, nm, reason); err != nil {
		return err
	}
	return p.q.Enqueue(ctx, Kind, nm.ID)
}

func (p *pass) changed(ctx context.Context, from machines.State, m machines.Machine, reason string) error {
	return p.event(ctx, "machine.state_changed", map[string]any{"machineId": m.ID, "from": string(from), "to": string(m.State),
		"purpose": string(m.Purpose), "reason": reason})
}

func (p *pass) event(ctx context.Context, typ string, payload map[string]any) error {
	_, err := outbox.Write(ctx, p.tx, outbox.Event{TenantID: p.m.TenantID, Type: typ, Resource: p.m.ID, Payload: payload})
	return err
}

// act does the current step's next thing for the attempt started at
// start; it returns why the attempt failed, "" while it goes on (or moved
// the machine).
func (p *pass) act(ctx context.Context, start time.Time) (string, error) {
	tasks, err := p.tasksSince(ctx, start)
	if err != nil {
		return "", err
	}
	switch p.m.State {
	case machines.StateInspecting:
		return p.inspect(ctx, tasks)
	case machines.StateBootingRamdisk:
		done, failure, err := p.bootRamdisk(ctx, tasks, start)
		if err != nil || failure != "" || !done {
			return failure, err
		}
		switch p.m.Purpose {
		case machines.PurposeRelease:
			return "", p.move(ctx, machines.StateWiping, machines.Change{}, "the ramdisk joined: wipe")
		case machines.PurposeRescue:
			return "", p.move(ctx, machines.StateRescue, machines.Change{}, "the ramdisk joined: rescue")
		default:
			return "", p.move(ctx, machines.StateDiagnosing, machines.Change{}, "the ramdisk joined: diagnose")
		}
	case machines.StateDiagnosing:
		return p.diagnose(ctx, start)
	case machines.StateWiping:
		return p.wipe(ctx, tasks, start)
	case machines.StateDeploying:
		done, failure, err := p.bootRamdisk(ctx, tasks, start)
		if err != nil || failure != "" || !done {
			return failure, err
		}
		return p.deploy(ctx, start)
	case machines.StateRebooting:
		return p.reboot(ctx, tasks, start)
	}
	return "", nil
}

// tasksSince returns the machine's tasks created at or after start, newest
// first.
func (p *pass) tasksSince(ctx context.Context, start time.Time) ([]sitetasks.Task, error) {
	all, err := sitetasks.ListByMachine(ctx, p.tx, p.m.ID)
	if err != nil {
		return nil, err
	}
	var out []sitetasks.Task
	for _, t := range all {
		if !t.CreatedAt.Before(start) {
			out = append(out, t)
		}
	}
	return out, nil
}

func latest(ts []sitetasks.Task, kind string) *sitetasks.Task {
	for i := range ts {
		if ts[i].Kind == kind {
			return &ts[i]
		}
	}
	return nil
}

// taskVerdict: done, failure ("" unless it failed).
func taskVerdict(t *sitetasks.Task) (bool, string) {
	switch t.State {
	case sitetasks.Succeeded:
		return true, ""
	case sitetasks.Failed, sitetasks.Expired:
		return false, fmt.Sprintf("%s (%s) %s: %s", t.Kind, t.ID, t.State, t.Error)
	}
	return false, ""
}

// notAfter is a task's or command's deadline: the attempt's.
func (p *pass) notAfter() time.Time {
	if p.m.StepDeadline != nil && p.m.StepDeadline.After(p.now) {
		return *p.m.StepDeadline
	}
	return p.now.Add(time.Minute)
}

// waiting reports err as "wait" when no site agent holds the boot lease.
func waiting(err error) bool { return fault.CodeOf(err) == fault.Unavailable }

// enqueueTask seals plain (when set) to the site's key and queues task
// kind with payload; with no lease holder it does nothing (the attempt
// waits).
func (p *pass) enqueueTask(ctx context.Context, kind string, payload sitetasks.Payload, plain []byte, notAfter time.Time) error {
	id := sitetasks.NewID()
	var sealed string
	if plain != nil {
		k, err := sitetasks.SealKey(ctx, p.tx, p.m.SiteID)
		if waiting(err) {
			return nil
		}
		if err != nil {
			return err
		}
		if sealed, err = credseal.Seal(k.JWK, plain, credseal.TaskAAD(id, p.m.ID)...); err != nil {
			return fmt.Errorf("seal %s for %s: %w", kind, p.m.ID, err)
		}
	}
	if _, err := sitetasks.Enqueue(ctx, p.tx, sitetasks.Task{ID: id, TenantID: p.m.TenantID, SiteID: p.m.SiteID, MachineID: p.m.ID,
		Kind: kind, Payload: payload, Sealed: sealed, NotAfter: notAfter}); err != nil {
		return fmt.Errorf("queue %s for %s: %w", kind, p.m.ID, err)
	}
	p.w.cfg.Sites.AfterCommit(p.q, p.m.SiteID)
	return nil
}

// bmcTask queues a bmc.* task with the machine's credentials.
func (p *pass) bmcTask(ctx context.Context, kind string, payload sitetasks.Payload, notAfter time.Time) (string, error) {
	plain, err := secrets.Open(ctx, p.tx, p.w.cfg.Keyring, p.m.TenantID, p.m.BMCCredentialsRef)
	if err != nil {
		if fault.CodeOf(err) == fault.Unsupported || fault.CodeOf(err) == fault.NotFound || errors.Is(err, secrets.ErrTampered) ||
			errors.Is(err, secrets.ErrUnknownKey) {
			return "the BMC's credentials: " + err.Error(), nil
		}
		return "", err
	}
	defer clear(plain)
	if _, err := secrets.ParseBMC(plain); err != nil {
		return err.Error(), nil
	}
	payload.BMC = &sitetasks.BMC{Address: p.m.BMCAddress, Insecure: true}
	return "", p.enqueueTask(ctx, kind, payload, plain, notAfter)
}

// reseal seals again the machine's tasks that wait for the holder's new key.
func (p *pass) reseal(ctx context.Context) error {
	ts, err := sitetasks.NeedingReseal(ctx, p.tx, p.m.SiteID)
	if err != nil {
		return err
	}
	for _, t := range ts {
		if t.MachineID != p.m.ID {
			continue
		}
		k, err := sitetasks.SealKey(ctx, p.tx, p.m.SiteID)
		if waiting(err) {
			return nil
		}
		if err != nil {
			return err
		}
		var plain []byte
		switch t.Kind {
		case sitetasks.KindPXEArm:
			// A boot token cannot be read back: expire the task's token by
			// failing the attempt's wait (the step's deadline) — mint anew.
			tok, err := p.ramdiskToken(ctx)
			if err != nil {
				return err
			}
			plain = []byte(tok)
		default:
			if plain, err = secrets.Open(ctx, p.tx, p.w.cfg.Keyring, p.m.TenantID, p.m.BMCCredentialsRef); err != nil {
				return err
			}
		}
		sealed, err := credseal.Seal(k.JWK, plain, credseal.TaskAAD(t.ID, p.m.ID)...)
		clear(plain)
		if err != nil {
			return err
		}
		if _, err := sitetasks.Reseal(ctx, p.tx, t.ID, sealed); err != nil {
			return err
		}
		p.w.cfg.Sites.AfterCommit(p.q, p.m.SiteID)
	}
	return nil
}

func (p *pass) inspect(ctx context.Context, ts []sitetasks.Task) (string, error) {
	t := latest(ts, sitetasks.KindBMCInspect)
	if t == nil {
		return p.bmcTask(ctx, sitetasks.KindBMCInspect, sitetasks.Payload{}, p.notAfter())
	}
	done, failure := taskVerdict(t)
	if !done {
		return failure, nil
	}
	if t.Result == nil || t.Result.Inventory == nil {
		return "bmc.inspect returned no inventory", nil
	}
	inv := t.Result.Inventory
	var macs []string
	for _, n := range inv.NICs {
		if n.MAC != "" && len(macs) < machines.MaxMACs {
			macs = append(macs, n.MAC)
		}
	}
	if len(macs) == 0 {
		return "bmc.inspect found no NIC with a MAC address: the machine cannot PXE-boot", nil
	}
	b, err := jsonMarshal(inv)
	if err != nil {
		return "", err
	}
	if p.m, err = machines.SetInventory(ctx, p.tx, p.m.ID, p.m.State, b, macs); err != nil {
		return "", err
	}
	return "", p.move(ctx, machines.StateBootingRamdisk, machines.Change{},
		fmt.Sprintf("inspected: %s %s, %d NICs, %d disks", inv.Manufacturer, inv.Model, len(inv.NICs), len(inv.Disks)))
}

// ramdiskToken mints the machine's one-time ramdisk boot token and records
// it on the machine.
func (p *pass) ramdiskToken(ctx context.Context) (string, error) {
	return p.token(ctx, jointoken.RoleRamdisk, RamdiskTokenTTL, machines.BootRamdisk)
}

func (p *pass) token(ctx context.Context, role string, ttl time.Duration, boot machines.Boot) (string, error) {
	s := jointoken.Mint()
	exp := p.now.Add(ttl)
	if _, err := jointoken.Create(ctx, p.tx, jointoken.Token{ID: s.ID, TenantID: p.m.TenantID, PoolID: p.m.PoolID,
		Name: "metal " + p.m.Name, Uses: 1, NodeID: p.m.NodeID, Role: role, ExpiresAt: &exp, CreatedBy: "metal"}, s.Hash); err != nil {
		return "", fmt.Errorf("mint the %s token of %s: %w", role, p.m.ID, err)
	}
	m, err := machines.SetBoot(ctx, p.tx, p.m.ID, p.m.State, boot, s.ID)
	if err != nil {
		return "", err
	}
	p.m = m
	return s.Token, nil
}

func (p *pass) ramdiskImages() (*sitetasks.Image, *sitetasks.Image) {
	r := p.w.cfg.Metal.Ramdisk
	or := func(a, b string) string {
		if a != "" {
			return a
		}
		return b
	}
	return &sitetasks.Image{URL: or(r.KernelURL, DefaultKernelURL), SHA256: or(r.KernelSHA256, DefaultImageSHA256)},
		&sitetasks.Image{URL: or(r.InitrdURL, DefaultInitrdURL), SHA256: or(r.InitrdSHA256, DefaultImageSHA256)}
}

// powerAction is cycle for a machine that is on, on otherwise.
func (p *pass) powerAction(ts []sitetasks.Task) string {
	state := ""
	if t := latest(ts, sitetasks.KindBMCBoot); t != nil && t.Result != nil {
		state = t.Result.PowerState
	}
	if strings.EqualFold(state, "On") {
		return "cycle"
	}
	return "on"
}

// sequence runs the site tasks of a boot one after another: each is
// queued once the one before it succeeded. It returns true once all did.
func (p *pass) sequence(ctx context.Context, ts []sitetasks.Task, steps []seqStep) (bool, string, error) {
	for _, s := range steps {
		t := latest(ts, s.kind)
		if t == nil {
			failure, err := s.queue(ctx)
			return false, failure, err
		}
		done, failure := taskVerdict(t)
		if !done {
			return false, failure, nil
		}
	}
	return true, "", nil
}

type seqStep struct {
	kind  string
	queue func(ctx context.Context) (string, error)
}

// bootRamdisk boots the machine into bcd ramdisk; true once its ramdisk
// holds a session opened since start.
func (p *pass) bootRamdisk(ctx context.Context, ts []sitetasks.Task, start time.Time) (bool, string, error) {
	kernel, initrd := p.ramdiskImages()
	done, failure, err := p.sequence(ctx, ts, []seqStep{
		{sitetasks.KindPXEArm, func(ctx context.Context) (string, error) {
			if _, err := sitetasks.SealKey(ctx, p.tx, p.m.SiteID); waiting(err) {
				return "", nil
			}
			tok, err := p.ramdiskToken(ctx)
			if err != nil {
				return "", err
			}
			return "", p.enqueueTask(ctx, sitetasks.KindPXEArm, sitetasks.Payload{MACs: p.m.MACs, Decision: "ramdisk",
				Kernel: kernel, Initrd: initrd}, []byte(tok), p.notAfter())
		}},
		{sitetasks.KindBMCBoot, func(ctx context.Context) (string, error) {
			return p.bmcTask(ctx, sitetasks.KindBMCBoot, sitetasks.Payload{BootTarget: "pxe"}, p.notAfter())
		}},
		{sitetasks.KindBMCPower, func(ctx context.Context) (string, error) {
			return p.bmcTask(ctx, sitetasks.KindBMCPower, sitetasks.Payload{PowerAction: p.powerAction(ts)}, p.notAfter())
		}},
	})
	if err != nil || !done {
		return false, failure, err
	}
	return p.sessionSince(ctx, start, nodes.StateCommissioning)
}

// sessionSince reports whether the machine's node is in one of states with
// a session seen since start.
func (p *pass) sessionSince(ctx context.Context, start time.Time, states ...string) (bool, string, error) {
	n, err := nodes.Get(ctx, p.tx, p.m.TenantID, p.m.NodeID)
	if fault.CodeOf(err) == fault.NotFound {
		return false, "", nil
	}
	if err != nil {
		return false, "", err
	}
	ok := slices.Contains(states, n.State) && n.GatewayID != "" && n.LastSeenAt != nil && !n.LastSeenAt.Before(start)
	return ok, "", nil
}

// commandKey is the idempotency key of the attempt's command (what names
// one command of the attempt).
func (p *pass) commandKey(what string) string {
	return fmt.Sprintf("metal:%s:%s:%d:%d:%s", p.m.ID, p.m.State, p.m.StepStartedAt.UnixMicro(), p.m.StepAttempts, what)
}

// command returns the attempt's command named what, queueing it with
// payload when there is none yet (payload called then).
func (p *pass) command(ctx context.Context, kind, what string, payload func() (any, error)) (*commands.Command, error) {
	key := p.commandKey(what)
	c, err := commands.ByIdempotencyKey(ctx, p.tx, p.m.NodeID, key)
	if err == nil {
		if p.w.cfg.TamperResult != nil {
			p.w.cfg.TamperResult(&c)
		}
		return &c, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return nil, err
	}
	pl, err := payload()
	if err != nil {
		return nil, err
	}
	_, created, err := p.w.cfg.Kinds.Enqueue(ctx, p.tx, commands.Request{NodeID: p.m.NodeID, Kind: kind, Payload: pl,
		IdempotencyKey: key, NotAfter: p.notAfter(), OwnerKind: Kind, OwnerKey: p.m.ID, CreatedBy: "metal"})
	if err != nil {
		return nil, fmt.Errorf("queue %s for %s: %w", kind, p.m.ID, err)
	}
	if created {
		node := p.m.NodeID
		p.q.AfterCommit(func() { p.w.cfg.Commands.Poke(node) })
	}
	return nil, nil
}

// verdict checks a finished command: its outcome and its node signature.
func (p *pass) verdict(ctx context.Context, c *commands.Command) (*agentv1.CommandResult, string, error) {
	if c == nil || !c.State.Final() {
		return nil, "", nil
	}
	if c.State != commands.Succeeded {
		return nil, fmt.Sprintf("%s (%s) %s: %s", c.Kind, c.ID, c.State, c.Reason), nil
	}
	if err := commands.VerifyNodeSignature(ctx, p.tx, *c, p.w.cfg.TrustDomain); err != nil {
		if errors.Is(err, errBadSignature()) {
			return nil, fmt.Sprintf("%s (%s): result refused, its node signature does not verify: %v", c.Kind, c.ID, err), nil
		}
		return nil, "", err
	}
	res := &agentv1.CommandResult{}
	if len(c.Result) > 0 {
		if err := protoUnmarshal(c.Result, res); err != nil {
			return nil, fmt.Sprintf("%s (%s): result does not decode: %v", c.Kind, c.ID, err), nil
		}
	}
	return res, "", nil
}

func (p *pass) diagnose(ctx context.Context, _ time.Time) (string, error) {
	c, err := p.command(ctx, "diag.nvml", "diag", func() (any, error) { return &agentv1.DiagNvml{}, nil })
	if err != nil {
		return "", err
	}
	res, failure, err := p.verdict(ctx, c)
	if err != nil || failure != "" || res == nil {
		return failure, err
	}
	if bad := diagFailure(res.GetDiagNvml()); bad != "" {
		return bad, nil
	}
	return "", p.move(ctx, machines.StateWiping, machines.Change{},
		fmt.Sprintf("diagnosed (%s): %d GPUs and %d disks healthy", c.ID, len(res.GetDiagNvml().GetGpus()), len(res.GetDiagNvml().GetDisks())))
}

func diagFailure(d *agentv1.DiagNvmlResult) string {
	var bad []string
	for _, g := range d.GetGpus() {
		if !g.GetHealthy() {
			bad = append(bad, fmt.Sprintf("GPU %s: %s", g.GetUuid(), g.GetReason()))
		}
	}
	for _, k := range d.GetDisks() {
		if !k.GetHealthy() {
			bad = append(bad, fmt.Sprintf("disk %s: %s", k.GetPath(), k.GetReason()))
		}
	}
	if len(bad) > 0 {
		return "diag.nvml found faults: " + strings.Join(bad, "; ")
	}
	return ""
}

// disks returns the disks of the node's latest diag.nvml whose signature
// verifies, or nil.
func (p *pass) disks(ctx context.Context) ([]*agentv1.DiskCheck, error) {
	cs, err := commands.LatestSucceeded(ctx, p.tx, p.m.NodeID, "diag.nvml", 5)
	if err != nil {
		return nil, err
	}
	for i := range cs {
		res, failure, err := p.verdict(ctx, &cs[i])
		if err != nil {
			return nil, err
		}
		if failure == "" && res != nil && len(res.GetDiagNvml().GetDisks()) > 0 {
			return res.GetDiagNvml().GetDisks(), nil
		}
	}
	return nil, nil
}

func wipeMethod(s string) agentv1.WipeMethod {
	switch s {
	case "discard":
		return agentv1.WipeMethod_WIPE_METHOD_DISCARD
	case "secure-erase":
		return agentv1.WipeMethod_WIPE_METHOD_SECURE_ERASE
	}
	return agentv1.WipeMethod_WIPE_METHOD_ZERO
}

func (p *pass) wipe(ctx context.Context, ts []sitetasks.Task, start time.Time) (string, error) {
	disks, err := p.disks(ctx)
	if err != nil {
		return "", err
	}
	if len(disks) == 0 {
		c, err := p.command(ctx, "diag.nvml", "disks", func() (any, error) { return &agentv1.DiagNvml{}, nil })
		if err != nil {
			return "", err
		}
		_, failure, err := p.verdict(ctx, c)
		if failure == "" && err == nil && c != nil && c.State == commands.Succeeded {
			failure = "diag.nvml reported no disks to wipe"
		}
		return failure, err
	}
	paths := make([]string, len(disks))
	for i, d := range disks {
		paths[i] = d.GetPath()
	}
	method := wipeMethod(p.w.cfg.Metal.WipeMethod)
	c, err := p.command(ctx, "disk.wipe", "wipe", func() (any, error) {
		return &agentv1.DiskWipe{Disks: paths, Method: method, Reason: fmt.Sprintf("metal %s of %s", p.m.Purpose, p.m.ID)}, nil
	})
	if err != nil {
		return "", err
	}
	res, failure, err := p.verdict(ctx, c)
	if err != nil || failure != "" || res == nil {
		return failure, err
	}
	wiped := map[string]bool{}
	for _, d := range res.GetDiskWipe().GetDisks() {
		if d.GetVerified() {
			wiped[d.GetPath()] = true
		}
	}
	for _, path := range paths {
		if !wiped[path] {
			return fmt.Sprintf("disk.wipe (%s) did not report %s wiped and verified", c.ID, path), nil
		}
	}
	// Ready: the boot server forgets it and it powers off (fire and forget:
	// a lost pxe.disarm or power-off does not unmake the wipe).
	notAfter := p.now.Add(10 * time.Minute)
	if err := p.enqueueTask(ctx, sitetasks.KindPXEDisarm, sitetasks.Payload{MACs: p.m.MACs}, nil, notAfter); err != nil {
		return "", err
	}
	if failure, err := p.bmcTask(ctx, sitetasks.KindBMCPower, sitetasks.Payload{PowerAction: "off"}, notAfter); err != nil || failure != "" {
		p.w.cfg.Logger.Warn("metal: could not power off a ready machine", "machine", p.m.ID, "reason", failure, "error", err)
		if err != nil {
			return "", err
		}
	}
	_ = ts
	_ = start
	return "", p.move(ctx, machines.StateReady, machines.Change{Boot: machines.BootNone},
		fmt.Sprintf("wiped %d disks (%s, %s), verified", len(paths), p.w.cfg.Metal.WipeMethod, c.ID))
}

// UserData is the cloud-init user data written for the installed system:
// the deploy's own (when set) followed by the join token, on a line of its
// own that the simulated and real installed systems read.
func UserData(own, token string) []byte {
	var b strings.Builder
	if own == "" {
		b.WriteString("#cloud-config\n")
	} else {
		b.WriteString(own)
		if !strings.HasSuffix(own, "\n") {
			b.WriteString("\n")
		}
	}
	b.WriteString(UserDataTokenPrefix + token + "\n")
	return []byte(b.String())
}

// UserDataTokenPrefix starts the user data line holding the join token.
const UserDataTokenPrefix = "# bc.join_token: "

// JoinTokenOf returns the join token of user data written by [UserData].
func JoinTokenOf(userData []byte) string {
	for line := range strings.SplitSeq(string(userData), "\n") {
		if tok, ok := strings.CutPrefix(line, UserDataTokenPrefix); ok {
			return strings.TrimSpace(tok)
		}
	}
	return ""
}

func (p *pass) deploy(ctx context.Context, _ time.Time) (string, error) {
	if p.m.Image == nil {
		return "the deploy names no image", nil
	}
	disks, err := p.disks(ctx)
	if err != nil {
		return "", err
	}
	if len(disks) == 0 {
		c, err := p.command(ctx, "diag.nvml", "disks", func() (any, error) { return &agentv1.DiagNvml{}, nil })
		if err != nil {
			return "", err
		}
		_, failure, err := p.verdict(ctx, c)
		if failure == "" && err == nil && c != nil && c.State == commands.Succeeded {
			failure = "diag.nvml reported no disk to deploy to"
		}
		return failure, err
	}
	img := p.m.Image
	c, err := p.command(ctx, "image.deploy", "deploy", func() (any, error) {
		tok, err := p.token(ctx, jointoken.RoleNode, NodeTokenTTL, machines.BootRamdisk)
		if err != nil {
			return nil, err
		}
		return &agentv1.ImageDeploy{Url: img.URL, Sha256: img.SHA256, Disk: disks[0].GetPath(), SizeBytes: uint64(max(img.SizeBytes, 0)),
			Format: agentv1.ImageFormat_IMAGE_FORMAT_RAW, CloudInitUserData: UserData(p.m.CloudInit, tok)}, nil
	})
	if err != nil {
		return "", err
	}
	res, failure, err := p.verdict(ctx, c)
	if err != nil || failure != "" || res == nil {
		return failure, err
	}
	if got := res.GetImageDeploy().GetSha256(); got != img.SHA256 {
		return fmt.Sprintf("image.deploy (%s) wrote sha256 %.64s, want %s", c.ID, got, img.SHA256), nil
	}
	return "", p.move(ctx, machines.StateRebooting, machines.Change{Boot: machines.BootLocal},
		fmt.Sprintf("image %s written to %s (%s)", img.SHA256[:12], disks[0].GetPath(), c.ID))
}

func (p *pass) reboot(ctx context.Context, ts []sitetasks.Task, start time.Time) (string, error) {
	done, failure, err := p.sequence(ctx, ts, []seqStep{
		{sitetasks.KindPXEArm, func(ctx context.Context) (string, error) {
			return "", p.enqueueTask(ctx, sitetasks.KindPXEArm, sitetasks.Payload{MACs: p.m.MACs, Decision: "local"}, nil, p.notAfter())
		}},
		{sitetasks.KindBMCBoot, func(ctx context.Context) (string, error) {
			return p.bmcTask(ctx, sitetasks.KindBMCBoot, sitetasks.Payload{BootTarget: "disk"}, p.notAfter())
		}},
		{sitetasks.KindBMCPower, func(ctx context.Context) (string, error) {
			return p.bmcTask(ctx, sitetasks.KindBMCPower, sitetasks.Payload{PowerAction: p.powerAction(ts)}, p.notAfter())
		}},
	})
	if err != nil || failure != "" || !done {
		return failure, err
	}
	ok, failure, err := p.sessionSince(ctx, start, nodes.StateAdopting, nodes.StateAdopted)
	if err != nil || failure != "" || !ok {
		return failure, err
	}
	return "", p.move(ctx, machines.StateJoined, machines.Change{}, "the installed system joined as node "+p.m.NodeID)
}
