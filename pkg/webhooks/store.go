package webhooks

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/secret"
)

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Disabled reasons.
const (
	ReasonGone      = "gone"
	ReasonFailing   = "failing"
	ReasonByRequest = "by request"
)

// RotationOverlap is how long the previous secret keeps signing after a
// rotation.
const RotationOverlap = 24 * time.Hour

// Webhook is a row of webhooks.
type Webhook struct {
	ID                 string
	TenantID           string
	URL                string
	EventTypes         []string
	Description        string
	IncludeDescendants bool
	// Secret signs deliveries; Previous, until PreviousExpiresAt, too.
	Secret            []byte
	Previous          []byte
	PreviousExpiresAt *time.Time
	Enabled           bool
	DisabledReason    string
	FailingSince      *time.Time
	CreatedBy         string
	CreatedAt         time.Time
	UpdatedAt         time.Time
}

// Keys returns the secrets that sign a delivery made at now: the current
// one, and the previous one during a rotation's overlap.
func (w Webhook) Keys(now time.Time) [][]byte {
	keys := [][]byte{w.Secret}
	if w.Previous != nil && w.PreviousExpiresAt != nil && now.Before(*w.PreviousExpiresAt) {
		keys = append(keys, w.Previous)
	}
	return keys
}

// NewID mints a webhook id.
func NewID() string { return "wh_" + secret.Random(10) }

const columns = `id, tenant_id, url, event_types, description, include_descendants, secret, previous_secret,
	previous_secret_expires_at, enabled, disabled_reason, failing_since, created_by, created_at, updated_at`

func scan(r pgx.Row) (Webhook, error) {
	var w Webhook
	err := r.Scan(&w.ID, &w.TenantID, &w.URL, &w.EventTypes, &w.Description, &w.IncludeDescendants, &w.Secret, &w.Previous,
		&w.PreviousExpiresAt, &w.Enabled, &w.DisabledReason, &w.FailingSince, &w.CreatedBy, &w.CreatedAt, &w.UpdatedAt)
	return w, err
}

func collect(rows pgx.Rows, err error) ([]Webhook, error) {
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Webhook, error) { return scan(r) })
}

// Create inserts w (ID, TenantID, URL, EventTypes, Description,
// IncludeDescendants, Secret, CreatedBy) and returns the stored row.
func Create(ctx context.Context, q Querier, w Webhook) (Webhook, error) {
	out, err := scan(q.QueryRow(ctx, `
		INSERT INTO webhooks (id, tenant_id, url, event_types, description, include_descendants, secret, created_by)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING `+columns,
		w.ID, w.TenantID, w.URL, w.EventTypes, w.Description, w.IncludeDescendants, w.Secret, w.CreatedBy))
	if err != nil {
		return Webhook{}, fmt.Errorf("create webhook: %w", err)
	}
	return out, nil
}

