package api

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/structpb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/admission"
	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// commandsAPI implements computev1.CommandsServiceServer: commands.run
// queues one of the allowlisted kinds (commands.Kind.API) on a node the
// caller may exec on; get, list and cancel act on a node's commands.
type commandsAPI struct {
	*Server
	computev1.UnimplementedCommandsServiceServer
}

// notAfterSeconds bounds commands.run's deadline.
const (
	defaultNotAfterSeconds = 600
	minNotAfterSeconds     = 10
	maxNotAfterSeconds     = 3600
)

func commandPB(c commands.Command) (*computev1.Command, error) {
	out := &computev1.Command{
		Id: c.ID, TenantId: c.TenantID, NodeId: c.NodeID, Seq: c.Seq, Kind: c.Kind, State: string(c.State), Reason: c.Reason,
		NotAfter: ts(c.NotAfter), MinGeneration: c.MinGeneration, Attempts: int32(c.Attempts),
		CancelRequestedTime: tsp(c.CancelRequestedAt), CreateTime: ts(c.CreatedAt), DispatchTime: tsp(c.DispatchedAt), FinishTime: tsp(c.FinishedAt),
	}
	var err error
	if out.Payload, err = jsonStruct(c.PayloadJSON()); err != nil {
		return nil, err
	}
	if len(c.Result) > 0 {
		if out.Result, err = jsonStruct(c.ResultJSON()); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func jsonStruct(b json.RawMessage, err error) (*structpb.Struct, error) {
	if err != nil {
		return nil, err
	}
	st := &structpb.Struct{}
	if err := protojson.Unmarshal(b, st); err != nil {
		return nil, fmt.Errorf("command JSON to Struct: %w", err)
	}
	return st, nil
}

// node returns the node resource of a command request: NOT_FOUND "nodeId"
// unless the node is in the tenant.
func (s *commandsAPI) node(ctx context.Context, tenant, nodeID string) (authz.Resource, error) {
	if err := required("nodeId", nodeID); err != nil {
		return authz.Resource{}, err
	}
	return authz.Get(ctx, s.db, tenant, authz.TypeNode, nodeID, "nodeId")
}

// Run queues a command through the admission sequence: the decision is
// compute:nodes:exec on the node, idempotency is scoped to the tenant and
// the caller's identity, and the gateway holding the node is poked after
// commit.
func (s *commandsAPI) Run(ctx context.Context, req *computev1.CommandsServiceRunRequest) (*computev1.CommandsServiceRunResponse, error) {
	k, ok := s.kinds.Lookup(req.GetKind())
	if !ok || !k.API {
		var allowed []string
		for _, k := range s.kinds.Kinds() {
			if k.API {
				allowed = append(allowed, k.Name)
			}
		}
		return nil, fault.New(fault.Unsupported, "kind", "kind %q cannot be run through the API (allowed: %s)", req.GetKind(), strings.Join(allowed, ", "))
	}
	secs := req.GetNotAfterSeconds()
	if secs == 0 {
		secs = defaultNotAfterSeconds
	}
	if secs < minNotAfterSeconds || secs > maxNotAfterSeconds {
		return nil, fault.New(fault.InvalidInput, "notAfterSeconds", "expected 0 (meaning %d) or %d to %d, got %d",
			defaultNotAfterSeconds, minNotAfterSeconds, maxNotAfterSeconds, req.GetNotAfterSeconds())
	}
	if req.GetMinGeneration() < 0 {
		return nil, fault.New(fault.InvalidInput, "minGeneration", "minGeneration must not be negative, got %d", req.GetMinGeneration())
	}
	var payload json.RawMessage
	if req.GetPayload() != nil {
		b, err := protojson.Marshal(req.GetPayload())
		if err != nil {
			return nil, fault.Wrap(err, fault.InvalidInput, "payload", "%v", err)
		}
		payload = b
	}
	if _, err := k.Encode(payload); err != nil {
		return nil, err
	}
	res, err := s.node(ctx, req.GetTenantId(), req.GetNodeId())
	if err != nil {
		return nil, err
	}
	p, _ := iam.PrincipalFrom(ctx)
	key := ""
	if req.GetIdempotencyKey() != "" {
		key = "api:" + p.IdentityID + ":" + req.GetIdempotencyKey()
	}
	out := &computev1.CommandsServiceRunResponse{}
	_, err = s.create(ctx, req, req.GetIdempotencyKey(), admission.Create{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Existing: true, // decided on the node; the node's projection row is not ours to write
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, _ string) (admission.Outcome, error) {
			c, _, err := s.kinds.Enqueue(ctx, tx, commands.Request{
				NodeID: req.GetNodeId(), Kind: k.Name, Payload: payload, IdempotencyKey: key,
				NotAfter: s.now().Add(time.Duration(secs) * time.Second), MinGeneration: req.GetMinGeneration(), CreatedBy: p.IdentityID,
			})
			if err != nil {
				return admission.Outcome{}, err
			}
			pb, err := commandPB(c)
			if err != nil {
				return admission.Outcome{}, err
			}
			o, err := outcome(&computev1.CommandsServiceRunResponse{Command: pb}, "command.requested", nil)
			o.Detail = map[string]any{"commandId": c.ID, "kind": c.Kind}
			o.Event.Resource = c.ID
			q.WakeCommands(req.GetNodeId())
			return o, err
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}

// Get returns one of a node's commands (compute:nodes:get on the node).
func (s *commandsAPI) Get(ctx context.Context, req *computev1.CommandsServiceGetRequest) (*computev1.CommandsServiceGetResponse, error) {
	if err := required("commandId", req.GetCommandId()); err != nil {
		return nil, err
	}
	res, err := s.node(ctx, req.GetTenantId(), req.GetNodeId())
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), res); err != nil {
		return nil, err
	}
	c, err := commands.Lookup(ctx, s.db, req.GetNodeId(), req.GetCommandId())
	if err != nil {
		return nil, err
	}
	pb, err := commandPB(c)
	if err != nil {
		return nil, err
	}
	return &computev1.CommandsServiceGetResponse{Command: pb}, nil
}

// Bounds of commands.getOutput's answer.
const (
	defaultOutputBytes = 256 << 10
	maxOutputBytes     = 1 << 20
)

// GetOutput reads a command's output from the page token's position on
// (compute:nodes:get on the node): the chunks the node streamed while the
// command runs, the result's whole output once it finished. The token is
// set while more may come, also when nothing new has arrived.
func (s *commandsAPI) GetOutput(ctx context.Context, req *computev1.CommandsServiceGetOutputRequest) (*computev1.CommandsServiceGetOutputResponse, error) {
	if err := required("commandId", req.GetCommandId()); err != nil {
		return nil, err
	}
	limit := int(req.GetMaxBytes())
	switch {
	case limit == 0:
		limit = defaultOutputBytes
	case limit < 0 || limit > maxOutputBytes:
		return nil, fault.New(fault.InvalidInput, "maxBytes", "expected 0 (meaning %d) or 1 to %d, got %d", defaultOutputBytes, maxOutputBytes, req.GetMaxBytes())
	}
	from, err := decodeCursor(req.GetPageToken())
	if err != nil {
		return nil, err
	}
	var offset int64
	if from != "" {
		if offset, err = strconv.ParseInt(from, 10, 64); err != nil || offset < 0 {
			return nil, fault.New(fault.InvalidInput, "pageToken", "not a page token from this API")
		}
	}
	res, err := s.node(ctx, req.GetTenantId(), req.GetNodeId())
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), res); err != nil {
		return nil, err
	}
	c, err := commands.Lookup(ctx, s.db, req.GetNodeId(), req.GetCommandId())
	if err != nil {
		return nil, err
	}
	o, err := commands.ReadOutput(ctx, s.db, c, offset, limit)
	if err != nil {
		return nil, err
	}
	out := &computev1.CommandsServiceGetOutputResponse{Data: o.Data, Offset: o.Offset, State: string(c.State), TotalBytes: o.Total}
	if !o.Done {
		b, _ := json.Marshal(cursor{After: strconv.FormatInt(o.Offset+int64(len(o.Data)), 10)})
		out.NextPageToken = base64.RawURLEncoding.EncodeToString(b)
	}
	return out, nil
}

