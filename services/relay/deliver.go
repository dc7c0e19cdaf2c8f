package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"math/rand/v2"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/events"
	"github.com/bettercompute/bettercompute/pkg/outbound"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/webhooks"
)

// deliverPass claims due deliveries and attempts them, in every relay
// process: woken by the fan-out, by DeliverSubject, by an attempt that
// ends, and every webhooks.poll.
func (s *Service) deliverPass(ctx context.Context) (more bool) {
	n, err := s.DeliverOnce(ctx)
	if err != nil && ctx.Err() == nil {
		s.log.Warn("claim deliveries", "err", err)
	}
	return n > 0 && len(s.slots) < cap(s.slots)
}

// DeliverOnce claims as many due deliveries as there are free attempt slots
// (and per-endpoint room) and starts their attempts; it returns how many it
// started. Attempts finish in the background; [Service.Wait] waits for them.
func (s *Service) DeliverOnce(ctx context.Context) (int, error) {
	free := cap(s.slots) - len(s.slots)
	if free <= 0 {
		return 0, nil
	}
	s.busyMu.Lock()
	busy := make(map[string]int, len(s.busy))
	for k, v := range s.busy {
		busy[k] = v
	}
	s.busyMu.Unlock()
	// A claim outlives the attempt it is for, and its record, comfortably;
	// a relay that dies holding one leaves it to another after this.
	hold := 2*s.cfg.Webhooks.Timeout.Std() + 5*time.Second
	// A stopping relay finishes its claim rather than strand the rows it
	// took until their hold passes.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	claimed, err := webhooks.Claim(cctx, s.db, free, s.cfg.Webhooks.PerEndpoint, busy, hold)
	if err != nil {
		return 0, err
	}
	for _, c := range claimed {
		s.slots <- struct{}{}
		s.busyMu.Lock()
		s.busy[c.WebhookID]++
		s.busyMu.Unlock()
		s.inflight.Add(1)
		go func() {
			defer func() {
				s.busyMu.Lock()
				if s.busy[c.WebhookID]--; s.busy[c.WebhookID] <= 0 {
					delete(s.busy, c.WebhookID)
				}
				s.busyMu.Unlock()
				<-s.slots
				s.inflight.Done()
				s.deliverer.Wake() // room for the next one
			}()
			s.attempt(context.WithoutCancel(ctx), c)
		}()
	}
	return len(claimed), nil
}

// Wait waits for the attempts in flight.
func (s *Service) Wait() { s.inflight.Wait() }

// body is what a webhook receives (Standard Webhooks' payload shape).
type body struct {
	Type      string          `json:"type"`
	Timestamp string          `json:"timestamp"`
	Data      json.RawMessage `json:"data"`
}

// maxResponse bounds how much of a response is read.
const maxResponse = 64 << 10

// attempt sends one delivery and records the outcome.
func (s *Service) attempt(ctx context.Context, c webhooks.Claimed) {
	id := events.EventID(c.EventID)
	b, _ := json.Marshal(body{Type: c.Type, Timestamp: c.At.UTC().Format(time.RFC3339Nano), Data: c.Payload})
	now := time.Now()
	actx, cancel := context.WithTimeout(ctx, s.cfg.Webhooks.Timeout.Std())
	defer cancel()
	req, err := http.NewRequestWithContext(actx, http.MethodPost, c.Webhook.URL, bytes.NewReader(b))
	var o webhooks.Outcome
	if err == nil {
		req.Header = webhooks.Headers(id, now, b, c.Webhook.Keys(now)...)
		req.Header.Set("User-Agent", "better-compute-webhooks/1")
		var resp *http.Response
		start := time.Now()
		resp, err = s.client.Do(req)
		s.m.attemptSeconds.Observe(time.Since(start).Seconds())
		if err == nil {
			_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxResponse))
			_ = resp.Body.Close()
			o.Status = resp.StatusCode
		}
	}
	// The tenant reads o.Err (the delivery's lastError, webhook.disabled):
	// a fixed class, never the resolver's answers or an address; the
	// details go to the log.
	switch {
	case err != nil:
		o.Err = outbound.Reason(err)
		s.log.InfoContext(ctx, "webhook delivery failed", "webhook", c.WebhookID, "tenant", c.Webhook.TenantID,
			"delivery", c.ID, "reason", o.Err, "err", err)
	case o.Status < 200 || o.Status > 299:
		o.Err = outbound.StatusReason(o.Status)
	}
	s.results <- attemptResult{c: c, o: o}
}