// Get returns tenant's webhook id, NOT_FOUND when there is none.
func Get(ctx context.Context, q Querier, tenant, id string) (Webhook, error) {
	w, err := scan(q.QueryRow(ctx, `SELECT `+columns+` FROM webhooks WHERE tenant_id = $1 AND id = $2`, tenant, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Webhook{}, fault.New(fault.NotFound, "id", "no webhook %q in tenant %q", id, tenant)
	}
	if err != nil {
		return Webhook{}, fmt.Errorf("read webhook: %w", err)
	}
	return w, nil
}

// Lock is [Get] with the row locked until tx ends.
func Lock(ctx context.Context, tx pgx.Tx, tenant, id string) (Webhook, error) {
	w, err := scan(tx.QueryRow(ctx, `SELECT `+columns+` FROM webhooks WHERE tenant_id = $1 AND id = $2 FOR UPDATE`, tenant, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Webhook{}, fault.New(fault.NotFound, "id", "no webhook %q in tenant %q", id, tenant)
	}
	if err != nil {
		return Webhook{}, fmt.Errorf("lock webhook: %w", err)
	}
	return w, nil
}

// List returns up to limit of tenant's webhooks with ids after after, in id
// order.
func List(ctx context.Context, q Querier, tenant, after string, limit int) ([]Webhook, error) {
	ws, err := collect(q.Query(ctx, `SELECT `+columns+` FROM webhooks WHERE tenant_id = $1 AND id > $2 ORDER BY id LIMIT $3`, tenant, after, limit))
	if err != nil {
		return nil, fmt.Errorf("list webhooks: %w", err)
	}
	return ws, nil
}

// Enabled returns every enabled webhook: the fan-out's view.
func Enabled(ctx context.Context, q Querier) ([]Webhook, error) {
	ws, err := collect(q.Query(ctx, `SELECT `+columns+` FROM webhooks WHERE enabled ORDER BY id`))
	if err != nil {
		return nil, fmt.Errorf("read enabled webhooks: %w", err)
	}
	return ws, nil
}

// Save writes w's mutable fields (URL, EventTypes, Description,
// IncludeDescendants, Enabled, DisabledReason, secrets) and returns the row.
func Save(ctx context.Context, q Querier, w Webhook) (Webhook, error) {
	out, err := scan(q.QueryRow(ctx, `
		UPDATE webhooks SET url = $3, event_types = $4, description = $5, include_descendants = $6,
		       enabled = $7, disabled_reason = $8, secret = $9, previous_secret = $10,
		       previous_secret_expires_at = $11, failing_since = CASE WHEN $7 AND NOT enabled THEN NULL ELSE failing_since END,
		       updated_at = now()
		 WHERE tenant_id = $1 AND id = $2 RETURNING `+columns,
		w.TenantID, w.ID, w.URL, w.EventTypes, w.Description, w.IncludeDescendants, w.Enabled, w.DisabledReason,
		w.Secret, w.Previous, w.PreviousExpiresAt))
	if err != nil {
		return Webhook{}, fmt.Errorf("save webhook: %w", err)
	}
	return out, nil
}

// Delete removes tenant's webhook id; its deliveries go with it.
func Delete(ctx context.Context, q Querier, tenant, id string) error {
	if _, err := q.Exec(ctx, `DELETE FROM webhooks WHERE tenant_id = $1 AND id = $2`, tenant, id); err != nil {
		return fmt.Errorf("delete webhook: %w", err)
	}
	return nil
}

// Delivery states.
const (
	Pending   = "pending"
	Succeeded = "succeeded"
	Failed    = "failed"
)

// Delivery is a row of webhook_deliveries.
type Delivery struct {
	ID            int64
	WebhookID     string
	EventID       int64
	EventType     string
	TenantID      string
	State         string
	Attempts      int
	NextAttemptAt time.Time
	LastStatus    int
	LastError     string
	CreatedAt     time.Time
	FinishedAt    *time.Time
}

const deliveryColumns = `d.id, d.webhook_id, d.event_id, coalesce(o.type, ''), d.tenant_id, d.state, d.attempts, d.next_attempt_at,
	d.last_status, d.last_error, d.created_at, d.finished_at`

func collectDeliveries(rows pgx.Rows, err error) ([]Delivery, error) {
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Delivery, error) {
		var d Delivery
		err := r.Scan(&d.ID, &d.WebhookID, &d.EventID, &d.EventType, &d.TenantID, &d.State, &d.Attempts, &d.NextAttemptAt,
			&d.LastStatus, &d.LastError, &d.CreatedAt, &d.FinishedAt)
		return d, err
	})
}

// Planned is one delivery the fan-out makes.
type Planned struct {
	WebhookID string
	EventID   int64
	TenantID  string
}

// Insert writes the planned deliveries, due now; a (webhook, event) pair
// that already has one keeps it, so a repeated fan-out adds nothing.
func Insert(ctx context.Context, q Querier, ds []Planned) (int64, error) {
	if len(ds) == 0 {
		return 0, nil
	}
	hooks := make([]string, len(ds))
	evs := make([]int64, len(ds))
	tenants := make([]string, len(ds))
	for i, d := range ds {
		hooks[i], evs[i], tenants[i] = d.WebhookID, d.EventID, d.TenantID
	}
	tag, err := q.Exec(ctx, `
		INSERT INTO webhook_deliveries (webhook_id, event_id, tenant_id)
		SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[])
		ON CONFLICT (webhook_id, event_id) DO NOTHING`, hooks, evs, tenants)
	if err != nil {
		return 0, fmt.Errorf("insert deliveries: %w", err)
	}
	return tag.RowsAffected(), nil
}