// List returns a node's commands, newest first, optionally in one state.
func (s *commandsAPI) List(ctx context.Context, req *computev1.CommandsServiceListRequest) (*computev1.CommandsServiceListResponse, error) {
	pg, err := readPage(req)
	if err != nil {
		return nil, err
	}
	var states []commands.State
	if st := commands.State(req.GetState()); st != "" {
		if !slices.Contains(commands.States, st) {
			return nil, fault.New(fault.InvalidInput, "state", "expected one of pending, in_flight, succeeded, failed, expired, cancelled, got %q", st)
		}
		states = append(states, st)
	}
	res, err := s.node(ctx, req.GetTenantId(), req.GetNodeId())
	if err != nil {
		return nil, err
	}
	if err := s.read(ctx, req.GetTenantId(), res); err != nil {
		return nil, err
	}
	cs, err := commands.List(ctx, s.db, req.GetNodeId(), states, pg.after, pg.size)
	if err != nil {
		return nil, err
	}
	out := &computev1.CommandsServiceListResponse{}
	for _, c := range cs {
		pb, err := commandPB(c)
		if err != nil {
			return nil, err
		}
		out.Commands = append(out.Commands, pb)
	}
	out.NextPageToken = nextPage(pg, cs, func(c commands.Command) string { return c.ID })
	return out, nil
}

// Cancel cancels a node's command (compute:nodes:exec on the node): a
// pending one becomes cancelled, an in-flight one is sent Cancel until the
// daemon settles it, a finished one is returned unchanged.
func (s *commandsAPI) Cancel(ctx context.Context, req *computev1.CommandsServiceCancelRequest) (*computev1.CommandsServiceCancelResponse, error) {
	if err := required("commandId", req.GetCommandId()); err != nil {
		return nil, err
	}
	res, err := s.node(ctx, req.GetTenantId(), req.GetNodeId())
	if err != nil {
		return nil, err
	}
	out := &computev1.CommandsServiceCancelResponse{}
	err = s.mutate(ctx, admission.Mutation{
		Call:     admission.Call{TenantID: req.GetTenantId()},
		Resource: res,
		Work: func(ctx context.Context, tx pgx.Tx, q *reconcile.Queue) (admission.Outcome, error) {
			c, err := commands.Cancel(ctx, tx, q, req.GetNodeId(), req.GetCommandId())
			if err != nil {
				return admission.Outcome{}, err
			}
			pb, err := commandPB(c)
			if err != nil {
				return admission.Outcome{}, err
			}
			o, err := outcome(&computev1.CommandsServiceCancelResponse{Command: pb}, "command.cancel_requested", nil)
			o.Detail = map[string]any{"commandId": c.ID, "state": string(c.State)}
			o.Event.Resource = c.ID
			q.WakeCommands(req.GetNodeId())
			return o, err
		},
	}, out)
	if err != nil {
		return nil, err
	}
	return out, nil
}
