package commands

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandsig"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/nodes"
)

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
	// System marks a command the control plane queues on its own (the
	// health job's, the metal workflow's), not on a caller's behalf: it
	// may take the slots ReservedForSystem.
	System bool
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

// ReservedForSystem of a node's MaxOpenPerNode open commands only
// commands the control plane queues on its own (Request.System: the
// remediation ladder's gpu.reset, its inventory refresh, the metal
// workflow's) may take. A caller
// who can run commands could otherwise fill every slot with commands that
// wait (a minGeneration far ahead, a deadline an hour away) and so hold
// remediation off the node until they expire.
const ReservedForSystem = 32

// Enqueue writes req as a pending command in tx and returns it, with
// created false when the node already has a command under the idempotency
// key (returned unchanged). The seq is the node's next_cmd_seq, taken with an
// UPDATE so concurrent enqueues for a node serialize on its row. A
// destructive kind is signed here, when r is a [Registry.Signing] registry
// (else it is queued unsigned and daemons reject it BAD_SIGNATURE): the
// signature covers the row as the gateway will send it and is stored with
// it. Wake the node (reconcile.Queue.WakeCommands) in the transaction.
//
// Faults: a node with MaxOpenPerNode commands pending or in flight
// (MaxOpenPerNode - ReservedForSystem for a caller's, not System) is
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
	limit := MaxOpenPerNode
	if !req.System {
		limit -= ReservedForSystem
	}
	if open >= limit {
		return Command{}, false, fault.New(fault.RateLimited, "nodeId", "node %s already has %d commands pending or in flight (at most %d); retry when some settle", req.NodeID, open, limit)
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
