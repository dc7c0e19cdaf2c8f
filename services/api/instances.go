package api

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/proto"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/instances"
	"github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// instancesAPI implements computev1.InstancesServiceServer: instances as
// desired state on the hosts of hosted pools (pkg/instances).
type instancesAPI struct {
	*Server
	computev1.UnimplementedInstancesServiceServer
}

func instancePB(in instances.Instance) *computev1.Instance {
	out := &computev1.Instance{
		Id: in.ID, TenantId: in.TenantID, PoolId: in.PoolID, NodeId: in.NodeID,
		Vcpus: int32(in.VCPUs), MemoryMib: in.MemoryMiB, DiskGib: in.DiskGiB, GpuCount: int32(in.GPUs), GpuModel: in.GPUModel,
		Image: in.Image, SshKeys: in.SSHKeys, PowerState: in.Power, State: in.State, Reason: in.Reason,
		Generation: in.Generation, ObservedGeneration: in.ObservedGeneration, ObservedState: in.ObservedState,
		Usage: &computev1.InstanceUsage{
			VcpuHours: in.Usage.VCPUHours, MemoryMibHours: in.Usage.MemoryMiBHours,
			DiskGibHours: in.Usage.DiskGiBHours, GpuHours: in.Usage.GPUHours,
		},
		CreateTime: ts(in.CreatedAt), UpdateTime: ts(in.UpdatedAt), PlaceTime: tsp(in.PlacedAt), DeleteTime: tsp(in.DeletedAt),
	}
	for _, g := range in.GPUDevices {
		out.Gpus = append(out.Gpus, &computev1.InstanceGpu{NodeId: g.NodeID, DeviceId: g.DeviceID, Model: g.Model, PciBusId: g.PCIBusID})
	}
	return out
}

func instanceResource(in instances.Instance) *authz.Resource {
	return &authz.Resource{Type: authz.TypeInstance, ID: in.ID, TenantID: in.TenantID, PoolID: in.PoolID}
}

func (s *instancesAPI) placeOptions() instances.PlaceOptions {
	return instances.PlaceOptions{LostAfter: s.capacity.LostAfter}
}

