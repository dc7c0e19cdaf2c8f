package api

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"maps"
	"net/url"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/machines"
	poolstore "github.com/bettercompute/bettercompute/pkg/pools"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/secrets"
	"github.com/bettercompute/bettercompute/pkg/sitetasks"
)

// metalAPI implements computev1.MetalServiceServer. It never answers, logs
// or records a BMC credential: the password is sealed in the transaction
// that stores the machine and only its secret's id (bmcCredentialsRef)
// leaves it.
type metalAPI struct {
	*Server
	computev1.UnimplementedMetalServiceServer
}

// deletableStates are where metal.delete may take a machine from: nothing
// of the flow is in flight there.
var deletableStates = []machines.State{machines.StateEnrolled, machines.StateReady, machines.StateFailed}

func machinePB(m machines.Machine) *computev1.Machine {
	out := &computev1.Machine{
		Id: m.ID, TenantId: m.TenantID, SiteId: m.SiteID, PoolId: m.PoolID, Name: m.Name, Labels: m.Labels,
		BmcAddress: m.BMCAddress, BmcCredentialsRef: m.BMCCredentialsRef, State: string(m.State), Purpose: string(m.Purpose),
		BmcCertificateSha256: m.BMCCertificateSHA256, BmcCaPinned: m.BMCCAPEM != "", BmcInsecureSkipVerify: m.BMCInsecure,
		StepAttempts: int32(m.StepAttempts), StepStartTime: ts(m.StepStartedAt), StepDeadlineTime: tsp(m.StepDeadline),
		FailedStep: string(m.FailedStep), FailedReason: m.FailedReason, Macs: m.MACs, NodeId: m.NodeID,
		CloudInitBytes: int32(len(m.CloudInit)), Boot: string(m.Boot), Generation: m.Generation,
		CreateTime: ts(m.CreatedAt), UpdateTime: ts(m.UpdatedAt),
	}
	if m.Image != nil {
		out.Image = &computev1.MachineImage{Url: m.Image.URL, Sha256: m.Image.SHA256, SizeBytes: m.Image.SizeBytes}
	}
	var inv map[string]any
	if len(m.Inventory) > 0 && json.Unmarshal(m.Inventory, &inv) == nil && len(inv) > 0 {
		out.Inventory, _ = structpb.NewStruct(inv)
	}
	return out
}

// machineOutcome is outcome with the event's payload the answer less the
// machine's bmcCredentialsRef: events reach more readers (webhooks,
// events.watch, anyone with events.list in the tenant) than the machine
// does, and a secret's id is not theirs to name.
func machineOutcome(resp proto.Message, m *computev1.Machine, event string, res *authz.Resource) (admission.Outcome, error) {
	out, err := outcome(resp, event, res)
	if err != nil || m == nil || m.GetBmcCredentialsRef() == "" {
		return out, err
	}
	ref := m.BmcCredentialsRef
	m.BmcCredentialsRef = ""
	payload, err := protojson.Marshal(resp)
	m.BmcCredentialsRef = ref
	if err != nil {
		return admission.Outcome{}, fmt.Errorf("encode event: %w", err)
	}
	out.Event.Payload = payload
	return out, nil
}

// machineResource is a machine's projection row: its pool, its labels and
// its site under authz.SiteLabel.
func machineResource(id, tenant, site, pool string, labels map[string]string) authz.Resource {
	l := maps.Clone(labels)
	if l == nil {
		l = map[string]string{}
	}
	l[authz.SiteLabel] = site
	return authz.Resource{Type: authz.TypeMachine, ID: id, TenantID: tenant, PoolID: pool, Labels: l}
}

// machine reads the projection row of a machine named by machineId.
func (s *metalAPI) machine(ctx context.Context, tenant, id string) (authz.Resource, error) {
	if err := required("machineId", id); err != nil {
		return authz.Resource{}, err
	}
	return authz.Get(ctx, s.db, tenant, authz.TypeMachine, id, "machineId")
}

