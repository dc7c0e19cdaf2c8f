// Package command is the node daemon's command executor: it checks each
// Command the gateway sends, journals the ones it accepts, runs them in
// lanes with credits and answers with CommandUpdates. It knows nothing of
// gRPC: the session hands it commands (Handle, Cancel), tells it the
// applied generation (SetApplied) and gives it a Send callback.
//
// A destructive kind's signature is checked first, before anything is
// journaled or held: one that does not verify against the pinned
// command-signing key for this daemon's trust domain (none pinned: always)
// is answered BAD_SIGNATURE and never journaled, so it takes no seq and the
// validly signed command under that seq still runs when it comes.
//
// Then checks, in order (the first that fails answers REJECTED with its
// code):
//
//  1. UNSUPPORTED: another node's command, a kind the daemon does not know
//     or its configuration denies (node.reboot without a reboot hook,
//     gpu.reset without a GPU inventory, disk.wipe, image.deploy and
//     node.kexec without a Config.Ramdisk), or
//     a body that is not the kind's payload message.
//  2. STALE_GENERATION: min_generation ahead of the applied generation. The
//     command is held (no answer) and re-checked as SetApplied advances;
//     if still ahead at not_after it is rejected.
//  3. EXPIRED: now past not_after.
//  4. BUSY: no credit left in the kind's lane. Not journaled: the control
//     plane retries it.
//
// The journal (one fsynced JSON file per seq under <root>/journal/) holds
// every command the daemon accepted or rejected other than BUSY and
// BAD_SIGNATURE; a seq it
// holds is never run again and a re-delivery is answered from it.
// Accepted commands are journaled before ACCEPTED is sent and before they
// run. At start, entries still accepted become failed ("interrupted: the
// agent restarted"), except self-terminating ones (node.reboot), which
// become succeeded when the boot id changed.
//
// A daemon with a Config.ResultKey (bcd ramdisk) signs the final update of
// every command it ran (succeeded, failed or cancelled, and those settled
// at start) with proto/resultsig for its node id and trust domain, and
// journals the signature with the outcome, so a re-delivery is answered
// with the same signed report. Rejections are not signed: nothing ran.
//
// A running command may stream output before its outcome (Executor.Output:
// logs.collect sends each source's lines once read): ACCEPTED updates with
// a CommandOutput chunk of at most 64 KiB, kept in memory while it runs and
// all sent again when the command is delivered again meanwhile, so a chunk
// lost with a session arrives with the next (the control plane keeps each
// chunk seq once). They are never journaled: the outcome's result holds
// the whole output.
package command

import (
	"bytes"
	"cmp"
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandkinds"
	"github.com/bettercompute/bettercompute/proto/commandsig"
	"github.com/bettercompute/bettercompute/proto/resultsig"
)

// Func runs one command of a kind with its decoded body. It returns the
// result, or an error to fail the command (a result returned with the error
// is still attached to the FAILED update). It must return once ctx ends.
type Func func(ctx context.Context, body *agentv1.CommandBody) (*agentv1.CommandResult, error)

// InstanceRebooter restarts one running VPS instance (instance.reboot).
type InstanceRebooter interface {
	Reboot(ctx context.Context, id string) error
}

// Inventory is what the built-in kinds read: Report for inventory.refresh;
// an implementation with Diagnose (diag.nvml) and Rescan (rescanning
// inventory.refresh), like *inventory.Collector, enables those.
type Inventory interface {
	Report(ctx context.Context, sections []string) (*agentv1.InventoryReport, error)
}

