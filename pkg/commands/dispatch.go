package commands

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// Claim marks the node's due pending commands in flight (attempts + 1,
// dispatched_at) and writes their command.in_flight events, in one
// transaction, only while epoch is the node's session epoch, and returns
// them by seq, ready to send. A pending command past its deadline is left
// to the sweeper.
func Claim(ctx context.Context, db Beginner, nodeID string, epoch int64) ([]Command, error) {
	var cs []Command
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var err error
		cs, err = collect(tx.Query(ctx, `
			WITH due AS (
				SELECT c.id FROM commands c JOIN nodes n ON n.id = c.node_id AND n.session_epoch = $2
				 WHERE c.node_id = $1 AND c.state = 'pending' AND c.next_attempt_at <= now() AND c.not_after > now()
				 ORDER BY c.seq FOR UPDATE OF c SKIP LOCKED)
			UPDATE commands c SET state = 'in_flight', attempts = attempts + 1, dispatched_at = now(), updated_at = now()
			  FROM due WHERE c.id = due.id
			RETURNING `+qualified("c"), nodeID, epoch))
		if err != nil {
			return err
		}
		for _, c := range cs {
			if err := event(ctx, tx, c); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("claim commands of %s: %w", nodeID, err)
	}
	slices.SortFunc(cs, func(a, b Command) int { return cmp.Compare(a.Seq, b.Seq) })
	return cs, nil
}

// Beginner starts transactions: a pool or a connection.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// ListInFlight returns the node's in-flight commands by seq: those to re-send
// on a new session (the daemon's journal dedupes them) and, with
// cancelOnly, only those with a cancel requested.
func ListInFlight(ctx context.Context, q Querier, nodeID string, cancelOnly bool) ([]Command, error) {
	return collect(q.Query(ctx, `
		SELECT `+Columns+` FROM commands WHERE node_id = $1 AND state = 'in_flight'
		   AND (NOT $2 OR cancel_requested_at IS NOT NULL) ORDER BY seq`, nodeID, cancelOnly))
}

// NodesWithWork returns, in one statement, which of the sessions (node ids
// with the epoch each holds) have due pending commands or in-flight ones
// with a cancel requested, while the epoch is still the node's: the
// gateway's bus-less resync.
func NodesWithWork(ctx context.Context, q Querier, ids []string, epochs []int64) ([]string, error) {
	// From the commands side: the pending and in-flight ones are few and
	// indexed (commands_sweep), so the statement costs the same at 10,000
	// sessions as at 10, and the gateway can run it twice a second when the
	// bus is down.
	rows, err := q.Query(ctx, `
		SELECT DISTINCT c.node_id
		  FROM commands c
		  JOIN unnest($1::text[], $2::bigint[]) AS s(id, epoch) ON s.id = c.node_id
		  JOIN nodes n ON n.id = c.node_id AND n.session_epoch = s.epoch
		 WHERE c.state IN ('pending', 'in_flight')
		   AND ((c.state = 'pending' AND c.next_attempt_at <= now() AND c.not_after > now())
		     OR (c.state = 'in_flight' AND c.cancel_requested_at IS NOT NULL))`, ids, epochs)
	if err != nil {
		return nil, fmt.Errorf("find nodes with commands: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// Wire returns c as the daemon receives it: its stored timeout (the kind's,
// for rows from before it was stored) and its stored signature. Nothing is
// signed here: the gateway holds no key, so a row written without a valid
// signature (by anything but a signing Enqueue) reaches the daemon unsigned
// and a destructive one is rejected BAD_SIGNATURE.
func (r *Registry) Wire(c Command) *agentv1.Command {
	timeout := c.Timeout
	if timeout <= 0 {
		timeout = r.timeout(c.Kind)
	}
	m := wire(c, timeout)
	m.Signature, m.KeyId = c.Signature, c.KeyID
	return m
}

// wire is c's Command with timeout, unsigned.
func wire(c Command, timeout time.Duration) *agentv1.Command {
	return &agentv1.Command{
		Id: c.ID, NodeId: c.NodeID, Seq: c.Seq, Kind: c.Kind, Body: c.Payload,
		NotAfter: timestamppb.New(c.NotAfter), MinGeneration: c.MinGeneration,
		Timeout: durationpb.New(timeout),
	}
}
