package relay

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/events"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/pkg/lease"
	"github.com/bettercompute/bettercompute/pkg/webhooks"
)

// FanoutCursor is the cursor of events.fanout in event_cursors.
const FanoutCursor = "fanout"

// TestEventType is delivered only to the webhook it names (webhooks.test).
const TestEventType = "webhook.test"

// fanoutPass runs events.fanout, then the subscribers, while this process
// leads: woken by the sequencer, and every second regardless (a resync
// that needs no bus).
func (s *Service) fanoutPass(ctx context.Context) (more bool) {
	if !s.Leading() {
		return false
	}
	more, err := s.FanoutOnce(ctx)
	if err != nil && ctx.Err() == nil && !errors.Is(err, lease.ErrNotLeading) {
		s.log.Warn("fan out events", "err", err)
	}
	subMore, err := s.SubscribersOnce(ctx)
	if err != nil && ctx.Err() == nil && !errors.Is(err, lease.ErrNotLeading) {
		s.log.Warn("run event subscribers", "err", err)
	}
	return more || subMore
}

// Matches reports whether webhook w receives event e: its tenant's events
// (and its descendants' with IncludeDescendants) of the types it names. A
// webhook.test event goes only to the webhook it tests.
func Matches(w webhooks.Webhook, e events.Event) bool {
	if e.Type == TestEventType {
		return e.Resource == w.ID
	}
	own := e.TenantID == w.TenantID
	if !own && (!w.IncludeDescendants || !iam.Covers(w.TenantID, e.TenantID)) {
		return false
	}
	return events.Match(w.EventTypes, e.Type)
}

// FanoutOnce turns the next batch of sequenced events into deliveries and
// moves the fan-out cursor past them, in one fenced transaction, and
// reports whether a full batch was found. It reads only PostgreSQL: events
// JetStream dropped, or that were never published, are fanned out all the
// same.
func (s *Service) FanoutOnce(ctx context.Context) (bool, error) {
	batch := s.cfg.Events.Batch
	var n int
	var made int64
	err := s.leader.InTx(ctx, func(tx pgx.Tx) error {
		cursor, err := events.LockCursor(ctx, tx, FanoutCursor)
		if err != nil {
			return err
		}
		evs, err := events.After(ctx, tx, cursor, batch)
		if err != nil || len(evs) == 0 {
			n = 0
			return err
		}
		n = len(evs)
		hooks, err := webhooks.Enabled(ctx, tx)
		if err != nil {
			return err
		}
		// By tenant, so each event looks only at its own tenant's webhooks
		// and its ancestors' (at most 8 levels), however many there are.
		byTenant := map[string][]webhooks.Webhook{}
		for _, w := range hooks {
			byTenant[w.TenantID] = append(byTenant[w.TenantID], w)
		}
		var plan []webhooks.Planned
		allowed := s.descendantDecider()
		for _, e := range evs {
			for _, t := range iam.Ancestors(e.TenantID) {
				for _, w := range byTenant[t] {
					if !Matches(w, e) {
						continue
					}
					if ok, err := allowed(ctx, w, e.TenantID); err != nil || !ok {
						if err != nil {
							return err
						}
						continue
					}
					plan = append(plan, webhooks.Planned{WebhookID: w.ID, EventID: e.ID, TenantID: w.TenantID})
				}
			}
		}
		if made, err = webhooks.Insert(ctx, tx, plan); err != nil {
			return err
		}
		return events.SetCursor(ctx, tx, FanoutCursor, evs[len(evs)-1].Seq)
	})
	if err != nil {
		return false, err
	}
	if made > 0 {
		s.m.fannedOut.Add(float64(made))
		s.deliverer.Wake()
		s.pokeDeliverers()
	}
	return n == batch, nil
}

// pokeDeliverers wakes the deliverers of other relay processes.
func (s *Service) pokeDeliverers() {
	if s.nc != nil && s.nc.IsConnected() {
		_ = s.nc.Publish(DeliverSubject, nil)
	}
}

// descendantDecider returns a function that says whether webhook w may
// receive the events of tenant, one of its descendants
// (includeDescendants): the identity that created w must be allowed
// compute:events:list on that tenant by its policies, so a forbid in a
// descendant's policies (or the creator's revocation) stops that
// descendant's events. Decisions are remembered for one batch.
func (s *Service) descendantDecider() func(ctx context.Context, w webhooks.Webhook, tenant string) (bool, error) {
	type key struct{ creator, tenant string }
	decided := map[key]bool{}
	principals := map[string]*iam.Principal{}
	return func(ctx context.Context, w webhooks.Webhook, tenant string) (bool, error) {
		if tenant == w.TenantID {
			return true, nil
		}
		k := key{w.CreatedBy, tenant}
		if ok, done := decided[k]; done {
			return ok, nil
		}
		p, seen := principals[w.CreatedBy]
		if !seen {
			i, err := iam.IdentityByID(ctx, s.db, w.CreatedBy)
			switch {
			case err == nil && i.RevokedAt == nil:
				p = &iam.Principal{IdentityID: i.ID, TenantID: i.TenantID, Kind: i.Kind, Name: i.Name}
			case err == nil || fault.CodeOf(err) == fault.NotFound:
			default:
				return false, err
			}
			principals[w.CreatedBy] = p
		}
		ok := false
		if p != nil {
			err := s.authz.Authorize(ctx, nil, *p, authz.EventsList, authz.TenantResource(tenant))
			if err != nil && fault.CodeOf(err) != fault.AccessDenied {
				return false, err
			}
			ok = err == nil
		}
		decided[k] = ok
		return ok, nil
	}
}
