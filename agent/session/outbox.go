package session

import (
	"context"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
)

// maxOutbox bounds the updates and reports queued while disconnected; the
// oldest are dropped beyond it (the journal answers re-deliveries anyway).
const maxOutbox = 10000

// waitSent returns once every message queued so far was sent, or ctx ends.
func (r *runner) waitSent(ctx context.Context) {
	r.outMu.Lock()
	target := r.queued
	r.outMu.Unlock()
	for {
		r.outMu.Lock()
		done, ch := r.sent >= target, r.sentCh
		r.outMu.Unlock()
		if done {
			return
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return
		}
	}
}

// advanceSent records n more messages sent or dropped. r.outMu is held.
func (r *runner) advanceSent(n uint64) {
	r.sent += n
	close(r.sentCh)
	r.sentCh = make(chan struct{})
}

// queue adds m to the outbox without blocking.
func (r *runner) queue(m *agentv1.SessionRequest) {
	r.outMu.Lock()
	if len(r.outbox) >= maxOutbox {
		r.log.Warn("session outbox full; dropping the oldest message")
		r.outbox = r.outbox[1:]
		r.advanceSent(1)
	}
	r.outbox = append(r.outbox, m)
	r.queued++
	r.outMu.Unlock()
	select {
	case r.outReady <- struct{}{}:
	default:
	}
}

// flushOutbox sends the queued messages in order; on a send error the
// unsent ones stay queued for the next session.
func (r *runner) flushOutbox(stream agentv1.NodeService_SessionClient) error {
	r.outMu.Lock()
	msgs := r.outbox
	r.outbox = nil
	r.outMu.Unlock()
	for i, m := range msgs {
		if err := stream.Send(m); err != nil {
			r.outMu.Lock()
			r.outbox = append(msgs[i:len(msgs):len(msgs)], r.outbox...)
			r.outMu.Unlock()
			select {
			case r.outReady <- struct{}{}:
			default:
			}
			return err
		}
		r.outMu.Lock()
		r.advanceSent(1)
		r.outMu.Unlock()
	}
	return nil
}