// machinePool resolves a pool of the tenant that machines' nodes can join.
func (s *metalAPI) machinePool(ctx context.Context, tenant, id string) (poolstore.Pool, error) {
	res, err := authz.Get(ctx, s.db, tenant, authz.TypePool, id, "poolId")
	if err != nil {
		return poolstore.Pool{}, err
	}
	p, err := poolstore.Get(ctx, s.db, tenant, res.ID)
	if err != nil {
		return poolstore.Pool{}, err
	}
	if p.Class == poolstore.ClassProvider {
		return poolstore.Pool{}, fault.New(fault.InvalidInput, "poolId", "pool %s holds a provider's capacity; machines join %s or %s pools",
			p.ID, poolstore.ClassGPU, poolstore.ClassVPSHost)
	}
	return p, nil
}

// validHTTPS checks an https://host[:port] URL (withPath allows a path),
// naming field.
func validHTTPS(field, v string, maxLen int, withPath bool) error {
	if err := required(field, v); err != nil {
		return err
	}
	if len(v) > maxLen {
		return fault.New(fault.InvalidInput, field, "at most %d characters", maxLen)
	}
	u, err := url.Parse(v)
	if err != nil || u.Scheme != "https" || u.Host == "" || u.Hostname() == "" || u.Opaque != "" {
		return fault.New(fault.InvalidInput, field, "expected an https:// URL with a host")
	}
	if u.User != nil {
		return fault.New(fault.InvalidInput, field, "must not hold credentials (user:password@): pass them as bmc.username and bmc.password")
	}
	if p := u.Port(); p != "" {
		if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
			return fault.New(fault.InvalidInput, field, "port %q: expected 1 to 65535", p)
		}
	}
	if !withPath && ((u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.Fragment != "") {
		return fault.New(fault.InvalidInput, field, "expected https://host[:port] with no path, query or fragment")
	}
	if withPath && u.Fragment != "" {
		return fault.New(fault.InvalidInput, field, "must not have a fragment")
	}
	return nil
}

// bmcAddress normalizes a checked BMC address: its host (and port) lower
// case, no trailing slash.
func bmcAddress(v string) string {
	u, _ := url.Parse(v)
	return "https://" + strings.ToLower(u.Host)
}

// bmcTLS is how metal.enroll says the BMC's certificate is verified.
type bmcTLS struct {
	caPEM, sha256 string
	insecure      bool
}

// validBMCTLS checks bmc.caPem (PEM certificates, at most
// sitetasks.MaxCAPEM bytes), bmc.certificateSha256 (64 hex digits) and
// bmc.insecureSkipVerify (alone).
func validBMCTLS(bmc *computev1.MachineBMC) (bmcTLS, error) {
	out := bmcTLS{caPEM: bmc.GetCaPem(), sha256: strings.ToLower(bmc.GetCertificateSha256()), insecure: bmc.GetInsecureSkipVerify()}
	if out.caPEM != "" {
		if len(out.caPEM) > sitetasks.MaxCAPEM {
			return bmcTLS{}, fault.New(fault.InvalidInput, "bmc.caPem", "at most %d bytes", sitetasks.MaxCAPEM)
		}
		rest, n := []byte(out.caPEM), 0
		for {
			var b *pem.Block
			if b, rest = pem.Decode(rest); b == nil {
				break
			}
			if b.Type != "CERTIFICATE" {
				return bmcTLS{}, fault.New(fault.InvalidInput, "bmc.caPem", "holds a %q block: expected certificates only", b.Type)
			}
			if _, err := x509.ParseCertificate(b.Bytes); err != nil {
				return bmcTLS{}, fault.New(fault.InvalidInput, "bmc.caPem", "certificate %d does not parse", n+1)
			}
			n++
		}
		if n == 0 || len(bytes.TrimSpace(rest)) != 0 {
			return bmcTLS{}, fault.New(fault.InvalidInput, "bmc.caPem", "expected one or more PEM certificates and nothing else")
		}
	}
	if out.sha256 != "" {
		if b, err := hex.DecodeString(out.sha256); err != nil || len(b) != sha256.Size {
			return bmcTLS{}, fault.New(fault.InvalidInput, "bmc.certificateSha256", "expected 64 hex digits (the SHA-256 of the certificate's DER)")
		}
	}
	if out.insecure && (out.caPEM != "" || out.sha256 != "") {
		return bmcTLS{}, fault.New(fault.InvalidInput, "bmc.insecureSkipVerify", "not with bmc.caPem or bmc.certificateSha256: verify or do not")
	}
	return out, nil
}

