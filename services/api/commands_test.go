package api_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/structpb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/services/api"
)

// commandNode joins one node to a pool of tenant acme and returns the
// harness, acme's key, another tenant's key and the node id.
func commandNode(t *testing.T) (*harness, string, string, string) {
	t.Helper()
	h := setup(t, api.Tuning{})
	_, acmeKey := h.member(t, "acme", "ops")
	h.policy(t, "acme", "members", `permit (principal in Tenant::"acme", action, resource in Tenant::"acme");`)
	_, otherKey := h.member(t, "other", "ops")
	h.policy(t, "other", "members", `permit (principal in Tenant::"other", action, resource in Tenant::"other");`)
	p, err := computev1.NewPoolsServiceClient(h.conn).Create(as(acmeKey), &computev1.PoolsServiceCreateRequest{TenantId: "acme", Name: "a", Class: "gpu"})
	if err != nil {
		t.Fatal(err)
	}
	tok, err := computev1.NewJoinTokensServiceClient(h.conn).Create(as(acmeKey), &computev1.JoinTokensServiceCreateRequest{TenantId: "acme", PoolId: p.GetPool().GetId(), Uses: 1})
	if err != nil {
		t.Fatal(err)
	}
	node, err := newJoiner(t, h).join(t, tok.GetToken(), "SN-cmd")
	if err != nil {
		t.Fatal(err)
	}
	return h, acmeKey, otherKey, node
}

