package mcpserver

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/protobuf/types/known/timestamppb"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
	"github.com/bettercompute/bettercompute/proto/client"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/fault"
)

// ReadTools are the tools that change nothing: all a read-only server
// (mcp.readOnly) offers.
var ReadTools = []string{"nodes_list", "nodes_get", "commands_get", "reservations_get", "capacity_get", "events_list"}

// MutatingTools change the fleet; each takes dryRun.
var MutatingTools = []string{"nodes_drain", "commands_run", "reservations_create", "reservations_release"}

// Field maximums shared by the tools.
const (
	maxID       = 128
	maxTenantID = 256
	maxReason   = 1024
	maxToken    = 4096
	maxPageSize = 500
	// maxReservationPages bounds how many pages of reservations a drain's
	// dry run reads to find the bookings on the node.
	maxReservationPages = 10
)

var (
	tenantBound = bound{maxLen: maxTenantID}
	idBound     = bound{maxLen: maxID}
	pageBound   = num(0, maxPageSize)
	tokenBound  = bound{maxLen: maxToken}
)

// The tools' inputs. Every tenantId defaults to the caller's own tenant.

// NodesListInput filters nodes_list.
type NodesListInput struct {
	TenantID  string            `json:"tenantId,omitempty" jsonschema:"the tenant whose nodes to list; default the caller's own"`
	PoolID    string            `json:"poolId,omitempty" jsonschema:"only this pool's nodes"`
	State     string            `json:"state,omitempty" jsonschema:"only nodes in this state (e.g. adopted, draining, drained)"`
	Condition string            `json:"condition,omitempty" jsonschema:"only nodes with this condition true (e.g. Ready, Draining, NeedsRepair)"`
	Labels    map[string]string `json:"labels,omitempty" jsonschema:"only nodes with all these labels"`
	PageSize  int32             `json:"pageSize,omitempty" jsonschema:"at most this many nodes (0: 100)"`
	PageToken string            `json:"pageToken,omitempty" jsonschema:"nextPageToken of the previous page"`
}

// NodesListOutput is a page of nodes.
type NodesListOutput struct {
	Nodes         []Node `json:"nodes"`
	NextPageToken string `json:"nextPageToken,omitempty"`
}

// NodeInput names a node.
type NodeInput struct {
	TenantID string `json:"tenantId,omitempty" jsonschema:"the node's tenant; default the caller's own"`
	NodeID   string `json:"nodeId" jsonschema:"the node"`
}

// NodeOutput is a node with its GPUs and desired-state sections.
type NodeOutput struct {
	Node     Node      `json:"node"`
	GPUs     []GPU     `json:"gpus"`
	Sections []Section `json:"sections"`
}

// DrainInput is nodes_drain's.
type DrainInput struct {
	TenantID        string `json:"tenantId,omitempty" jsonschema:"the node's tenant; default the caller's own"`
	NodeID          string `json:"nodeId" jsonschema:"the node to drain"`
	DeadlineSeconds int64  `json:"deadlineSeconds,omitempty" jsonschema:"how long its bookings may stay, 0 to 604800; 0 means 3600"`
	Reason          string `json:"reason,omitempty" jsonschema:"why, for the audit log and the events"`
	DryRun          bool   `json:"dryRun,omitempty" jsonschema:"answer what would be drained (the node, its GPUs, the reservations booked on it) and change nothing"`
	Confirm         bool   `json:"confirm,omitempty" jsonschema:"required (true) to drain: draining moves the node's bookings off it"`
}

// DrainOutput says what a drain affects (dry run) or did.
type DrainOutput struct {
	DryRun       bool          `json:"dryRun"`
	Node         Node          `json:"node"`
	GPUs         []GPU         `json:"gpus"`
	Reservations []Reservation `json:"reservations" jsonschema:"reservations of the node's tenant with GPUs booked on the node"`
	Message      string        `json:"message"`
}

