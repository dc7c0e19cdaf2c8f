package gateway

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// Dispatch sends node's due commands (and Cancel for in-flight ones with a
// cancel requested) if this gateway holds its session: the handler of the
// command poke bc.commands.<node>. Without a session here it does nothing;
// the gateway that holds the node finds the work on its resync.
func (g *Gateway) Dispatch(ctx context.Context, nodeID string) error {
	g.mu.Lock()
	s, ok := g.sessions[nodeID]
	g.mu.Unlock()
	if !ok {
		return nil
	}
	return g.dispatch(ctx, s, false)
}

// dispatch claims the session's due pending commands (in flight, attempts
// + 1, only while the session is the node's current one; those its role
// may not be sent are failed instead: a ramdisk is sent only the
// commissioning flow's kinds, another session never a ramdisk-only kind)
// and sends them
// with the signature stored at enqueue (it signs nothing); with resend (a new session) it first sends the
// in-flight ones again, except those with a cancel requested; then it
// sends Cancel for every in-flight command with a cancel requested. A
// command claimed but not sent stays in flight and goes again on the
// node's next session.
func (g *Gateway) dispatch(ctx context.Context, s *session, resend bool) error {
	// One read of the in-flight commands: all of them on a new session
	// (to send again), else only those with a cancel requested.
	inflight, err := commands.ListInFlight(ctx, g.cfg.DB, s.nodeID, !resend)
	if err != nil {
		return err
	}
	var out, cancels []commands.Command
	for _, c := range inflight {
		// One with a cancel requested gets only a Cancel: the daemon
		// answers it from its journal, or journals it cancelled unseen, so
		// a command cancelled while its send was lost never starts.
		switch {
		case c.CancelRequestedAt != nil:
			cancels = append(cancels, c)
		case !g.kinds.SendableTo(c.Kind, s.ramdisk):
			// Claimed under a session of the other kind (the node went
			// into, or out of, its ramdisk): never sent here; the
			// reconnect rules or the sweeper settle it.
			g.log.WarnContext(ctx, "in-flight command not sent: the session's role does not take its kind",
				"node", s.nodeID, "command", c.ID, "kind", c.Kind, "ramdisk", s.ramdisk)
		default:
			out = append(out, c)
		}
	}
	// Due commands the session may not be sent are failed in the claim
	// (commands.ReasonInRamdisk, commands.ReasonRamdiskOnly).
	var claimed []commands.Command
	err = reconcile.InTx(ctx, g.cfg.DB, g.cfg.Waker, func(tx pgx.Tx, q *reconcile.Queue) error {
		var err error
		claimed, err = g.kinds.ClaimSession(ctx, tx, q, s.nodeID, s.epoch, s.ramdisk)
		return err
	})
	if err != nil {
		return err
	}
	out = append(out, claimed...)
	for _, c := range out {
		if err := s.send(&agentv1.SessionResponse{Body: &agentv1.SessionResponse_Command{Command: g.kinds.Wire(c)}}); err != nil {
			return fmt.Errorf("send command %s: %w", c.ID, err)
		}
	}
	for _, c := range cancels {
		if err := s.send(&agentv1.SessionResponse{Body: &agentv1.SessionResponse_Cancel{Cancel: &agentv1.CommandCancel{Id: c.ID, Seq: c.Seq}}}); err != nil {
			return fmt.Errorf("send cancel %s: %w", c.ID, err)
		}
	}
	return nil
}

// applyUpdate settles a command from the daemon's update, only while the
// session is the node's current one. A BUSY rejection schedules the
// command's next dispatch after its back-off (the resync would find it too).
func (g *Gateway) applyUpdate(ctx context.Context, s *session, u *agentv1.CommandUpdate) error {
	var a commands.Applied
	err := reconcile.InTx(ctx, g.cfg.DB, g.cfg.Waker, func(tx pgx.Tx, q *reconcile.Queue) error {
		var err error
		a, err = g.kinds.Apply(ctx, tx, q, s.nodeID, s.epoch, u)
		return err
	})
	if err != nil {
		return err
	}
	if a.Ignored {
		g.log.InfoContext(ctx, "command update ignored: no such command in flight under this session",
			"node", s.nodeID, "epoch", s.epoch, "command", u.GetId(), "seq", u.GetSeq(), "outcome", u.GetOutcome().String())
		return nil
	}
	if a.RetryIn > 0 {
		time.AfterFunc(a.RetryIn+10*time.Millisecond, func() {
			select {
			case <-g.stop:
				return
			default:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if err := g.Dispatch(ctx, s.nodeID); err != nil {
				g.log.Warn("dispatch commands after BUSY", "node", s.nodeID, "err", err)
			}
		})
	}
	return nil
}

// ResyncCommands finds, in one statement for all its sessions, the nodes
// with due pending commands or in-flight ones with a cancel requested, and
// dispatches to them: delivery without the bus. The liveness loop calls it
// every interval.
func (g *Gateway) ResyncCommands(ctx context.Context) error {
	g.mu.Lock()
	ids := make([]string, 0, len(g.sessions))
	epochs := make([]int64, 0, len(g.sessions))
	for _, s := range g.sessions {
		ids = append(ids, s.nodeID)
		epochs = append(epochs, s.epoch)
	}
	g.mu.Unlock()
	if len(ids) == 0 {
		return nil
	}
	nodes, err := commands.NodesWithWork(ctx, g.cfg.DB, ids, epochs)
	if err != nil {
		return err
	}
	var errs []error
	for _, id := range nodes {
		// ctx (the liveness tick's) only decides whether to start the next
		// node: a dispatch cut off by it could commit its claim and then
		// fail before sending, leaving the command in flight, unsent,
		// until the node's next session or the sweeper's timeout. The
		// nodes left go on the next resync.
		if ctx.Err() != nil {
			break
		}
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), dispatchTimeout)
		errs = append(errs, g.Dispatch(dctx, id))
		cancel()
	}
	return errors.Join(errs...)
}

// dispatchTimeout bounds one node's dispatch in the resync.
const dispatchTimeout = 10 * time.Second