func (s *metalAPI) Enroll(ctx context.Context, req *computev1.MetalServiceEnrollRequest) (*computev1.MetalServiceEnrollResponse, error) {
	if err := required("siteId", req.GetSiteId()); err != nil {
		return nil, err
	}
	if err := required("poolId", req.GetPoolId()); err != nil {
		return nil, err
	}
	if err := validName("name", req.GetName()); err != nil {
		return nil, err
	}
	if len(req.GetName()) > machines.MaxNameLen {
		return nil, fault.New(fault.InvalidInput, "name", "at most %d characters", machines.MaxNameLen)
	}
	if err := validLabels(req.GetLabels()); err != nil {
		return nil, err
	}
	bmc := req.GetBmc()
	if bmc == nil {
		return nil, fault.New(fault.InvalidInput, "bmc", "required: the BMC's address and credentials")
	}
	if err := validHTTPS("bmc.address", bmc.GetAddress(), machines.MaxBMCAddressLen, false); err != nil {
		return nil, err
	}
	ref := bmc.GetCredentialsRef()
	if ref != "" {
		switch {
		case !strings.HasPrefix(ref, "sec_") || len(ref) > 64:
			return nil, fault.New(fault.InvalidInput, "bmc.credentialsRef", "%q is not a secret id (sec_…)", ref)
		case bmc.GetUsername() != "":
			return nil, fault.New(fault.InvalidInput, "bmc.username", "not with bmc.credentialsRef: name the credentials or give them, not both")
		case bmc.GetPassword() != "":
			return nil, fault.New(fault.InvalidInput, "bmc.password", "not with bmc.credentialsRef: name the credentials or give them, not both")
		}
	} else {
		switch {
		case bmc.GetUsername() == "":
			return nil, fault.New(fault.InvalidInput, "bmc.username", "required (or bmc.credentialsRef)")
		case len(bmc.GetUsername()) > secrets.MaxBMCUsernameLen:
			return nil, fault.New(fault.InvalidInput, "bmc.username", "at most %d characters", secrets.MaxBMCUsernameLen)
		case bmc.GetPassword() == "":
			return nil, fault.New(fault.InvalidInput, "bmc.password", "required (or bmc.credentialsRef)")
		case len(bmc.GetPassword()) > secrets.MaxBMCPasswordLen:
			return nil, fault.New(fault.InvalidInput, "bmc.password", "at most %d characters", secrets.MaxBMCPasswordLen)
		}
	}
	tlsPin, err := validBMCTLS(bmc)
	if err != nil {
		return nil, err
	}
	kr := s.secrets
	if kr == nil {
		return nil, fault.New(fault.Unsupported, secrets.ConfigField,
			"this control plane has no secrets key, so it cannot store BMC credentials: set %s", secrets.ConfigField)
	}
	tenant := req.GetTenantId()
	site, err := authz.Get(ctx, s.db, tenant, authz.TypeSite, req.GetSiteId(), "siteId")
	if err != nil {
		return nil, err
	}
	pool, err := s.machinePool(ctx, tenant, req.GetPoolId())
	if err != nil {
		return nil, err
	}
	if ref != "" {
		meta, err := secrets.Get(ctx, s.db, tenant, ref)
		if fault.CodeOf(err) == fault.NotFound {
			return nil, fault.New(fault.NotFound, "bmc.credentialsRef", "secret %q not found in tenant %s", ref, tenant)
		}
		if err != nil {
			return nil, err
		}
		if meta.Kind != secrets.KindBMC {
			return nil, fault.New(fault.InvalidInput, "bmc.credentialsRef", "secret %s holds %s, not BMC credentials", ref, meta.Kind)
		}
		// The secret goes only to the BMC it was created for.
		if meta.BoundTo == "" || meta.BoundTo != bmcAddress(bmc.GetAddress()) {
			return nil, fault.New(fault.AccessDenied, "bmc.credentialsRef",
				"secret %s is bound to another BMC address: a BMC's credentials are sent to that BMC only; give the credentials instead", ref)
		}
		users, err := machines.UsersOfCredentials(ctx, s.db, tenant, ref)
		if err != nil {
			return nil, err
		}
		res := make([]authz.Resource, len(users))
		for i, u := range users {
			res[i] = machineResource(u.ID, u.TenantID, u.SiteID, u.PoolID, u.Labels)
		}
		if err := s.mayUseSecret(ctx, tenant, "bmc.credentialsRef", ref, res); err != nil {
			return nil, err
		}
	}
	address := bmcAddress(bmc.GetAddress())
	creds := secrets.BMCCredentials{Username: bmc.GetUsername(), Password: bmc.GetPassword()}

	// The idempotency record keeps a hash of the request: a keyed one of
	// the password, so the stored hash cannot be tried against guesses.
	hashed := proto.Clone(req).(*computev1.MetalServiceEnrollRequest)
	if pw := hashed.GetBmc().GetPassword(); pw != "" {
		hashed.Bmc.Password = hex.EncodeToString(kr.Fingerprint([]byte(pw)))
	}
	out := &computev1.MetalServiceEnrollResponse{}
	_, err = s.create(ctx, hashed, req.GetIdempotencyKey(), admission.Create{
		Call:     admission.Call{TenantID: tenant},
		Resource: machineResource("", tenant, site.ID, pool.ID, req.GetLabels()),
		NewID:    machines.NewID,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, id string) (admission.Outcome, error) {
			credsRef := ref
			if credsRef == "" {
				credsRef = secrets.NewID()
				if err := secrets.Put(ctx, tx, kr, secrets.Secret{ID: credsRef, TenantID: tenant, Kind: secrets.KindBMC,
					BoundTo: address, Plain: creds.Marshal()}); err != nil {
					return admission.Outcome{}, err
				}
			}
			m, err := machines.Create(ctx, tx, machines.Machine{ID: id, TenantID: tenant, SiteID: site.ID, PoolID: pool.ID,
				Name: req.GetName(), Labels: req.GetLabels(), BMCAddress: address, BMCCredentialsRef: credsRef, NodeID: iam.NewID("node"),
				BMCCAPEM: tlsPin.caPEM, BMCCertificateSHA256: tlsPin.sha256, BMCInsecure: tlsPin.insecure})
			if err != nil {
				return admission.Outcome{}, err
			}
			if err := q.Enqueue(ctx, sitetasks.ReconcileKind, m.ID); err != nil {
				return admission.Outcome{}, err
			}
			res := machineResource(m.ID, tenant, m.SiteID, m.PoolID, m.Labels)
			pb := machinePB(m)
			return machineOutcome(&computev1.MetalServiceEnrollResponse{Machine: pb}, pb, "machine.enrolled", &res)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *metalAPI) Get(ctx context.Context, req *computev1.MetalServiceGetRequest) (*computev1.MetalServiceGetResponse, error) {
	res, err := s.machine(ctx, req.GetTenantId(), req.GetMachineId())
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), res); err != nil {
		return nil, err
	}
	m, err := machines.Get(ctx, s.db, req.GetTenantId(), req.GetMachineId())
	if err != nil {
		return nil, err
	}
	return &computev1.MetalServiceGetResponse{Machine: machinePB(m)}, nil
}