func (s *instancesAPI) Create(ctx context.Context, req *computev1.InstancesServiceCreateRequest) (*computev1.InstancesServiceCreateResponse, error) {
	if err := required("poolId", req.GetPoolId()); err != nil {
		return nil, err
	}
	in := instances.Instance{
		TenantID: req.GetTenantId(), PoolID: req.GetPoolId(),
		Size:     instances.Size{VCPUs: int(req.GetVcpus()), MemoryMiB: req.GetMemoryMib(), DiskGiB: req.GetDiskGib(), GPUs: int(req.GetGpuCount())},
		GPUModel: req.GetGpuModel(), Image: req.GetImage(), SSHKeys: req.GetSshKeys(), UserData: req.GetUserData(),
		IdempotencyKey: req.GetIdempotencyKey(),
	}
	if err := instances.Validate(in); err != nil {
		return nil, err
	}
	class, err := instances.PoolOf(ctx, s.db, req.GetTenantId(), req.GetPoolId())
	if err != nil {
		return nil, err
	}
	out := &computev1.InstancesServiceCreateResponse{}
	_, err = s.create(ctx, req, req.GetIdempotencyKey(), admission.Create{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: authz.Resource{Type: authz.TypeInstance, TenantID: req.GetTenantId(), PoolID: req.GetPoolId()},
		NewID:    func() string { return iam.NewID("inst") },
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, id string) (admission.Outcome, error) {
			in := in
			in.ID = id
			if class == "provider" {
				// No host: the vps.provider workflow makes its machine.
				stored, err := createAtProvider(ctx, tx, q, in)
				if err != nil {
					return admission.Outcome{}, err
				}
				return outcome(&computev1.InstancesServiceCreateResponse{Instance: instancePB(stored)}, "instance.created", instanceResource(stored))
			}
			// Quota, placement and the claim of every dimension, in this
			// transaction; the host's desired state follows.
			node, err := instances.Create(ctx, tx, &in, s.placeOptions())
			if err != nil {
				return admission.Outcome{}, err
			}
			if err := nodespec.Invalidate(ctx, q, node); err != nil {
				return admission.Outcome{}, err
			}
			stored, err := instances.Lock(ctx, tx, id)
			if err != nil {
				return admission.Outcome{}, err
			}
			return outcome(&computev1.InstancesServiceCreateResponse{Instance: instancePB(stored)}, "instance.placed", instanceResource(stored))
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

// instance reads an instance's projection row: NOT_FOUND on instanceId
// outside the caller's tenant.
func (s *instancesAPI) instance(ctx context.Context, tenant, id string) (authz.Resource, error) {
	if err := required("instanceId", id); err != nil {
		return authz.Resource{}, err
	}
	return authz.Get(ctx, s.db, tenant, authz.TypeInstance, id, "instanceId")
}

func (s *instancesAPI) Get(ctx context.Context, req *computev1.InstancesServiceGetRequest) (*computev1.InstancesServiceGetResponse, error) {
	res, err := s.instance(ctx, req.GetTenantId(), req.GetInstanceId())
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), res); err != nil {
		return nil, err
	}
	in, err := instances.Get(ctx, s.db, req.GetTenantId(), req.GetInstanceId())
	if err != nil {
		return nil, err
	}
	return &computev1.InstancesServiceGetResponse{Instance: instancePB(in)}, nil
}

func (s *instancesAPI) List(ctx context.Context, req *computev1.InstancesServiceListRequest) (*computev1.InstancesServiceListResponse, error) {
	pg, err := readPage(req)
	if err != nil {
		return nil, err
	}
	if st := req.GetState(); st != "" && !slicesContains(instances.States, st) {
		return nil, fault.New(fault.InvalidInput, "state", "expected one of pending, placed, running, stopped, failed, deleting, deleted, got %q", st)
	}
	if err := s.read(ctx, req.GetTenantId(), authz.TenantResource(req.GetTenantId())); err != nil {
		return nil, err
	}
	ins, err := instances.List(ctx, s.db, instances.ListFilter{TenantID: req.GetTenantId(), PoolID: req.GetPoolId(), State: req.GetState(), After: pg.after, Limit: pg.size})
	if err != nil {
		return nil, err
	}
	out := &computev1.InstancesServiceListResponse{}
	for _, in := range ins {
		out.Instances = append(out.Instances, instancePB(in))
	}
	out.NextPageToken = nextPage(pg, ins, func(in instances.Instance) string { return in.ID })
	return out, nil
}

// change runs a desired-state change of an instance through admission:
// apply changes it in the transaction and says whether it did; a change
// invalidates the host's desired state in the same transaction. event is
// the outbox event; wrap builds the response from the instance.
func (s *instancesAPI) change(ctx context.Context, tenant, id, event string,
	apply func(ctx context.Context, tx pgx.Tx) (instances.Instance, bool, error),
	wrap func(*computev1.Instance) proto.Message,
	out proto.Message) error {
	res, err := s.instance(ctx, tenant, id)
	if err != nil {
		return err
	}
	return s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: tenant},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			before, err := instances.Lock(ctx, tx, id)
			if err != nil {
				return admission.Outcome{}, err
			}
			in, changed, err := apply(ctx, tx)
			if err != nil {
				return admission.Outcome{}, err
			}
			if changed && before.NodeID != "" {
				if err := nodespec.Invalidate(ctx, q, before.NodeID); err != nil {
					return admission.Outcome{}, err
				}
			}
			if changed && before.NodeID == "" {
				// A provider instance: its workflow acts (services/vps).
				if err := q.Enqueue(ctx, instances.ProviderJob, id); err != nil {
					return admission.Outcome{}, err
				}
			}
			return outcome(wrap(instancePB(in)), event, nil)
		},
	}, out)
}