// Config configures an Executor. Root, NodeID, BootID and Send are
// required.
type Config struct {
	// Root is the agent's root directory; the journal is <Root>/journal.
	Root string
	// NodeID is this node: commands for another node are UNSUPPORTED.
	NodeID string
	// BootID is this boot; journaled with accepted commands.
	BootID string
	// Send delivers a CommandUpdate to the control plane. It is called
	// with the Executor's lock held: it must not block or call back into
	// the Executor (the session queues updates).
	Send func(*agentv1.CommandUpdate)
	// WaitSent, when set, returns once every update Send was given so far
	// has gone out to the control plane, or ctx ends. The executor waits
	// on it (at most RebootGrace) before calling RebootHook, so ACCEPTED
	// leaves before the machine goes down.
	WaitSent func(ctx context.Context)
	// Inventory backs diag.nvml and inventory.refresh; nil fails them.
	Inventory Inventory
	// OnInventory receives the report inventory.refresh collected, for
	// the session to send as an InventoryReport; nil drops it.
	OnInventory func(*agentv1.InventoryReport)
	// LogFile is the daemon's own log that logs.collect reads for source
	// "agent" (and its rotated LogFile.1); empty means LogPath(Root).
	LogFile string
	// Logs says where logs.collect reads the kernel's ring buffer and the
	// journal; zero values mean /dev/kmsg and journalctl on PATH.
	Logs LogSources
	// CommandKey is the control plane's command-signing public key;
	// without it every destructive command is BAD_SIGNATURE.
	CommandKey ed25519.PublicKey
	// TrustDomain is this node's SPIFFE trust domain (from its
	// certificate): a destructive command's signature must be for it, so
	// one signed for another installation pinning the same key is
	// BAD_SIGNATURE. Empty refuses every destructive command.
	TrustDomain string
	// DenyKinds are kinds this daemon refuses (UNSUPPORTED).
	DenyKinds []string
	// Resetter resets GPUs for gpu.reset; nil means Inventory when it is
	// one (an *inventory.Collector: nvidia-smi on real NVML, clearing the
	// injected faults on the mock). gpu.reset also needs Inventory to
	// list compute processes and check the GPUs again (see GPUInventory).
	Resetter Resetter
	// RebootHook reboots the machine for node.reboot, after the command
	// is journaled and ACCEPTED is sent. Nil disallows node.reboot
	// (UNSUPPORTED). It should return once the reboot is under way.
	RebootHook func(ctx context.Context, reason string) error
	// Instances reboots VPS instances for instance.reboot (a
	// *vps.Reconciler on a vps-host); nil refuses the kind (UNSUPPORTED).
	Instances InstanceRebooter
	// Upgrade runs agent.upgrade: it clears the UpgradeFailed latch when
	// the payload says so, admits the signed release manifest (if any) and
	// stages its build, and returns the handover, which the executor calls
	// once the command's outcome was sent (nil: nothing to hand over). Nil
	// refuses the kind (UNSUPPORTED).
	Upgrade func(ctx context.Context, p *agentv1.AgentUpgrade) (handover func(), err error)
	// Ramdisk runs the commissioning kinds (disk.wipe, image.deploy,
	// node.kexec) and adds a burn-in check of the disks to diag.nvml: an
	// *ramdisk.Ramdisk in bcd ramdisk. Nil refuses those kinds
	// (UNSUPPORTED).
	Ramdisk Ramdisk
	// ResultKey, when set, signs the final update of every command run
	// (proto/resultsig; see the package comment): bcd ramdisk's Ed25519
	// key, the one its certificate binds. Signing needs TrustDomain.
	ResultKey ed25519.PrivateKey
	// Executors replace the built-in Func of known kinds (tests use slow
	// or blocking ones); a key that is not a known kind is an error.
	Executors map[string]Func
	// Logger; nil means slog.Default().
	Logger *slog.Logger
	// Now is the clock; nil means time.Now.
	Now func() time.Time
	// Retention is how long finished journal entries are kept; 7 days by
	// default (far beyond any command's not_after plus timeout).
	Retention time.Duration
}

// Executor checks, journals and runs commands. Its methods are safe for
// concurrent use and never block on a running command.
type Executor struct {
	cfg   Config
	log   *slog.Logger
	funcs map[string]Func

	ctx  context.Context
	stop context.CancelFunc
	wg   sync.WaitGroup

	mu      sync.Mutex
	journal *journal
	applied int64
	held    map[int64]*held
	running map[int64]context.CancelCauseFunc
	// outputs holds the output chunks each running command sent so far,
	// sent again when the command is delivered again (see Handle).
	outputs map[int64][]*agentv1.CommandOutput
	inUse   map[string]int
	closed  bool
	// handover is agent.upgrade's, called once its outcome was sent
	// (guarded by mu).
	handover func()
}

