package webhooks

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
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
// at most room(webhook) of each webhook, where busy maps webhook ids to the
// attempts this process already has in flight and perEndpoint bounds them.
// A claimed delivery's next attempt moves to now + hold, so another process
// takes it only if this one dies; a row another claimer took first is
// skipped: the UPDATE re-checks that it is still due.
func Claim(ctx context.Context, q Querier, limit, perEndpoint int, busy map[string]int, hold time.Duration) ([]Claimed, error) {
	busyIDs := make([]string, 0, len(busy))
	busyN := make([]int32, 0, len(busy))
	for id, n := range busy {
		busyIDs = append(busyIDs, id)
		busyN = append(busyN, int32(n))
	}
	// Candidates first (a window per webhook cannot take row locks), then
	// the claim, which re-checks state and due time under the row lock.
	rows, err := q.Query(ctx, `
		WITH c AS (
			SELECT x.id FROM (
				SELECT d.id, d.webhook_id, row_number() OVER (PARTITION BY d.webhook_id ORDER BY d.next_attempt_at, d.id) AS rn
				  FROM webhook_deliveries d JOIN webhooks w ON w.id = d.webhook_id AND w.enabled
				 WHERE d.state = 'pending' AND d.next_attempt_at <= now()
			) x LEFT JOIN unnest($2::text[], $3::int[]) AS b(id, n) ON b.id = x.webhook_id
			 WHERE x.rn <= $4 - coalesce(b.n, 0)
			 LIMIT $1
		), u AS (
			UPDATE webhook_deliveries d SET next_attempt_at = now() + $5 * interval '1 microsecond'
			  FROM c WHERE d.id = c.id AND d.state = 'pending' AND d.next_attempt_at <= now()
			RETURNING d.*
		)
		SELECT `+deliveryColumns+`, o.created_at, o.payload, `+prefixed("w")+`
		  FROM u d JOIN outbox o ON o.id = d.event_id JOIN webhooks w ON w.id = d.webhook_id`,
		limit, busyIDs, busyN, perEndpoint, hold.Microseconds())
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

// Succeed records a successful attempt of delivery id: the delivery is
// done and its webhook is no longer failing.
func Succeed(ctx context.Context, tx pgx.Tx, id int64, webhookID string, o Outcome) error {
	if _, err := tx.Exec(ctx, `UPDATE webhook_deliveries SET state = 'succeeded', attempts = attempts + 1, last_status = $2,
		last_error = '', finished_at = now() WHERE id = $1 AND state = 'pending'`, id, o.Status); err != nil {
		return fmt.Errorf("record delivery: %w", err)
	}
	if _, err := tx.Exec(ctx, `UPDATE webhooks SET failing_since = NULL WHERE id = $1 AND failing_since IS NOT NULL`, webhookID); err != nil {
		return fmt.Errorf("record delivery: %w", err)
	}
	return nil
}

// Fail records a failed attempt of delivery id. With retryIn > 0 the
// delivery is retried then; otherwise it has failed for good. It returns
// when the webhook started failing (the first failure since its last
// success).
func Fail(ctx context.Context, tx pgx.Tx, id int64, webhookID string, o Outcome, retryIn time.Duration) (time.Time, error) {
	var err error
	if retryIn > 0 {
		_, err = tx.Exec(ctx, `UPDATE webhook_deliveries SET attempts = attempts + 1, last_status = $2, last_error = $3,
			next_attempt_at = now() + $4 * interval '1 microsecond' WHERE id = $1 AND state = 'pending'`, id, o.Status, clip(o.Err), retryIn.Microseconds())
	} else {
		_, err = tx.Exec(ctx, `UPDATE webhook_deliveries SET state = 'failed', attempts = attempts + 1, last_status = $2, last_error = $3,
			finished_at = now() WHERE id = $1 AND state = 'pending'`, id, o.Status, clip(o.Err))
	}
	if err != nil {
		return time.Time{}, fmt.Errorf("record failed delivery: %w", err)
	}
	var since time.Time
	if err := tx.QueryRow(ctx, `UPDATE webhooks SET failing_since = coalesce(failing_since, now()) WHERE id = $1 RETURNING failing_since`,
		webhookID).Scan(&since); err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return time.Time{}, fmt.Errorf("record failing webhook: %w", err)
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

// NextDue returns when the soonest pending delivery of an enabled webhook
// is due, and false when there is none.
func NextDue(ctx context.Context, q Querier) (time.Time, bool, error) {
	var at *time.Time
	err := q.QueryRow(ctx, `SELECT min(d.next_attempt_at) FROM webhook_deliveries d JOIN webhooks w ON w.id = d.webhook_id AND w.enabled
		WHERE d.state = 'pending'`).Scan(&at)
	if err != nil {
		return time.Time{}, false, fmt.Errorf("read next due delivery: %w", err)
	}
	if at == nil {
		return time.Time{}, false, nil
	}
	return *at, true, nil
}
