package api_test

import (
	"context"
	"crypto/ecdh"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/hpke"
	"crypto/rand"
	"crypto/x509"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/types/known/fieldmaskpb"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/jointoken"
	"github.com/bettercompute/bettercompute/pkg/nodeca"
	"github.com/bettercompute/bettercompute/services/api"
	"github.com/bettercompute/bettercompute/services/joinservice"
)

// joiner is a joinservice on the harness's database, joining simulated
// hardware with tokens minted over the API.
type joiner struct {
	svc *joinservice.Service
	key *joinservice.Key
}

func newJoiner(t *testing.T, h *harness) *joiner {
	t.Helper()
	ca, err := nodeca.Open(nodeca.Config{TrustDomain: "api.test", Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	key, err := joinservice.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	svc, err := joinservice.New(joinservice.Config{DB: h.db, CA: ca, Key: key})
	if err != nil {
		t.Fatal(err)
	}
	return &joiner{svc: svc, key: key}
}

// join joins the hardware of serial with token and returns the node id.
func (j *joiner) join(t *testing.T, token, serial string) (string, error) {
	t.Helper()
	pk, err := ecdh.X25519().NewPublicKey(j.key.PublicKey())
	if err != nil {
		t.Fatal(err)
	}
	hpk, err := hpke.NewDHKEMPublicKey(pk)
	if err != nil {
		t.Fatal(err)
	}
	enc, sender, err := hpke.NewSender(hpk, hpke.HKDFSHA256(), hpke.AES128GCM(), []byte("bettercompute join v1"))
	if err != nil {
		t.Fatal(err)
	}
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	csr, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, k)
	if err != nil {
		t.Fatal(err)
	}
	sealed, err := sender.Seal(joinservice.SealAAD(csr), []byte(token))
	if err != nil {
		t.Fatal(err)
	}
	claims := &agentv1.HardwareClaims{Hostname: "host-" + serial, MachineId: "m-" + serial, SystemSerial: serial}
	for i := range 2 {
		claims.Gpus = append(claims.Gpus, &agentv1.GPU{Index: uint32(i), Uuid: fmt.Sprintf("GPU-%s-%d", serial, i), Model: "NVIDIA H200"})
	}
	resp, err := j.svc.Join(context.Background(), &agentv1.JoinRequest{
		SealedToken: sealed, EncapsulatedKey: enc, JoinserviceKeyId: j.key.ID(), Csr: csr, Claims: claims,
	})
	return resp.GetNodeId(), err
}

func TestJoinTokens(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	ctx := as(h.root)
	j := newJoiner(t, h)
	tokens := computev1.NewJoinTokensServiceClient(h.conn)
	pool, err := computev1.NewPoolsServiceClient(h.conn).Create(ctx, &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "h200", Class: "gpu"})
	if err != nil {
		t.Fatal(err)
	}
	poolID := pool.GetPool().GetId()

	var tokenID, token string
	t.Run("create shows the token once", func(t *testing.T) {
		body := fmt.Sprintf(`{"tenantId":"root","poolId":%q,"name":"rack-1","uses":2,"labels":{"rack":"r1"},
			"expect":{"gpuCount":2,"gpuModel":"H200"},"idempotencyKey":"jt-1"}`, poolID)
		code, resp := h.rest(t, h.root, "joinTokens/create", body)
		if code != http.StatusOK {
			t.Fatalf("%d %v", code, resp)
		}
		token, _ = resp["token"].(string)
		jt, _ := resp["joinToken"].(map[string]any)
		tokenID, _ = jt["id"].(string)
		if !strings.HasPrefix(token, jointoken.Prefix+tokenID+".") || jt["usesLeft"] != float64(2) || jt["reclaim"] != false || jt["expireTime"] == nil {
			t.Fatalf("create: %v", resp)
		}
		if exp, _ := jt["expect"].(map[string]any); exp["gpuCount"] != float64(2) || exp["gpuModel"] != "H200" {
			t.Fatalf("expect: %v", jt["expect"])
		}
		_, replay := h.rest(t, h.root, "joinTokens/create", body)
		if replay["token"] != "" || replay["joinToken"].(map[string]any)["id"] != tokenID {
			t.Fatalf("a replay must return the token's metadata without the token: %v", replay)
		}
		_, secret, _ := jointoken.Parse(token)
		code, raw := h.restRaw(t, h.root, "joinTokens/list", []byte(`{"tenantId":"root"}`))
		if code != http.StatusOK || strings.Contains(string(raw), secret) || !strings.Contains(string(raw), tokenID) {
			t.Fatalf("list must show the token's metadata and never its secret: %d %s", code, raw)
		}
	})

	t.Run("bad input", func(t *testing.T) {
		for _, tc := range []struct {
			req   *computev1.JoinTokensServiceCreateRequest
			code  fault.Code
			field string
		}{
			{&computev1.JoinTokensServiceCreateRequest{TenantId: "root"}, fault.InvalidInput, "poolId"},
			{&computev1.JoinTokensServiceCreateRequest{TenantId: "root", PoolId: "pool_nope"}, fault.NotFound, "poolId"},
			{&computev1.JoinTokensServiceCreateRequest{TenantId: "root", PoolId: poolID, Uses: -1}, fault.InvalidInput, "uses"},
			{&computev1.JoinTokensServiceCreateRequest{TenantId: "root", PoolId: poolID, Expect: &computev1.JoinTokenExpect{GpuCount: 1000}}, fault.InvalidInput, "expect.gpuCount"},
			// A reclaim must name the nodes it may take back.
			{&computev1.JoinTokensServiceCreateRequest{TenantId: "root", PoolId: poolID, Reclaim: true}, fault.InvalidInput, "reclaimNodeIds"},
			{&computev1.JoinTokensServiceCreateRequest{TenantId: "root", PoolId: poolID, ReclaimNodeIds: []string{"node_a"}}, fault.InvalidInput, "reclaimNodeIds"},
			{&computev1.JoinTokensServiceCreateRequest{TenantId: "root", PoolId: poolID, Reclaim: true, ReclaimNodeIds: []string{"pool_x"}}, fault.InvalidInput, "reclaimNodeIds"},
			{&computev1.JoinTokensServiceCreateRequest{TenantId: "root", PoolId: poolID, Reclaim: true, ReclaimNodeIds: []string{"node_a", "node_a"}}, fault.InvalidInput, "reclaimNodeIds"},
		} {
			_, err := tokens.Create(ctx, tc.req)
			wantCode(t, err, tc.code, tc.field)
		}
	})

	t.Run("the token joins nodes until its uses are spent", func(t *testing.T) {
		first, err := j.join(t, token, "SN-1")
		if err != nil {
			t.Fatal(err)
		}
		// The same hardware again: this token names no node to reclaim.
		if _, err := j.join(t, token, "SN-1"); err == nil {
			t.Fatal("the same hardware joined again without a token naming its node")
		}
		if _, err := j.join(t, token, "SN-2"); err != nil {
			t.Fatal(err)
		}
		if _, err := j.join(t, token, "SN-3"); !errors.Is(err, jointoken.ErrExhausted) {
			t.Fatalf("third join: %v, want exhausted", err)
		}
		// A token that names the node takes it back.
		rt, err := tokens.Create(ctx, &computev1.JoinTokensServiceCreateRequest{TenantId: "root", PoolId: poolID, Reclaim: true, ReclaimNodeIds: []string{first}})
		if err != nil || !slices.Equal(rt.GetJoinToken().GetReclaimNodeIds(), []string{first}) {
			t.Fatalf("reclaim token %v %v", rt, err)
		}
		again, err := j.join(t, rt.GetToken(), "SN-1")
		if err != nil || again != first {
			t.Fatalf("reclaim gave %q (%v), want %s", again, err, first)
		}
		list, err := tokens.List(ctx, &computev1.JoinTokensServiceListRequest{TenantId: "root", PoolId: poolID})
		if err != nil || len(list.GetJoinTokens()) != 2 || list.GetJoinTokens()[0].GetUsesLeft() != 0 || list.GetJoinTokens()[1].GetUsesLeft() != 0 {
			t.Fatalf("list %v %v: want both tokens spent", list, err)
		}
	})

	t.Run("revoke stops the token", func(t *testing.T) {
		fresh, err := tokens.Create(ctx, &computev1.JoinTokensServiceCreateRequest{TenantId: "root", PoolId: poolID, Uses: 5})
		if err != nil {
			t.Fatal(err)
		}
		got, err := tokens.Revoke(ctx, &computev1.JoinTokensServiceRevokeRequest{TenantId: "root", JoinTokenId: fresh.GetJoinToken().GetId()})
		if err != nil || got.GetJoinToken().GetRevokeTime() == nil {
			t.Fatalf("revoke %v %v", got, err)
		}
		if _, err := j.join(t, fresh.GetToken(), "SN-3"); !errors.Is(err, jointoken.ErrRevoked) {
			t.Fatalf("join with a revoked token: %v", err)
		}
		_, err = tokens.Revoke(ctx, &computev1.JoinTokensServiceRevokeRequest{TenantId: "root", JoinTokenId: "nope"})
		wantCode(t, err, fault.NotFound, "joinTokenId")
	})
}

