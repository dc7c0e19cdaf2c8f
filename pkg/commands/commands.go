// Package commands is the command queue: one-shot actions with a deadline,
// queued for one node as durable rows of the commands table in the caller's
// transaction, delivered by the gateway holding the node's session, and
// settled from the daemon's CommandUpdates.
//
// A module queues a command with [Enqueue] inside its transaction and wakes
// the node's gateway after commit (reconcile.Queue.WakeCommands). A
// destructive command is signed there, in the enqueue transaction, with the command-signing key
// of a [Registry.Signing] registry, and the signature is stored with the
// row. The gateway claims the node's due commands ([Claim]), sends them with
// their stored signature (it holds no key, so it cannot forge one), and
// applies the daemon's answers ([Registry.Apply]). On every new session it
// reconciles in-flight commands with the node's boot and journal
// ([Registry.Reconnect]). The command-sweeper ([Sweeper]) expires pending
// commands past their deadline and times out in-flight ones. Every state
// change writes an outbox event command.<state>; a final state also wakes
// the command's owner (a work-queue key) in the same transaction.
//
// Output a running command streams (ACCEPTED updates with a chunk) is kept
// in command_output by [Registry.Apply], bounded by the kind's budget and
// once per chunk seq, until a result holding the whole output replaces it;
// [ReadOutput] reads it, running or finished.
package commands

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/outbox"
)

// State is a command's state.
type State string

// The states. Pending and in-flight are live; the rest are final.
const (
	Pending   State = "pending"
	InFlight  State = "in_flight"
	Succeeded State = "succeeded"
	Failed    State = "failed"
	Expired   State = "expired"
	Cancelled State = "cancelled"
)

// States lists every state, for validation.
var States = []State{Pending, InFlight, Succeeded, Failed, Expired, Cancelled}

// Final reports whether s is a final state.
func (s State) Final() bool { return s != Pending && s != InFlight }

// Reasons the control plane writes.
const (
	ReasonExpired     = "EXPIRED"
	ReasonTimeout     = "timeout"
	ReasonJournalLost = "journal-lost"
	ReasonRebooted    = "the node reconnected with a new boot id"
	ReasonCancelled   = "cancelled"
)

// Command is one row of the commands table.
type Command struct {
	ID                string
	TenantID          string
	NodeID            string
	Seq               int64
	Kind              string
	Payload           []byte // serialized agentv1.CommandBody
	IdempotencyKey    string
	NotAfter          time.Time
	MinGeneration     int64
	State             State
	Reason            string
	Attempts          int
	BusyCount         int
	NextAttemptAt     time.Time
	Result            []byte // serialized agentv1.CommandResult; nil when none
	CancelRequestedAt *time.Time
	OwnerKind         string
	OwnerKey          string
	CreatedBy         string
	DispatchedAt      *time.Time
	AcceptedAt        *time.Time
	FinishedAt        *time.Time
	CreatedAt         time.Time
	UpdatedAt         time.Time
	// Timeout is the kind's timeout when the command was queued (part of
	// the signature); 0 for rows from before it was stored.
	Timeout time.Duration
	// Signature and KeyID are the command's signature (commandsig), made
	// at enqueue for destructive kinds; nil and "" when unsigned.
	Signature []byte
	KeyID     string
	// NodeSignature is the node's signature over the update that finished
	// the command (proto/resultsig: bcd ramdisk signs every result), with
	// the outcome and reason it signed; nil when that update was unsigned.
	// Check it with [VerifyNodeSignature] before acting on the result.
	NodeSignature *NodeSignature
}

// NodeSigned reports whether the update that finished c carried a node
// signature (not whether it verifies: see [VerifyNodeSignature]).
func (c Command) NodeSigned() bool { return c.NodeSignature != nil }

// Columns is the column list [Scan] reads, in order.
const Columns = `id, tenant_id, node_id, seq, kind, payload, idempotency_key, not_after, min_generation, state, reason,
	attempts, busy_count, next_attempt_at, result, cancel_requested_at, owner_kind, owner_key, created_by,
	dispatched_at, accepted_at, finished_at, created_at, updated_at, timeout_ms, signature, key_id, node_signature`

// qualified returns Columns prefixed with alias.
func qualified(alias string) string {
	cols := strings.Split(Columns, ",")
	for i, c := range cols {
		cols[i] = alias + "." + strings.TrimSpace(c)
	}
	return strings.Join(cols, ", ")
}

// Scan reads a row of Columns.
func Scan(r pgx.Row) (Command, error) {
	var c Command
	var timeoutMS int64
	err := r.Scan(&c.ID, &c.TenantID, &c.NodeID, &c.Seq, &c.Kind, &c.Payload, &c.IdempotencyKey, &c.NotAfter, &c.MinGeneration,
		&c.State, &c.Reason, &c.Attempts, &c.BusyCount, &c.NextAttemptAt, &c.Result, &c.CancelRequestedAt, &c.OwnerKind, &c.OwnerKey,
		&c.CreatedBy, &c.DispatchedAt, &c.AcceptedAt, &c.FinishedAt, &c.CreatedAt, &c.UpdatedAt, &timeoutMS, &c.Signature, &c.KeyID, &c.NodeSignature)
	c.Timeout = time.Duration(timeoutMS) * time.Millisecond
	return c, err
}

