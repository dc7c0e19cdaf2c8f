package api

import (
	"context"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/bettercompute/bettercompute/proto/agentrelease"
	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
	"github.com/bettercompute/bettercompute/proto/runtimespec"
	"github.com/bettercompute/bettercompute/proto/sitespec"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/instances"
	"github.com/bettercompute/bettercompute/pkg/miglayouts"
	"github.com/bettercompute/bettercompute/pkg/nodespec"
	poolstore "github.com/bettercompute/bettercompute/pkg/pools"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/rollouts"
	"github.com/bettercompute/bettercompute/pkg/tunnels"
)

// pools implements computev1.PoolsServiceServer.
type pools struct {
	*Server
	computev1.UnimplementedPoolsServiceServer
}

func poolPB(p poolstore.Pool) *computev1.Pool {
	return &computev1.Pool{
		Id: p.ID, TenantId: p.TenantID, Name: p.Name, Class: p.Class, Description: p.Description,
		Labels: p.Labels, Generation: p.Generation, CreateTime: ts(p.CreatedAt), UpdateTime: ts(p.UpdatedAt),
		Acceptance: p.Acceptance, Sharing: p.Sharing, DefaultQuota: int32(p.DefaultQuota),
	}
}

func poolResource(p poolstore.Pool) *authz.Resource {
	return &authz.Resource{Type: authz.TypePool, ID: p.ID, TenantID: p.TenantID, PoolID: p.ID, Labels: p.Labels}
}

// MaxDescription bounds a pool's description.
const MaxDescription = 1024