// attemptResult is an attempt's outcome on its way to the recorder.
type attemptResult struct {
	c webhooks.Claimed
	o webhooks.Outcome
}

// recordBatch bounds the outcomes recorded in one transaction.
const recordBatch = 500

// recorder stores attempts' outcomes in batches, one transaction each, so
// delivery throughput is not one transaction per attempt. It ends when
// results is closed, after recording what was sent.
func (s *Service) recorder() {
	for r := range s.results {
		batch := []attemptResult{r}
	fill:
		for len(batch) < recordBatch {
			select {
			case r, ok := <-s.results:
				if !ok {
					break fill
				}
				batch = append(batch, r)
			default:
				break fill
			}
		}
		if err := s.record(batch); err != nil {
			// The deliveries stay claimed until their hold passes, then are
			// attempted again: at least once.
			s.log.Warn("record delivery attempts", "n", len(batch), "err", err)
		}
	}
}

// record stores a batch of outcomes: successes; 410 Gone, which fails the
// delivery and disables the webhook; other failures, retried on the
// schedule, which disable a webhook failing for webhooks.disableAfter.
func (s *Service) record(batch []attemptResult) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rs := make([]webhooks.Result, len(batch))
	gone := map[string]attemptResult{}
	hooks := map[string]attemptResult{}
	for i, b := range batch {
		r := webhooks.Result{ID: b.c.ID, WebhookID: b.c.WebhookID, Outcome: b.o}
		switch {
		case b.o.Err == "":
			s.m.attempts.WithLabelValues("succeeded").Inc()
		case b.o.Status == http.StatusGone:
			gone[b.c.WebhookID] = b
			s.m.attempts.WithLabelValues("gone").Inc()
		default:
			r.RetryIn = s.retryIn(b.c.Attempts + 1)
			s.m.attempts.WithLabelValues("failed").Inc()
		}
		hooks[b.c.WebhookID] = b
		rs[i] = r
	}
	return db.InTx(ctx, s.db, db.TxOptions{}, func(tx pgx.Tx) error {
		since, err := webhooks.Record(ctx, tx, rs)
		if err != nil {
			return err
		}
		for id, b := range gone {
			if err := s.disable(ctx, tx, b.c, webhooks.ReasonGone, b.o); err != nil {
				return err
			}
			delete(since, id)
		}
		for id, at := range since {
			if time.Since(at) >= s.cfg.Webhooks.DisableAfter.Std() {
				b := hooks[id]
				if err := s.disable(ctx, tx, b.c, webhooks.ReasonFailing, b.o); err != nil {
					return err
				}
			}
		}
		return nil
	})
}

// retryIn is the wait before the attempt after attempt n (1-based), with up
// to 10 % jitter; 0 when the schedule is spent.
func (s *Service) retryIn(n int) time.Duration {
	sched := s.cfg.Webhooks.RetrySchedule
	if n > len(sched) {
		return 0
	}
	d := sched[n-1].Std()
	return d + time.Duration(rand.Int64N(int64(d)/10+1))
}

// disable turns the webhook off and says so with a webhook.disabled event.
func (s *Service) disable(ctx context.Context, tx pgx.Tx, c webhooks.Claimed, reason string, o webhooks.Outcome) error {
	changed, err := webhooks.Disable(ctx, tx, c.WebhookID, reason)
	if err != nil || !changed {
		return err
	}
	s.log.Warn("webhook disabled", "webhook", c.WebhookID, "tenant", c.Webhook.TenantID, "reason", reason, "status", o.Status, "err", o.Err)
	_, err = outbox.Write(ctx, tx, outbox.Event{TenantID: c.Webhook.TenantID, Type: "webhook.disabled", Resource: c.WebhookID,
		Payload: map[string]any{"webhookId": c.WebhookID, "reason": reason, "lastStatusCode": o.Status, "lastError": o.Err}})
	return err
}
