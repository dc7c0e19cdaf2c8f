// Package outbox writes events to the transactional outbox: a row per event,
// in the same transaction as the change it reports, which the outbox relay
// later publishes to JetStream (stream BC_EVENTS, subject
// bc.events.<tenant>.<type>, message id = row id).
package outbox

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/pkg/events"
	"github.com/bettercompute/bettercompute/pkg/wake"
)

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// BatchQuerier also runs statements that return no rows.
type BatchQuerier interface {
	Querier
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Event is one committed fact others may care about.
type Event struct {
	// TenantID is the tenant the event belongs to.
	TenantID string
	// Type is a dotted name, e.g. "pool.created", listed in the event
	// catalog (events.Catalog).
	Type string
	// Resource is the id of the resource the event is about (a node, a
	// reservation, a command), when it has one: events.list and
	// events.watch filter on it as "subject".
	Resource string
	// Payload is marshalled to JSON; nil is {}.
	Payload any
}

// Write inserts e and returns its id. Call it inside the transaction that
// makes the change e reports. A type missing from the event catalog is
// refused, so no event type ships undocumented.
func Write(ctx context.Context, q Querier, e Event) (int64, error) {
	if _, ok := events.Lookup(e.Type); !ok {
		return 0, fmt.Errorf("write outbox event: type %q is not in the event catalog (pkg/events)", e.Type)
	}
	payload := e.Payload
	if payload == nil {
		payload = map[string]any{}
	}
	var id int64
	err := q.QueryRow(ctx, `
		INSERT INTO outbox (tenant_id, type, subject, resource_id, payload) VALUES ($1, $2, $3, $4, $5) RETURNING id`,
		e.TenantID, e.Type, wake.EventSubject(e.TenantID, e.Type), e.Resource, payload).Scan(&id)
	if err != nil {
		return 0, fmt.Errorf("write outbox event %s: %w", e.Type, err)
	}
	return id, nil
}

// WriteMany inserts es in one statement, in order: what a batch of changes
// (a batch of nodes converging, a batch of specs stored) writes instead of
// a statement per event. Like [Write] it refuses a type missing from the
// catalog, and then writes none.
func WriteMany(ctx context.Context, q BatchQuerier, es []Event) error {
	if len(es) == 0 {
		return nil
	}
	tenants := make([]string, len(es))
	types := make([]string, len(es))
	subjects := make([]string, len(es))
	resources := make([]string, len(es))
	payloads := make([]string, len(es))
	for i, e := range es {
		if _, ok := events.Lookup(e.Type); !ok {
			return fmt.Errorf("write outbox events: type %q is not in the event catalog (pkg/events)", e.Type)
		}
		payload := e.Payload
		if payload == nil {
			payload = map[string]any{}
		}
		b, err := json.Marshal(payload)
		if err != nil {
			return fmt.Errorf("write outbox event %s: %w", e.Type, err)
		}
		tenants[i], types[i], subjects[i], resources[i], payloads[i] = e.TenantID, e.Type, wake.EventSubject(e.TenantID, e.Type), e.Resource, string(b)
	}
	_, err := q.Exec(ctx, `
		INSERT INTO outbox (tenant_id, type, subject, resource_id, payload)
		SELECT t, ty, su, r, p::jsonb FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[])
		    WITH ORDINALITY AS e(t, ty, su, r, p, ord) ORDER BY ord`,
		tenants, types, subjects, resources, payloads)
	if err != nil {
		return fmt.Errorf("write %d outbox events: %w", len(es), err)
	}
	return nil
}

// Waiting counts the events that wait: unsequenced (for the relay to number)
// and sequenced but unpublished (for JetStream).
func Waiting(ctx context.Context, q Querier) (unsequenced, unpublished int64, err error) {
	err = q.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM outbox WHERE seq IS NULL),
		(SELECT count(*) FROM outbox WHERE sent_at IS NULL AND seq IS NOT NULL)`).Scan(&unsequenced, &unpublished)
	if err != nil {
		return 0, 0, fmt.Errorf("count waiting events: %w", err)
	}
	return unsequenced, unpublished, nil
}
