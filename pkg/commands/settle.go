package commands

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandkinds"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/workqueue"
)

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
// gateway sends the daemon Cancel until it settles (wake the node in the
// transaction); a finished one is returned unchanged. An unknown command is
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
		if o := u.GetOutput(); o != nil {
			if err := appendOutput(ctx, tx, c, o); err != nil {
				return Applied{Command: c}, err
			}
			if c.AcceptedAt != nil {
				return Applied{Command: c}, nil // no write to the command for each chunk
			}
		}
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
		if _, whole := commandkinds.ResultOutput(u.GetResult()); err == nil && whole && len(c.Result) > 0 {
			err = dropOutput(ctx, tx, c.ID) // the result holds it all
		}
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