// held is a command waiting for its min_generation.
type held struct {
	c     *agentv1.Command
	timer *time.Timer
}

var (
	errCancelled = errors.New("cancelled")
	errTimeout   = errors.New("timeout")
	errStopping  = errors.New("interrupted: the agent stopped")
)

// RebootGrace bounds the wait for ACCEPTED to go out before a reboot.
const RebootGrace = 5 * time.Second

// InterruptedReason is the reason of a command that was running when the
// daemon stopped, answered when it is delivered again.
const InterruptedReason = "interrupted: the agent restarted"

// New opens the journal, settles entries left accepted by an earlier run
// (see the package comment) and returns an Executor with applied
// generation 0 (call SetApplied with the persisted observed generation).
func New(cfg Config) (*Executor, error) {
	if cfg.Root == "" || cfg.NodeID == "" || cfg.BootID == "" || cfg.Send == nil {
		return nil, errors.New("command: root, node id, boot id and send are required")
	}
	cfg.Logger = cmp.Or(cfg.Logger, slog.Default())
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	cfg.Retention = cmp.Or(cfg.Retention, 7*24*time.Hour)
	cfg.LogFile = cmp.Or(cfg.LogFile, LogPath(cfg.Root))
	cfg.Logs = cfg.Logs.withDefaults()
	j, err := openJournal(filepath.Join(cfg.Root, JournalDir), cfg.Retention, cfg.Now())
	if err != nil {
		return nil, err
	}
	e := &Executor{
		cfg: cfg, log: cfg.Logger, journal: j,
		held: map[int64]*held{}, running: map[int64]context.CancelCauseFunc{}, outputs: map[int64][]*agentv1.CommandOutput{}, inUse: map[string]int{},
	}
	if cfg.Resetter == nil {
		cfg.Resetter, _ = cfg.Inventory.(Resetter)
	}
	e.cfg.Resetter = cfg.Resetter
	e.funcs = map[string]Func{
		KindDiagNvml: e.diagNvml, KindInventoryRefresh: e.inventoryRefresh, KindLogsCollect: e.logsCollect,
		KindGPUReset: e.gpuReset, KindDiskWipe: e.diskWipe, KindImageDeploy: e.imageDeploy,
		KindInstanceReboot: e.instanceReboot, KindAgentUpgrade: e.agentUpgrade,
	}
	for k, f := range cfg.Executors {
		if _, ok := kinds[k]; !ok {
			return nil, fmt.Errorf("command: executor for unknown kind %q", k)
		}
		e.funcs[k] = f
	}
	for _, en := range j.entries {
		if en.State != stateAccepted {
			continue
		}
		next := *en
		next.At = cfg.Now()
		switch {
		case kinds[en.Kind].SelfTerminating && en.BootID == cfg.BootID:
			continue // the reboot has not happened yet; the control plane times it out
		case kinds[en.Kind].SelfTerminating:
			next.State = stateSucceeded
		default:
			next.State, next.Reason = stateFailed, InterruptedReason
		}
		e.seal(&next)
		if err := j.put(&next); err != nil {
			return nil, err
		}
	}
	e.ctx, e.stop = context.WithCancel(context.Background())
	return e, nil
}

// Close cancels running commands, drops held ones and waits for the
// commands' goroutines. Handle and Cancel do nothing afterwards.
func (e *Executor) Close() {
	e.mu.Lock()
	e.closed = true
	for seq, h := range e.held {
		h.timer.Stop()
		delete(e.held, seq)
	}
	e.mu.Unlock()
	e.stop()
	e.wg.Wait()
}

