package events

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Event is one row of the event log (the outbox table).
type Event struct {
	// ID is the outbox row's id; [EventID] is its public form.
	ID int64
	// Seq is the event's place in commit order, 0 until the relay
	// sequences it.
	Seq int64
	// TenantID, Type and Resource are the event's (outbox.Event).
	TenantID string
	Type     string
	Resource string
	// Subject is the JetStream subject, bc.events.<tenant>.<type>.
	Subject string
	// At is when the event's transaction wrote it.
	At time.Time
	// Payload is the event's JSON payload.
	Payload json.RawMessage
	// Sent says JetStream acknowledged it.
	Sent bool
}

// EventID is the public id of outbox row id: what webhooks send as
// webhook-id and the bus as Nats-Msg-Id.
func EventID(id int64) string { return "evt_" + strconv.FormatInt(id, 10) }

// ParseEventID parses an [EventID].
func ParseEventID(s string) (int64, error) {
	n, err := strconv.ParseInt(strings.TrimPrefix(s, "evt_"), 10, 64)
	if err != nil || !strings.HasPrefix(s, "evt_") || n <= 0 {
		return 0, fmt.Errorf("%q is not an event id (evt_<n>)", s)
	}
	return n, nil
}

// Cursor is the public form of a seq.
func Cursor(seq int64) string { return strconv.FormatInt(seq, 10) }

// ParseCursor parses a [Cursor]; "" is 0, the start of the log.
func ParseCursor(s string) (int64, error) {
	if s == "" {
		return 0, nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 {
		return 0, errors.New("not a cursor from this API (an event's cursor)")
	}
	return n, nil
}

const columns = `id, coalesce(seq, 0), tenant_id, type, resource_id, subject, created_at, payload, sent_at IS NOT NULL`

func collect(rows pgx.Rows, err error) ([]Event, error) {
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Event, error) {
		var e Event
		err := r.Scan(&e.ID, &e.Seq, &e.TenantID, &e.Type, &e.Resource, &e.Subject, &e.At, &e.Payload, &e.Sent)
		return e, err
	})
}