func collect(rows pgx.Rows, err error) ([]Command, error) {
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Command, error) { return Scan(r) })
}

// ByIdempotencyKey reads the node's command queued under key, or
// pgx.ErrNoRows.
func ByIdempotencyKey(ctx context.Context, q Querier, nodeID, key string) (Command, error) {
	return Scan(q.QueryRow(ctx, `SELECT `+Columns+` FROM commands WHERE node_id = $1 AND idempotency_key = $2`, nodeID, key))
}

// LatestSucceeded returns up to limit of the node's succeeded commands of
// kind, the most recently finished first.
func LatestSucceeded(ctx context.Context, q Querier, nodeID, kind string, limit int) ([]Command, error) {
	return collect(q.Query(ctx, `SELECT `+Columns+` FROM commands
		WHERE node_id = $1 AND kind = $2 AND state = 'succeeded' ORDER BY finished_at DESC NULLS LAST LIMIT $3`, nodeID, kind, limit))
}

// Body decodes the payload.
func (c Command) Body() (*agentv1.CommandBody, error) {
	var b agentv1.CommandBody
	if err := proto.Unmarshal(c.Payload, &b); err != nil {
		return nil, fmt.Errorf("command %s: decode body: %w", c.ID, err)
	}
	return &b, nil
}

// PayloadJSON returns the kind's payload message as proto3 JSON.
func (c Command) PayloadJSON() (json.RawMessage, error) {
	b, err := c.Body()
	if err != nil {
		return nil, err
	}
	return oneofJSON(b.ProtoReflect())
}

// ResultJSON returns the result's message as proto3 JSON, or nil when the
// command has no result.
func (c Command) ResultJSON() (json.RawMessage, error) {
	if len(c.Result) == 0 {
		return nil, nil
	}
	var r agentv1.CommandResult
	if err := proto.Unmarshal(c.Result, &r); err != nil {
		return nil, fmt.Errorf("command %s: decode result: %w", c.ID, err)
	}
	return oneofJSON(r.ProtoReflect())
}

// oneofJSON marshals the set field of m's single oneof ({} when none).
func oneofJSON(m protoreflect.Message) (json.RawMessage, error) {
	od := m.Descriptor().Oneofs().Get(0)
	fd := m.WhichOneof(od)
	if fd == nil {
		return json.RawMessage("{}"), nil
	}
	return protojson.Marshal(m.Get(fd).Message().Interface())
}

// event writes the outbox event of c's (new) state: command.<state>.
func event(ctx context.Context, tx outbox.Querier, c Command) error {
	payload := map[string]any{
		"commandId": c.ID, "nodeId": c.NodeID, "seq": c.Seq, "kind": c.Kind, "state": string(c.State),
		"reason": c.Reason, "attempts": c.Attempts,
	}
	_, err := outbox.Write(ctx, tx, outbox.Event{TenantID: c.TenantID, Type: "command." + string(c.State), Resource: c.ID, Payload: payload})
	return err
}

// Get returns a node's command.
func Get(ctx context.Context, q pgx.Tx, nodeID, id string) (Command, error) {
	c, err := Scan(q.QueryRow(ctx, `SELECT `+Columns+` FROM commands WHERE node_id = $1 AND id = $2`, nodeID, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Command{}, fault.New(fault.NotFound, "commandId", "command %s of node %s does not exist", id, nodeID)
	}
	return c, err
}

// Querier runs queries: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Lookup returns a node's command outside a transaction.
func Lookup(ctx context.Context, q Querier, nodeID, id string) (Command, error) {
	c, err := Scan(q.QueryRow(ctx, `SELECT `+Columns+` FROM commands WHERE node_id = $1 AND id = $2`, nodeID, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Command{}, fault.New(fault.NotFound, "commandId", "command %s of node %s does not exist", id, nodeID)
	}
	return c, err
}

// List returns a node's commands, newest first, optionally only those in
// states, after the cursor (a command id of the previous page), at most
// limit.
func List(ctx context.Context, q Querier, nodeID string, states []State, after string, limit int) ([]Command, error) {
	ss := make([]string, len(states))
	for i, s := range states {
		ss[i] = string(s)
	}
	return collect(q.Query(ctx, `
		SELECT `+Columns+` FROM commands
		 WHERE node_id = $1 AND (cardinality($2::text[]) = 0 OR state = ANY($2))
		   AND ($3 = '' OR (created_at, id) < (SELECT created_at, id FROM commands WHERE node_id = $1 AND id = $3))
		 ORDER BY created_at DESC, id DESC LIMIT $4`, nodeID, ss, after, limit))
}