// Handle checks c and answers through Send, unless c is held waiting for
// its min_generation. A seq the journal holds is answered from it.
func (e *Executor) Handle(c *agentv1.Command) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return
	}
	if c.GetNodeId() != e.cfg.NodeID {
		// Not journaled: the seq is another node's.
		e.send(rejected(c, agentv1.RejectCode_REJECT_CODE_UNSUPPORTED, fmt.Sprintf("the command is for node %q; this is %q", c.GetNodeId(), e.cfg.NodeID)))
		return
	}
	if en := e.journal.get(c.GetSeq()); en != nil {
		e.send(en.update())
		if _, ok := e.running[c.GetSeq()]; ok && !en.final() {
			// Delivered again while it runs (a new session): the chunks
			// sent so far may have been lost with the old one.
			for _, o := range e.outputs[c.GetSeq()] {
				e.send(outputUpdate(en.ID, en.Seq, o))
			}
		}
		return
	}
	if _, ok := e.held[c.GetSeq()]; ok {
		return // still waiting for its generation
	}
	if Destructive(c.GetKind()) {
		// Before anything is journaled or held: a command nobody with the
		// key admitted must not take the seq of one somebody did.
		if err := commandsig.Verify(c, e.cfg.TrustDomain, e.cfg.CommandKey); err != nil {
			reason := "the signature does not verify with the pinned command-signing key for trust domain " + e.cfg.TrustDomain
			switch {
			case len(e.cfg.CommandKey) == 0:
				reason = "no command-signing key is pinned (bcd node --command-key): destructive commands are refused"
			case e.cfg.TrustDomain == "":
				reason = "this daemon has no trust domain: destructive commands are refused"
			}
			e.log.Warn("command refused: bad signature (not journaled)", "seq", c.GetSeq(), "id", c.GetId(), "kind", c.GetKind(), "key_id", c.GetKeyId())
			e.send(rejected(c, agentv1.RejectCode_REJECT_CODE_BAD_SIGNATURE, reason))
			return
		}
	}
	body, reason := e.decode(c)
	if reason != "" {
		e.reject(c, agentv1.RejectCode_REJECT_CODE_UNSUPPORTED, reason)
		return
	}
	if c.GetMinGeneration() > e.applied {
		h := &held{c: c}
		seq := c.GetSeq()
		h.timer = time.AfterFunc(max(c.GetNotAfter().AsTime().Sub(e.cfg.Now()), 0), func() { e.heldDeadline(seq, h) })
		e.held[seq] = h
		e.log.Info("command held until the spec catches up", "seq", seq, "kind", c.GetKind(), "min_generation", c.GetMinGeneration(), "applied", e.applied)
		return
	}
	e.proceed(c, body)
}

// decode returns c's body or why it is UNSUPPORTED.
func (e *Executor) decode(c *agentv1.Command) (*agentv1.CommandBody, string) {
	k, ok := kinds[c.GetKind()]
	if !ok {
		return nil, fmt.Sprintf("unknown command kind %q", c.GetKind())
	}
	if slices.Contains(e.cfg.DenyKinds, c.GetKind()) {
		return nil, fmt.Sprintf("command kind %q is denied by this daemon's configuration (--deny-kinds)", c.GetKind())
	}
	if c.GetKind() == KindNodeReboot && e.cfg.RebootHook == nil {
		return nil, "node.reboot is not allowed on this daemon (bcd node --allow-reboot)"
	}
	if _, ok := e.cfg.Inventory.(GPUInventory); c.GetKind() == KindGPUReset && (e.cfg.Resetter == nil || !ok) {
		return nil, "gpu.reset is not available on this daemon (no GPU inventory)"
	}
	if c.GetKind() == KindInstanceReboot && e.cfg.Instances == nil {
		return nil, "instance.reboot is not available on this daemon (it runs no VPS runtime: bcd node --vps-runtime)"
	}
	if c.GetKind() == KindAgentUpgrade && e.cfg.Upgrade == nil {
		return nil, "agent.upgrade is not available on this daemon (no release key pinned: bcd node --release-key)"
	}
	if k.RamdiskOnly && e.cfg.Ramdisk == nil {
		return nil, c.GetKind() + " runs only in bcd ramdisk (commissioning)"
	}
	body := &agentv1.CommandBody{}
	if err := proto.Unmarshal(c.GetBody(), body); err != nil {
		return nil, fmt.Sprintf("the body is not a CommandBody: %v", err)
	}
	if of, _ := commandkinds.Of(body); of.Name != k.Name {
		return nil, fmt.Sprintf("the body is not a %s payload", c.GetKind())
	}
	return body, ""
}