// Sequence gives up to limit committed, unsequenced events their seqs, in
// id order, and returns them in seq order. Only the outbox relay calls it,
// in a transaction fenced by its lease, so seqs are assigned by one writer
// at a time and only ever grow: a reader that has seen seq n never later
// finds an event below it.
func Sequence(ctx context.Context, tx pgx.Tx, limit int) ([]Event, error) {
	// The partial index outbox_unsequenced holds only rows waiting here.
	rows, err := tx.Query(ctx, `SELECT id FROM outbox WHERE seq IS NULL ORDER BY id LIMIT $1 FOR UPDATE`, limit)
	if err != nil {
		return nil, fmt.Errorf("read unsequenced events: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil || len(ids) == 0 {
		return nil, err
	}
	// One call takes len(ids) values: setval moves the sequence to the last
	// one, and the batch numbers first..last in id order.
	var last int64
	if err := tx.QueryRow(ctx, `SELECT setval('events_seq', nextval('events_seq') + $1 - 1)`, len(ids)).Scan(&last); err != nil {
		return nil, fmt.Errorf("take event seqs: %w", err)
	}
	first := last - int64(len(ids)) + 1
	evs, err := collect(tx.Query(ctx, `
		UPDATE outbox o SET seq = $2 + u.ord - 1
		  FROM unnest($1::bigint[]) WITH ORDINALITY AS u(id, ord)
		 WHERE o.id = u.id
		RETURNING `+qualified, ids, first))
	if err != nil {
		return nil, fmt.Errorf("sequence events: %w", err)
	}
	sortBySeq(evs)
	return evs, nil
}

const qualified = `o.id, coalesce(o.seq, 0), o.tenant_id, o.type, o.resource_id, o.subject, o.created_at, o.payload, o.sent_at IS NOT NULL`

func sortBySeq(evs []Event) {
	slices.SortFunc(evs, func(a, b Event) int { return cmp.Compare(a.Seq, b.Seq) })
}

// Unpublished returns up to limit sequenced events JetStream has not
// acknowledged, in seq order.
func Unpublished(ctx context.Context, q Querier, limit int) ([]Event, error) {
	evs, err := collect(q.Query(ctx, `SELECT `+columns+` FROM outbox
		WHERE sent_at IS NULL AND seq IS NOT NULL ORDER BY seq LIMIT $1`, limit))
	if err != nil {
		return nil, fmt.Errorf("read unpublished events: %w", err)
	}
	return evs, nil
}

// MarkSent records that JetStream acknowledged the events ids.
func MarkSent(ctx context.Context, q Querier, ids []int64) error {
	if len(ids) == 0 {
		return nil
	}
	if _, err := q.Exec(ctx, `UPDATE outbox SET sent_at = now() WHERE id = ANY($1) AND sent_at IS NULL`, ids); err != nil {
		return fmt.Errorf("mark events sent: %w", err)
	}
	return nil
}

// Filter selects events for events.list and events.watch.
type Filter struct {
	// TenantID is the tenant; with Descendants, its whole subtree (the
	// root tenant's subtree is every tenant).
	TenantID    string
	Descendants bool
	// Types are patterns ([Match]); empty matches every type.
	Types []string
	// Resource, when set, selects events about that resource id.
	Resource string
	// After selects events with a larger seq.
	After int64
	// Limit caps the events returned.
	Limit int
}

// Matches reports whether f selects e (its tenant, subtree, types and
// resource; not After or Limit): [List]'s condition, in memory, for the
// watches' fan-out.
func (f Filter) Matches(e Event) bool {
	own := e.TenantID == f.TenantID
	below := f.Descendants && (f.TenantID == "root" || strings.HasPrefix(e.TenantID, f.TenantID+"."))
	if !own && !below {
		return false
	}
	if f.Resource != "" && e.Resource != f.Resource {
		return false
	}
	return Match(f.Types, e.Type)
}

// Scan is [List] over the seqs after f.After up to and including upTo,
// at most window of them: a replay reads the log in bounded chunks however
// little of it f selects. It returns the events (at most f.Limit) and the
// seq the next chunk starts after: the last event's when the chunk was
// cut by f.Limit, else the end of the scanned window, so a filter that
// matches nothing still moves forward.
func Scan(ctx context.Context, q Querier, f Filter, upTo, window int64) ([]Event, int64, error) {
	end := min(upTo, f.After+window)
	if end <= f.After {
		return nil, f.After, nil
	}
	evs, err := list(ctx, q, f, end)
	if err != nil {
		return nil, f.After, err
	}
	if len(evs) == f.Limit {
		return evs, evs[len(evs)-1].Seq, nil
	}
	return evs, end, nil
}

// List returns the sequenced events f selects, in seq order.
func List(ctx context.Context, q Querier, f Filter) ([]Event, error) {
	return list(ctx, q, f, math.MaxInt64)
}

// list is List up to and including seq upTo.
func list(ctx context.Context, q Querier, f Filter, upTo int64) ([]Event, error) {
	exact, prefixes, all := splitPatterns(f.Types)
	if all {
		exact, prefixes = nil, nil
	}
	subtree := ""
	if f.Descendants {
		subtree = f.TenantID + ".%"
		if f.TenantID == "root" {
			subtree = "%"
		}
	}
	// outbox_tenant_seq serves a tenant's feed, outbox_resource_seq one
	// resource's; both walk forward from the cursor.
	evs, err := collect(q.Query(ctx, `SELECT `+columns+` FROM outbox
		WHERE seq > $1 AND seq <= $8
		  AND (tenant_id = $2 OR ($3 <> '' AND tenant_id LIKE $3))
		  AND ($4 = '' OR resource_id = $4)
		  AND (cardinality($5::text[]) + cardinality($6::text[]) = 0
		       OR type = ANY($5) OR EXISTS (SELECT 1 FROM unnest($6::text[]) AS p WHERE starts_with(type, p)))
		ORDER BY seq LIMIT $7`, f.After, f.TenantID, subtree, f.Resource, exact, prefixes, f.Limit, upTo))
	if err != nil {
		return nil, fmt.Errorf("list events: %w", err)
	}
	return evs, nil
}

// splitPatterns turns patterns into exact names and prefixes ("node.").
func splitPatterns(ps []string) (exact, prefixes []string, all bool) {
	exact, prefixes = []string{}, []string{}
	for _, p := range ps {
		switch {
		case p == "*":
			all = true
		case strings.HasSuffix(p, ".*"):
			prefixes = append(prefixes, p[:len(p)-1])
		default:
			exact = append(exact, p)
		}
	}
	return exact, prefixes, all
}

// After returns up to limit sequenced events after seq, in seq order: the
// fan-out's read.
func After(ctx context.Context, q Querier, seq int64, limit int) ([]Event, error) {
	evs, err := collect(q.Query(ctx, `SELECT `+columns+` FROM outbox WHERE seq > $1 ORDER BY seq LIMIT $2`, seq, limit))
	if err != nil {
		return nil, fmt.Errorf("read events after %d: %w", seq, err)
	}
	return evs, nil
}

// LockCursor reads the named cursor, locking its row until tx ends. A
// cursor that does not exist yet starts at 0, the oldest event kept.
func LockCursor(ctx context.Context, tx pgx.Tx, name string) (int64, error) {
	return lockCursor(ctx, tx, name, false)
}

// LockCursorFromHead is [LockCursor] for a cursor that, when new, starts at
// the newest event: a subscriber added today does not replay the log.
func LockCursorFromHead(ctx context.Context, tx pgx.Tx, name string) (int64, error) {
	return lockCursor(ctx, tx, name, true)
}

func lockCursor(ctx context.Context, tx pgx.Tx, name string, fromHead bool) (int64, error) {
	var seq int64
	err := tx.QueryRow(ctx, `SELECT seq FROM event_cursors WHERE name = $1 FOR UPDATE`, name).Scan(&seq)
	if errors.Is(err, pgx.ErrNoRows) {
		_, err = tx.Exec(ctx, `INSERT INTO event_cursors (name, seq)
			SELECT $1, CASE WHEN $2 THEN coalesce(max(seq), 0) ELSE 0 END FROM outbox ON CONFLICT DO NOTHING`, name, fromHead)
		if err == nil {
			err = tx.QueryRow(ctx, `SELECT seq FROM event_cursors WHERE name = $1 FOR UPDATE`, name).Scan(&seq)
		}
	}
	if err != nil {
		return 0, fmt.Errorf("read cursor %s: %w", name, err)
	}
	return seq, nil
}

// ReadCursor reads the named cursor without locking it.
func ReadCursor(ctx context.Context, q Querier, name string) (int64, error) {
	var seq int64
	err := q.QueryRow(ctx, `SELECT seq FROM event_cursors WHERE name = $1`, name).Scan(&seq)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("read cursor %s: %w", name, err)
	}
	return seq, nil
}