func TestNodes(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	ctx := as(h.root)
	j := newJoiner(t, h)
	bg := context.Background()
	_, acmeKey := h.member(t, "acme", "ops")
	h.policy(t, "acme", "members", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)
	_, otherKey := h.member(t, "other", "ops")
	h.policy(t, "other", "members", `permit (principal in Tenant::"other", action, resource in Tenant::"other");`)

	pools := computev1.NewPoolsServiceClient(h.conn)
	tokens := computev1.NewJoinTokensServiceClient(h.conn)
	nodesC := computev1.NewNodesServiceClient(h.conn)
	var poolIDs []string
	for _, name := range []string{"a", "b"} {
		p, err := pools.Create(as(acmeKey), &computev1.PoolsServiceCreateRequest{TenantId: "acme", Name: name, Class: "gpu"})
		if err != nil {
			t.Fatal(err)
		}
		poolIDs = append(poolIDs, p.GetPool().GetId())
	}
	// Pool a gets 3 nodes labelled rack=r1, pool b 2 labelled rack=r2.
	var ids []string
	for i, pool := range poolIDs {
		tok, err := tokens.Create(as(acmeKey), &computev1.JoinTokensServiceCreateRequest{
			TenantId: "acme", PoolId: pool, Uses: 3, Labels: map[string]string{"rack": fmt.Sprintf("r%d", i+1)},
		})
		if err != nil {
			t.Fatal(err)
		}
		for k := range 3 - i {
			id, err := j.join(t, tok.GetToken(), fmt.Sprintf("SN-%d-%d", i, k))
			if err != nil {
				t.Fatal(err)
			}
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	// One node is adopted and has inventory.
	adopted := ids[0]
	if _, err := h.db.Exec(bg, `UPDATE nodes SET state = 'adopted', generation = 1, observed_generation = 1,
		session_epoch = 3, gateway_id = 'gw-1', last_seen_at = now() WHERE id = $1`, adopted); err != nil {
		t.Fatal(err)
	}
	fixture.Device(t, h.db, fixture.DeviceOpts{Node: adopted, ID: "GPU-b", Index: 1})
	fixture.Device(t, h.db, fixture.DeviceOpts{Node: adopted, ID: "GPU-a", Index: 0})

	t.Run("update labels, and what bad updates get", func(t *testing.T) {
		cur, err := nodesC.Get(as(acmeKey), &computev1.NodesServiceGetRequest{TenantId: "acme", NodeId: ids[2]})
		if err != nil {
			t.Fatal(err)
		}
		labels := map[string]string{"extra": "x"}
		for k, v := range cur.GetNode().GetLabels() {
			labels[k] = v // keep what the list subtest filters on
		}
		up, err := nodesC.Update(as(acmeKey), &computev1.NodesServiceUpdateRequest{TenantId: "acme", NodeId: ids[2],
			Labels: labels, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"labels"}}})
		if err != nil || up.GetNode().GetLabels()["extra"] != "x" || len(up.GetNode().GetLabels()) != len(labels) {
			t.Fatalf("update %v %v", up, err)
		}
		var audited int
		_ = h.db.QueryRow(bg, `SELECT count(*) FROM audit WHERE action = 'compute:nodes:update' AND resource LIKE '%' || $1 || '%'`, ids[2]).Scan(&audited)
		if audited != 1 {
			t.Fatalf("audit rows for the update: %d", audited)
		}
		_, err = nodesC.Update(as(acmeKey), &computev1.NodesServiceUpdateRequest{TenantId: "acme", NodeId: ids[2], UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"state"}}})
		wantCode(t, err, fault.InvalidInput, "updateMask")
		_, err = nodesC.Update(as(acmeKey), &computev1.NodesServiceUpdateRequest{TenantId: "acme", NodeId: ids[2]})
		wantCode(t, err, fault.InvalidInput, "updateMask")
		_, err = nodesC.Update(as(acmeKey), &computev1.NodesServiceUpdateRequest{TenantId: "acme", NodeId: ids[2],
			Labels: map[string]string{"": "x"}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"labels"}}})
		wantCode(t, err, fault.InvalidInput, "labels")
		_, err = nodesC.Update(as(acmeKey), &computev1.NodesServiceUpdateRequest{TenantId: "acme", NodeId: "node_nope",
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"labels"}}})
		wantCode(t, err, fault.NotFound, "nodeId")
	})

	t.Run("get over REST and gRPC", func(t *testing.T) {
		code, body := h.rest(t, acmeKey, "nodes/get", fmt.Sprintf(`{"tenantId":"acme","nodeId":%q}`, adopted))
		if code != http.StatusOK {
			t.Fatalf("%d %v", code, body)
		}
		n := body["node"].(map[string]any)
		for _, f := range []string{"id", "tenantId", "poolId", "state", "labels", "devices", "lastSeenAt", "sessionEpoch", "gatewayId", "generation", "observedGeneration"} {
			if _, ok := n[f]; !ok {
				t.Errorf("nodes.get has no %s: %v", f, n)
			}
		}
		devs := n["devices"].([]any)
		if n["state"] != "adopted" || n["gatewayId"] != "gw-1" || n["sessionEpoch"] != "3" || len(devs) != 2 || devs[0].(map[string]any)["id"] != "GPU-a" {
			t.Fatalf("node %v", n)
		}
		got, err := nodesC.Get(as(acmeKey), &computev1.NodesServiceGetRequest{TenantId: "acme", NodeId: ids[1]})
		if err != nil || got.GetNode().GetState() != "adopting" || got.GetNode().GetTenantId() != "acme" || got.GetNode().GetLabels()["rack"] == "" {
			t.Fatalf("get %v %v", got, err)
		}
		// The liveness job's Ready condition shows with its value, reason
		// and time.
		if c := n["conditions"].([]any)[0].(map[string]any); c["type"] != "Ready" || c["status"] != true || c["value"] != "True" || c["since"] == nil {
			t.Fatalf("Ready condition %v", c)
		}
		if _, err := h.db.Exec(bg, `UPDATE nodes SET ready = 'Lost', ready_reason = 'no heartbeat', ready_since = now() WHERE id = $1`, ids[1]); err != nil {
			t.Fatal(err)
		}
		got, err = nodesC.Get(as(acmeKey), &computev1.NodesServiceGetRequest{TenantId: "acme", NodeId: ids[1]})
		if err != nil {
			t.Fatal(err)
		}
		if c := got.GetNode().GetConditions()[0]; c.GetType() != "Ready" || c.GetStatus() || c.GetValue() != "Lost" || c.GetReason() != "no heartbeat" || c.GetSince() == nil {
			t.Fatalf("Lost Ready condition %v", c)
		}
	})

	t.Run("list filters by pool, state and label, in pages", func(t *testing.T) {
		collect := func(t *testing.T, req *computev1.NodesServiceListRequest) []string {
			t.Helper()
			var seen []string
			for {
				page, err := nodesC.List(ctx, req)
				if err != nil {
					t.Fatal(err)
				}
				for _, n := range page.GetNodes() {
					seen = append(seen, n.GetId())
				}
				if req.PageToken = page.GetNextPageToken(); req.PageToken == "" {
					return seen
				}
			}
		}
		if all := collect(t, &computev1.NodesServiceListRequest{TenantId: "acme", PageSize: 2}); !slices.Equal(all, ids) {
			t.Fatalf("paged %v, want %v", all, ids)
		}
		if a := collect(t, &computev1.NodesServiceListRequest{TenantId: "acme", PoolId: poolIDs[0]}); len(a) != 3 {
			t.Fatalf("pool a: %v", a)
		}
		if r2 := collect(t, &computev1.NodesServiceListRequest{TenantId: "acme", Labels: map[string]string{"rack": "r2"}}); len(r2) != 2 {
			t.Fatalf("rack r2: %v", r2)
		}
		if st := collect(t, &computev1.NodesServiceListRequest{TenantId: "acme", State: "adopted"}); !slices.Equal(st, []string{adopted}) {
			t.Fatalf("adopted: %v", st)
		}
		inA := slices.Contains(collect(t, &computev1.NodesServiceListRequest{TenantId: "acme", PoolId: poolIDs[0]}), adopted)
		combined := collect(t, &computev1.NodesServiceListRequest{TenantId: "acme", PoolId: poolIDs[0], State: "adopted", Labels: map[string]string{"rack": "r1"}})
		if want := inA; (len(combined) == 1) != want {
			t.Fatalf("pool a, adopted, rack r1: %v (adopted node in pool a: %v)", combined, inA)
		}
		code, body := h.rest(t, h.root, "nodes/list", `{"tenantId":"acme","state":"sleeping"}`)
		wantREST(t, code, body, fault.InvalidInput, "state")
		_, err := nodesC.List(ctx, &computev1.NodesServiceListRequest{TenantId: "acme", PageToken: "junk"})
		wantCode(t, err, fault.InvalidInput, "pageToken")
	})

	t.Run("revoke ends a node's certificates, and what bad revokes get", func(t *testing.T) {
		victim := ids[len(ids)-1]
		_, err := nodesC.Revoke(as(otherKey), &computev1.NodesServiceRevokeRequest{TenantId: "acme", NodeId: victim})
		wantCode(t, err, fault.AccessDenied, "tenantId")
		_, err = nodesC.Revoke(as(otherKey), &computev1.NodesServiceRevokeRequest{TenantId: "other", NodeId: victim})
		wantCode(t, err, fault.NotFound, "nodeId")
		_, err = nodesC.Revoke(as(acmeKey), &computev1.NodesServiceRevokeRequest{TenantId: "acme", NodeId: victim, Reason: strings.Repeat("x", 1025)})
		wantCode(t, err, fault.InvalidInput, "reason")
		_, err = nodesC.Revoke(as(acmeKey), &computev1.NodesServiceRevokeRequest{TenantId: "acme"})
		wantCode(t, err, fault.InvalidInput, "nodeId")
		var live int
		_ = h.db.QueryRow(bg, `SELECT count(*) FROM node_certificates WHERE node_id = $1 AND revoked_at IS NULL`, victim).Scan(&live)
		if live != 1 {
			t.Fatalf("%d live certificates before the revoke, want 1: a refused revoke revoked something", live)
		}
		got, err := nodesC.Revoke(as(acmeKey), &computev1.NodesServiceRevokeRequest{TenantId: "acme", NodeId: victim, Reason: "decommissioned"})
		if err != nil || got.GetRevokedCertificates() != 1 || got.GetNode().GetId() != victim {
			t.Fatalf("revoke %v %v", got, err)
		}
		_ = h.db.QueryRow(bg, `SELECT count(*) FROM node_certificates WHERE node_id = $1 AND revoked_at IS NULL`, victim).Scan(&live)
		var events int
		_ = h.db.QueryRow(bg, `SELECT count(*) FROM outbox WHERE type = 'node.revoked' AND resource_id = $1`, victim).Scan(&events)
		if live != 0 || events != 1 {
			t.Fatalf("after the revoke: %d live certificates, %d node.revoked events", live, events)
		}
		again, err := nodesC.Revoke(as(acmeKey), &computev1.NodesServiceRevokeRequest{TenantId: "acme", NodeId: victim})
		if err != nil || again.GetRevokedCertificates() != 0 {
			t.Fatalf("a second revoke: %v %v, want 0 revoked", again, err)
		}
	})

	t.Run("another tenant sees nothing", func(t *testing.T) {
		_, err := nodesC.Get(as(otherKey), &computev1.NodesServiceGetRequest{TenantId: "acme", NodeId: adopted})
		wantCode(t, err, fault.AccessDenied, "tenantId")
		_, err = nodesC.Get(as(otherKey), &computev1.NodesServiceGetRequest{TenantId: "other", NodeId: adopted})
		wantCode(t, err, fault.NotFound, "nodeId")
		code, body := h.rest(t, otherKey, "nodes/list", `{"tenantId":"acme"}`)
		wantREST(t, code, body, fault.AccessDenied, "tenantId")
		list, err := nodesC.List(as(otherKey), &computev1.NodesServiceListRequest{TenantId: "other"})
		if err != nil || len(list.GetNodes()) != 0 {
			t.Fatalf("other's own list: %v %v", list, err)
		}
		_, err = tokens.Create(as(otherKey), &computev1.JoinTokensServiceCreateRequest{TenantId: "other", PoolId: poolIDs[0]})
		wantCode(t, err, fault.NotFound, "poolId")
		_, err = tokens.List(as(otherKey), &computev1.JoinTokensServiceListRequest{TenantId: "acme"})
		wantCode(t, err, fault.AccessDenied, "tenantId")
	})

	t.Run("a policy can forbid minting tokens for one pool", func(t *testing.T) {
		h.policy(t, "acme", "no-tokens-for-b", fmt.Sprintf(`forbid (principal, action == Action::"compute:join-tokens:create", resource in Pool::%q);`, poolIDs[1]))
		_, err := tokens.Create(as(acmeKey), &computev1.JoinTokensServiceCreateRequest{TenantId: "acme", PoolId: poolIDs[1]})
		wantCode(t, err, fault.AccessDenied, "")
		if _, err := tokens.Create(as(acmeKey), &computev1.JoinTokensServiceCreateRequest{TenantId: "acme", PoolId: poolIDs[0]}); err != nil {
			t.Fatal(err)
		}
	})
}
