package vps

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
)

// Op is one step the reconciler takes for an instance.
type Op string

// The steps.
const (
	// OpCreate creates a missing instance (and starts it when desired).
	OpCreate Op = "create"
	// OpStart starts a stopped or failed instance.
	OpStart Op = "start"
	// OpStop powers off a running instance.
	OpStop Op = "stop"
	// OpResize gives an instance a new size or GPU set (restarting it when
	// it runs).
	OpResize Op = "resize"
	// OpUpdate records a new generation with nothing else changed.
	OpUpdate Op = "update"
	// OpDelete deletes an instance the spec no longer names.
	OpDelete Op = "delete"
)

// Step is one instance's step.
type Step struct {
	// ID is the instance.
	ID string
	// Op is what happens to it.
	Op Op
}

// String is "resize inst_a".
func (s Step) String() string { return string(s.Op) + " " + s.ID }

// Steps compares the desired instances with what a runtime has (both by
// id) and returns what the reconciler would do, sorted by id: nothing for
// an instance that matches.
func Steps(desired []Spec, observed []Observed) []Step {
	have := make(map[string]Observed, len(observed))
	for _, o := range observed {
		have[o.ID] = o
	}
	want := make(map[string]bool, len(desired))
	var out []Step
	for _, s := range desired {
		want[s.ID] = true
		o, ok := have[s.ID]
		switch {
		case !ok:
			out = append(out, Step{s.ID, OpCreate})
		case Matches(o, s):
		case o.Size != s.Size || !slices.Equal(o.GPUs, s.GPUs):
			out = append(out, Step{s.ID, OpResize})
		case o.State != s.Power && s.Power == Running:
			out = append(out, Step{s.ID, OpStart})
		case o.State != s.Power:
			out = append(out, Step{s.ID, OpStop})
		default:
			out = append(out, Step{s.ID, OpUpdate})
		}
	}
	for _, o := range observed {
		if !want[o.ID] {
			out = append(out, Step{o.ID, OpDelete})
		}
	}
	slices.SortFunc(out, func(a, b Step) int { return cmp.Compare(a.ID, b.ID) })
	return out
}

// Config sets up a Reconciler.
type Config struct {
	// Runtime runs the instances. Required.
	Runtime Runtime
	// GPUs returns the PCI address of each of the host's GPUs by UUID (from
	// its inventory); nil means the host has none, so an instance booking a
	// GPU fails.
	GPUs func(ctx context.Context) (map[string]string, error)
	// Logger logs adoption and failures; nil means slog.Default().
	Logger *slog.Logger
}

// Reconciler makes a Runtime run exactly the desired instances. Apply and
// Plan may be called from any goroutine; applies are serialised.
type Reconciler struct {
	cfg Config
	mu  sync.Mutex // serialises Apply and Reboot
}

// NewReconciler returns a Reconciler over cfg.Runtime.
func NewReconciler(cfg Config) (*Reconciler, error) {
	if cfg.Runtime == nil {
		return nil, errors.New("vps: a runtime is required")
	}
	cfg.Logger = cmp.Or(cfg.Logger, slog.Default())
	return &Reconciler{cfg: cfg}, nil
}

// Adopt lists what the runtime already runs (after a restart of the
// daemon), logs it and returns it; Apply then re-applies the spec to those
// instances without re-creating any.
func (r *Reconciler) Adopt(ctx context.Context) ([]Observed, error) {
	obs, err := r.cfg.Runtime.List(ctx)
	if err != nil {
		return nil, fmt.Errorf("vps: listing instances: %w", err)
	}
	for _, o := range obs {
		r.cfg.Logger.InfoContext(ctx, "adopted instance", "instance", o.ID, "state", o.State, "size", o.Size.String(), "generation", o.Generation)
	}
	return obs, nil
}

// Resolve fills each spec's GPUs (PCI addresses, sorted) from its
// GPUUUIDs through Config.GPUs. An instance naming a GPU the host does
// not have gets an error in failed (by id) and is left out of the result.
func (r *Reconciler) Resolve(ctx context.Context, desired []Spec) (resolved []Spec, failed map[string]string, err error) {
	var pci map[string]string
	needs := slices.ContainsFunc(desired, func(s Spec) bool { return len(s.GPUUUIDs) > 0 })
	if needs && r.cfg.GPUs != nil {
		if pci, err = r.cfg.GPUs(ctx); err != nil {
			return nil, nil, fmt.Errorf("vps: reading the GPU inventory: %w", err)
		}
	}
	failed = map[string]string{}
	for _, s := range desired {
		s.GPUs = nil
		var missing []string
		for _, u := range s.GPUUUIDs {
			a, ok := pci[u]
			if !ok || a == "" {
				missing = append(missing, u)
				continue
			}
			s.GPUs = append(s.GPUs, strings.ToLower(a))
		}
		if len(missing) > 0 {
			failed[s.ID] = "GPUs not on this host: " + strings.Join(missing, ", ")
			continue
		}
		slices.Sort(s.GPUs)
		resolved = append(resolved, s)
	}
	return resolved, failed, nil
}