// InsertOne writes one delivery due now and returns it.
func InsertOne(ctx context.Context, q Querier, d Planned) (Delivery, error) {
	ds, err := collectDeliveries(q.Query(ctx, `
		WITH d AS (INSERT INTO webhook_deliveries (webhook_id, event_id, tenant_id) VALUES ($1, $2, $3) RETURNING *)
		SELECT `+deliveryColumns+` FROM d LEFT JOIN outbox o ON o.id = d.event_id`, d.WebhookID, d.EventID, d.TenantID))
	if err != nil || len(ds) == 0 {
		return Delivery{}, fmt.Errorf("insert delivery: %w", cmpErr(err))
	}
	return ds[0], nil
}

func cmpErr(err error) error {
	if err == nil {
		return pgx.ErrNoRows
	}
	return err
}

// Claimed is a delivery claimed for an attempt, with what the attempt needs.
type Claimed struct {
	Delivery
	Webhook Webhook
	// Event is the event's type, time and payload.
	Type    string
	At      time.Time
	Payload json.RawMessage
}

// Claim takes up to limit due deliveries of enabled webhooks for an attempt,
// at most perEndpoint minus busy[webhook] of each webhook, where busy maps
// webhook ids to the attempts this process already has in flight. A
// claimed delivery's next attempt moves to now + hold, so another process
// takes it only if this one dies; a row another claimer took first is
// skipped: the UPDATE re-checks that it is still due.
//
// Each webhook is probed on its own (webhook_deliveries_due, by webhook and
// due time), in a random order, so a webhook with a long backlog costs only
// its room, and never hides another webhook's due deliveries behind it.
func Claim(ctx context.Context, q Querier, limit, perEndpoint int, busy map[string]int, hold time.Duration) ([]Claimed, error) {
	rows, err := q.Query(ctx, `SELECT id FROM webhooks WHERE enabled`)
	if err != nil {
		return nil, fmt.Errorf("claim deliveries: %w", err)
	}
	hooks, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("claim deliveries: %w", err)
	}
	rand.Shuffle(len(hooks), func(i, j int) { hooks[i], hooks[j] = hooks[j], hooks[i] })
	ids := make([]string, 0, len(hooks))
	rooms := make([]int32, 0, len(hooks))
	for _, h := range hooks {
		if room := perEndpoint - busy[h]; room > 0 {
			ids = append(ids, h)
			rooms = append(rooms, int32(room))
		}
	}
	if len(ids) == 0 {
		return nil, nil
	}
	rows, err = q.Query(ctx, `
		SELECT d.id FROM unnest($2::text[], $3::int[]) WITH ORDINALITY AS h(id, room, ord)
		CROSS JOIN LATERAL (
			SELECT d.id FROM webhook_deliveries d
			 WHERE d.webhook_id = h.id AND d.state = 'pending' AND d.next_attempt_at <= now()
			 ORDER BY d.next_attempt_at LIMIT h.room) d
		ORDER BY h.ord
		LIMIT $1`, limit, ids, rooms)
	if err != nil {
		return nil, fmt.Errorf("claim deliveries: %w", err)
	}
	due, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil || len(due) == 0 {
		return nil, err
	}
	// The ids as an array keep the UPDATE on the primary key whatever the
	// planner thinks of the candidates.
	rows, err = q.Query(ctx, `
		WITH u AS (
			UPDATE webhook_deliveries d SET next_attempt_at = now() + $2 * interval '1 microsecond'
			 WHERE d.id = ANY($1::bigint[]) AND d.state = 'pending' AND d.next_attempt_at <= now()
			RETURNING d.*
		)
		SELECT `+deliveryColumns+`, o.created_at, o.payload, `+prefixed("w")+`
		  FROM u d JOIN outbox o ON o.id = d.event_id JOIN webhooks w ON w.id = d.webhook_id`,
		due, hold.Microseconds())
	if err != nil {
		return nil, fmt.Errorf("claim deliveries: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Claimed, error) {
		var c Claimed
		d := &c.Delivery
		w := &c.Webhook
		err := r.Scan(&d.ID, &d.WebhookID, &d.EventID, &d.EventType, &d.TenantID, &d.State, &d.Attempts, &d.NextAttemptAt,
			&d.LastStatus, &d.LastError, &d.CreatedAt, &d.FinishedAt, &c.At, &c.Payload,
			&w.ID, &w.TenantID, &w.URL, &w.EventTypes, &w.Description, &w.IncludeDescendants, &w.Secret, &w.Previous,
			&w.PreviousExpiresAt, &w.Enabled, &w.DisabledReason, &w.FailingSince, &w.CreatedBy, &w.CreatedAt, &w.UpdatedAt)
		c.Type = d.EventType
		return c, err
	})
}