func (s *instancesAPI) Stop(ctx context.Context, req *computev1.InstancesServiceStopRequest) (*computev1.InstancesServiceStopResponse, error) {
	out := &computev1.InstancesServiceStopResponse{}
	err := s.change(ctx, req.GetTenantId(), req.GetInstanceId(), "instance.stopped",
		func(ctx context.Context, tx pgx.Tx) (instances.Instance, bool, error) {
			return instances.SetPower(ctx, tx, req.GetInstanceId(), instances.PowerStopped)
		},
		func(in *computev1.Instance) proto.Message {
			return &computev1.InstancesServiceStopResponse{Instance: in}
		}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *instancesAPI) Start(ctx context.Context, req *computev1.InstancesServiceStartRequest) (*computev1.InstancesServiceStartResponse, error) {
	out := &computev1.InstancesServiceStartResponse{}
	err := s.change(ctx, req.GetTenantId(), req.GetInstanceId(), "instance.started",
		func(ctx context.Context, tx pgx.Tx) (instances.Instance, bool, error) {
			return instances.SetPower(ctx, tx, req.GetInstanceId(), instances.PowerRunning)
		},
		func(in *computev1.Instance) proto.Message {
			return &computev1.InstancesServiceStartResponse{Instance: in}
		}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *instancesAPI) Resize(ctx context.Context, req *computev1.InstancesServiceResizeRequest) (*computev1.InstancesServiceResizeResponse, error) {
	size := instances.Size{VCPUs: int(req.GetVcpus()), MemoryMiB: req.GetMemoryMib(), DiskGiB: req.GetDiskGib(), GPUs: int(req.GetGpuCount())}
	if err := required("instanceId", req.GetInstanceId()); err != nil {
		return nil, err
	}
	if err := instances.ValidSize(size); err != nil {
		return nil, err
	}
	out := &computev1.InstancesServiceResizeResponse{}
	err := s.change(ctx, req.GetTenantId(), req.GetInstanceId(), "instance.resized",
		func(ctx context.Context, tx pgx.Tx) (instances.Instance, bool, error) {
			return instances.Resize(ctx, tx, req.GetInstanceId(), size)
		},
		func(in *computev1.Instance) proto.Message {
			return &computev1.InstancesServiceResizeResponse{Instance: in}
		}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *instancesAPI) Delete(ctx context.Context, req *computev1.InstancesServiceDeleteRequest) (*computev1.InstancesServiceDeleteResponse, error) {
	out := &computev1.InstancesServiceDeleteResponse{}
	err := s.change(ctx, req.GetTenantId(), req.GetInstanceId(), "instance.deleted",
		func(ctx context.Context, tx pgx.Tx) (instances.Instance, bool, error) {
			in, err := instances.Lock(ctx, tx, req.GetInstanceId())
			if err != nil {
				return instances.Instance{}, false, err
			}
			if in.NodeID == "" {
				// Deleting until the workflow deleted its machine.
				return instances.DeleteProvider(ctx, tx, req.GetInstanceId())
			}
			return instances.Delete(ctx, tx, req.GetInstanceId())
		},
		func(in *computev1.Instance) proto.Message {
			return &computev1.InstancesServiceDeleteResponse{Instance: in}
		}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

// Reboot queues instance.reboot on the instance's host: a command with a
// deadline (notAfterSeconds, as commands.run's), which the host refuses
// past it (EXPIRED) and runs at most once. Only a placed, live instance
// whose desired power state is running can be rebooted (else CONFLICT);
// the decision is compute:instances:reboot on the instance.
func (s *instancesAPI) Reboot(ctx context.Context, req *computev1.InstancesServiceRebootRequest) (*computev1.InstancesServiceRebootResponse, error) {
	secs := req.GetNotAfterSeconds()
	if secs == 0 {
		secs = defaultNotAfterSeconds
	}
	if secs < minNotAfterSeconds || secs > maxNotAfterSeconds {
		return nil, fault.New(fault.InvalidInput, "notAfterSeconds", "expected 0 (meaning %d) or %d to %d, got %d",
			defaultNotAfterSeconds, minNotAfterSeconds, maxNotAfterSeconds, req.GetNotAfterSeconds())
	}
	res, err := s.instance(ctx, req.GetTenantId(), req.GetInstanceId())
	if err != nil {
		return nil, err
	}
	p, _ := iam.PrincipalFrom(ctx)
	key := ""
	if req.GetIdempotencyKey() != "" {
		key = "api:" + p.IdentityID + ":" + req.GetIdempotencyKey()
	}
	out := &computev1.InstancesServiceRebootResponse{}
	_, err = s.create(ctx, req, req.GetIdempotencyKey(), admission.Create{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Existing: true, // decided on the instance; its projection row exists
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, _ string) (admission.Outcome, error) {
			in, err := instances.Lock(ctx, tx, req.GetInstanceId())
			if err != nil {
				return admission.Outcome{}, err
			}
			switch {
			case !instances.Live(in.State):
				return admission.Outcome{}, fault.New(fault.Conflict, "instanceId", "instance %s is %s", in.ID, in.State)
			case in.NodeID == "":
				return admission.Outcome{}, fault.New(fault.Conflict, "instanceId", "instance %s is not on a host (state %s)", in.ID, in.State)
			case in.Power != instances.PowerRunning:
				return admission.Outcome{}, fault.New(fault.Conflict, "instanceId", "instance %s is stopped: start it instead", in.ID)
			}
			c, _, err := s.kinds.Enqueue(ctx, tx, commands.Request{
				NodeID: in.NodeID, Kind: commands.KindInstanceReboot, Payload: map[string]any{"instanceId": in.ID},
				IdempotencyKey: key, NotAfter: s.now().Add(time.Duration(secs) * time.Second), CreatedBy: p.IdentityID,
			})
			if err != nil {
				return admission.Outcome{}, err
			}
			pb, err := commandPB(c)
			if err != nil {
				return admission.Outcome{}, err
			}
			o, err := outcome(&computev1.InstancesServiceRebootResponse{Instance: instancePB(in), Command: pb}, "command.requested", nil)
			o.Detail = map[string]any{"commandId": c.ID, "kind": c.Kind, "instanceId": in.ID}
			o.Event.Resource = c.ID
			q.WakeCommands(in.NodeID) // the host's gateway
			return o, err
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

func instanceQuotaPB(q instances.Quota) *computev1.InstanceQuota {
	return &computev1.InstanceQuota{PoolId: q.PoolID, TenantId: q.TenantID, Vcpus: q.VCPUs, MemoryMib: q.MemoryMiB, DiskGib: q.DiskGiB,
		Gpus: q.GPUs, UpdateTime: ts(q.UpdatedAt)}
}

// maxQuota bounds a quota's dimension.
const maxQuota = 1 << 40

func (s *instancesAPI) SetQuota(ctx context.Context, req *computev1.InstancesServiceSetQuotaRequest) (*computev1.InstancesServiceSetQuotaResponse, error) {
	if err := required("forTenantId", req.GetForTenantId()); err != nil {
		return nil, err
	}
	if !iam.ValidTenantID(req.GetForTenantId()) || !iam.Covers(req.GetTenantId(), req.GetForTenantId()) {
		return nil, fault.New(fault.InvalidInput, "forTenantId", "%q is not %s or one of its descendants", req.GetForTenantId(), req.GetTenantId())
	}
	for _, d := range []struct {
		field string
		v     *int64
	}{{"vcpus", req.Vcpus}, {"memoryMiB", req.MemoryMib}, {"diskGiB", req.DiskGib}, {"gpus", req.Gpus}} {
		if d.v != nil && (*d.v < 0 || *d.v > maxQuota) {
			return nil, fault.New(fault.InvalidInput, d.field, "expected 0 to %d, got %d", int64(maxQuota), *d.v)
		}
	}
	if err := required("poolId", req.GetPoolId()); err != nil {
		return nil, err
	}
	res, err := authz.Get(ctx, s.db, req.GetTenantId(), authz.TypePool, req.GetPoolId(), "poolId")
	if err != nil {
		return nil, err
	}
	out := &computev1.InstancesServiceSetQuotaResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, _ *reconcile.Queue) (admission.Outcome, error) {
			if _, err := iam.GetTenant(ctx, tx, req.GetForTenantId()); fault.CodeOf(err) == fault.NotFound {
				return admission.Outcome{}, fault.New(fault.NotFound, "forTenantId", "no tenant %q", req.GetForTenantId())
			} else if err != nil {
				return admission.Outcome{}, err
			}
			q, set, err := instances.SetQuota(ctx, tx, instances.Quota{PoolID: res.ID, TenantID: req.GetForTenantId(),
				VCPUs: req.Vcpus, MemoryMiB: req.MemoryMib, DiskGiB: req.DiskGib, GPUs: req.Gpus})
			if err != nil {
				return admission.Outcome{}, err
			}
			resp := &computev1.InstancesServiceSetQuotaResponse{}
			if set {
				resp.Quota = instanceQuotaPB(q)
			}
			return outcome(resp, "instanceQuota.set", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *instancesAPI) ListQuotas(ctx context.Context, req *computev1.InstancesServiceListQuotasRequest) (*computev1.InstancesServiceListQuotasResponse, error) {
	if err := required("poolId", req.GetPoolId()); err != nil {
		return nil, err
	}
	res, err := authz.Get(ctx, s.db, req.GetTenantId(), authz.TypePool, req.GetPoolId(), "poolId")
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), res); err != nil {
		return nil, err
	}
	qs, err := instances.ListQuotas(ctx, s.db, res.ID)
	if err != nil {
		return nil, err
	}
	out := &computev1.InstancesServiceListQuotasResponse{}
	for _, q := range qs {
		out.Quotas = append(out.Quotas, instanceQuotaPB(q))
	}
	return out, nil
}
