package api_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/api"
)

// drainFixture is a harness with tenant acme (key acmeKey), tenant other
// (key otherKey), and acme's nodes joined through joinservice: ids[0] and
// ids[1] adopted, ids[2] still adopting.
type drainFixture struct {
	h                 *harness
	j                 *joiner
	acmeKey, otherKey string
	pool              string
	ids               []string
	serials           map[string]string
	nodes             computev1.NodesServiceClient
	tokens            computev1.JoinTokensServiceClient
}

func newDrainFixture(t *testing.T) *drainFixture {
	t.Helper()
	h := setup(t, api.Tuning{})
	f := &drainFixture{h: h, j: newJoiner(t, h), serials: map[string]string{}}
	_, f.acmeKey = h.member(t, "acme", "ops")
	h.policy(t, "acme", "members", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)
	_, f.otherKey = h.member(t, "other", "ops")
	h.policy(t, "other", "members", `permit (principal in Tenant::"other", action, resource in Tenant::"other");`)
	f.nodes = computev1.NewNodesServiceClient(h.conn)
	f.tokens = computev1.NewJoinTokensServiceClient(h.conn)
	p, err := computev1.NewPoolsServiceClient(h.conn).Create(as(f.acmeKey), &computev1.PoolsServiceCreateRequest{TenantId: "acme", Name: "a", Class: "gpu"})
	if err != nil {
		t.Fatal(err)
	}
	f.pool = p.GetPool().GetId()
	tok, err := f.tokens.Create(as(f.acmeKey), &computev1.JoinTokensServiceCreateRequest{TenantId: "acme", PoolId: f.pool, Uses: 3})
	if err != nil {
		t.Fatal(err)
	}
	for _, serial := range []string{"SN-D0", "SN-D1", "SN-D2"} {
		id, err := f.j.join(t, tok.GetToken(), serial)
		if err != nil {
			t.Fatal(err)
		}
		f.ids = append(f.ids, id)
		f.serials[id] = serial
	}
	if _, err := h.db.Exec(context.Background(), `UPDATE nodes SET state = 'adopted', generation = 1, observed_generation = 1, last_seen_at = now()
		WHERE id = ANY($1)`, f.ids[:2]); err != nil {
		t.Fatal(err)
	}
	return f
}

