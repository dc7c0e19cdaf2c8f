package vps

// The provider workflow (vps.provider): instances of provider pools (class
// "provider") get a machine at the pool's provider (pkg/providers), keyed
// by the instance id.
//
// It is level-triggered: each run reads one instance and its machine, does
// the one provider call that brings the machine closer to the instance's
// desired state, records what the provider answered, and runs again (1 s
// later) until the instance is settled:
//
//   - pending, no machine id: create under the instance id as the
//     idempotency key. "A create may have been sent" is committed before
//     the call; the machine id is written after it. A crash in between
//     only repeats the create, which the provider answers with the same
//     machine.
//   - a machine: read it; running or stopped as desired → the instance is
//     running or stopped; running but desired stopped → stop; stopped but
//     desired running → start; on its way (pending, starting, stopping) →
//     wait; gone → failed.
//   - deleting: delete the machine (gone is success; with no machine id
//     but a create that may have been sent, create again under the key to
//     learn the id first), then deleted.
//
// Each step (create, start, stop, delete) has a deadline and at most
// MaxAttempts failed provider calls; past either, or on a refusal that a
// retry cannot help (401, 400, …), the instance is failed with the step and
// the reason. A failed instance is settled until it is deleted. The
// periodic key "resync" enqueues every provider instance not settled, so
// the workflow completes with the bus down or a wake-up lost. Credentials
// are opened from pkg/secrets for each run and appear in no log, reason or
// error.

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/instances"
	"github.com/bettercompute/bettercompute/pkg/outbound"
	"github.com/bettercompute/bettercompute/pkg/providers"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/secrets"
)

// KindProvider is the provider workflow's work kind, keyed by instance id
// (instances.ProviderJob).
const KindProvider = instances.ProviderJob

// ProviderResyncKey is the provider workflow's periodic key: its run
// enqueues every provider instance not settled.
const ProviderResyncKey = "resync"

// Deps are the provider workflow's dependencies and settings. Zero values
// take the defaults given.
type Deps struct {
	// Keyring opens the pools' credentials secrets (secrets.keyFile).
	// Required.
	Keyring *secrets.Keyring
	// Logger; nil discards.
	Logger *slog.Logger
	// Role is the runtime membership that runs the workflow; default "vps".
	Role string
	// Outbound are the rules of requests to providers (pkg/outbound:
	// https, public addresses, the operator's allowed hosts;
	// config.Providers.Outbound); the zero value is production's.
	Outbound outbound.Options
	// HTTP is the client requests to providers go through; nil is one
	// built from Outbound.
	HTTP *outbound.Client
	// Resync is the period of the resync key; default 10s.
	Resync time.Duration
	// CreateTimeout bounds the create step (the call and provisioning
	// until running); default 15m. PowerTimeout bounds start and stop;
	// default 10m. DeleteTimeout bounds delete; default 10m.
	CreateTimeout, PowerTimeout, DeleteTimeout time.Duration
	// MaxAttempts bounds the failed provider calls of one step; default 5.
	MaxAttempts int
	// CallTimeout bounds each provider request; default 30s. CallAttempts
	// bounds the tries of one call on 429 and 5xx; default 3.
	CallTimeout  time.Duration
	CallAttempts int
}

func (d *Deps) defaults() error {
	if d.Keyring == nil {
		return errors.New("vps provider workflow: a secrets keyring is required (secrets.keyFile)")
	}
	if d.Logger == nil {
		d.Logger = slog.New(slog.DiscardHandler)
	}
	d.Role = cmp.Or(d.Role, string(config.RoleVPS))
	d.Resync = cmp.Or(d.Resync, 10*time.Second)
	d.CreateTimeout = cmp.Or(d.CreateTimeout, 15*time.Minute)
	d.PowerTimeout = cmp.Or(d.PowerTimeout, 10*time.Minute)
	d.DeleteTimeout = cmp.Or(d.DeleteTimeout, 10*time.Minute)
	d.MaxAttempts = cmp.Or(d.MaxAttempts, 5)
	d.CallTimeout = cmp.Or(d.CallTimeout, 30*time.Second)
	d.CallAttempts = cmp.Or(d.CallAttempts, 3)
	if d.HTTP == nil {
		d.Outbound.Setting = cmp.Or(d.Outbound.Setting, "providers")
		d.HTTP = outbound.NewClient(d.Outbound)
	}
	return nil
}