func payload(t *testing.T, m map[string]any) *structpb.Struct {
	t.Helper()
	s, err := structpb.NewStruct(m)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestCommandsRun(t *testing.T) {
	t.Parallel()
	h, acmeKey, otherKey, node := commandNode(t)
	cmds := computev1.NewCommandsServiceClient(h.conn)
	ctx := as(acmeKey)
	refresh := &computev1.CommandsServiceRunRequest{TenantId: "acme", NodeId: node, Kind: "inventory.refresh",
		Payload: payload(t, map[string]any{"sections": []any{"gpus"}, "rescan": true}), IdempotencyKey: "refresh-1"}

	projected := func() string {
		var at string
		if err := h.db.QueryRow(t.Context(), `SELECT updated_at::text || draft::text FROM authz_projection WHERE type = 'Node' AND id = $1`, node).Scan(&at); err != nil {
			t.Fatal(err)
		}
		return at
	}
	nodeRow := projected()
	run, err := cmds.Run(ctx, refresh)
	if err != nil {
		t.Fatal(err)
	}
	if got := projected(); got != nodeRow {
		t.Fatalf("commands.run rewrote the node's projection row: %s, then %s", nodeRow, got)
	}
	c := run.GetCommand()
	if c.GetState() != "pending" || c.GetSeq() != 1 || c.GetKind() != "inventory.refresh" || c.GetTenantId() != "acme" ||
		!c.GetPayload().GetFields()["rescan"].GetBoolValue() || c.GetPayload().GetFields()["sections"].GetListValue().GetValues()[0].GetStringValue() != "gpus" {
		t.Fatalf("run: %v", c)
	}
	// notAfterSeconds 0 means 600 from the API's clock.
	if want := h.clock.Now().Add(600 * time.Second); c.GetNotAfter().AsTime().Sub(want).Abs() > time.Millisecond {
		t.Fatalf("notAfter %s, want %s", c.GetNotAfter().AsTime(), want)
	}
	if h.count(t, `SELECT count(*) FROM audit WHERE action = 'compute:nodes:exec' AND decision = 'allow'`) != 1 {
		t.Fatal("no audit row for commands.run")
	}
	if h.count(t, `SELECT count(*) FROM outbox WHERE type = 'command.pending'`) != 1 {
		t.Fatal("no command.pending event")
	}

	// The same key and request replays; another request under it is CONFLICT.
	again, err := cmds.Run(ctx, refresh)
	if err != nil || again.GetCommand().GetId() != c.GetId() {
		t.Fatalf("replay: %v %v, want %s", again, err, c.GetId())
	}
	changed := &computev1.CommandsServiceRunRequest{TenantId: "acme", NodeId: node, Kind: "diag.nvml", IdempotencyKey: "refresh-1"}
	_, err = cmds.Run(ctx, changed)
	wantCode(t, err, fault.Conflict, "idempotencyKey")
	// The key is scoped to the identity: root's refresh-1 is a new command.
	root, err := cmds.Run(as(h.root), refresh)
	if err != nil || root.GetCommand().GetId() == c.GetId() || root.GetCommand().GetSeq() != 2 {
		t.Fatalf("root under the same key: %v %v", root, err)
	}

	before := h.count(t, `SELECT count(*) FROM commands`)
	for _, tc := range []struct {
		name  string
		req   *computev1.CommandsServiceRunRequest
		code  fault.Code
		field string
	}{
		{"a kind off the allowlist", &computev1.CommandsServiceRunRequest{TenantId: "acme", NodeId: node, Kind: "gpu.reset"}, fault.Unsupported, "kind"},
		{"an unknown kind", &computev1.CommandsServiceRunRequest{TenantId: "acme", NodeId: node, Kind: "rm.rf"}, fault.Unsupported, "kind"},
		{"a deadline under 10 s", &computev1.CommandsServiceRunRequest{TenantId: "acme", NodeId: node, Kind: "diag.nvml", NotAfterSeconds: 9}, fault.InvalidInput, "notAfterSeconds"},
		{"a deadline over an hour", &computev1.CommandsServiceRunRequest{TenantId: "acme", NodeId: node, Kind: "diag.nvml", NotAfterSeconds: 3601}, fault.InvalidInput, "notAfterSeconds"},
		{"a negative deadline", &computev1.CommandsServiceRunRequest{TenantId: "acme", NodeId: node, Kind: "diag.nvml", NotAfterSeconds: -1}, fault.InvalidInput, "notAfterSeconds"},
		{"a payload that is not the kind's", &computev1.CommandsServiceRunRequest{TenantId: "acme", NodeId: node, Kind: "inventory.refresh", Payload: payload(t, map[string]any{"level": "full"})}, fault.InvalidInput, "payload"},
		{"no node", &computev1.CommandsServiceRunRequest{TenantId: "acme", Kind: "diag.nvml"}, fault.InvalidInput, "nodeId"},
		{"an unknown node", &computev1.CommandsServiceRunRequest{TenantId: "acme", NodeId: "node_nope", Kind: "diag.nvml"}, fault.NotFound, "nodeId"},
	} {
		_, err := cmds.Run(ctx, tc.req)
		if c, f := envelope(err); c != tc.code || f != tc.field {
			t.Errorf("%s: got %s %q (%v), want %s %q", tc.name, c, f, err, tc.code, tc.field)
		}
	}
	// Another tenant: denied before anything is read, and acme's node is
	// not found from its own tenant.
	_, err = cmds.Run(as(otherKey), &computev1.CommandsServiceRunRequest{TenantId: "acme", NodeId: node, Kind: "diag.nvml"})
	wantCode(t, err, fault.AccessDenied, "tenantId")
	_, err = cmds.Run(as(otherKey), &computev1.CommandsServiceRunRequest{TenantId: "other", NodeId: node, Kind: "diag.nvml"})
	wantCode(t, err, fault.NotFound, "nodeId")
	_, err = cmds.Get(as(otherKey), &computev1.CommandsServiceGetRequest{TenantId: "acme", NodeId: node, CommandId: c.GetId()})
	wantCode(t, err, fault.AccessDenied, "tenantId")
	if after := h.count(t, `SELECT count(*) FROM commands`); after != before {
		t.Fatalf("refused runs wrote %d commands", after-before)
	}

	// The bounds themselves are accepted.
	for _, secs := range []int32{10, 3600} {
		if _, err := cmds.Run(ctx, &computev1.CommandsServiceRunRequest{TenantId: "acme", NodeId: node, Kind: "diag.nvml", NotAfterSeconds: secs}); err != nil {
			t.Errorf("notAfterSeconds %d: %v", secs, err)
		}
	}
}

func TestCommandsGetListCancel(t *testing.T) {
	t.Parallel()
	h, acmeKey, _, node := commandNode(t)
	cmds := computev1.NewCommandsServiceClient(h.conn)
	ctx := as(acmeKey)
	var ids []string
	for _, kind := range []string{"diag.nvml", "logs.collect", "node.reboot"} {
		r, err := cmds.Run(ctx, &computev1.CommandsServiceRunRequest{TenantId: "acme", NodeId: node, Kind: kind})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, r.GetCommand().GetId())
	}
	got, err := cmds.Get(ctx, &computev1.CommandsServiceGetRequest{TenantId: "acme", NodeId: node, CommandId: ids[1]})
	if err != nil || got.GetCommand().GetKind() != "logs.collect" {
		t.Fatalf("get: %v %v", got, err)
	}
	_, err = cmds.Get(ctx, &computev1.CommandsServiceGetRequest{TenantId: "acme", NodeId: node, CommandId: "cmd_nope"})
	wantCode(t, err, fault.NotFound, "commandId")

	// Cancel: pending → cancelled; again → unchanged.
	cancelled, err := cmds.Cancel(ctx, &computev1.CommandsServiceCancelRequest{TenantId: "acme", NodeId: node, CommandId: ids[0]})
	if err != nil || cancelled.GetCommand().GetState() != "cancelled" || cancelled.GetCommand().GetFinishTime() == nil {
		t.Fatalf("cancel: %v %v", cancelled, err)
	}
	again, err := cmds.Cancel(ctx, &computev1.CommandsServiceCancelRequest{TenantId: "acme", NodeId: node, CommandId: ids[0]})
	if err != nil || again.GetCommand().GetState() != "cancelled" || !again.GetCommand().GetFinishTime().AsTime().Equal(cancelled.GetCommand().GetFinishTime().AsTime()) {
		t.Fatalf("cancel again: %v %v", again, err)
	}
	// In flight: a cancel request, still in flight.
	if _, err := h.db.Exec(context.Background(), `UPDATE commands SET state = 'in_flight' WHERE id = $1`, ids[1]); err != nil {
		t.Fatal(err)
	}
	inflight, err := cmds.Cancel(ctx, &computev1.CommandsServiceCancelRequest{TenantId: "acme", NodeId: node, CommandId: ids[1]})
	if err != nil || inflight.GetCommand().GetState() != "in_flight" || inflight.GetCommand().GetCancelRequestedTime() == nil {
		t.Fatalf("cancel in flight: %v %v", inflight, err)
	}

	// List: newest first, by state, paged.
	all, err := cmds.List(ctx, &computev1.CommandsServiceListRequest{TenantId: "acme", NodeId: node})
	if err != nil || len(all.GetCommands()) != 3 || all.GetCommands()[0].GetId() != ids[2] || all.GetNextPageToken() != "" {
		t.Fatalf("list: %v %v", all, err)
	}
	pending, err := cmds.List(ctx, &computev1.CommandsServiceListRequest{TenantId: "acme", NodeId: node, State: "pending"})
	if err != nil || len(pending.GetCommands()) != 1 || pending.GetCommands()[0].GetId() != ids[2] {
		t.Fatalf("list pending: %v %v", pending, err)
	}
	page, err := cmds.List(ctx, &computev1.CommandsServiceListRequest{TenantId: "acme", NodeId: node, PageSize: 2})
	if err != nil || len(page.GetCommands()) != 2 || page.GetNextPageToken() == "" {
		t.Fatalf("page 1: %v %v", page, err)
	}
	page2, err := cmds.List(ctx, &computev1.CommandsServiceListRequest{TenantId: "acme", NodeId: node, PageSize: 2, PageToken: page.GetNextPageToken()})
	if err != nil || len(page2.GetCommands()) != 1 || page2.GetCommands()[0].GetId() != ids[0] {
		t.Fatalf("page 2: %v %v", page2, err)
	}
	_, err = cmds.List(ctx, &computev1.CommandsServiceListRequest{TenantId: "acme", NodeId: node, State: "running"})
	wantCode(t, err, fault.InvalidInput, "state")

	// REST: the spec's example body.
	status, body := h.rest(t, acmeKey, "commands/run", `{"tenantId": "acme", "nodeId": "`+node+`", "kind": "inventory.refresh",
		"payload": {"sections": ["gpus"], "rescan": true}, "idempotencyKey": "refresh-1"}`)
	cmd, _ := body["command"].(map[string]any)
	if status != http.StatusOK || cmd["state"] != "pending" || cmd["payload"].(map[string]any)["rescan"] != true {
		t.Fatalf("REST run: %d %v", status, body)
	}
	status, body = h.rest(t, acmeKey, "commands/run", `{"tenantId": "acme", "nodeId": "`+node+`", "kind": "agent.rollback"}`)
	wantREST(t, status, body, fault.Unsupported, "kind")
}