func (s *metalAPI) List(ctx context.Context, req *computev1.MetalServiceListRequest) (*computev1.MetalServiceListResponse, error) {
	pg, err := readPage(req)
	if err != nil {
		return nil, err
	}
	f := machines.Filter{TenantID: req.GetTenantId(), SiteID: req.GetSiteId(), After: pg.after, Limit: pg.size}
	if st := machines.State(req.GetState()); st != "" {
		if !st.Valid() {
			return nil, fault.New(fault.InvalidInput, "state", "%q: expected one of %v", st, machines.States())
		}
		f.States = []machines.State{st}
	}
	if err := s.read(ctx, req.GetTenantId(), authz.TenantResource(req.GetTenantId())); err != nil {
		return nil, err
	}
	list, err := machines.List(ctx, s.db, f)
	if err != nil {
		return nil, err
	}
	out := &computev1.MetalServiceListResponse{}
	for _, m := range list {
		out.Machines = append(out.Machines, machinePB(m))
	}
	out.NextPageToken = nextPage(pg, list, func(m machines.Machine) string { return m.ID })
	return out, nil
}

// change runs one state change of a machine as an admitted mutation: the
// decision on the machine, then, in one transaction, the machine locked,
// step (which returns the machine as changed, and the projection row to
// write, if it changed), the workflow enqueued, the audit and outbox rows.
func (s *metalAPI) change(ctx context.Context, tenant, id, event string, out proto.Message,
	step func(ctx context.Context, tx pgx.Tx, m machines.Machine) (machines.Machine, *authz.Resource, error),
	wrap func(*computev1.Machine) proto.Message) error {
	res, err := s.machine(ctx, tenant, id)
	if err != nil {
		return err
	}
	return s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: tenant},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			m, err := machines.Lock(ctx, tx, tenant, id)
			if err != nil {
				return admission.Outcome{}, err
			}
			m, newRes, err := step(ctx, tx, m)
			if err != nil {
				return admission.Outcome{}, err
			}
			if err := q.Enqueue(ctx, sitetasks.ReconcileKind, m.ID); err != nil {
				return admission.Outcome{}, err
			}
			pb := machinePB(m)
			return machineOutcome(wrap(pb), pb, event, newRes)
		},
	}, out)
}