// NewProviderReconciler returns the vps.provider reconciler (sharded by
// instance id, with the periodic resync key).
func NewProviderReconciler(d Deps) (reconcile.Reconciler, error) {
	if err := d.defaults(); err != nil {
		return reconcile.Reconciler{}, err
	}
	w := &providerFlow{d: d}
	return reconcile.Reconciler{Name: KindProvider, ShardBy: reconcile.ShardByNode, Role: d.Role, Run: w.run,
		Periodic: []reconcile.Periodic{{Key: ProviderResyncKey, Every: d.Resync}}}, nil
}

// RegisterProvider registers the provider workflow with rt.
func RegisterProvider(rt *reconcile.Runtime, d Deps) error {
	r, err := NewProviderReconciler(d)
	if err != nil {
		return err
	}
	return rt.Register(r)
}

type providerFlow struct{ d Deps }

func (w *providerFlow) run(ctx context.Context, rc *reconcile.RunContext, key string) (reconcile.Result, error) {
	if key == ProviderResyncKey {
		return reconcile.Done, w.resync(ctx, rc)
	}
	p, err := instances.GetProvider(ctx, rc.DB(), key, false)
	if fault.CodeOf(err) == fault.NotFound {
		return reconcile.Done, nil
	}
	if err != nil {
		return reconcile.Done, err
	}
	if p.NodeID != "" || p.State == instances.StateDeleted || p.State == instances.StateFailed {
		return reconcile.Done, nil
	}
	r := &providerRun{w: w, rc: rc, p: p, log: rc.Logger.With("instance", p.ID, "pool", p.PoolID)}
	return r.step(ctx)
}

