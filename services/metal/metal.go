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
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/machines"
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
	if p.now, err = db.Now(ctx, p.tx); err != nil {
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
	if failed, err := p.checkCertificate(ctx, tasks); err != nil || failed {
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

// notAfter is a task's or command's deadline: the attempt's.
func (p *pass) notAfter() time.Time {
	if p.m.StepDeadline != nil && p.m.StepDeadline.After(p.now) {
		return *p.m.StepDeadline
	}
	return p.now.Add(time.Minute)
}
