// Package commands is the command queue: one-shot actions with a deadline,
// queued for one node as durable rows of the commands table in the caller's
// transaction, delivered by the gateway holding the node's session, and
// settled from the daemon's CommandUpdates.
//
// A module queues a command with [Enqueue] inside its transaction and pokes
// the node's gateway after commit with [Poker.Poke]. A destructive command
// is signed there, in the enqueue transaction, with the command-signing key
// of a [Registry.Signing] registry, and the signature is stored with the
// row. The gateway claims the node's due commands ([Claim]), sends them with
// their stored signature (it holds no key, so it cannot forge one), and
// applies the daemon's answers ([Registry.Apply]). On every new session it
// reconciles in-flight commands with the node's boot and journal
// ([Registry.Reconnect]). The command-sweeper ([Sweeper]) expires pending
// commands past their deadline and times out in-flight ones. Every state
// change writes an outbox event command.<state>; a final state also wakes
// the command's owner (a work-queue key) in the same transaction.
package commands

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandsig"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
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

// Request is what [Enqueue] queues.
type Request struct {
	// NodeID is the target; the gateway holding it is found at dispatch.
	NodeID string
	// Kind is a registered kind.
	Kind string
	// Payload is the kind's payload message: the message itself, or its
	// proto3 JSON as json.RawMessage, []byte, string or a map; nil is an
	// empty message. Never routing data.
	Payload any
	// IdempotencyKey is unique per node: a repeat returns the existing
	// command. Empty means the command's id (never a repeat).
	IdempotencyKey string
	// NotAfter is the deadline; mandatory and in the future.
	NotAfter time.Time
	// MinGeneration is the desired-state generation the command presupposes;
	// 0 when none.
	MinGeneration int64
	// Owner is the work-queue key woken when the command reaches a final
	// state; zero for none.
	OwnerKind, OwnerKey string
	// CreatedBy records who asked (an identity id); optional.
	CreatedBy string
}

// Encode encodes payload into the CommandBody of kind k. A payload that is
// not the kind's message (another message, JSON that does not fit, not an
// object) is INVALID_INPUT "payload".
func (k Kind) Encode(payload any) ([]byte, error) {
	msg := k.Message()
	want := msg.Descriptor().FullName()
	var raw []byte
	switch p := payload.(type) {
	case nil:
	case proto.Message:
		if got := p.ProtoReflect().Descriptor().FullName(); got != want {
			return nil, fault.New(fault.InvalidInput, "payload", "kind %s takes %s, not %s", k.Name, want, got)
		}
		proto.Merge(msg.Interface(), p)
	case json.RawMessage:
		raw = p
	case []byte:
		raw = p
	case string:
		raw = []byte(p)
	default:
		b, err := json.Marshal(p)
		if err != nil {
			return nil, fault.Wrap(err, fault.InvalidInput, "payload", "payload is not JSON: %v", err)
		}
		raw = b
	}
	if raw != nil && len(bytes.TrimSpace(raw)) > 0 && !bytes.Equal(bytes.TrimSpace(raw), []byte("null")) {
		if t := bytes.TrimSpace(raw); t[0] != '{' {
			return nil, fault.New(fault.InvalidInput, "payload", "payload of %s must be a JSON object (%s)", k.Name, want)
		}
		if err := protojson.Unmarshal(raw, msg.Interface()); err != nil {
			return nil, fault.Wrap(err, fault.InvalidInput, "payload", "payload does not fit %s for kind %s: %v", want, k.Name, err)
		}
	}
	body := (&agentv1.CommandBody{}).ProtoReflect()
	body.Set(body.Descriptor().Fields().ByName(k.Field), protoreflect.ValueOfMessage(msg))
	if k.Check != nil {
		if err := k.Check(body.Interface().(*agentv1.CommandBody)); err != nil {
			return nil, err
		}
	}
	return proto.MarshalOptions{Deterministic: true}.Marshal(body.Interface())
}

// MaxOpenPerNode bounds a node's commands pending or in flight: a caller
// cannot queue without end for a node that is down.
const MaxOpenPerNode = 256