func prefixed(alias string) string {
	return alias + `.id, ` + alias + `.tenant_id, ` + alias + `.url, ` + alias + `.event_types, ` + alias + `.description, ` +
		alias + `.include_descendants, ` + alias + `.secret, ` + alias + `.previous_secret, ` + alias + `.previous_secret_expires_at, ` +
		alias + `.enabled, ` + alias + `.disabled_reason, ` + alias + `.failing_since, ` + alias + `.created_by, ` +
		alias + `.created_at, ` + alias + `.updated_at`
}

// Outcome is what one attempt got.
type Outcome struct {
	// Status is the HTTP status code; 0 when none came back.
	Status int
	// Err says why the attempt failed; "" for a success.
	Err string
}

// Result is one attempt's outcome, to record.
type Result struct {
	// ID and WebhookID name the delivery.
	ID        int64
	WebhookID string
	Outcome
	// RetryIn, for a failure, is when to try again; 0 fails the delivery
	// for good.
	RetryIn time.Duration
}

// OK reports whether the attempt succeeded.
func (r Result) OK() bool { return r.Err == "" }

// Record stores a batch of attempts' outcomes in tx: successes finish their
// deliveries and end their webhooks' failing streaks; failures are retried
// after RetryIn or fail for good, and start a streak where none was. It
// returns when each webhook with only failures in the batch started
// failing, to decide whether to disable it.
func Record(ctx context.Context, tx pgx.Tx, rs []Result) (map[string]time.Time, error) {
	if len(rs) == 0 {
		return nil, nil
	}
	ids := make([]int64, len(rs))
	oks := make([]bool, len(rs))
	statuses := make([]int32, len(rs))
	errs := make([]string, len(rs))
	retries := make([]int64, len(rs))
	okHooks, failedHooks := map[string]bool{}, map[string]bool{}
	for i, r := range rs {
		ids[i], oks[i], statuses[i], errs[i], retries[i] = r.ID, r.OK(), int32(r.Status), clip(r.Err), r.RetryIn.Microseconds()
		if r.OK() {
			okHooks[r.WebhookID] = true
		} else {
			failedHooks[r.WebhookID] = true
		}
	}
	if _, err := tx.Exec(ctx, `
		UPDATE webhook_deliveries d SET
		       state = CASE WHEN r.ok THEN 'succeeded' WHEN r.retry > 0 THEN 'pending' ELSE 'failed' END,
		       attempts = d.attempts + 1, last_status = r.status, last_error = r.err,
		       next_attempt_at = CASE WHEN NOT r.ok AND r.retry > 0 THEN now() + r.retry * interval '1 microsecond' ELSE d.next_attempt_at END,
		       finished_at = CASE WHEN r.ok OR r.retry <= 0 THEN now() END
		  FROM unnest($1::bigint[], $2::bool[], $3::int[], $4::text[], $5::bigint[]) AS r(id, ok, status, err, retry)
		 WHERE d.id = r.id AND d.state = 'pending'`, ids, oks, statuses, errs, retries); err != nil {
		return nil, fmt.Errorf("record deliveries: %w", err)
	}
	var ok, failed []string
	for h := range okHooks {
		ok = append(ok, h)
	}
	for h := range failedHooks {
		if !okHooks[h] {
			failed = append(failed, h)
		}
	}
	// Sorted, so concurrent recorders lock webhooks in one order.
	slices.Sort(ok)
	slices.Sort(failed)
	if len(ok) > 0 {
		if _, err := tx.Exec(ctx, `UPDATE webhooks SET failing_since = NULL WHERE id = ANY($1) AND failing_since IS NOT NULL`, ok); err != nil {
			return nil, fmt.Errorf("record deliveries: %w", err)
		}
	}
	since := map[string]time.Time{}
	if len(failed) > 0 {
		rows, err := tx.Query(ctx, `UPDATE webhooks SET failing_since = coalesce(failing_since, now()) WHERE id = ANY($1) RETURNING id, failing_since`, failed)
		if err != nil {
			return nil, fmt.Errorf("record failing webhooks: %w", err)
		}
		for rows.Next() {
			var id string
			var at time.Time
			if err := rows.Scan(&id, &at); err != nil {
				rows.Close()
				return nil, err
			}
			since[id] = at
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return nil, fmt.Errorf("record failing webhooks: %w", err)
		}
	}
	return since, nil
}