// CommandRunInput is commands_run's.
type CommandRunInput struct {
	TenantID        string `json:"tenantId,omitempty" jsonschema:"the node's tenant; default the caller's own"`
	NodeID          string `json:"nodeId" jsonschema:"the node to run the command on"`
	Kind            string `json:"kind" jsonschema:"the command kind (the API's allowlist)"`
	NotAfterSeconds int32  `json:"notAfterSeconds,omitempty" jsonschema:"the command's deadline: 0 (600) or 10 to 3600 seconds"`
	IdempotencyKey  string `json:"idempotencyKey,omitempty" jsonschema:"a retry with the same key answers the same command"`
	DryRun          bool   `json:"dryRun,omitempty" jsonschema:"answer what would run (the node, the kind, whether it is destructive) and queue nothing"`
	Confirm         bool   `json:"confirm,omitempty" jsonschema:"required (true) for a destructive kind such as node.reboot"`
}

// CommandRunOutput says what would run (dry run) or what was queued.
type CommandRunOutput struct {
	DryRun      bool     `json:"dryRun"`
	NodeID      string   `json:"nodeId"`
	Kind        string   `json:"kind"`
	Destructive bool     `json:"destructive"`
	Description string   `json:"description"`
	Node        Node     `json:"node"`
	Command     *Command `json:"command,omitempty"`
	Message     string   `json:"message"`
}

// CommandInput names a command.
type CommandInput struct {
	TenantID  string `json:"tenantId,omitempty" jsonschema:"the node's tenant; default the caller's own"`
	NodeID    string `json:"nodeId" jsonschema:"the command's node"`
	CommandID string `json:"commandId" jsonschema:"the command"`
}

// CommandOutput is a command.
type CommandOutput struct {
	Command Command `json:"command"`
}

// ReservationCreateInput is reservations_create's.
type ReservationCreateInput struct {
	TenantID       string            `json:"tenantId,omitempty" jsonschema:"the tenant the GPUs are for; default the caller's own"`
	PoolID         string            `json:"poolId" jsonschema:"the pool"`
	GPUCount       int32             `json:"gpuCount,omitempty" jsonschema:"how many whole GPUs (not with migProfile)"`
	MigProfile     string            `json:"migProfile,omitempty" jsonschema:"book MIG slices of this profile (e.g. 1g.18gb) instead of whole GPUs; count says how many"`
	Count          int32             `json:"count,omitempty" jsonschema:"with migProfile: how many slices"`
	Model          string            `json:"model,omitempty" jsonschema:"only GPUs of this model"`
	MinMemoryBytes int64             `json:"minMemoryBytes,omitempty" jsonschema:"only GPUs with at least this much memory"`
	SameNode       bool              `json:"sameNode,omitempty" jsonschema:"all GPUs on one node"`
	NodeLabels     map[string]string `json:"nodeLabels,omitempty" jsonschema:"only nodes with all these labels"`
	StartTime      string            `json:"startTime,omitempty" jsonschema:"RFC 3339; default now"`
	EndTime        string            `json:"endTime,omitempty" jsonschema:"RFC 3339; default none"`
	IdempotencyKey string            `json:"idempotencyKey,omitempty" jsonschema:"a retry with the same key answers the same reservation"`
	DryRun         bool              `json:"dryRun,omitempty" jsonschema:"answer what capacity_get says is free in the pool (GPUs, or slices of migProfile) against what is asked, and book nothing"`
}

// ReservationCreateOutput says whether the ask fits (dry run) or what was
// booked.
type ReservationCreateOutput struct {
	DryRun      bool         `json:"dryRun"`
	Requested   int32        `json:"requested" jsonschema:"GPUs, or MIG slices with migProfile"`
	Model       string       `json:"model,omitempty"`
	MigProfile  string       `json:"migProfile,omitempty"`
	Free        int32        `json:"free" jsonschema:"free GPUs in the pool (of the model, when one is asked), or free slices of migProfile"`
	Fits        bool         `json:"fits" jsonschema:"enough are free; placement may still refuse on sameNode, memory, labels or quota"`
	Capacity    *Capacity    `json:"capacity,omitempty"`
	Reservation *Reservation `json:"reservation,omitempty"`
	Message     string       `json:"message"`
}

// ReservationInput names a reservation.
type ReservationInput struct {
	TenantID      string `json:"tenantId,omitempty" jsonschema:"the reservation's tenant; default the caller's own"`
	ReservationID string `json:"reservationId" jsonschema:"the reservation"`
}

// ReservationOutput is a reservation.
type ReservationOutput struct {
	Reservation Reservation `json:"reservation"`
}

