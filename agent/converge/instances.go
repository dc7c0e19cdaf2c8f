package converge

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/bettercompute/bettercompute/agent/vps"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// PlanTimeout bounds listing the VPS runtime's instances while planning.
const PlanTimeout = 30 * time.Second

const mib = 1 << 20

// instanceReporter is a handler that reports per-instance status with its
// section.
type instanceReporter interface {
	instanceStatuses() []*agentv1.InstanceStatus
}

// instances is the instances section's handler: delegating to rec, or
// unsupported when the node runs no VPS runtime.
func instances(rec *vps.Reconciler) Handler {
	if rec == nil {
		return unsupported{section: "instances", would: planInstances}
	}
	return &instancesHandler{rec: rec}
}

// instancesHandler converges the instances section through a
// vps.Reconciler: Plan validates the section, resolves GPUs and lists the
// runtime; Apply makes the runtime match. An invalid section changes
// nothing (FAILED_TERMINAL), so a bad spec never deletes an instance.
type instancesHandler struct {
	rec *vps.Reconciler

	mu       sync.Mutex
	desired  []vps.Spec
	failed   map[string]string
	statuses []*agentv1.InstanceStatus
}

func (*instancesHandler) Section() string { return "instances" }

// specs translates the section into vps specs.
func specs(sec *agentv1.Instances) ([]vps.Spec, error) {
	var errs []error
	out := make([]vps.Spec, 0, len(sec.GetInstances()))
	for _, in := range sec.GetInstances() {
		if in.GetMemoryBytes()%mib != 0 {
			errs = append(errs, vps.FieldError{Field: fmt.Sprintf("instances[%s].memory_bytes", in.GetId()),
				Problem: fmt.Sprintf("%d is not a whole number of MiB", in.GetMemoryBytes())})
		}
		out = append(out, vps.Spec{
			ID: in.GetId(), Generation: in.GetGeneration(), Image: in.GetImage(), Power: vps.State(in.GetState()),
			Size:     vps.Size{VCPUs: in.GetVcpus(), MemoryMiB: in.GetMemoryBytes() / mib, DiskGiB: in.GetDiskGib()},
			GPUUUIDs: slices.Clone(in.GetGpuUuids()), Hostname: in.GetHostname(), SSHKeys: slices.Clone(in.GetSshAuthorizedKeys()),
			UserData: in.GetUserData(), NetworkConfig: in.GetNetworkConfig(),
		})
	}
	if err := vps.Validate(out); err != nil {
		errs = append(errs, err)
	}
	return out, errors.Join(errs...)
}

// status translates one observed instance.
func status(o vps.Observed) *agentv1.InstanceStatus {
	return &agentv1.InstanceStatus{Id: o.ID, State: string(o.State), Reason: o.Reason, Generation: o.Generation,
		Vcpus: o.Size.VCPUs, MemoryBytes: o.Size.MemoryMiB * mib, DiskGib: o.Size.DiskGiB, GpuPciAddresses: slices.Clone(o.GPUs)}
}

func statuses(obs []vps.Observed) []*agentv1.InstanceStatus {
	out := make([]*agentv1.InstanceStatus, 0, len(obs))
	for _, o := range obs {
		out = append(out, status(o))
	}
	return out
}

func (h *instancesHandler) Plan(_ Current, d *agentv1.NodeSpec) (Plan, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.desired, h.failed = nil, nil
	want, err := specs(d.GetInstances())
	if err != nil {
		h.statuses = nil
		return Plan{Terminal: "invalid instances section: " + strings.ReplaceAll(err.Error(), "\n", "; ")}, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), PlanTimeout)
	defer cancel()
	resolved, failed, err := h.rec.Resolve(ctx, want)
	if err != nil {
		return Plan{}, err
	}
	steps, obs, err := h.rec.Plan(ctx, resolved)
	if err != nil {
		return Plan{}, err
	}
	h.desired, h.failed = resolved, failed
	// Until Apply runs, report what the runtime has for the instances the
	// spec names, and the ones that cannot be applied.
	have := map[string]vps.Observed{}
	for _, o := range obs {
		have[o.ID] = o
	}
	var report []vps.Observed
	for _, s := range want {
		o, ok := have[s.ID]
		if reason, bad := failed[s.ID]; bad {
			o.ID, o.State, o.Reason = s.ID, vps.Failed, reason
		} else if !ok {
			continue
		}
		report = append(report, o)
	}
	h.statuses = statuses(report)
	p := Plan{}
	for _, s := range steps {
		if s.Op == vps.OpDelete && failed[s.ID] != "" {
			continue
		}
		p.Steps = append(p.Steps, s.String())
	}
	if len(failed) > 0 {
		var parts []string
		for _, id := range slices.Sorted(maps.Keys(failed)) {
			parts = append(parts, id+": "+failed[id])
		}
		p.Failure = "instances not applied: " + strings.Join(parts, "; ")
	}
	p.Summary = summary(report)
	return p, nil
}

// summary is the converged section's reason: "runs 2 instances: inst_a
// running, inst_b stopped".
func summary(obs []vps.Observed) string {
	if len(obs) == 0 {
		return "runs no instances"
	}
	parts := make([]string, 0, len(obs))
	for _, o := range obs {
		parts = append(parts, o.ID+" "+string(o.State))
	}
	return fmt.Sprintf("runs %d instances: %s", len(obs), strings.Join(parts, ", "))
}

func (h *instancesHandler) Apply(ctx context.Context, _ Current, _ Plan) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	res := h.rec.Apply(ctx, h.desired, h.failed)
	if res.Instances != nil || res.Err == nil {
		h.statuses = statuses(res.Instances)
	}
	if res.Err != nil {
		return errors.New(strings.ReplaceAll(res.Err.Error(), "\n", "; "))
	}
	return nil
}

func (h *instancesHandler) instanceStatuses() []*agentv1.InstanceStatus {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.statuses
}