// clip bounds an error message kept in the database.
func clip(s string) string {
	const maxLen = 1024
	if len(s) > maxLen {
		return s[:maxLen]
	}
	return s
}

// Disable turns webhook id off for reason; it reports whether it was on.
func Disable(ctx context.Context, tx pgx.Tx, id, reason string) (bool, error) {
	tag, err := tx.Exec(ctx, `UPDATE webhooks SET enabled = false, disabled_reason = $2, updated_at = now() WHERE id = $1 AND enabled`, id, reason)
	if err != nil {
		return false, fmt.Errorf("disable webhook: %w", err)
	}
	return tag.RowsAffected() == 1, nil
}

// DeliveryFilter selects deliveries of one webhook.
type DeliveryFilter struct {
	TenantID  string
	WebhookID string
	// State, when set, selects one state.
	State string
	// BeforeID pages: only deliveries with a smaller id; 0 starts at the
	// newest.
	BeforeID int64
	Limit    int
}

// ListDeliveries returns the deliveries f selects, newest first.
func ListDeliveries(ctx context.Context, q Querier, f DeliveryFilter) ([]Delivery, error) {
	ds, err := collectDeliveries(q.Query(ctx, `SELECT `+deliveryColumns+`
		  FROM webhook_deliveries d LEFT JOIN outbox o ON o.id = d.event_id
		 WHERE d.tenant_id = $1 AND d.webhook_id = $2 AND ($3 = '' OR d.state = $3) AND ($4 = 0 OR d.id < $4)
		 ORDER BY d.id DESC LIMIT $5`, f.TenantID, f.WebhookID, f.State, f.BeforeID, f.Limit))
	if err != nil {
		return nil, fmt.Errorf("list deliveries: %w", err)
	}
	return ds, nil
}

// GetDelivery returns delivery id of one of tenant's webhooks; NOT_FOUND
// when there is none.
func GetDelivery(ctx context.Context, q Querier, tenant string, id int64) (Delivery, error) {
	ds, err := collectDeliveries(q.Query(ctx, `SELECT `+deliveryColumns+`
		  FROM webhook_deliveries d LEFT JOIN outbox o ON o.id = d.event_id WHERE d.tenant_id = $1 AND d.id = $2`, tenant, id))
	if err != nil {
		return Delivery{}, fmt.Errorf("read delivery: %w", err)
	}
	if len(ds) == 0 {
		return Delivery{}, fault.New(fault.NotFound, "deliveryId", "no delivery %d in tenant %q", id, tenant)
	}
	return ds[0], nil
}

// Redeliver makes delivery id pending and due now, whatever its state.
func Redeliver(ctx context.Context, q Querier, tenant string, id int64) (Delivery, error) {
	ds, err := collectDeliveries(q.Query(ctx, `
		WITH d AS (UPDATE webhook_deliveries SET state = 'pending', next_attempt_at = now(), finished_at = NULL
		           WHERE tenant_id = $1 AND id = $2 RETURNING *)
		SELECT `+deliveryColumns+` FROM d LEFT JOIN outbox o ON o.id = d.event_id`, tenant, id))
	if err != nil {
		return Delivery{}, fmt.Errorf("redeliver: %w", err)
	}
	if len(ds) == 0 {
		return Delivery{}, fault.New(fault.NotFound, "deliveryId", "no delivery %d in tenant %q", id, tenant)
	}
	return ds[0], nil
}

// DueDeliveries counts the pending deliveries due now. q needs only
// QueryRow (a metrics scrape holds no more).
func DueDeliveries(ctx context.Context, q interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}) (int64, error) {
	var n int64
	if err := q.QueryRow(ctx, `SELECT count(*) FROM webhook_deliveries WHERE state = 'pending' AND next_attempt_at <= now()`).Scan(&n); err != nil {
		return 0, fmt.Errorf("count due deliveries: %w", err)
	}
	return n, nil
}