// ReleaseInput is reservations_release's.
type ReleaseInput struct {
	TenantID      string `json:"tenantId,omitempty" jsonschema:"the reservation's tenant; default the caller's own"`
	ReservationID string `json:"reservationId" jsonschema:"the reservation to release"`
	DryRun        bool   `json:"dryRun,omitempty" jsonschema:"answer which GPUs and nodes would be freed and release nothing"`
}

// ReleaseOutput says what a release frees (dry run) or freed.
type ReleaseOutput struct {
	DryRun      bool        `json:"dryRun"`
	Reservation Reservation `json:"reservation"`
	FreedGPUs   []Booking   `json:"freedGpus"`
	FreedNodes  []string    `json:"freedNodes"`
	Message     string      `json:"message"`
}

// CapacityInput names a pool.
type CapacityInput struct {
	TenantID string `json:"tenantId,omitempty" jsonschema:"the pool's tenant; default the caller's own"`
	PoolID   string `json:"poolId" jsonschema:"the pool"`
}

// EventsListInput filters events_list.
type EventsListInput struct {
	TenantID           string   `json:"tenantId,omitempty" jsonschema:"the tenant whose events to list; default the caller's own"`
	Types              []string `json:"types,omitempty" jsonschema:"only events of these types (e.g. node.drained, command.succeeded)"`
	Subject            string   `json:"subject,omitempty" jsonschema:"only events about this resource id"`
	After              string   `json:"after,omitempty" jsonschema:"only events after this cursor (an event's cursor, or nextPageToken)"`
	PageSize           int32    `json:"pageSize,omitempty" jsonschema:"at most this many events (0: 50)"`
	IncludeDescendants bool     `json:"includeDescendants,omitempty" jsonschema:"include the events of the tenant's descendants"`
}

// EventsListOutput is a page of events, oldest first.
type EventsListOutput struct {
	Events        []Event `json:"events"`
	NextPageToken string  `json:"nextPageToken,omitempty"`
}

// addTool registers a typed tool whose handler gets the caller's context
// and tenant; errors come back as tool errors "CODE field: message".
func addTool[In, Out any](s *server, t *mcp.Tool, bounds map[string]bound, h func(ctx context.Context, tenant string, in In) (Out, error)) {
	t.InputSchema = inputSchema[In](bounds)
	mcp.AddTool(s.mcp, t, func(ctx context.Context, req *mcp.CallToolRequest, in In) (*mcp.CallToolResult, Out, error) {
		var zero Out
		cctx, tenant, err := s.caller(ctx, req)
		if err != nil {
			return nil, zero, toolError(err)
		}
		out, err := h(cctx, tenant, in)
		if err != nil {
			s.logger.Debug("tool failed", "tool", t.Name, "err", err)
			return nil, zero, toolError(err)
		}
		return nil, out, nil
	})
}

// toolError renders an API or input error as "CODE field: message".
func toolError(err error) error {
	if fe, ok := fault.As(err); ok {
		return fe
	}
	return fmt.Errorf("%s", client.EnvelopeOf(err).String())
}

func tenantOr(in, caller string) string {
	if in != "" {
		return in
	}
	return caller
}

func yes(b bool) *bool { return &b }