func wrongState(m machines.Machine, what string, want ...machines.State) error {
	parts := make([]string, len(want))
	for i, w := range want {
		parts[i] = string(w)
	}
	return fault.New(fault.Conflict, "state", "machine %s is %s; %s needs it %s", m.ID, m.State, what, strings.Join(parts, ", "))
}

func (s *metalAPI) Deploy(ctx context.Context, req *computev1.MetalServiceDeployRequest) (*computev1.MetalServiceDeployResponse, error) {
	img := req.GetImage()
	if img == nil {
		return nil, fault.New(fault.InvalidInput, "image", "required: url, sha256 and sizeBytes")
	}
	if err := validHTTPS("image.url", img.GetUrl(), machines.MaxImageURLLen, true); err != nil {
		return nil, err
	}
	sum := strings.ToLower(img.GetSha256())
	if b, err := hex.DecodeString(sum); err != nil || len(b) != 32 {
		return nil, fault.New(fault.InvalidInput, "image.sha256", "expected 64 hex digits (SHA-256)")
	}
	if n := img.GetSizeBytes(); n < 1 || n > machines.MaxImageBytes {
		return nil, fault.New(fault.InvalidInput, "image.sizeBytes", "expected 1 to %d, got %d", int64(machines.MaxImageBytes), n)
	}
	if len(req.GetCloudInit()) > machines.MaxCloudInitBytes {
		return nil, fault.New(fault.InvalidInput, "cloudInit", "at most %d bytes, got %d", machines.MaxCloudInitBytes, len(req.GetCloudInit()))
	}
	poolID := ""
	if req.GetPoolId() != "" {
		p, err := s.machinePool(ctx, req.GetTenantId(), req.GetPoolId())
		if err != nil {
			return nil, err
		}
		poolID = p.ID
	}
	image := &machines.Image{URL: img.GetUrl(), SHA256: sum, SizeBytes: img.GetSizeBytes()}
	out := &computev1.MetalServiceDeployResponse{}
	err := s.change(ctx, req.GetTenantId(), req.GetMachineId(), "machine.deploy_requested", out,
		func(ctx context.Context, tx pgx.Tx, m machines.Machine) (machines.Machine, *authz.Resource, error) {
			if m.State != machines.StateReady {
				return m, nil, wrongState(m, "deploy", machines.StateReady)
			}
			m, err := machines.SetState(ctx, tx, m.ID, []machines.State{machines.StateReady}, machines.StateDeploying,
				machines.Change{Purpose: machines.PurposeDeploy, Image: image, CloudInit: req.GetCloudInit(), PoolID: poolID})
			if err != nil {
				return m, nil, err
			}
			var res *authz.Resource
			if poolID != "" {
				r := machineResource(m.ID, m.TenantID, m.SiteID, m.PoolID, m.Labels)
				res = &r
			}
			return m, res, nil
		},
		func(pb *computev1.Machine) proto.Message { return &computev1.MetalServiceDeployResponse{Machine: pb} })
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *metalAPI) Release(ctx context.Context, req *computev1.MetalServiceReleaseRequest) (*computev1.MetalServiceReleaseResponse, error) {
	out := &computev1.MetalServiceReleaseResponse{}
	err := s.change(ctx, req.GetTenantId(), req.GetMachineId(), "machine.release_requested", out,
		func(ctx context.Context, tx pgx.Tx, m machines.Machine) (machines.Machine, *authz.Resource, error) {
			switch {
			case m.State == machines.StateFailed && m.Purpose == machines.PurposeCommission:
				return m, nil, fault.New(fault.Conflict, "state", "machine %s failed while commissioning (at %s): retry or delete it; release is for deployed machines", m.ID, m.FailedStep)
			case m.State != machines.StateJoined && m.State != machines.StateRescue && m.State != machines.StateFailed:
				return m, nil, wrongState(m, "release", machines.StateJoined, machines.StateRescue, machines.StateFailed)
			}
			m, err := machines.SetState(ctx, tx, m.ID, []machines.State{m.State}, machines.StateBootingRamdisk,
				machines.Change{Purpose: machines.PurposeRelease})
			return m, nil, err
		},
		func(pb *computev1.Machine) proto.Message { return &computev1.MetalServiceReleaseResponse{Machine: pb} })
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *metalAPI) Retry(ctx context.Context, req *computev1.MetalServiceRetryRequest) (*computev1.MetalServiceRetryResponse, error) {
	out := &computev1.MetalServiceRetryResponse{}
	err := s.change(ctx, req.GetTenantId(), req.GetMachineId(), "machine.retried", out,
		func(ctx context.Context, tx pgx.Tx, m machines.Machine) (machines.Machine, *authz.Resource, error) {
			if m.State != machines.StateFailed {
				return m, nil, wrongState(m, "retry", machines.StateFailed)
			}
			m, err := machines.Retry(ctx, tx, m.ID, nil)
			return m, nil, err
		},
		func(pb *computev1.Machine) proto.Message { return &computev1.MetalServiceRetryResponse{Machine: pb} })
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *metalAPI) Rescue(ctx context.Context, req *computev1.MetalServiceRescueRequest) (*computev1.MetalServiceRescueResponse, error) {
	out := &computev1.MetalServiceRescueResponse{}
	err := s.change(ctx, req.GetTenantId(), req.GetMachineId(), "machine.rescue_requested", out,
		func(ctx context.Context, tx pgx.Tx, m machines.Machine) (machines.Machine, *authz.Resource, error) {
			if m.State != machines.StateReady && m.State != machines.StateJoined && m.State != machines.StateFailed {
				return m, nil, wrongState(m, "rescue", machines.StateReady, machines.StateJoined, machines.StateFailed)
			}
			m, err := machines.SetState(ctx, tx, m.ID, []machines.State{m.State}, machines.StateBootingRamdisk,
				machines.Change{Purpose: machines.PurposeRescue})
			return m, nil, err
		},
		func(pb *computev1.Machine) proto.Message { return &computev1.MetalServiceRescueResponse{Machine: pb} })
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *metalAPI) Delete(ctx context.Context, req *computev1.MetalServiceDeleteRequest) (*computev1.MetalServiceDeleteResponse, error) {
	tenant := req.GetTenantId()
	res, err := s.machine(ctx, tenant, req.GetMachineId())
	if err != nil {
		return nil, err
	}
	out := &computev1.MetalServiceDeleteResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: tenant},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			m, err := machines.Get(ctx, tx, tenant, req.GetMachineId())
			if err != nil {
				return admission.Outcome{}, err
			}
			// The secret first, then the machine: a concurrent delete of
			// another machine with the same credentials waits here, and
			// then sees this one gone.
			if _, err := secrets.Lock(ctx, tx, tenant, m.BMCCredentialsRef); err != nil {
				return admission.Outcome{}, err
			}
			if m, err = machines.Delete(ctx, tx, tenant, m.ID, deletableStates); err != nil {
				return admission.Outcome{}, err
			}
			others, err := machines.UsingCredentials(ctx, tx, m.BMCCredentialsRef, m.ID)
			if err != nil {
				return admission.Outcome{}, err
			}
			if others == 0 {
				if err := secrets.Delete(ctx, tx, tenant, m.BMCCredentialsRef); err != nil {
					return admission.Outcome{}, err
				}
			}
			if err := authz.Delete(ctx, tx, authz.TypeMachine, m.ID); err != nil {
				return admission.Outcome{}, err
			}
			if err := q.Enqueue(ctx, sitetasks.ReconcileKind, m.ID); err != nil {
				return admission.Outcome{}, err
			}
			pb := machinePB(m)
			return machineOutcome(&computev1.MetalServiceDeleteResponse{Machine: pb}, pb, "machine.deleted", nil)
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}