// TestCommandsRunMinGeneration: commands.run takes minGeneration, stores
// it with the command (what the gateway sends the daemon as min_generation)
// and counts it in the idempotent request; a negative one is INVALID_INPUT
// naming minGeneration, and nothing is queued.
func TestCommandsRunMinGeneration(t *testing.T) {
	t.Parallel()
	h, acmeKey, _, node := commandNode(t)
	cmds := computev1.NewCommandsServiceClient(h.conn)
	ctx := as(acmeKey)
	_, err := cmds.Run(ctx, &computev1.CommandsServiceRunRequest{TenantId: "acme", NodeId: node, Kind: "diag.nvml", MinGeneration: -1})
	wantCode(t, err, fault.InvalidInput, "minGeneration")
	if n := h.count(t, `SELECT count(*) FROM commands WHERE node_id = $1`, node); n != 0 {
		t.Fatalf("%d commands queued by a negative minGeneration", n)
	}
	status, body := h.rest(t, acmeKey, "commands/run", `{"tenantId":"acme","nodeId":"`+node+`","kind":"diag.nvml","minGeneration":"-3"}`)
	wantREST(t, status, body, fault.InvalidInput, "minGeneration")

	req := &computev1.CommandsServiceRunRequest{TenantId: "acme", NodeId: node, Kind: "diag.nvml", MinGeneration: 42, IdempotencyKey: "gen-1"}
	run, err := cmds.Run(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if run.GetCommand().GetMinGeneration() != 42 {
		t.Fatalf("minGeneration %d, want 42", run.GetCommand().GetMinGeneration())
	}
	if n := h.count(t, `SELECT count(*) FROM commands WHERE id = $1 AND min_generation = 42`, run.GetCommand().GetId()); n != 1 {
		t.Fatal("min_generation not stored with the command")
	}
	got, err := cmds.Get(ctx, &computev1.CommandsServiceGetRequest{TenantId: "acme", NodeId: node, CommandId: run.GetCommand().GetId()})
	if err != nil || got.GetCommand().GetMinGeneration() != 42 {
		t.Fatalf("get: %v %v", got, err)
	}
	// Another minGeneration under the same key is another request.
	_, err = cmds.Run(ctx, &computev1.CommandsServiceRunRequest{TenantId: "acme", NodeId: node, Kind: "diag.nvml", MinGeneration: 43, IdempotencyKey: "gen-1"})
	wantCode(t, err, fault.Conflict, "idempotencyKey")
}