func (s *server) addTools(readOnly bool) {
	ro := &mcp.ToolAnnotations{ReadOnlyHint: true, OpenWorldHint: yes(false)}
	addTool(s, &mcp.Tool{Name: "nodes_list", Title: "List nodes", Annotations: ro,
		Description: "Lists a tenant's nodes (GPU servers) with their state, conditions and GPU counts, filtered by pool, state, condition or labels."},
		map[string]bound{"tenantId": tenantBound, "poolId": idBound, "state": {maxLen: 64}, "condition": {maxLen: 64},
			"labels": {maxLen: 256, maxItems: 64}, "pageSize": pageBound, "pageToken": tokenBound},
		s.nodesList)
	addTool(s, &mcp.Tool{Name: "nodes_get", Title: "Get a node", Annotations: ro,
		Description: "Gets one node: its state, conditions (Drifted with its reasons), GPUs (health, quarantine, MIG layout and slices with their bookings), desired-state sections and the rollout batch it is in."},
		map[string]bound{"tenantId": tenantBound, "nodeId": idBound}, s.nodesGet)
	addTool(s, &mcp.Tool{Name: "commands_get", Title: "Get a command", Annotations: ro,
		Description: "Gets a command run on a node: its state (final once settled), reason and result."},
		map[string]bound{"tenantId": tenantBound, "nodeId": idBound, "commandId": idBound}, s.commandsGet)
	addTool(s, &mcp.Tool{Name: "reservations_get", Title: "Get a reservation", Annotations: ro,
		Description: "Gets a reservation: its state and the GPUs booked for it, node by node."},
		map[string]bound{"tenantId": tenantBound, "reservationId": idBound}, s.reservationsGet)
	addTool(s, &mcp.Tool{Name: "capacity_get", Title: "Get a pool's capacity", Annotations: ro,
		Description: "Counts a pool's GPUs: free, booked, unavailable and quarantined, in all and per model; its MIG slices the same way per profile; drifted nodes; and each tenant's use."},
		map[string]bound{"tenantId": tenantBound, "poolId": idBound}, s.capacityGet)
	addTool(s, &mcp.Tool{Name: "events_list", Title: "List events", Annotations: ro,
		Description: "Lists a tenant's events, oldest first, by type and subject; page with after."},
		map[string]bound{"tenantId": tenantBound, "types": {maxLen: 128, maxItems: 32}, "subject": {maxLen: 256},
			"after": {maxLen: 256}, "pageSize": pageBound},
		s.eventsList)
	if readOnly {
		return
	}

	var kinds []string
	var destructive []string
	for _, k := range s.kinds {
		kinds = append(kinds, k.Name)
		if k.Destructive {
			destructive = append(destructive, k.Name)
		}
	}
	addTool(s, &mcp.Tool{Name: "nodes_drain", Title: "Drain a node",
		Annotations: &mcp.ToolAnnotations{DestructiveHint: yes(true), IdempotentHint: true, OpenWorldHint: yes(false)},
		Description: "Drains a node: no new bookings, and its bookings move off it by the deadline. Destructive: needs confirm: true; " +
			"dryRun: true answers the node, its GPUs and the reservations booked on it, and changes nothing."},
		map[string]bound{"tenantId": tenantBound, "nodeId": idBound, "deadlineSeconds": num(0, 604800), "reason": {maxLen: maxReason}},
		s.nodesDrain)
	addTool(s, &mcp.Tool{Name: "commands_run", Title: "Run a command on a node",
		Annotations: &mcp.ToolAnnotations{DestructiveHint: yes(len(destructive) > 0), OpenWorldHint: yes(false)},
		Description: "Queues one of the allowlisted command kinds (" + strings.Join(kinds, ", ") + ") on a node; read its outcome with commands_get. " +
			"Destructive kinds (" + strings.Join(destructive, ", ") + ") need confirm: true; dryRun: true answers the node, the kind and whether it is destructive, and queues nothing."},
		map[string]bound{"tenantId": tenantBound, "nodeId": idBound, "kind": {maxLen: 64, enum: kinds},
			"notAfterSeconds": num(0, 3600), "idempotencyKey": {maxLen: 255}},
		s.commandsRun)
	addTool(s, &mcp.Tool{Name: "reservations_create", Title: "Book GPUs",
		Annotations: &mcp.ToolAnnotations{DestructiveHint: yes(false), OpenWorldHint: yes(false)},
		Description: "Books GPUs of a pool for a tenant: gpuCount whole GPUs, or migProfile and count for MIG slices. " +
			"dryRun: true answers what capacity_get says is free in the pool against what is asked, and books nothing."},
		map[string]bound{"tenantId": tenantBound, "poolId": idBound, "gpuCount": num(1, 4096), "migProfile": {maxLen: 64},
			"count": num(1, 1024), "model": {maxLen: 128},
			"minMemoryBytes": num(0, 1<<50), "nodeLabels": {maxLen: 256, maxItems: 64}, "startTime": {maxLen: 64}, "endTime": {maxLen: 64},
			"idempotencyKey": {maxLen: 255}},
		s.reservationsCreate)
	addTool(s, &mcp.Tool{Name: "reservations_release", Title: "Release a reservation",
		Annotations: &mcp.ToolAnnotations{DestructiveHint: yes(false), IdempotentHint: true, OpenWorldHint: yes(false)},
		Description: "Releases a reservation: its GPUs are withdrawn from the nodes and free again. dryRun: true answers the GPUs and nodes that would be freed, and releases nothing."},
		map[string]bound{"tenantId": tenantBound, "reservationId": idBound}, s.reservationsRelease)
}