// SetApplied records the generation of desired state the daemon has
// applied and continues the held commands it satisfies.
func (e *Executor) SetApplied(gen int64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if gen <= e.applied || e.closed {
		return
	}
	e.applied = gen
	seqs := make([]int64, 0, len(e.held))
	for seq, h := range e.held {
		if h.c.GetMinGeneration() <= gen {
			seqs = append(seqs, seq)
		}
	}
	slices.Sort(seqs)
	for _, seq := range seqs {
		h := e.held[seq]
		h.timer.Stop()
		delete(e.held, seq)
		body, _ := e.decode(h.c)
		e.proceed(h.c, body)
	}
}

// heldDeadline runs at a held command's not_after.
func (e *Executor) heldDeadline(seq int64, h *held) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.held[seq] != h {
		return
	}
	delete(e.held, seq)
	if h.c.GetMinGeneration() > e.applied {
		e.reject(h.c, agentv1.RejectCode_REJECT_CODE_STALE_GENERATION,
			fmt.Sprintf("min_generation %d is still ahead of the applied generation %d at not_after", h.c.GetMinGeneration(), e.applied))
		return
	}
	body, _ := e.decode(h.c)
	e.proceed(h.c, body)
}

// proceed runs checks 3 and 4 and accepts c (its signature, when the kind
// is destructive, was checked in Handle). e.mu is held.
func (e *Executor) proceed(c *agentv1.Command, body *agentv1.CommandBody) {
	k := kinds[c.GetKind()]
	now := e.cfg.Now()
	if na := c.GetNotAfter().AsTime(); now.After(na) {
		e.reject(c, agentv1.RejectCode_REJECT_CODE_EXPIRED, fmt.Sprintf("past not_after %s", na.UTC().Format(time.RFC3339)))
		return
	}
	if e.inUse[k.Lane] >= Credits[k.Lane] {
		e.send(rejected(c, agentv1.RejectCode_REJECT_CODE_BUSY, fmt.Sprintf("no credit left in lane %q", k.Lane)))
		return
	}
	en := &entry{Seq: c.GetSeq(), ID: c.GetId(), Kind: c.GetKind(), State: stateAccepted, BootID: e.cfg.BootID, At: now}
	if err := e.journal.put(en); err != nil {
		e.log.Error("command not journaled; refusing it", "seq", c.GetSeq(), "err", err)
		e.send(&agentv1.CommandUpdate{Id: c.GetId(), Seq: c.GetSeq(), Outcome: agentv1.CommandOutcome_COMMAND_OUTCOME_FAILED, Reason: "cannot journal the command: " + err.Error()})
		return
	}
	e.inUse[k.Lane]++
	ctx, cancel := context.WithCancelCause(e.ctx)
	e.running[c.GetSeq()] = cancel
	e.send(en.update())
	e.log.Info("command accepted", "seq", c.GetSeq(), "id", c.GetId(), "kind", c.GetKind())
	e.wg.Add(1)
	go e.run(context.WithValue(ctx, outputKey{}, &outputTo{id: c.GetId(), seq: c.GetSeq()}), cancel, c, body, en)
}