func (s *pools) Create(ctx context.Context, req *computev1.PoolsServiceCreateRequest) (*computev1.PoolsServiceCreateResponse, error) {
	if err := validName("name", req.GetName()); err != nil {
		return nil, err
	}
	if err := required("class", req.GetClass()); err != nil {
		return nil, err
	}
	if !poolstore.ValidClass(req.GetClass()) {
		return nil, fault.New(fault.InvalidInput, "class", "expected one of %s, got %q", strings.Join(poolstore.Classes, ", "), req.GetClass())
	}
	if len(req.GetDescription()) > MaxDescription {
		return nil, fault.New(fault.InvalidInput, "description", "at most %d bytes", MaxDescription)
	}
	if err := validLabels(req.GetLabels()); err != nil {
		return nil, err
	}
	acceptance, err := validAcceptance(req.GetAcceptance())
	if err != nil {
		return nil, err
	}
	sharing, err := validSharing(req.GetSharing())
	if err != nil {
		return nil, err
	}
	defaultQuota, err := validDefaultQuota(req.GetDefaultQuota())
	if err != nil {
		return nil, err
	}
	out := &computev1.PoolsServiceCreateResponse{}
	_, err = s.create(ctx, req, req.GetIdempotencyKey(), admission.Create{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: authz.Resource{Type: authz.TypePool, TenantID: req.GetTenantId(), Labels: req.GetLabels()},
		NewID:    func() string { return iam.NewID("pool") },
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, id string) (admission.Outcome, error) {
			p, err := poolstore.Create(ctx, tx, poolstore.Pool{
				ID: id, TenantID: req.GetTenantId(), Name: req.GetName(), Class: req.GetClass(),
				Description: req.GetDescription(), Labels: req.GetLabels(), Acceptance: acceptance,
				Sharing: sharing, DefaultQuota: defaultQuota,
			})
			if err != nil {
				return admission.Outcome{}, err
			}
			return outcome(&computev1.PoolsServiceCreateResponse{Pool: poolPB(p)}, "pool.created", poolResource(p))
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *pools) Get(ctx context.Context, req *computev1.PoolsServiceGetRequest) (*computev1.PoolsServiceGetResponse, error) {
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
	p, err := poolstore.Get(ctx, s.db, req.GetTenantId(), req.GetPoolId())
	if err != nil {
		return nil, err
	}
	return &computev1.PoolsServiceGetResponse{Pool: poolPB(p)}, nil
}

func (s *pools) List(ctx context.Context, req *computev1.PoolsServiceListRequest) (*computev1.PoolsServiceListResponse, error) {
	pg, err := readPage(req)
	if err != nil {
		return nil, err
	}
	if req.GetClass() != "" && !poolstore.ValidClass(req.GetClass()) {
		return nil, fault.New(fault.InvalidInput, "class", "expected one of %s, got %q", strings.Join(poolstore.Classes, ", "), req.GetClass())
	}
	if err := s.read(ctx, req.GetTenantId(), authz.TenantResource(req.GetTenantId())); err != nil {
		return nil, err
	}
	ps, err := poolstore.List(ctx, s.db, req.GetTenantId(), req.GetClass(), pg.after, pg.size)
	if err != nil {
		return nil, err
	}
	out := &computev1.PoolsServiceListResponse{}
	for _, p := range ps {
		out.Pools = append(out.Pools, poolPB(p))
	}
	out.NextPageToken = nextPage(pg, ps, func(p poolstore.Pool) string { return p.ID })
	return out, nil
}

// validAcceptance checks a pool's acceptance checks: known kinds, each once.
func validAcceptance(checks []string) ([]string, error) {
	out := make([]string, 0, len(checks))
	for _, c := range checks {
		if !slices.Contains(poolstore.AcceptanceChecks, c) {
			return nil, fault.New(fault.InvalidInput, "acceptance", "unknown acceptance check %q (known: %s)", c, strings.Join(poolstore.AcceptanceChecks, ", "))
		}
		if slices.Contains(out, c) {
			return nil, fault.New(fault.InvalidInput, "acceptance", "%q is listed twice", c)
		}
		out = append(out, c)
	}
	return out, nil
}

// validSharing checks a pool's sharing setting; empty is "none".
func validSharing(v string) (string, error) {
	if v == "" {
		return poolstore.SharingNone, nil
	}
	if !slices.Contains(poolstore.Sharings, v) {
		return "", fault.New(fault.InvalidInput, "sharing", "expected one of %s, got %q", strings.Join(poolstore.Sharings, ", "), v)
	}
	return v, nil
}

// validDefaultQuota checks a pool's default quota (GPUs per child tenant).
func validDefaultQuota(n int32) (int, error) {
	if n < 0 || n > poolstore.MaxDefaultQuota {
		return 0, fault.New(fault.InvalidInput, "defaultQuota", "expected 0 (none) to %d GPUs per tenant, got %d", poolstore.MaxDefaultQuota, n)
	}
	return int(n), nil
}

// specSection validates a NodeSpec section given as JSON and returns its
// canonical proto3 JSON; a nil struct clears the section.
func specSection(st *structpb.Struct, into proto.Message, field string) ([]byte, error) {
	if st == nil {
		return []byte("{}"), nil
	}
	raw, err := protojson.Marshal(st)
	if err != nil {
		return nil, fault.New(fault.InvalidInput, field, "not JSON: %v", err)
	}
	if err := protojson.Unmarshal(raw, into); err != nil {
		return nil, fault.New(fault.InvalidInput, field, "not a valid %s section: %v", field, err)
	}
	return protojson.Marshal(into)
}

// poolSection validates the pool settings section named (site, health or
// runtime) as pools.update and rollouts.create take it, with the node's own
// rules (proto/sitespec, proto/runtimespec: a value its daemon would refuse
// never reaches a node), and returns its canonical proto3 JSON; a nil
// struct clears the section. Error fields are prefix + the section's path.
func poolSection(name string, st *structpb.Struct, prefix string) ([]byte, error) {
	switch name {
	case "site":
		site := &agentv1.SiteSettings{}
		b, err := specSection(st, site, prefix+"site")
		if err != nil {
			return nil, err
		}
		if bad := sitespec.Validate(sitespec.FromProto(site)); len(bad) > 0 {
			return nil, fault.New(fault.InvalidInput, prefix+"site."+jsonName(site, bad[0].Field), "%s", bad[0].Msg)
		}
		return b, nil
	case "health":
		return specSection(st, &agentv1.HealthSettings{}, prefix+"health")
	case "runtime":
		rt := &agentv1.RuntimeSettings{}
		b, err := specSection(st, rt, prefix+"runtime")
		if err != nil {
			return nil, err
		}
		if bad := runtimespec.Validate(rt); len(bad) > 0 {
			return nil, fault.New(fault.InvalidInput, prefix+"runtime."+jsonName(rt, bad[0].Field), "%s", bad[0].Msg)
		}
		return b, nil
	}
	return nil, fault.New(fault.InvalidInput, prefix+"updateMask", "%q is not a pool settings section (site, health, runtime)", name)
}

// agentSection validates a pool's agent settings as pools.update and
// rollouts.create take them: a release manifest that parses, is well formed
// and signed, as agent.upgrade's admission checks it (the signature itself,
// the expiry and the counter are each node's to check, against the release
// key it pins: the control plane need not hold it). It returns the NodeSpec
// agent section's canonical proto3 JSON (the manifest re-encoded) and the
// manifest's version. An expired manifest is refused here too (every node
// would refuse it). No manifest clears the section ("{}", version "").
// Error fields are prefix + "agent.releaseManifest".
func agentSection(st *computev1.PoolAgentSettings, prefix string) ([]byte, string, error) {
	field := prefix + "agent.releaseManifest"
	raw := st.GetReleaseManifest()
	if raw == "" {
		return []byte("{}"), "", nil
	}
	if len(raw) > agentrelease.MaxManifestBytes {
		return nil, "", fault.New(fault.InvalidInput, field, "at most %d bytes, got %d", agentrelease.MaxManifestBytes, len(raw))
	}
	m, err := agentrelease.Parse([]byte(raw))
	if err == nil {
		err = agentrelease.Check(m)
	}
	if err != nil {
		return nil, "", fault.Wrap(err, fault.InvalidInput, field, "%v", err)
	}
	if len(m.Signature) == 0 || m.KeyID == "" {
		return nil, "", fault.New(fault.InvalidInput, field, "the manifest is not signed (better-compute artifacts publish)")
	}
	if !time.Now().Before(m.NotAfter) {
		return nil, "", fault.New(fault.InvalidInput, field, "the manifest of %s expired at %s: publish it again", m.Version, m.NotAfter.UTC().Format(time.RFC3339))
	}
	enc, err := agentrelease.Encode(m)
	if err != nil {
		return nil, "", fault.Wrap(err, fault.InvalidInput, field, "%v", err)
	}
	b, err := protojson.Marshal(&agentv1.AgentSettings{ReleaseManifest: enc})
	if err != nil {
		return nil, "", err
	}
	return b, m.Version, nil
}

// poolAgentPB is a stored agent section (proto3 JSON of AgentSettings) as
// the API shows it: the manifest's JSON text.
func poolAgentPB(section []byte) *computev1.PoolAgentSettings {
	var a agentv1.AgentSettings
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(section, &a); err != nil {
		return &computev1.PoolAgentSettings{}
	}
	return &computev1.PoolAgentSettings{ReleaseManifest: string(a.GetReleaseManifest())}
}

// jsonName is the JSON name of msg's field named (in proto) field.
func jsonName(msg proto.Message, field string) string {
	if fd := msg.ProtoReflect().Descriptor().Fields().ByName(protoreflect.Name(field)); fd != nil {
		return fd.JSONName()
	}
	return field
}

func (s *pools) Update(ctx context.Context, req *computev1.PoolsServiceUpdateRequest) (*computev1.PoolsServiceUpdateResponse, error) {
	if err := required("poolId", req.GetPoolId()); err != nil {
		return nil, err
	}
	if len(req.GetUpdateMask().GetPaths()) == 0 {
		return nil, fault.New(fault.InvalidInput, "updateMask", "required: name the fields to change (description, labels, site, health, runtime, mig, agent, acceptance, sharing, defaultQuota, vps, provider, tunnels)")
	}
	var u poolstore.Update
	var vps *instances.Settings
	var provider *providerUpdate
	var mig *[]miglayouts.Layout
	var tunnelRules *[]*agentv1.TunnelRule
	for _, path := range req.GetUpdateMask().GetPaths() {
		switch path {
		case "tunnels":
			r, err := tunnelRulesOf(req.GetTunnels(), "tunnels")
			if err != nil {
				return nil, err
			}
			tunnelRules = &r
		case "description":
			if len(req.GetDescription()) > MaxDescription {
				return nil, fault.New(fault.InvalidInput, "description", "at most %d bytes", MaxDescription)
			}
			d := req.GetDescription()
			u.Description = &d
		case "labels":
			if err := validLabels(req.GetLabels()); err != nil {
				return nil, err
			}
			u.Labels, u.SetLabels = req.GetLabels(), true
		case "site":
			b, err := poolSection("site", req.GetSite(), "")
			if err != nil {
				return nil, err
			}
			u.Site = b
		case "health":
			b, err := poolSection("health", req.GetHealth(), "")
			if err != nil {
				return nil, err
			}
			u.Health = b
		case "runtime":
			b, err := poolSection("runtime", req.GetRuntime(), "")
			if err != nil {
				return nil, err
			}
			u.Runtime = b
		case "agent":
			b, _, err := agentSection(req.GetAgent(), "")
			if err != nil {
				return nil, err
			}
			u.Agent = b
		case "acceptance":
			a, err := validAcceptance(req.GetAcceptance())
			if err != nil {
				return nil, err
			}
			u.Acceptance = a
		case "sharing":
			v, err := validSharing(req.GetSharing())
			if err != nil {
				return nil, err
			}
			u.Sharing = &v
		case "vps":
			v := req.GetVps()
			vps = &instances.Settings{
				Host:    instances.Size{VCPUs: int(v.GetHost().GetVcpus()), MemoryMiB: v.GetHost().GetMemoryMib(), DiskGiB: v.GetHost().GetDiskGib()},
				Reserve: instances.Size{VCPUs: int(v.GetReserve().GetVcpus()), MemoryMiB: v.GetReserve().GetMemoryMib(), DiskGiB: v.GetReserve().GetDiskGib()},
			}
			if err := instances.ValidSettings(*vps, "vps"); err != nil {
				return nil, err
			}
		case "provider":
			pu, err := s.validProvider(req.GetProvider())
			if err != nil {
				return nil, err
			}
			provider = pu
		case "mig":
			l, err := migLayouts(req.GetMig(), true)
			if err != nil {
				return nil, err
			}
			mig = &l
		case "default_quota", "defaultQuota":
			n, err := validDefaultQuota(req.GetDefaultQuota())
			if err != nil {
				return nil, err
			}
			u.DefaultQuota = &n
		default:
			return nil, fault.New(fault.InvalidInput, "updateMask", "field %q cannot be updated (description, labels, site, health, runtime, mig, agent, acceptance, sharing, defaultQuota, vps, provider, tunnels can)", path)
		}
	}
	res, err := authz.Get(ctx, s.db, req.GetTenantId(), authz.TypePool, req.GetPoolId(), "poolId")
	if err != nil {
		return nil, err
	}
	out := &computev1.PoolsServiceUpdateResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			p, err := poolstore.Apply(ctx, tx, req.GetTenantId(), req.GetPoolId(), u)
			if err != nil {
				return admission.Outcome{}, err
			}
			if vps != nil {
				if p.Class != poolstore.ClassVPSHost {
					return admission.Outcome{}, fault.New(fault.InvalidInput, "vps", "pool %s is a %s pool; vps settings apply to vps-host pools", p.ID, p.Class)
				}
				// The hosts' totals follow in this transaction.
				if err := instances.SetSettings(ctx, tx, p.ID, *vps); err != nil {
					return admission.Outcome{}, err
				}
			}
			if provider != nil {
				if err := s.setProvider(ctx, tx, p.ID, p.Class, p.TenantID, provider); err != nil {
					return admission.Outcome{}, err
				}
			}
			if mig != nil {
				// A rollout of MIG layouts in flight owns the pool's.
				if r, ok, err := rollouts.ActiveOf(ctx, tx, p.ID); err != nil {
					return admission.Outcome{}, err
				} else if ok && r.Change.Names("mig") {
					return admission.Outcome{}, fault.New(fault.Conflict, "updateMask", "pool %s has an active rollout %s (%s) of its MIG layouts: cancel it or wait for it", p.ID, r.ID, r.State)
				}
				if err := setPoolMig(ctx, tx, q, p, *mig, req.GetMig().GetResetPolicy()); err != nil {
					return admission.Outcome{}, err
				}
			}
			if tunnelRules != nil {
				if err := tunnels.SetPoolRules(ctx, tx, p.ID, *tunnelRules); err != nil {
					return admission.Outcome{}, err
				}
				if err := nodespec.InvalidatePool(ctx, tx, q, p.ID); err != nil {
					return admission.Outcome{}, err
				}
			}
			if u.Site != nil || u.Health != nil || u.Runtime != nil || u.Agent != nil {
				// A rollout in flight owns the pool's settings until it
				// ends: its success writes them (docs/rollouts.md).
				if r, ok, err := rollouts.ActiveOf(ctx, tx, p.ID); err != nil {
					return admission.Outcome{}, err
				} else if ok {
					return admission.Outcome{}, fault.New(fault.Conflict, "updateMask", "pool %s has an active rollout %s (%s): cancel it or wait for it before changing site, health, runtime or agent", p.ID, r.ID, r.State)
				}
				// Every node of the pool gets a new desired state, in this
				// transaction.
				if err := nodespec.InvalidatePool(ctx, tx, q, p.ID); err != nil {
					return admission.Outcome{}, err
				}
			}
			return outcome(&computev1.PoolsServiceUpdateResponse{Pool: poolPB(p)}, "pool.updated", poolResource(p))
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}