// --- read tools ---

func (s *server) nodesList(ctx context.Context, tenant string, in NodesListInput) (NodesListOutput, error) {
	res, err := s.nodes.List(ctx, &computev1.NodesServiceListRequest{
		TenantId: tenantOr(in.TenantID, tenant), PoolId: in.PoolID, State: in.State, Condition: in.Condition,
		Labels: in.Labels, PageSize: in.PageSize, PageToken: in.PageToken,
	})
	if err != nil {
		return NodesListOutput{}, err
	}
	out := NodesListOutput{Nodes: []Node{}, NextPageToken: res.GetNextPageToken()}
	for _, n := range res.GetNodes() {
		out.Nodes = append(out.Nodes, nodeOf(n))
	}
	return out, nil
}

func (s *server) getNode(ctx context.Context, tenant, nodeID string) (*computev1.Node, error) {
	if err := required("nodeId", nodeID); err != nil {
		return nil, err
	}
	res, err := s.nodes.Get(ctx, &computev1.NodesServiceGetRequest{TenantId: tenant, NodeId: nodeID})
	if err != nil {
		return nil, err
	}
	return res.GetNode(), nil
}

func (s *server) nodesGet(ctx context.Context, tenant string, in NodeInput) (NodeOutput, error) {
	n, err := s.getNode(ctx, tenantOr(in.TenantID, tenant), in.NodeID)
	if err != nil {
		return NodeOutput{}, err
	}
	return NodeOutput{Node: nodeOf(n), GPUs: gpusOf(n), Sections: sectionsOf(n)}, nil
}

func (s *server) commandsGet(ctx context.Context, tenant string, in CommandInput) (CommandOutput, error) {
	if err := required("nodeId", in.NodeID); err != nil {
		return CommandOutput{}, err
	}
	if err := required("commandId", in.CommandID); err != nil {
		return CommandOutput{}, err
	}
	res, err := s.cmds.Get(ctx, &computev1.CommandsServiceGetRequest{TenantId: tenantOr(in.TenantID, tenant), NodeId: in.NodeID, CommandId: in.CommandID})
	if err != nil {
		return CommandOutput{}, err
	}
	return CommandOutput{Command: commandOf(res.GetCommand())}, nil
}

func (s *server) getReservation(ctx context.Context, tenant, id string) (*computev1.Reservation, error) {
	if err := required("reservationId", id); err != nil {
		return nil, err
	}
	res, err := s.reservations.Get(ctx, &computev1.ReservationsServiceGetRequest{TenantId: tenant, ReservationId: id})
	if err != nil {
		return nil, err
	}
	return res.GetReservation(), nil
}

func (s *server) reservationsGet(ctx context.Context, tenant string, in ReservationInput) (ReservationOutput, error) {
	r, err := s.getReservation(ctx, tenantOr(in.TenantID, tenant), in.ReservationID)
	if err != nil {
		return ReservationOutput{}, err
	}
	return ReservationOutput{Reservation: reservationOf(r)}, nil
}

func (s *server) getCapacity(ctx context.Context, tenant, pool string) (Capacity, error) {
	if err := required("poolId", pool); err != nil {
		return Capacity{}, err
	}
	res, err := s.capacity.Get(ctx, &computev1.CapacityServiceGetRequest{TenantId: tenant, PoolId: pool})
	if err != nil {
		return Capacity{}, err
	}
	return capacityOf(pool, res), nil
}

func (s *server) capacityGet(ctx context.Context, tenant string, in CapacityInput) (Capacity, error) {
	return s.getCapacity(ctx, tenantOr(in.TenantID, tenant), in.PoolID)
}

func (s *server) eventsList(ctx context.Context, tenant string, in EventsListInput) (EventsListOutput, error) {
	res, err := s.events.List(ctx, &computev1.EventsServiceListRequest{
		TenantId: tenantOr(in.TenantID, tenant), Types: in.Types, Subject: in.Subject, After: in.After,
		PageSize: in.PageSize, IncludeDescendants: in.IncludeDescendants,
	})
	if err != nil {
		return EventsListOutput{}, err
	}
	out := EventsListOutput{Events: []Event{}, NextPageToken: res.GetNextPageToken()}
	for _, e := range res.GetEvents() {
		out.Events = append(out.Events, eventOf(e))
	}
	return out, nil
}