// run executes an accepted command and journals and answers its outcome.
func (e *Executor) run(ctx context.Context, cancel context.CancelCauseFunc, c *agentv1.Command, body *agentv1.CommandBody, en *entry) {
	defer e.wg.Done()
	defer cancel(nil)
	k := kinds[c.GetKind()]
	var res *agentv1.CommandResult
	var err error
	if d := c.GetTimeout().AsDuration(); c.GetTimeout() != nil && d > 0 {
		var stop context.CancelFunc
		ctx, stop = context.WithTimeoutCause(ctx, d, errTimeout)
		defer stop()
	}
	if k.SelfTerminating {
		err = e.terminate(ctx, c.GetKind(), body)
		if err == nil {
			// Stays accepted: it succeeds when the node comes back
			// with a new boot id.
			e.mu.Lock()
			delete(e.running, c.GetSeq())
			delete(e.outputs, c.GetSeq())
			e.inUse[k.Lane]--
			e.mu.Unlock()
			e.log.Info("reboot under way", "seq", c.GetSeq(), "kind", c.GetKind())
			return
		}
	} else {
		res, err = e.funcs[c.GetKind()](ctx, body)
	}
	cause := context.Cause(ctx)
	e.mu.Lock()
	defer e.mu.Unlock()
	delete(e.running, c.GetSeq())
	delete(e.outputs, c.GetSeq())
	e.inUse[k.Lane]--
	final := *en
	final.At = e.cfg.Now()
	switch {
	case err == nil:
		final.State = stateSucceeded
	case errors.Is(cause, errCancelled):
		final.State, final.Reason, res = stateCancelled, "cancelled", nil
	case e.ctx.Err() != nil:
		final.State, final.Reason = stateFailed, errStopping.Error()
	case errors.Is(cause, errTimeout):
		final.State, final.Reason = stateFailed, fmt.Sprintf("timeout: still running after %s", c.GetTimeout().AsDuration())
	default:
		final.State, final.Reason = stateFailed, err.Error()
	}
	if res != nil {
		if b, merr := proto.Marshal(res); merr == nil {
			final.Result = b
		}
	}
	e.seal(&final)
	if perr := e.journal.put(&final); perr != nil {
		// Keep the outcome in memory so re-deliveries get it; after a
		// restart the entry reads as interrupted.
		e.log.Error("command outcome not journaled", "seq", c.GetSeq(), "err", perr)
		e.journal.entries[final.Seq] = &final
	}
	e.log.Info("command finished", "seq", c.GetSeq(), "kind", c.GetKind(), "state", final.State, "reason", final.Reason)
	e.send(final.update())
	if h := e.handover; h != nil && c.GetKind() == KindAgentUpgrade {
		e.handover = nil
		if final.State == stateSucceeded {
			// The outcome goes out before the session ends.
			e.wg.Go(func() {
				if e.cfg.WaitSent != nil {
					wctx, cancel := context.WithTimeout(e.ctx, RebootGrace)
					e.cfg.WaitSent(wctx)
					cancel()
				}
				h()
			})
		}
	}
}

// terminate runs a self-terminating kind: node.reboot's RebootHook, or
// node.kexec's load (fetch, check, kexec -l) and then exec. Updates sent so
// far are given RebootGrace to go out before the machine goes down. A nil
// error means the machine is going down.
func (e *Executor) terminate(ctx context.Context, kind string, body *agentv1.CommandBody) error {
	waitSent := func() {
		if e.cfg.WaitSent != nil {
			wctx, cancel := context.WithTimeout(ctx, RebootGrace)
			e.cfg.WaitSent(wctx)
			cancel()
		}
	}
	switch kind {
	case KindNodeKexec:
		if err := e.cfg.Ramdisk.LoadKexec(ctx, body.GetNodeKexec()); err != nil {
			return fmt.Errorf("kexec: %w", err)
		}
		waitSent()
		if err := e.cfg.Ramdisk.ExecKexec(ctx); err != nil {
			return fmt.Errorf("kexec: %w", err)
		}
		return nil
	default:
		waitSent()
		if err := e.cfg.RebootHook(ctx, body.GetNodeReboot().GetReason()); err != nil {
			return fmt.Errorf("reboot: %w", err)
		}
		return nil
	}
}

// seal signs en's update with ResultKey (when set) and keeps the
// signature in en. A report that cannot be signed (no trust domain) goes
// unsigned, and the control plane refuses it; the error is logged.
func (e *Executor) seal(en *entry) {
	if e.cfg.ResultKey == nil {
		return
	}
	en.Signature = nil
	u := en.update()
	s := resultsig.Subject{TrustDomain: e.cfg.TrustDomain, NodeID: e.cfg.NodeID, CommandID: en.ID, Kind: en.Kind, Seq: en.Seq}
	if err := resultsig.Sign(u, s, e.cfg.ResultKey); err != nil {
		e.log.Error("command result not signed", "seq", en.Seq, "kind", en.Kind, "err", err)
		return
	}
	b, err := proto.Marshal(u.GetNodeSignature())
	if err != nil {
		e.log.Error("command result not signed", "seq", en.Seq, "kind", en.Kind, "err", err)
		return
	}
	en.Signature = b
}