func (f *drainFixture) state(t *testing.T, id string) string {
	t.Helper()
	var s string
	if err := f.h.db.QueryRow(context.Background(), `SELECT state FROM nodes WHERE id = $1`, id).Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

func condition(n *computev1.Node, typ string) *computev1.NodeCondition {
	for _, c := range n.GetConditions() {
		if c.GetType() == typ {
			return c
		}
	}
	return nil
}

func TestDrainAPIBadInput(t *testing.T) {
	t.Parallel()
	f := newDrainFixture(t)
	ctx := as(f.acmeKey)
	id := f.ids[0]
	for _, tc := range []struct {
		name  string
		call  func() error
		code  fault.Code
		field string
	}{
		{"drain without a node", func() error {
			_, err := f.nodes.Drain(ctx, &computev1.NodesServiceDrainRequest{TenantId: "acme"})
			return err
		}, fault.InvalidInput, "nodeId"},
		{"drain with a negative deadline", func() error {
			_, err := f.nodes.Drain(ctx, &computev1.NodesServiceDrainRequest{TenantId: "acme", NodeId: id, DeadlineSeconds: -1})
			return err
		}, fault.InvalidInput, "deadlineSeconds"},
		{"drain with a deadline over 7 days", func() error {
			_, err := f.nodes.Drain(ctx, &computev1.NodesServiceDrainRequest{TenantId: "acme", NodeId: id, DeadlineSeconds: 604801})
			return err
		}, fault.InvalidInput, "deadlineSeconds"},
		{"drain with a long reason", func() error {
			_, err := f.nodes.Drain(ctx, &computev1.NodesServiceDrainRequest{TenantId: "acme", NodeId: id, Reason: strings.Repeat("x", 1025)})
			return err
		}, fault.InvalidInput, "reason"},
		{"drain an unknown node", func() error {
			_, err := f.nodes.Drain(ctx, &computev1.NodesServiceDrainRequest{TenantId: "acme", NodeId: "node_nope"})
			return err
		}, fault.NotFound, "nodeId"},
		{"drain another tenant's node", func() error {
			_, err := f.nodes.Drain(as(f.otherKey), &computev1.NodesServiceDrainRequest{TenantId: "acme", NodeId: id})
			return err
		}, fault.AccessDenied, "tenantId"},
		{"drain another tenant's node as one's own", func() error {
			_, err := f.nodes.Drain(as(f.otherKey), &computev1.NodesServiceDrainRequest{TenantId: "other", NodeId: id})
			return err
		}, fault.NotFound, "nodeId"},
		{"drain an adopting node", func() error {
			_, err := f.nodes.Drain(ctx, &computev1.NodesServiceDrainRequest{TenantId: "acme", NodeId: f.ids[2]})
			return err
		}, fault.Conflict, "nodeId"},
		{"undrain without a node", func() error {
			_, err := f.nodes.Undrain(ctx, &computev1.NodesServiceUndrainRequest{TenantId: "acme"})
			return err
		}, fault.InvalidInput, "nodeId"},
		{"undrain an adopted node", func() error {
			_, err := f.nodes.Undrain(ctx, &computev1.NodesServiceUndrainRequest{TenantId: "acme", NodeId: id})
			return err
		}, fault.Conflict, "nodeId"},
		{"undrain an unknown node", func() error {
			_, err := f.nodes.Undrain(ctx, &computev1.NodesServiceUndrainRequest{TenantId: "acme", NodeId: "node_nope"})
			return err
		}, fault.NotFound, "nodeId"},
		{"retire without a node", func() error {
			_, err := f.nodes.Retire(ctx, &computev1.NodesServiceRetireRequest{TenantId: "acme"})
			return err
		}, fault.InvalidInput, "nodeId"},
		{"retire with a deadline over 7 days", func() error {
			_, err := f.nodes.Retire(ctx, &computev1.NodesServiceRetireRequest{TenantId: "acme", NodeId: id, DeadlineSeconds: 700000})
			return err
		}, fault.InvalidInput, "deadlineSeconds"},
		{"retire with a long reason", func() error {
			_, err := f.nodes.Retire(ctx, &computev1.NodesServiceRetireRequest{TenantId: "acme", NodeId: id, Reason: strings.Repeat("x", 2000)})
			return err
		}, fault.InvalidInput, "reason"},
		{"retire another tenant's node", func() error {
			_, err := f.nodes.Retire(as(f.otherKey), &computev1.NodesServiceRetireRequest{TenantId: "acme", NodeId: id})
			return err
		}, fault.AccessDenied, "tenantId"},
		{"retire an adopting node", func() error {
			_, err := f.nodes.Retire(ctx, &computev1.NodesServiceRetireRequest{TenantId: "acme", NodeId: f.ids[2]})
			return err
		}, fault.Conflict, "nodeId"},
		{"list by an unknown condition", func() error {
			_, err := f.nodes.List(ctx, &computev1.NodesServiceListRequest{TenantId: "acme", Condition: "Happy"})
			return err
		}, fault.InvalidInput, "condition"},
		{"list by a condition with a bad value", func() error {
			_, err := f.nodes.List(ctx, &computev1.NodesServiceListRequest{TenantId: "acme", Condition: "Ready=Maybe"})
			return err
		}, fault.InvalidInput, "condition"},
		{"list by a negated condition with a value", func() error {
			_, err := f.nodes.List(ctx, &computev1.NodesServiceListRequest{TenantId: "acme", Condition: "!Ready=Lost"})
			return err
		}, fault.InvalidInput, "condition"},
		{"list by a long condition", func() error {
			_, err := f.nodes.List(ctx, &computev1.NodesServiceListRequest{TenantId: "acme", Condition: strings.Repeat("A", 65)})
			return err
		}, fault.InvalidInput, "condition"},
	} {
		t.Run(tc.name, func(t *testing.T) { wantCode(t, tc.call(), tc.code, tc.field) })
	}
	// Over REST, too. (nodes.drain, undrain and retire have no REST
	// binding in http.yaml yet; nodes.list has.)
	code, body := f.h.rest(t, f.acmeKey, "nodes/list", `{"tenantId":"acme","condition":"Ready="}`)
	wantREST(t, code, body, fault.InvalidInput, "condition")
	// Nothing refused changed anything.
	for _, id := range f.ids[:2] {
		if s := f.state(t, id); s != "adopted" {
			t.Fatalf("%s is %s after refused calls", id, s)
		}
	}
	if n := f.h.count(t, `SELECT count(*) FROM outbox WHERE type LIKE 'node.drain%' OR type LIKE 'node.retire%'`); n != 0 {
		t.Fatalf("%d drain events after refused calls", n)
	}
}

func TestDrainAPIDrainUndrainRetire(t *testing.T) {
	t.Parallel()
	f := newDrainFixture(t)
	ctx := as(f.acmeKey)
	bg := context.Background()
	a, b := f.ids[0], f.ids[1]

	before := time.Now()
	got, err := f.nodes.Drain(ctx, &computev1.NodesServiceDrainRequest{TenantId: "acme", NodeId: a, Reason: "rack move"})
	if err != nil {
		t.Fatal(err)
	}
	n := got.GetNode()
	dl := n.GetDrainDeadline().AsTime()
	if n.GetState() != "draining" || n.GetDrainReason() != "rack move" || n.GetRetiring() || n.GetSchedulable() ||
		dl.Before(before.Add(time.Hour-time.Minute)) || dl.After(time.Now().Add(time.Hour+time.Minute)) {
		t.Fatalf("drained node: %v", n)
	}
	c := condition(n, "Draining")
	if c == nil || !c.GetStatus() || c.GetValue() != "True" || !strings.Contains(c.GetReason(), "rack move") || !strings.Contains(c.GetReason(), "deadline") || c.GetSince() == nil {
		t.Fatalf("Draining condition: %v", n.GetConditions())
	}
	if i := slices.IndexFunc(n.GetConditions(), func(c *computev1.NodeCondition) bool { return c.GetType() == "Draining" }); i != 1 {
		t.Fatalf("Draining should follow Ready: %v", n.GetConditions())
	}
	if n := f.h.count(t, `SELECT count(*) FROM audit WHERE action = 'compute:nodes:drain' AND resource LIKE '%' || $1 || '%'`, a); n != 1 {
		t.Fatalf("%d audit rows for the drain", n)
	}
	if n := f.h.count(t, `SELECT count(*) FROM outbox WHERE resource_id = $1 AND type IN ('node.drain_requested', 'node.draining')`, a); n != 2 {
		t.Fatalf("%d drain events, want node.drain_requested and node.draining", n)
	}
	// With no booking, the drain job (the app runs the controllers role)
	// drains it as soon as it looks.
	poll.Until(t, 30*time.Second, "the node without bookings to be drained", func() bool { return f.state(t, a) == "drained" })

	// The condition filter sees it.
	list := func(cond string) []string {
		t.Helper()
		resp, err := f.nodes.List(ctx, &computev1.NodesServiceListRequest{TenantId: "acme", Condition: cond})
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, n := range resp.GetNodes() {
			ids = append(ids, n.GetId())
		}
		return ids
	}
	if got := list("Draining"); !slices.Equal(got, []string{a}) {
		t.Fatalf("Draining: %v", got)
	}
	if got := list("!Draining"); slices.Contains(got, a) || len(got) != 2 {
		t.Fatalf("!Draining: %v", got)
	}
	if _, err := f.h.db.Exec(bg, `UPDATE nodes SET needs_repair = true, needs_repair_reason = 'gpu.reset failed', needs_repair_since = now() WHERE id = $1`, b); err != nil {
		t.Fatal(err)
	}
	if got := list("NeedsRepair=True"); !slices.Equal(got, []string{b}) {
		t.Fatalf("NeedsRepair=True: %v", got)
	}
	nb, err := f.nodes.Get(ctx, &computev1.NodesServiceGetRequest{TenantId: "acme", NodeId: b})
	if err != nil {
		t.Fatal(err)
	}
	if c := condition(nb.GetNode(), "NeedsRepair"); c == nil || !c.GetStatus() || c.GetReason() != "gpu.reset failed" || c.GetSince() == nil {
		t.Fatalf("NeedsRepair condition: %v", nb.GetNode().GetConditions())
	}

	// Undrain returns it to service.
	un, err := f.nodes.Undrain(ctx, &computev1.NodesServiceUndrainRequest{TenantId: "acme", NodeId: a})
	if err != nil {
		t.Fatal(err)
	}
	if n := un.GetNode(); n.GetState() != "adopted" || n.GetDrainDeadline() != nil || n.GetDrainReason() != "" || condition(n, "Draining") != nil || !n.GetSchedulable() {
		t.Fatalf("undrained: %v", n)
	}
	if n := f.h.count(t, `SELECT count(*) FROM outbox WHERE resource_id = $1 AND type = 'node.undrained'`, a); n != 1 {
		t.Fatalf("%d node.undrained events", n)
	}

	// Retire: drained (no bookings), then retired with its certificate
	// revoked.
	ret, err := f.nodes.Retire(ctx, &computev1.NodesServiceRetireRequest{TenantId: "acme", NodeId: a, DeadlineSeconds: 60, Reason: "end of life"})
	if err != nil || !ret.GetNode().GetRetiring() {
		t.Fatalf("retire: %v %v", ret, err)
	}
	poll.Until(t, 30*time.Second, "the retiring node to be retired", func() bool { return f.state(t, a) == "retired" })
	if n := f.h.count(t, `SELECT count(*) FROM node_certificates WHERE node_id = $1 AND revoked_at IS NULL`, a); n != 0 {
		t.Fatalf("%d live certificates of a retired node", n)
	}
	if n := f.h.count(t, `SELECT count(*) FROM outbox WHERE resource_id = $1 AND type IN ('node.retire_requested', 'node.drained', 'node.retired')`, a); n != 4 {
		t.Fatalf("%d retire events, want node.retire_requested, node.drained twice and node.retired", n)
	}
	if n := f.h.count(t, `SELECT count(*) FROM audit WHERE action = 'compute:nodes:retire' AND resource LIKE '%' || $1 || '%'`, a); n != 2 {
		t.Fatalf("%d retire audit rows, want the API's and the drain job's", n)
	}
	_, err = f.nodes.Undrain(ctx, &computev1.NodesServiceUndrainRequest{TenantId: "acme", NodeId: a})
	wantCode(t, err, fault.Conflict, "nodeId")
	_, err = f.nodes.Drain(ctx, &computev1.NodesServiceDrainRequest{TenantId: "acme", NodeId: a})
	wantCode(t, err, fault.Conflict, "nodeId")

	// Rejoin: the same hardware with a plain token, or a reclaim token made
	// before the retirement, is refused; a reclaim token made after it
	// that names the node takes it back.
	plain, err := f.tokens.Create(ctx, &computev1.JoinTokensServiceCreateRequest{TenantId: "acme", PoolId: f.pool, Uses: 1})
	if err != nil {
		t.Fatal(err)
	}
	_, err = f.j.join(t, plain.GetToken(), f.serials[a])
	if fe, ok := fault.As(err); !ok || fe.Code != fault.Conflict || fe.Field != "claims" || !strings.Contains(fe.Message, "retired") || !strings.Contains(fe.Message, "reclaimNodeIds") {
		t.Fatalf("rejoin with a plain token: %v", err)
	}
	early, err := f.tokens.Create(ctx, &computev1.JoinTokensServiceCreateRequest{TenantId: "acme", PoolId: f.pool, Uses: 1, Reclaim: true, ReclaimNodeIds: []string{a}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.h.db.Exec(bg, `UPDATE join_tokens SET created_at = (SELECT retired_at - interval '1 second' FROM nodes WHERE id = $1) WHERE id = $2`,
		a, early.GetJoinToken().GetId()); err != nil {
		t.Fatal(err)
	}
	_, err = f.j.join(t, early.GetToken(), f.serials[a])
	if fe, ok := fault.As(err); !ok || fe.Code != fault.Conflict || fe.Field != "claims" || !strings.Contains(fe.Message, "retired") {
		t.Fatalf("rejoin with a token from before the retirement: %v", err)
	}
	fresh, err := f.tokens.Create(ctx, &computev1.JoinTokensServiceCreateRequest{TenantId: "acme", PoolId: f.pool, Uses: 1, Reclaim: true, ReclaimNodeIds: []string{a}})
	if err != nil {
		t.Fatal(err)
	}
	back, err := f.j.join(t, fresh.GetToken(), f.serials[a])
	if err != nil || back != a {
		t.Fatalf("rejoin with a new token naming it: %q %v", back, err)
	}
	if s := f.state(t, a); s != "adopting" {
		t.Fatalf("the rejoined node is %s, want adopting", s)
	}
}
