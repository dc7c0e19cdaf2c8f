package api_test

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/types/known/fieldmaskpb"
	"google.golang.org/protobuf/types/known/structpb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	desired "github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/services/api"
)

func TestNodesGetSpec(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	ctx := t.Context()
	_, acmeKey := h.member(t, "acme", "ops")
	h.policy(t, "acme", "members", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)
	_, otherKey := h.member(t, "other", "ops")
	h.policy(t, "other", "members", `permit (principal in Tenant::"other", action, resource in Tenant::"other");`)
	p, err := computev1.NewPoolsServiceClient(h.conn).Create(as(acmeKey), &computev1.PoolsServiceCreateRequest{TenantId: "acme", Name: "a", Class: "gpu"})
	if err != nil {
		t.Fatal(err)
	}
	poolID := p.GetPool().GetId()
	if _, err := h.db.Exec(ctx, `UPDATE pools SET site = '{"logLevel": "debug"}' WHERE id = $1`, poolID); err != nil {
		t.Fatal(err)
	}
	fixture.Node(t, h.db, fixture.NodeOpts{ID: "node_x", Tenant: "acme", Pool: poolID, State: nodes.StateAdopted, Labels: map[string]string{"rack": "r1"}})
	if err := authz.Put(ctx, h.db, authz.Resource{Type: authz.TypeNode, ID: "node_x", TenantID: "acme", PoolID: poolID}); err != nil {
		t.Fatal(err)
	}

	// The server runs every role: its nodespec controller computes the spec
	// once the node is invalidated.
	if err := reconcile.InTx(ctx, h.db, nil, func(_ pgx.Tx, q *reconcile.Queue) error { return desired.Invalidate(ctx, q, "node_x") }); err != nil {
		t.Fatal(err)
	}
	c := computev1.NewNodesServiceClient(h.conn)
	poll.UntilNil(t, 20*time.Second, "the spec to be computed", func() error {
		got, err := c.GetSpec(as(acmeKey), &computev1.NodesServiceGetSpecRequest{TenantId: "acme", NodeId: "node_x"})
		if err != nil {
			t.Fatal(err)
		}
		if got.GetGeneration() == 1 {
			return nil
		}
		return fmt.Errorf("got %v", got)
	})

	t.Run("over REST", func(t *testing.T) {
		code, body := h.rest(t, acmeKey, "nodes/getSpec", `{"tenantId":"acme","nodeId":"node_x"}`)
		if code != http.StatusOK {
			t.Fatalf("%d %v", code, body)
		}
		spec, _ := body["spec"].(map[string]any)
		identity, _ := spec["identity"].(map[string]any)
		site, _ := spec["site"].(map[string]any)
		if body["generation"] != "1" || identity["nodeId"] != "node_x" || identity["poolId"] != poolID || site["logLevel"] != "debug" {
			t.Fatalf("getSpec %v", body)
		}
		if body["specError"] != "" {
			t.Fatalf("no spec error expected: %v", body)
		}
	})

	t.Run("a spec error shows in getSpec and nodes.get", func(t *testing.T) {
		if _, err := h.db.Exec(ctx, `UPDATE nodes SET spec_error = 'conflicting desired state' WHERE id = 'node_x'`); err != nil {
			t.Fatal(err)
		}
		got, err := c.GetSpec(as(acmeKey), &computev1.NodesServiceGetSpecRequest{TenantId: "acme", NodeId: "node_x"})
		if err != nil || got.GetSpecError() != "conflicting desired state" || got.GetGeneration() != 1 || got.GetSpec().GetFields()["identity"] == nil {
			t.Fatalf("getSpec %v %v", got, err)
		}
		n, err := c.Get(as(acmeKey), &computev1.NodesServiceGetRequest{TenantId: "acme", NodeId: "node_x"})
		if err != nil || n.GetNode().GetSpecError() != "conflicting desired state" {
			t.Fatalf("get %v %v", n, err)
		}
	})

	t.Run("errors", func(t *testing.T) {
		_, err := c.GetSpec(as(acmeKey), &computev1.NodesServiceGetSpecRequest{TenantId: "acme"})
		wantCode(t, err, fault.InvalidInput, "nodeId")
		_, err = c.GetSpec(as(acmeKey), &computev1.NodesServiceGetSpecRequest{TenantId: "acme", NodeId: "node_nope"})
		wantCode(t, err, fault.NotFound, "nodeId")
		_, err = c.GetSpec(as(otherKey), &computev1.NodesServiceGetSpecRequest{TenantId: "acme", NodeId: "node_x"})
		wantCode(t, err, fault.AccessDenied, "tenantId")
		code, body := h.rest(t, otherKey, "nodes/getSpec", fmt.Sprintf(`{"tenantId":"other","nodeId":%q}`, "node_x"))
		wantREST(t, code, body, fault.NotFound, "nodeId")
	})

	t.Run("the pool's runtime settings reach its nodes' spec", func(t *testing.T) {
		pools := computev1.NewPoolsServiceClient(h.conn)
		rt, _ := structpb.NewStruct(map[string]any{"engines": []any{"containerd"}, "cdiSpecDirs": []any{"/var/run/cdi"}})
		if _, err := pools.Update(as(acmeKey), &computev1.PoolsServiceUpdateRequest{TenantId: "acme", PoolId: poolID, Runtime: rt,
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"runtime"}}}); err != nil {
			t.Fatal(err)
		}
		poll.UntilNil(t, 20*time.Second, "the runtime section in the spec", func() error {
			code, body := h.rest(t, acmeKey, "nodes/getSpec", `{"tenantId":"acme","nodeId":"node_x"}`)
			spec, _ := body["spec"].(map[string]any)
			runtime, _ := spec["runtime"].(map[string]any)
			site, _ := spec["site"].(map[string]any)
			if code == http.StatusOK && body["generation"] == "2" && fmt.Sprint(runtime["engines"]) == "[containerd]" &&
				fmt.Sprint(runtime["cdiSpecDirs"]) == "[/var/run/cdi]" && site["logLevel"] == "debug" {
				return nil
			}
			return fmt.Errorf("%d %v", code, body)
		})
		// A refused value changes nothing: the generation stays.
		bad, _ := structpb.NewStruct(map[string]any{"engines": []any{"containerd", "containerd"}})
		_, err := pools.Update(as(acmeKey), &computev1.PoolsServiceUpdateRequest{TenantId: "acme", PoolId: poolID, Runtime: bad,
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"runtime"}}})
		wantCode(t, err, fault.InvalidInput, "runtime.engines")
		got, err := c.GetSpec(as(acmeKey), &computev1.NodesServiceGetSpecRequest{TenantId: "acme", NodeId: "node_x"})
		if err != nil || got.GetGeneration() != 2 {
			t.Fatalf("getSpec after a refused update %v %v", got, err)
		}
	})
}
