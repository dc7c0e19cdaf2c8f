package converge

import (
	"context"
	"errors"
	"fmt"
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
// runtime; Apply makes the runtime match. The section holds instances of
// several tenants, so one bad instance fails alone: an invalid one (or one
// whose GPUs are not here, or whose runtime step fails) is reported failed
// with its reason, is neither applied nor deleted, and the others converge
// — the section stays CONVERGED and its report complete. Only a problem of
// the section itself (more instances than a host runs) or of the host (the
// runtime cannot list) fails the section.
type instancesHandler struct {
	rec *vps.Reconciler

	mu       sync.Mutex
	desired  []vps.Spec
	failed   map[string]string
	invalid  map[string]int64 // generation of each invalid instance
	statuses []*agentv1.InstanceStatus
}

func (*instancesHandler) Section() string { return "instances" }

// specs translates the section into vps specs: the valid ones, and the
// invalid ones by id with their problems and generation. err is a problem
// of the whole section.
func specs(sec *agentv1.Instances) (valid []vps.Spec, invalid map[string]string, gens map[string]int64, dropped int, err error) {
	all := make([]vps.Spec, 0, len(sec.GetInstances()))
	mem := map[string]string{}
	gens = map[string]int64{}
	for _, in := range sec.GetInstances() {
		if in.GetMemoryBytes()%mib != 0 {
			mem[in.GetId()] = vps.FieldError{Field: fmt.Sprintf("instances[%s].memory_bytes", in.GetId()),
				Problem: fmt.Sprintf("%d is not a whole number of MiB", in.GetMemoryBytes())}.Error()
		}
		gens[in.GetId()] = in.GetGeneration()
		all = append(all, vps.Spec{
			ID: in.GetId(), Generation: in.GetGeneration(), Image: in.GetImage(), Power: vps.State(in.GetState()),
			Size:     vps.Size{VCPUs: in.GetVcpus(), MemoryMiB: in.GetMemoryBytes() / mib, DiskGiB: in.GetDiskGib()},
			GPUUUIDs: slices.Clone(in.GetGpuUuids()), Hostname: in.GetHostname(), SSHKeys: slices.Clone(in.GetSshAuthorizedKeys()),
			UserData: in.GetUserData(), NetworkConfig: in.GetNetworkConfig(),
		})
	}
	valid, invalid, dropped, err = vps.ValidateEach(all)
	if err != nil {
		return nil, nil, nil, 0, err
	}
	for id, problem := range mem {
		if _, known := invalid[id]; !known && !slices.ContainsFunc(valid, func(s vps.Spec) bool { return s.ID == id }) {
			continue // a malformed id: dropped
		}
		if prev := invalid[id]; prev != "" {
			problem = prev + "; " + problem
		}
		invalid[id] = problem
	}
	valid = slices.DeleteFunc(valid, func(s vps.Spec) bool { return mem[s.ID] != "" })
	return valid, invalid, gens, dropped, nil
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
	h.desired, h.failed, h.invalid = nil, nil, nil
	want, invalid, gens, dropped, err := specs(d.GetInstances())
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
	h.invalid = map[string]int64{}
	for id, problem := range invalid {
		failed[id] = "invalid: " + problem
		h.invalid[id] = gens[id]
	}
	h.desired, h.failed = resolved, failed
	// Until Apply runs, report what the runtime has for the instances the
	// spec names, and the ones that cannot be applied.
	have := map[string]vps.Observed{}
	for _, o := range obs {
		have[o.ID] = o
	}
	var report []vps.Observed
	for _, s := range d.GetInstances().GetInstances() {
		id := s.GetId()
		o, ok := have[id]
		if reason, bad := failed[id]; bad {
			o.ID, o.State, o.Reason = id, vps.Failed, reason
		} else if !ok {
			continue
		}
		if slices.ContainsFunc(report, func(r vps.Observed) bool { return r.ID == id }) {
			continue // named twice: reported once
		}
		report = append(report, o)
	}
	h.statuses = h.withInvalid(statuses(report))
	p := Plan{}
	for _, s := range steps {
		if s.Op == vps.OpDelete && failed[s.ID] != "" {
			continue
		}
		p.Steps = append(p.Steps, s.String())
	}
	p.Summary = summary(report)
	if dropped > 0 {
		p.Summary += fmt.Sprintf("; %d instances with a malformed id ignored", dropped)
	}
	return p, nil
}

// withInvalid reports each invalid instance at the generation the spec
// gives it: retrying cannot help, and the control plane records the
// failure for that generation.
func (h *instancesHandler) withInvalid(st []*agentv1.InstanceStatus) []*agentv1.InstanceStatus {
	for _, s := range st {
		if gen, ok := h.invalid[s.GetId()]; ok {
			s.Generation = gen
		}
	}
	return st
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
	if res.Instances == nil && res.Err != nil {
		// The runtime itself failed (it could not list): the section fails.
		return errors.New(strings.ReplaceAll(res.Err.Error(), "\n", "; "))
	}
	// One instance failing fails only that instance: its status says why
	// (the reconciler logged it), and the next converge retries it.
	h.statuses = h.withInvalid(statuses(res.Instances))
	return nil
}

func (h *instancesHandler) instanceStatuses() []*agentv1.InstanceStatus {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.statuses
}