// --- mutating tools ---

// bookedOn lists the reservations of tenant with GPUs booked on node (those
// placed or bound), reading at most maxReservationPages pages per state.
func (s *server) bookedOn(ctx context.Context, tenant, node string) ([]Reservation, bool, error) {
	out := []Reservation{}
	complete := true
	for _, state := range []string{"placed", "bound"} {
		token := ""
		for page := 0; ; page++ {
			if page == maxReservationPages {
				complete = false
				break
			}
			res, err := s.reservations.List(ctx, &computev1.ReservationsServiceListRequest{TenantId: tenant, State: state, PageSize: maxPageSize, PageToken: token})
			if err != nil {
				return nil, false, err
			}
			for _, r := range res.GetReservations() {
				if slices.ContainsFunc(r.GetBookings(), func(b *computev1.Booking) bool { return b.GetNodeId() == node }) {
					out = append(out, reservationOf(r))
				}
			}
			if token = res.GetNextPageToken(); token == "" {
				break
			}
		}
	}
	return out, complete, nil
}

func (s *server) nodesDrain(ctx context.Context, tenant string, in DrainInput) (DrainOutput, error) {
	tenant = tenantOr(in.TenantID, tenant)
	if !in.DryRun && !in.Confirm {
		return DrainOutput{}, fault.New(fault.InvalidInput, "confirm",
			"nodes_drain is destructive (the node takes no new bookings and its bookings move off it): set confirm: true to drain %s, or dryRun: true to see what it affects", in.NodeID)
	}
	n, err := s.getNode(ctx, tenant, in.NodeID)
	if err != nil {
		return DrainOutput{}, err
	}
	out := DrainOutput{DryRun: in.DryRun, Node: nodeOf(n), GPUs: gpusOf(n)}
	booked, complete, err := s.bookedOn(ctx, n.GetTenantId(), n.GetId())
	if err != nil {
		return DrainOutput{}, err
	}
	out.Reservations = booked
	gpus := 0
	for _, r := range booked {
		for _, b := range r.Bookings {
			if b.NodeID == n.GetId() {
				gpus++
			}
		}
	}
	affects := fmt.Sprintf("%d GPUs, %d reservations booked on it (%d of its GPUs)", len(out.GPUs), len(booked), gpus)
	if !complete {
		affects += fmt.Sprintf("; only the first %d pages of reservations were read", maxReservationPages)
	}
	if in.DryRun {
		deadline := in.DeadlineSeconds
		if deadline == 0 {
			deadline = 3600
		}
		out.Message = fmt.Sprintf("would drain node %s (%s, state %s): %s; its bookings may stay %s. Nothing was changed.",
			n.GetId(), n.GetHostname(), n.GetState(), affects, time.Duration(deadline)*time.Second)
		return out, nil
	}
	res, err := s.nodes.Drain(ctx, &computev1.NodesServiceDrainRequest{TenantId: tenant, NodeId: in.NodeID, DeadlineSeconds: in.DeadlineSeconds, Reason: in.Reason})
	if err != nil {
		return DrainOutput{}, err
	}
	out.Node, out.GPUs = nodeOf(res.GetNode()), gpusOf(res.GetNode())
	out.Message = fmt.Sprintf("node %s is %s: %s", res.GetNode().GetId(), res.GetNode().GetState(), affects)
	return out, nil
}