// resync enqueues every provider instance not settled.
func (w *providerFlow) resync(ctx context.Context, rc *reconcile.RunContext) error {
	after := ""
	for {
		ids, err := instances.ProviderUnsettled(ctx, rc.DB(), after, 500)
		if err != nil {
			return err
		}
		if len(ids) == 0 {
			return nil
		}
		err = rc.InTx(ctx, func(tx pgx.Tx, q *reconcile.Queue) error {
			for _, id := range ids {
				if err := q.Enqueue(ctx, KindProvider, id); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
		after = ids[len(ids)-1]
	}
}

// providerRun is one run over one instance.
type providerRun struct {
	w   *providerFlow
	rc  *reconcile.RunContext
	p   instances.ProviderInstance
	log *slog.Logger
}

func (r *providerRun) step(ctx context.Context) (reconcile.Result, error) {
	p := r.p
	prov, err := r.provider(ctx)
	if err != nil {
		return r.failed(ctx, stepFor(p), err)
	}
	switch {
	case p.State == instances.StateDeleting:
		return r.delete(ctx, prov)
	case p.ProviderMachineID == "":
		return r.create(ctx, prov)
	}
	m, err := prov.Get(ctx, p.ProviderMachineID)
	if errors.Is(err, providers.ErrNotFound) || (err == nil && m.State == providers.StateDeleted) {
		return reconcile.Done, r.write(ctx, func(tx pgx.Tx) error {
			return instances.FailProvider(ctx, tx, p.ID, fmt.Sprintf("machine %s no longer exists at the provider", p.ProviderMachineID))
		})
	}
	if err != nil {
		return r.failed(ctx, stepFor(p), err)
	}
	want := p.Power
	switch {
	case m.State == want:
		var changed bool
		err := r.write(ctx, func(tx pgx.Tx) error {
			if cur, err := instances.GetProvider(ctx, tx, p.ID, true); err != nil || cur.Generation != p.Generation {
				return err // changed meanwhile: the key runs again
			}
			var err error
			changed, err = instances.Settle(ctx, tx, p.ID, want, m.State)
			return err
		})
		if err == nil && changed {
			r.log.InfoContext(ctx, "provider instance settled", "state", want, "machine", m.ID)
		}
		return reconcile.Done, err
	case m.State == providers.StateRunning && want == instances.PowerStopped:
		return r.power(ctx, instances.StepStop, m, prov.Stop)
	case m.State == providers.StateStopped && want == instances.PowerRunning:
		return r.power(ctx, instances.StepStart, m, prov.Start)
	}
	// On its way (pending, starting, stopping): wait, within the step's
	// deadline.
	return r.wait(ctx, m)
}

// stepFor is the step an instance's next provider call belongs to.
func stepFor(p instances.ProviderInstance) string {
	switch {
	case p.State == instances.StateDeleting:
		return instances.StepDelete
	case p.Step != "":
		return p.Step
	case p.ProviderMachineID == "" || p.State == instances.StatePending:
		return instances.StepCreate
	case p.Power == instances.PowerStopped:
		return instances.StepStop
	}
	return instances.StepStart
}

func (r *providerRun) timeout(step string) time.Duration {
	switch step {
	case instances.StepCreate:
		return r.w.d.CreateTimeout
	case instances.StepDelete:
		return r.w.d.DeleteTimeout
	}
	return r.w.d.PowerTimeout
}

// provider builds the pool's client from its settings and credentials.
func (r *providerRun) provider(ctx context.Context) (providers.Provider, error) {
	s, ok, err := instances.GetProviderSettings(ctx, r.rc.DB(), r.p.PoolID)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, &providers.Error{Kind: providers.ErrRejected, Op: "configure",
			Message: fmt.Sprintf("pool %s has no provider settings (pools.update provider)", r.p.PoolID)}
	}
	plain, err := secrets.Open(ctx, r.rc.DB(), r.w.d.Keyring, r.p.TenantID, s.CredentialsRef)
	if err != nil {
		if fault.CodeOf(err) == fault.NotFound {
			return nil, &providers.Error{Kind: providers.ErrRejected, Op: "configure", Message: fmt.Sprintf("credentials secret %s not found", s.CredentialsRef)}
		}
		return nil, fmt.Errorf("open credentials %s of pool %s: %w", s.CredentialsRef, r.p.PoolID, err)
	}
	creds, err := providers.ParseCredentials(plain)
	if err != nil {
		return nil, &providers.Error{Kind: providers.ErrRejected, Op: "configure", Message: fmt.Sprintf("secret %s: %v", s.CredentialsRef, err)}
	}
	return providers.NewClient(providers.ClientConfig{Endpoint: s.Endpoint, Token: creds.Token, HTTP: r.w.d.HTTP,
		Timeout: r.w.d.CallTimeout, Attempts: r.w.d.CallAttempts})
}

// write runs fn in the run's fenced transaction.
func (r *providerRun) write(ctx context.Context, fn func(tx pgx.Tx) error) error {
	return r.rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error { return fn(tx) })
}

// begin makes step the instance's current step (due within its timeout)
// and fails the instance when the step's deadline has passed; false then.
func (r *providerRun) begin(ctx context.Context, step string, extra func(tx pgx.Tx) error) (bool, error) {
	p := r.p
	if p.Step == step && p.Deadline != nil && p.Now.After(*p.Deadline) {
		return false, r.write(ctx, func(tx pgx.Tx) error {
			return instances.FailProvider(ctx, tx, p.ID, fmt.Sprintf("provider %s did not finish within %s", step, r.timeout(step)))
		})
	}
	return true, r.write(ctx, func(tx pgx.Tx) error {
		if _, err := instances.BeginStep(ctx, tx, p.ID, step, r.timeout(step)); err != nil {
			return err
		}
		if extra != nil {
			return extra(tx)
		}
		return nil
	})
}

// failed counts a failed provider call of step: a refusal no retry can
// help, or the last attempt, fails the instance; otherwise the key backs
// off (longer when the provider said Retry-After) and runs again.
func (r *providerRun) failed(ctx context.Context, step string, cause error) (reconcile.Result, error) {
	p := r.p
	var pe *providers.Error
	if !errors.As(cause, &pe) {
		return reconcile.Done, cause // ours (the database, the keyring): back off
	}
	permanent := errors.Is(cause, providers.ErrRejected)
	var n int
	err := r.write(ctx, func(tx pgx.Tx) error {
		if _, err := instances.BeginStep(ctx, tx, p.ID, step, r.timeout(step)); err != nil {
			return err
		}
		var err error
		if n, err = instances.FailedAttempt(ctx, tx, p.ID); err != nil {
			return err
		}
		if permanent || n >= r.w.d.MaxAttempts {
			// The tenant reads the reason: the failure's class, never the
			// provider's text or the network's (those are logged below).
			return instances.FailProvider(ctx, tx, p.ID, fmt.Sprintf("provider %s failed after %d attempts: %s", step, n, pe.Reason()))
		}
		return nil
	})
	if err != nil {
		return reconcile.Done, err
	}
	if permanent || n >= r.w.d.MaxAttempts {
		r.log.WarnContext(ctx, "provider instance failed", "step", step, "attempts", n, "err", cause)
		return reconcile.Done, nil
	}
	r.log.InfoContext(ctx, "provider call failed; retrying", "step", step, "attempt", n, "err", cause)
	return reconcile.Done, fmt.Errorf("provider %s of %s (attempt %d of %d): %w", step, p.ID, n, r.w.d.MaxAttempts, cause)
}

func (r *providerRun) create(ctx context.Context, prov providers.Provider) (reconcile.Result, error) {
	p := r.p
	ok, err := r.begin(ctx, instances.StepCreate, func(tx pgx.Tx) error {
		// Committed before the call: from here a machine may exist under
		// the instance's key.
		return instances.MarkCreateSent(ctx, tx, p.ID)
	})
	if err != nil || !ok {
		return reconcile.Done, err
	}
	m, err := prov.Create(ctx, createRequest(p.Instance))
	if err != nil {
		return r.failed(ctx, instances.StepCreate, err)
	}
	if err := r.write(ctx, func(tx pgx.Tx) error { return instances.RecordMachine(ctx, tx, p.ID, m.ID, m.State) }); err != nil {
		return reconcile.Done, err
	}
	r.log.InfoContext(ctx, "provider machine created", "machine", m.ID, "state", m.State)
	return reconcile.SyncAgain, nil
}

func createRequest(in instances.Instance) providers.CreateRequest {
	return providers.CreateRequest{
		IdempotencyKey: in.ID,
		Size:           providers.Size{VCPUs: in.VCPUs, MemoryMiB: in.MemoryMiB, DiskGiB: in.DiskGiB, GPUs: in.GPUs, GPUModel: in.GPUModel},
		Image:          in.Image, SSHKeys: in.SSHKeys, UserData: in.UserData,
	}
}

func (r *providerRun) power(ctx context.Context, step string, m providers.Machine, call func(context.Context, string) (providers.Machine, error)) (reconcile.Result, error) {
	p := r.p
	ok, err := r.begin(ctx, step, nil)
	if err != nil || !ok {
		return reconcile.Done, err
	}
	got, err := call(ctx, m.ID)
	if err != nil {
		return r.failed(ctx, step, err)
	}
	r.log.InfoContext(ctx, "provider machine "+step, "machine", m.ID, "state", got.State)
	return reconcile.SyncAgain, r.write(ctx, func(tx pgx.Tx) error { return instances.RecordMachine(ctx, tx, p.ID, m.ID, got.State) })
}

func (r *providerRun) wait(ctx context.Context, m providers.Machine) (reconcile.Result, error) {
	p := r.p
	step := stepFor(p)
	ok, err := r.begin(ctx, step, nil)
	if err != nil || !ok {
		return reconcile.Done, err
	}
	if m.State != p.MachineState {
		if err := r.write(ctx, func(tx pgx.Tx) error { return instances.RecordMachine(ctx, tx, p.ID, m.ID, m.State) }); err != nil {
			return reconcile.Done, err
		}
	}
	return reconcile.SyncAgain, nil
}

func (r *providerRun) delete(ctx context.Context, prov providers.Provider) (reconcile.Result, error) {
	p := r.p
	ok, err := r.begin(ctx, instances.StepDelete, nil)
	if err != nil || !ok {
		return reconcile.Done, err
	}
	id := p.ProviderMachineID
	if id == "" && p.CreateSent {
		// A create may have reached the provider without its answer
		// reaching us: the same key names that machine, if any.
		m, err := prov.Create(ctx, createRequest(p.Instance))
		if err != nil {
			return r.failed(ctx, instances.StepDelete, err)
		}
		id = m.ID
		if err := r.write(ctx, func(tx pgx.Tx) error { return instances.RecordMachine(ctx, tx, p.ID, m.ID, m.State) }); err != nil {
			return reconcile.Done, err
		}
	}
	if id != "" {
		if err := prov.Delete(ctx, id); err != nil {
			return r.failed(ctx, instances.StepDelete, err)
		}
	}
	if err := r.write(ctx, func(tx pgx.Tx) error { return instances.FinishDelete(ctx, tx, p.ID) }); err != nil {
		return reconcile.Done, err
	}
	r.log.InfoContext(ctx, "provider instance deleted", "machine", id)
	return reconcile.Done, nil
}