// Enqueue writes req as a pending command in tx and returns it, with
// created false when the node already has a command under the idempotency
// key (returned unchanged). The seq is the node's next_cmd_seq, taken with an
// UPDATE so concurrent enqueues for a node serialize on its row. A
// destructive kind is signed here, when r is a [Registry.Signing] registry
// (else it is queued unsigned and daemons reject it BAD_SIGNATURE): the
// signature covers the row as the gateway will send it and is stored with
// it. Call [Poker.Poke] after commit.
//
// Faults: a node with MaxOpenPerNode commands pending or in flight is
// RATE_LIMITED "nodeId"; an unknown kind is UNSUPPORTED "kind"; a payload that does not fit
// the kind's message INVALID_INPUT "payload"; a missing or past deadline
// INVALID_INPUT "notAfter"; a negative minimum generation INVALID_INPUT
// "minGeneration"; an unknown node NOT_FOUND "nodeId".
func (r *Registry) Enqueue(ctx context.Context, tx pgx.Tx, req Request) (Command, bool, error) {
	k, ok := r.Lookup(req.Kind)
	if !ok {
		return Command{}, false, fault.New(fault.Unsupported, "kind", "unknown command kind %q", req.Kind)
	}
	payload, err := k.Encode(req.Payload)
	if err != nil {
		return Command{}, false, err
	}
	if req.NotAfter.IsZero() {
		return Command{}, false, fault.New(fault.InvalidInput, "notAfter", "a command needs a deadline (notAfter)")
	}
	if req.MinGeneration < 0 {
		return Command{}, false, fault.New(fault.InvalidInput, "minGeneration", "minGeneration must not be negative")
	}
	if req.NodeID == "" {
		return Command{}, false, fault.New(fault.InvalidInput, "nodeId", "nodeId is required")
	}
	if (req.OwnerKind == "") != (req.OwnerKey == "") {
		return Command{}, false, fault.New(fault.InvalidInput, "owner", "owner needs both a kind and a key")
	}
	if req.IdempotencyKey != "" {
		c, err := Scan(tx.QueryRow(ctx, `SELECT `+Columns+` FROM commands WHERE node_id = $1 AND idempotency_key = $2`, req.NodeID, req.IdempotencyKey))
		if err == nil {
			return c, false, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return Command{}, false, fmt.Errorf("enqueue: %w", err)
		}
	}
	var future bool
	if err := tx.QueryRow(ctx, `SELECT $1::timestamptz > now()`, req.NotAfter).Scan(&future); err != nil {
		return Command{}, false, fmt.Errorf("enqueue: %w", err)
	}
	if !future {
		return Command{}, false, fault.New(fault.InvalidInput, "notAfter", "notAfter %s is not in the future", req.NotAfter.UTC().Format(time.RFC3339))
	}
	seq, tenant, err := nodes.NextCommandSeq(ctx, tx, req.NodeID)
	if errors.Is(err, pgx.ErrNoRows) {
		return Command{}, false, fault.New(fault.NotFound, "nodeId", "node %s does not exist", req.NodeID)
	}
	if err != nil {
		return Command{}, false, fmt.Errorf("enqueue: %w", err)
	}
	// The node's row is locked (NextCommandSeq): the count is exact.
	var open int
	if err := tx.QueryRow(ctx, `SELECT count(*) FROM commands WHERE node_id = $1 AND state IN ('pending', 'in_flight')`, req.NodeID).Scan(&open); err != nil {
		return Command{}, false, fmt.Errorf("enqueue: %w", err)
	}
	if open >= MaxOpenPerNode {
		return Command{}, false, fault.New(fault.RateLimited, "nodeId", "node %s already has %d commands pending or in flight (at most %d); retry when some settle", req.NodeID, open, MaxOpenPerNode)
	}
	id := iam.NewID("cmd")
	key := req.IdempotencyKey
	if key == "" {
		key = id
	}
	// PostgreSQL keeps microseconds: sign the deadline as it is stored.
	notAfter := req.NotAfter.Truncate(time.Microsecond)
	timeout := k.Timeout.Truncate(time.Millisecond)
	var sig []byte
	var keyID string
	if k.Destructive && r.signer != nil {
		w := wire(Command{ID: id, NodeID: req.NodeID, Seq: seq, Kind: k.Name, Payload: payload, NotAfter: notAfter,
			MinGeneration: req.MinGeneration}, timeout)
		commandsig.Sign(w, r.trustDomain, r.signer.Key)
		sig, keyID = w.GetSignature(), w.GetKeyId()
	}
	c, err := Scan(tx.QueryRow(ctx, `
		INSERT INTO commands (id, tenant_id, node_id, seq, kind, payload, idempotency_key, not_after, min_generation, owner_kind, owner_key, created_by,
		                      timeout_ms, signature, key_id)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
		ON CONFLICT (node_id, idempotency_key) DO NOTHING
		RETURNING `+Columns,
		id, tenant, req.NodeID, seq, k.Name, payload, key, notAfter, req.MinGeneration, req.OwnerKind, req.OwnerKey, req.CreatedBy,
		timeout.Milliseconds(), sig, keyID))
	if errors.Is(err, pgx.ErrNoRows) {
		// A concurrent enqueue under the same key committed first.
		c, err := Scan(tx.QueryRow(ctx, `SELECT `+Columns+` FROM commands WHERE node_id = $1 AND idempotency_key = $2`, req.NodeID, key))
		if err != nil {
			return Command{}, false, fmt.Errorf("enqueue: %w", err)
		}
		return c, false, nil
	}
	if err != nil {
		return Command{}, false, fmt.Errorf("enqueue: %w", err)
	}
	if err := event(ctx, tx, c); err != nil {
		return Command{}, false, err
	}
	return c, true, nil
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

// Waker wakes a command's owner in the transaction that finished it: a
// *reconcile.Queue (poked after commit) or [TxWaker].
type Waker interface {
	Enqueue(ctx context.Context, kind, key string) error
}

// TxWaker wakes owners through tx without a poke: for transactions not run
// through reconcile.InTx (the owner's worker finds the key on its poll).
func TxWaker(tx workqueue.Querier) Waker { return txWaker{tx} }

type txWaker struct{ tx workqueue.Querier }

func (w txWaker) Enqueue(ctx context.Context, kind, key string) error {
	return workqueue.Enqueue(ctx, w.tx, kind, key)
}

// finish moves c to a final state in tx, writes its event and wakes its
// owner through q: the one path to a final state.
func finish(ctx context.Context, tx pgx.Tx, w Waker, c Command, state State, reason string, result []byte) (Command, error) {
	return finishSigned(ctx, tx, w, c, state, reason, result, nil)
}

// finishSigned is finish storing the node's signature of the final update
// too (nil: none).
func finishSigned(ctx context.Context, tx pgx.Tx, w Waker, c Command, state State, reason string, result []byte, sig *NodeSignature) (Command, error) {
	out, err := Scan(tx.QueryRow(ctx, `
		UPDATE commands SET state = $2, reason = $3, result = coalesce($4, result), node_signature = coalesce($5, node_signature),
		       finished_at = now(), updated_at = now()
		 WHERE id = $1 RETURNING `+Columns, c.ID, string(state), reason, result, sig))
	if err != nil {
		return Command{}, fmt.Errorf("finish command %s: %w", c.ID, err)
	}
	if err := event(ctx, tx, out); err != nil {
		return Command{}, err
	}
	observeFinished(out)
	if out.OwnerKind != "" && w != nil {
		if err := w.Enqueue(ctx, out.OwnerKind, out.OwnerKey); err != nil {
			return Command{}, fmt.Errorf("wake owner of %s: %w", c.ID, err)
		}
	}
	return out, nil
}

// Cancel cancels a node's command in tx: a pending one becomes cancelled
// (and is never sent); an in-flight one gets cancel_requested_at, so the
// gateway sends the daemon Cancel until it settles (poke the node after
// commit); a finished one is returned unchanged. An unknown command is
// NOT_FOUND "commandId".
func Cancel(ctx context.Context, tx pgx.Tx, w Waker, nodeID, id string) (Command, error) {
	c, err := Scan(tx.QueryRow(ctx, `SELECT `+Columns+` FROM commands WHERE node_id = $1 AND id = $2 FOR UPDATE`, nodeID, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Command{}, fault.New(fault.NotFound, "commandId", "command %s of node %s does not exist", id, nodeID)
	}
	if err != nil {
		return Command{}, err
	}
	switch c.State {
	case Pending:
		return finish(ctx, tx, w, c, Cancelled, ReasonCancelled, nil)
	case InFlight:
		return Scan(tx.QueryRow(ctx, `
			UPDATE commands SET cancel_requested_at = coalesce(cancel_requested_at, now()), updated_at = now()
			 WHERE id = $1 RETURNING `+Columns, c.ID))
	}
	return c, nil
}

// BusyBackoff is the delay before a command rejected BUSY for the n-th time
// (n ≥ 1) is sent again: 1 s doubling, at most 30 s, with up to ±20 %
// jitter (u in [0, 1)), never above 30 s.
func BusyBackoff(n int, u float64) time.Duration {
	d := time.Second << min(max(n-1, 0), 5)
	d = min(d, 30*time.Second)
	j := time.Duration(float64(d) * (0.8 + 0.4*u))
	return min(j, 30*time.Second)
}

// Applied is what [Registry.Apply] did.
type Applied struct {
	// Command is the command after the update; zero when ignored.
	Command Command
	// Ignored: the update was for no in-flight command of this node under
	// this session.
	Ignored bool
	// RetryIn is set when the command went back to pending (BUSY): send it
	// again after this long.
	RetryIn time.Duration
}

// Apply settles a node's command from the daemon's update (protocol rule 7)
// in tx, only while epoch is the node's session epoch and the command is in
// flight; anything else is ignored.
func (r *Registry) Apply(ctx context.Context, tx pgx.Tx, w Waker, nodeID string, epoch int64, u *agentv1.CommandUpdate) (Applied, error) {
	c, err := Scan(tx.QueryRow(ctx, `
		SELECT `+qualified("c")+` FROM commands c JOIN nodes n ON n.id = c.node_id
		 WHERE c.node_id = $1 AND c.id = $2 AND c.seq = $3 AND n.session_epoch = $4
		   FOR UPDATE OF c`, nodeID, u.GetId(), u.GetSeq(), epoch))
	if errors.Is(err, pgx.ErrNoRows) || (err == nil && c.State != InFlight) {
		return Applied{Ignored: true}, nil
	}
	if err != nil {
		return Applied{}, fmt.Errorf("apply update: %w", err)
	}
	var result []byte
	if u.GetResult() != nil {
		result, err = proto.MarshalOptions{Deterministic: true}.Marshal(u.GetResult())
		if err != nil {
			return Applied{}, err
		}
	}
	switch u.GetOutcome() {
	case agentv1.CommandOutcome_COMMAND_OUTCOME_ACCEPTED:
		c, err = Scan(tx.QueryRow(ctx, `UPDATE commands SET accepted_at = coalesce(accepted_at, now()), updated_at = now() WHERE id = $1 RETURNING `+Columns, c.ID))
		return Applied{Command: c}, err
	case agentv1.CommandOutcome_COMMAND_OUTCOME_REJECTED:
		code := strings.TrimPrefix(u.GetReject().String(), "REJECT_CODE_")
		switch u.GetReject() {
		case agentv1.RejectCode_REJECT_CODE_BUSY:
			delay := BusyBackoff(c.BusyCount+1, rand.Float64())
			c, err = Scan(tx.QueryRow(ctx, `
				UPDATE commands SET state = 'pending', busy_count = busy_count + 1, reason = 'BUSY',
				       next_attempt_at = now() + $2::interval, updated_at = now()
				 WHERE id = $1 RETURNING `+Columns, c.ID, delay))
			if err != nil {
				return Applied{}, err
			}
			return Applied{Command: c, RetryIn: delay}, event(ctx, tx, c)
		case agentv1.RejectCode_REJECT_CODE_EXPIRED:
			c, err = finish(ctx, tx, w, c, Expired, ReasonExpired, nil)
		default:
			c, err = finish(ctx, tx, w, c, Failed, code, nil)
		}
	case agentv1.CommandOutcome_COMMAND_OUTCOME_SUCCEEDED, agentv1.CommandOutcome_COMMAND_OUTCOME_FAILED, agentv1.CommandOutcome_COMMAND_OUTCOME_CANCELLED:
		state, reason := settled(u.GetOutcome(), u.GetReason())
		sig := nodeSignatureOf(u)
		if state == Cancelled && sig == nil {
			result = nil // a signed one keeps what it signed
		}
		c, err = finishSigned(ctx, tx, w, c, state, reason, result, sig)
	default:
		return Applied{Ignored: true}, nil
	}
	return Applied{Command: c}, err
}

// Reconnect applies protocol rule 8 in tx, the transaction that bumps the
// node's session epoch, given the boot and journal ids stored before and
// reported now: with a new boot id, in-flight self-terminating commands
// succeed; with a new journal id, in-flight commands that are not
// retry-safe fail with reason journal-lost and retry-safe ones go back to
// pending. An empty stored id (no session before) changes nothing.
func (r *Registry) Reconnect(ctx context.Context, tx pgx.Tx, w Waker, nodeID, oldBoot, oldJournal, newBoot, newJournal string) error {
	if oldBoot == newBoot && oldJournal == newJournal {
		return nil
	}
	inflight, err := collect(tx.Query(ctx, `SELECT `+Columns+` FROM commands WHERE node_id = $1 AND state = 'in_flight' ORDER BY seq FOR UPDATE`, nodeID))
	if err != nil {
		return fmt.Errorf("reconnect: %w", err)
	}
	newBootSeen := oldBoot != "" && newBoot != oldBoot
	journalLost := oldJournal != "" && newJournal != oldJournal
	for _, c := range inflight {
		k, known := r.Lookup(c.Kind)
		switch {
		case newBootSeen && known && k.SelfTerminating:
			_, err = finish(ctx, tx, w, c, Succeeded, ReasonRebooted, nil)
		case journalLost && c.CancelRequestedAt != nil:
			_, err = finish(ctx, tx, w, c, Cancelled, ReasonCancelled, nil)
		case journalLost && known && k.RetrySafe:
			var back Command
			back, err = Scan(tx.QueryRow(ctx, `
				UPDATE commands SET state = 'pending', reason = $2, next_attempt_at = now(), accepted_at = NULL,
				       cancel_requested_at = NULL, updated_at = now()
				 WHERE id = $1 RETURNING `+Columns, c.ID, ReasonJournalLost))
			if err == nil {
				err = event(ctx, tx, back)
			}
		case journalLost:
			_, err = finish(ctx, tx, w, c, Failed, ReasonJournalLost, nil)
		}
		if err != nil {
			return fmt.Errorf("reconnect: %w", err)
		}
	}
	return nil
}