func (s *server) commandsRun(ctx context.Context, tenant string, in CommandRunInput) (CommandRunOutput, error) {
	tenant = tenantOr(in.TenantID, tenant)
	i := slices.IndexFunc(s.kinds, func(k commands.Kind) bool { return k.Name == in.Kind })
	if i < 0 {
		var names []string
		for _, k := range s.kinds {
			names = append(names, k.Name)
		}
		return CommandRunOutput{}, fault.New(fault.InvalidInput, "kind", "%q is not a command kind the API runs (allowed: %s)", in.Kind, strings.Join(names, ", "))
	}
	k := s.kinds[i]
	if n := in.NotAfterSeconds; n != 0 && (n < 10 || n > 3600) {
		return CommandRunOutput{}, fault.New(fault.InvalidInput, "notAfterSeconds", "expected 0 (meaning 600) or 10 to 3600, got %d", n)
	}
	if k.Destructive && !in.DryRun && !in.Confirm {
		return CommandRunOutput{}, fault.New(fault.InvalidInput, "confirm",
			"%s is destructive (%s): set confirm: true to run it on %s, or dryRun: true to see what it affects", k.Name, k.Doc, in.NodeID)
	}
	n, err := s.getNode(ctx, tenant, in.NodeID)
	if err != nil {
		return CommandRunOutput{}, err
	}
	out := CommandRunOutput{DryRun: in.DryRun, NodeID: n.GetId(), Kind: k.Name, Destructive: k.Destructive, Description: k.Doc, Node: nodeOf(n)}
	if in.DryRun {
		what := "not destructive"
		if k.Destructive {
			what = "destructive: it needs confirm: true"
		}
		out.Message = fmt.Sprintf("would run %s on node %s (%s, state %s, %d GPUs); %s. Nothing was queued.",
			k.Name, n.GetId(), n.GetHostname(), n.GetState(), out.Node.GPUs, what)
		return out, nil
	}
	res, err := s.cmds.Run(ctx, &computev1.CommandsServiceRunRequest{
		TenantId: tenant, NodeId: in.NodeID, Kind: k.Name, NotAfterSeconds: in.NotAfterSeconds, IdempotencyKey: in.IdempotencyKey,
	})
	if err != nil {
		return CommandRunOutput{}, err
	}
	c := commandOf(res.GetCommand())
	out.Command = &c
	out.Message = fmt.Sprintf("queued %s %s on node %s (state %s); read its outcome with commands_get", k.Name, c.ID, n.GetId(), c.State)
	return out, nil
}

func parseTime(field, v string) (*timestamppb.Timestamp, error) {
	if v == "" {
		return nil, nil
	}
	t, err := time.Parse(time.RFC3339, v)
	if err != nil {
		return nil, fault.New(fault.InvalidInput, field, "expected an RFC 3339 time such as 2030-01-02T15:04:05Z, got %q", v)
	}
	return timestamppb.New(t), nil
}