// Cancel stops the command cc names: a running one is cancelled and
// answers CANCELLED (or its outcome, when it finished first); a held or
// unknown one is journaled as cancelled and answered CANCELLED, so a later
// delivery never runs it; a journaled one re-sends its journaled state.
func (e *Executor) Cancel(cc *agentv1.CommandCancel) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return
	}
	seq := cc.GetSeq()
	if cancel, ok := e.running[seq]; ok {
		cancel(errCancelled)
		return
	}
	if en := e.journal.get(seq); en != nil {
		e.send(en.update())
		return
	}
	en := &entry{Seq: seq, ID: cc.GetId(), State: stateCancelled, Reason: "cancelled before it ran", BootID: e.cfg.BootID, At: e.cfg.Now()}
	if h, ok := e.held[seq]; ok {
		h.timer.Stop()
		delete(e.held, seq)
		en.Kind = h.c.GetKind()
	}
	if err := e.journal.put(en); err != nil {
		e.log.Error("cancel not journaled", "seq", seq, "err", err)
		e.journal.entries[seq] = en
	}
	e.send(en.update())
}

// reject journals a rejection other than BUSY and answers it. e.mu is held.
func (e *Executor) reject(c *agentv1.Command, code agentv1.RejectCode, reason string) {
	en := &entry{Seq: c.GetSeq(), ID: c.GetId(), Kind: c.GetKind(), State: stateRejected, Reject: code.String(), Reason: reason, BootID: e.cfg.BootID, At: e.cfg.Now()}
	if err := e.journal.put(en); err != nil {
		e.log.Error("rejection not journaled", "seq", c.GetSeq(), "err", err)
	}
	e.log.Info("command rejected", "seq", c.GetSeq(), "kind", c.GetKind(), "code", code.String(), "reason", reason)
	e.send(rejected(c, code, reason))
}

func rejected(c *agentv1.Command, code agentv1.RejectCode, reason string) *agentv1.CommandUpdate {
	return &agentv1.CommandUpdate{Id: c.GetId(), Seq: c.GetSeq(), Outcome: agentv1.CommandOutcome_COMMAND_OUTCOME_REJECTED, Reject: code, Reason: reason}
}

func (e *Executor) send(u *agentv1.CommandUpdate) { e.cfg.Send(u) }

// outputKey is the context key of a running command's outputTo.
type outputKey struct{}

// outputTo is where a running command's output goes: its id and seq, and
// the bytes and chunks it sent so far.
type outputTo struct {
	id     string
	seq    int64
	offset uint64
	next   uint32
}

// Output sends data, the next stretch of the running command's output
// (ctx is the one its Func was given), to the control plane now, in
// chunks of at most commandkinds.MaxOutputChunk bytes (ACCEPTED updates
// with an output), and keeps them to send again if the command is
// delivered again while it runs. Outside a command's Func it does nothing.
// What a command sends this way must be, all together, what its result
// says its output is (logs.collect: the result's data).
func (e *Executor) Output(ctx context.Context, data []byte) {
	to, ok := ctx.Value(outputKey{}).(*outputTo)
	if !ok || len(data) == 0 {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, running := e.running[to.seq]; !running {
		return
	}
	for len(data) > 0 {
		n := min(len(data), commandkinds.MaxOutputChunk)
		o := &agentv1.CommandOutput{Seq: to.next, Offset: to.offset, Data: bytes.Clone(data[:n])}
		to.next++
		to.offset += uint64(n)
		data = data[n:]
		e.outputs[to.seq] = append(e.outputs[to.seq], o)
		e.send(outputUpdate(to.id, to.seq, o))
	}
}

// outputUpdate is the ACCEPTED update that carries chunk o of a command.
func outputUpdate(id string, seq int64, o *agentv1.CommandOutput) *agentv1.CommandUpdate {
	return &agentv1.CommandUpdate{Id: id, Seq: seq, Outcome: agentv1.CommandOutcome_COMMAND_OUTCOME_ACCEPTED, Output: o}
}
