package relay

import (
	"context"
	"errors"
	"fmt"
	"regexp"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/events"
	"github.com/bettercompute/bettercompute/pkg/lease"
)

// Subscriber is an in-process subscriber of committed events (the spec's
// event-subscribers): a module that reacts to events inside the control
// plane. The relay's lease holder runs every subscriber after the fan-out,
// each behind its own cursor in event_cursors ("sub:<name>"), and calls
// Handle for each matching event in the same transaction that moves the
// cursor: what Handle writes to the database commits exactly once with the
// cursor, and an error rolls both back and retries the batch on the next
// pass (so one event that always fails holds its subscriber back, and says
// so in the log). A new subscriber starts after the newest event sequenced
// when it first runs.
type Subscriber struct {
	// Name identifies the subscriber's cursor: lower case, digits, dots and
	// dashes.
	Name string
	// Types are patterns ([events.Match]); empty means every type.
	Types []string
	// Handle reacts to one event in tx.
	Handle func(ctx context.Context, tx pgx.Tx, e events.Event) error
}

var subscriberName = regexp.MustCompile(`^[a-z][a-z0-9.-]{0,62}$`)

func (s Subscriber) validate() error {
	if !subscriberName.MatchString(s.Name) {
		return fmt.Errorf("subscriber name %q: want lower case letters, digits, dots and dashes", s.Name)
	}
	if s.Handle == nil {
		return fmt.Errorf("subscriber %s: no Handle", s.Name)
	}
	for _, p := range s.Types {
		if err := events.CheckPattern(p); err != nil {
			return fmt.Errorf("subscriber %s: %w", s.Name, err)
		}
	}
	return nil
}

// SubscribersOnce runs one batch of every subscriber and reports whether
// any found a full batch. It needs the lease.
func (s *Service) SubscribersOnce(ctx context.Context) (bool, error) {
	more := false
	var errs []error
	for _, sub := range s.cfg.Subscribers {
		full, err := s.subscriberOnce(ctx, sub)
		if err != nil {
			if errors.Is(err, lease.ErrNotLeading) {
				return false, err
			}
			errs = append(errs, fmt.Errorf("subscriber %s: %w", sub.Name, err))
		}
		more = more || full
	}
	return more, errors.Join(errs...)
}

func (s *Service) subscriberOnce(ctx context.Context, sub Subscriber) (bool, error) {
	batch := s.cfg.Events.Batch
	var n int
	err := s.leader.InTx(ctx, func(tx pgx.Tx) error {
		name := "sub:" + sub.Name
		cursor, err := events.LockCursorFromHead(ctx, tx, name)
		if err != nil {
			return err
		}
		evs, err := events.After(ctx, tx, cursor, batch)
		if err != nil || len(evs) == 0 {
			n = 0
			return err
		}
		n = len(evs)
		for _, e := range evs {
			if !events.Match(sub.Types, e.Type) {
				continue
			}
			if err := sub.Handle(ctx, tx, e); err != nil {
				return fmt.Errorf("event %s (%s): %w", events.EventID(e.ID), e.Type, err)
			}
		}
		return events.SetCursor(ctx, tx, name, evs[len(evs)-1].Seq)
	})
	return n == batch, err
}