func (s *server) reservationsCreate(ctx context.Context, tenant string, in ReservationCreateInput) (ReservationCreateOutput, error) {
	tenant = tenantOr(in.TenantID, tenant)
	if err := required("poolId", in.PoolID); err != nil {
		return ReservationCreateOutput{}, err
	}
	asked := in.GPUCount
	switch {
	case in.MigProfile != "" && in.GPUCount != 0:
		return ReservationCreateOutput{}, fault.New(fault.InvalidInput, "gpuCount", "not with migProfile: count says how many %s slices", in.MigProfile)
	case in.MigProfile != "":
		if in.Count < 1 {
			return ReservationCreateOutput{}, fault.New(fault.InvalidInput, "count", "at least 1 %s slice, got %d", in.MigProfile, in.Count)
		}
		asked = in.Count
	case in.Count != 0:
		return ReservationCreateOutput{}, fault.New(fault.InvalidInput, "count", "only with migProfile (for whole GPUs, use gpuCount)")
	case in.GPUCount < 1:
		return ReservationCreateOutput{}, fault.New(fault.InvalidInput, "gpuCount", "at least 1, got %d (or migProfile and count for MIG slices)", in.GPUCount)
	}
	start, err := parseTime("startTime", in.StartTime)
	if err != nil {
		return ReservationCreateOutput{}, err
	}
	end, err := parseTime("endTime", in.EndTime)
	if err != nil {
		return ReservationCreateOutput{}, err
	}
	out := ReservationCreateOutput{DryRun: in.DryRun, Requested: asked, Model: in.Model, MigProfile: in.MigProfile}
	if in.DryRun && in.MigProfile != "" {
		c, err := s.getCapacity(ctx, tenant, in.PoolID)
		if err != nil {
			return ReservationCreateOutput{}, err
		}
		out.Capacity = &c
		for _, m := range c.MigProfiles {
			if m.Profile == in.MigProfile {
				out.Free = m.Free
			}
		}
		out.Fits = out.Free >= asked
		verdict := "fits"
		if !out.Fits {
			verdict = "does not fit now"
		}
		out.Message = fmt.Sprintf("would book %d MIG %s slices of pool %s (packed onto partly used GPUs first); %d are free: it %s "+
			"(placement also checks model, labels and quota). Nothing was booked.", asked, in.MigProfile, in.PoolID, out.Free, verdict)
		return out, nil
	}
	if in.DryRun {
		c, err := s.getCapacity(ctx, tenant, in.PoolID)
		if err != nil {
			return ReservationCreateOutput{}, err
		}
		out.Capacity = &c
		out.Free = c.Total.Free
		if in.Model != "" {
			out.Free = 0
			for _, m := range c.Models {
				if m.Model == in.Model {
					out.Free = m.Free
				}
			}
		}
		out.Fits = out.Free >= in.GPUCount
		of := ""
		if in.Model != "" {
			of = " " + in.Model
		}
		verdict := "fits"
		if !out.Fits {
			verdict = "does not fit now"
		}
		out.Message = fmt.Sprintf("asked %d%s GPUs of pool %s; %d are free: it %s (placement also checks sameNode, memory, labels and quota). Nothing was booked.",
			in.GPUCount, of, in.PoolID, out.Free, verdict)
		return out, nil
	}
	req := &computev1.ReservationsServiceCreateRequest{
		TenantId: tenant, PoolId: in.PoolID, GpuCount: in.GPUCount, MigProfile: in.MigProfile, Count: in.Count,
		StartTime: start, EndTime: end, IdempotencyKey: in.IdempotencyKey,
	}
	if in.Model != "" || in.MinMemoryBytes != 0 || in.SameNode || len(in.NodeLabels) > 0 {
		req.Constraints = &computev1.Constraints{Model: in.Model, MinMemoryBytes: in.MinMemoryBytes, SameNode: in.SameNode, NodeLabels: in.NodeLabels}
	}
	res, err := s.reservations.Create(ctx, req)
	if err != nil {
		return ReservationCreateOutput{}, err
	}
	r := reservationOf(res.GetReservation())
	out.Reservation = &r
	what := "GPUs"
	if r.MigProfile != "" {
		what = "MIG " + r.MigProfile + " slices"
	}
	out.Message = fmt.Sprintf("reservation %s is %s with %d %s booked on %d nodes", r.ID, r.State, len(r.Bookings), what, len(r.Nodes))
	return out, nil
}

// finalReservation reports whether a reservation holds no GPUs any more.
func finalReservation(state string) bool {
	return state == "released" || state == "expired" || state == "failed"
}

func (s *server) reservationsRelease(ctx context.Context, tenant string, in ReleaseInput) (ReleaseOutput, error) {
	tenant = tenantOr(in.TenantID, tenant)
	r, err := s.getReservation(ctx, tenant, in.ReservationID)
	if err != nil {
		return ReleaseOutput{}, err
	}
	sum := reservationOf(r)
	out := ReleaseOutput{DryRun: in.DryRun, Reservation: sum, FreedGPUs: sum.Bookings, FreedNodes: sum.Nodes}
	if finalReservation(sum.State) {
		out.FreedGPUs, out.FreedNodes = []Booking{}, []string{}
	}
	if in.DryRun {
		if finalReservation(sum.State) {
			out.Message = fmt.Sprintf("reservation %s is already %s: releasing frees nothing. Nothing was changed.", sum.ID, sum.State)
		} else {
			out.Message = fmt.Sprintf("would release reservation %s (%s): frees %d GPUs on %d nodes (%s). Nothing was changed.",
				sum.ID, sum.State, len(out.FreedGPUs), len(out.FreedNodes), strings.Join(out.FreedNodes, ", "))
		}
		return out, nil
	}
	res, err := s.reservations.Release(ctx, &computev1.ReservationsServiceReleaseRequest{TenantId: tenant, ReservationId: in.ReservationID})
	if err != nil {
		return ReleaseOutput{}, err
	}
	out.Reservation = reservationOf(res.GetReservation())
	out.Message = fmt.Sprintf("reservation %s is %s: %d GPUs on %d nodes freed", out.Reservation.ID, out.Reservation.State, len(out.FreedGPUs), len(out.FreedNodes))
	return out, nil
}