// Plan returns the steps Apply would take now, and what the runtime has.
// desired must be resolved (see Resolve).
func (r *Reconciler) Plan(ctx context.Context, desired []Spec) ([]Step, []Observed, error) {
	obs, err := r.cfg.Runtime.List(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("vps: listing instances: %w", err)
	}
	return Steps(desired, obs), obs, nil
}

// Result is what an Apply did.
type Result struct {
	// Instances are the desired instances as observed after the apply,
	// and any instance whose delete failed, sorted by id.
	Instances []Observed
	// Steps are the steps taken.
	Steps []Step
	// Err joins the failures (nil when every instance is as desired).
	Err error
}

// Apply makes the runtime match desired (validated with Validate and
// resolved with Resolve): Ensure for every instance that does not match,
// Delete for every instance the spec does not name. One instance failing
// does not stop the others; its Observed says Failed with the reason.
// failed carries instances that cannot be applied at all (from Resolve),
// reported Failed with that reason.
func (r *Reconciler) Apply(ctx context.Context, desired []Spec, failed map[string]string) Result {
	r.mu.Lock()
	defer r.mu.Unlock()
	var res Result
	var errs []error
	steps, obs, err := r.Plan(ctx, desired)
	if err != nil {
		res.Err = err
		return res
	}
	have := make(map[string]Observed, len(obs))
	for _, o := range obs {
		have[o.ID] = o
	}
	op := make(map[string]Op, len(steps))
	for _, s := range steps {
		op[s.ID] = s.Op
	}
	res.Steps = steps
	for _, s := range desired {
		o, ok := have[s.ID]
		if _, act := op[s.ID]; act || !ok {
			got, err := r.cfg.Runtime.Ensure(ctx, s)
			if err != nil {
				r.cfg.Logger.WarnContext(ctx, "instance not applied", "instance", s.ID, "step", op[s.ID], "err", err)
				errs = append(errs, fmt.Errorf("%s %s: %w", op[s.ID], s.ID, err))
				got = Observed{ID: s.ID, State: Failed, Reason: Reason(err), Generation: o.Generation, Image: o.Image, Size: o.Size, GPUs: o.GPUs}
			} else if got.State == Failed || got.State != s.Power {
				errs = append(errs, fmt.Errorf("%s %s: %s (%s)", op[s.ID], s.ID, got.State, got.Reason))
			}
			o = got
		}
		res.Instances = append(res.Instances, o)
	}
	for id, reason := range failed {
		o := have[id]
		res.Instances = append(res.Instances, Observed{ID: id, State: Failed, Reason: truncate(reason, MaxReasonBytes), Generation: o.Generation,
			Image: o.Image, Size: o.Size, GPUs: o.GPUs})
		errs = append(errs, fmt.Errorf("%s: %s", id, reason))
	}
	for _, s := range steps {
		if s.Op != OpDelete || failed[s.ID] != "" {
			continue
		}
		if err := r.cfg.Runtime.Delete(ctx, s.ID); err != nil {
			r.cfg.Logger.WarnContext(ctx, "instance not deleted", "instance", s.ID, "err", err)
			errs = append(errs, fmt.Errorf("delete %s: %w", s.ID, err))
			o := have[s.ID]
			o.State, o.Reason, o.Generation = Failed, truncate("deleting: "+err.Error(), MaxReasonBytes), 0
			res.Instances = append(res.Instances, o)
			continue
		}
		r.cfg.Logger.InfoContext(ctx, "deleted instance", "instance", s.ID)
	}
	slices.SortFunc(res.Instances, func(a, b Observed) int { return cmp.Compare(a.ID, b.ID) })
	res.Err = errors.Join(errs...)
	return res
}

// Reboot restarts a running instance (the instances.reboot command).
func (r *Reconciler) Reboot(ctx context.Context, id string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.cfg.Runtime.Reboot(ctx, id); err != nil {
		return fmt.Errorf("vps: reboot %s: %w", id, err)
	}
	return nil
}