// SetCursor moves the named cursor (locked by [LockCursor] in tx).
func SetCursor(ctx context.Context, tx pgx.Tx, name string, seq int64) error {
	if _, err := tx.Exec(ctx, `UPDATE event_cursors SET seq = $2, updated_at = now() WHERE name = $1`, name, seq); err != nil {
		return fmt.Errorf("move cursor %s: %w", name, err)
	}
	return nil
}

// Head returns the newest seq, 0 when nothing is sequenced.
func Head(ctx context.Context, q Querier) (int64, error) {
	var seq int64
	if err := q.QueryRow(ctx, `SELECT coalesce(max(seq), 0) FROM outbox`).Scan(&seq); err != nil {
		return 0, fmt.Errorf("read the event head: %w", err)
	}
	return seq, nil
}

// Prune deletes up to limit events older than before that the fan-out has
// passed (their deliveries go with them), and returns how many. Unsent
// events older than before are pruned too: the stream would have dropped
// them by then.
func Prune(ctx context.Context, q Querier, before time.Time, limit int) (int64, error) {
	tag, err := q.Exec(ctx, `
		DELETE FROM outbox WHERE id IN (
			SELECT id FROM outbox
			 WHERE created_at < $1 AND seq IS NOT NULL
			   AND seq <= (SELECT seq FROM event_cursors WHERE name = 'fanout')
			 ORDER BY created_at LIMIT $2)`, before, limit)
	if err != nil {
		return 0, fmt.Errorf("prune events: %w", err)
	}
	return tag.RowsAffected(), nil
}

// Stats counts what is waiting, for metrics and tests.
type Stats struct {
	// Unsequenced events wait for the relay; Unpublished for JetStream.
	Unsequenced, Unpublished int64
	// Total is every event kept.
	Total int64
}

// ReadStats counts events by state.
func ReadStats(ctx context.Context, q Querier) (Stats, error) {
	var s Stats
	err := q.QueryRow(ctx, `SELECT count(*) FILTER (WHERE seq IS NULL), count(*) FILTER (WHERE seq IS NOT NULL AND sent_at IS NULL), count(*) FROM outbox`).
		Scan(&s.Unsequenced, &s.Unpublished, &s.Total)
	if err != nil {
		return Stats{}, fmt.Errorf("count events: %w", err)
	}
	return s, nil
}
