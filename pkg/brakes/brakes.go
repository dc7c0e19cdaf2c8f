// Package brakes stores the eviction brakes (table brakes): what keeps the
// control plane from acting on half the fleet because a gateway or a rack
// switch hiccupped. Every action on a lost node — the placer's replace and
// fail, a remediation step — first asks [Allow]:
//
//   - a circuit breaker per pool and per gateway and tenant (the nodes of
//     one tenant a gateway last held): while more than
//     Config.UnhealthyThreshold of the scope's nodes are not ready, nothing
//     in it is acted on. A gateway's breaker counts one tenant's nodes only,
//     so one tenant's lost (or simulated) nodes behind a shared gateway
//     never pause another tenant's; and a node Lost for longer than
//     Config.LongLostAfter is out of every ratio, so nodes that never come
//     back cannot hold a breaker open for ever. [Evaluate] (run by the
//     liveness job, in the transaction that changes Ready) opens and closes
//     the breakers and returns the transitions, for the
//     fleet.eviction_paused and fleet.eviction_resumed events;
//   - token buckets, taken in the acting transaction, so the rates hold
//     across every placer and controller process: one per tenant
//     (Config.TenantRate, Config.TenantBurst) under the fleet-wide ceiling
//     (Config.Rate nodes per second, Config.Burst at once). A tenant's
//     bucket is smaller than the fleet's, so one tenant asking without end
//     takes at most its share and the others still get tokens.
//
// Time is passed in (now), so tests drive the bucket with a fake clock.
package brakes

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/iam"
)

// Defaults of [Config].
const (
	DefaultRate               = 0.1
	DefaultBurst              = 1
	DefaultUnhealthyThreshold = 0.55
	// DefaultLongLostAfter: a node Lost this long is out of the breakers'
	// ratios.
	DefaultLongLostAfter = time.Hour
)

// Config configures the brakes (config nodes.evictionRate,
// nodes.evictionBurst, nodes.unhealthyThreshold).
type Config struct {
	// Rate is how many lost nodes per second may be acted on, fleet-wide;
	// 0 means 0.1.
	Rate float64
	// Burst is how many at once; 0 means 1.
	Burst int
	// UnhealthyThreshold: a pool, or one tenant's nodes behind a gateway,
	// with more than this fraction of its nodes not ready is paused; 0
	// means 0.55.
	UnhealthyThreshold float64
	// TenantRate is how many of one tenant's lost nodes per second may be
	// acted on (nodes.tenantEvictionRate), under Rate; 0 means half of
	// Rate.
	TenantRate float64
	// TenantBurst is how many of one tenant's at once
	// (nodes.tenantEvictionBurst), at most Burst; 0 means half of Burst,
	// at least 1.
	TenantBurst int
	// LongLostAfter: a node Lost for longer than this is out of the
	// breakers' counts (nodes.longLostAfter); 0 means 1h.
	LongLostAfter time.Duration
}

// Subject is what an action is on: the node, its pool and the gateway that
// last held it ("" when none). The tenant whose bucket and breakers apply
// is the node's (read from the database, the pool's when the node is
// gone), never the caller's word.
type Subject struct {
	NodeID    string
	PoolID    string
	GatewayID string
}

// Decision is [Allow]'s answer.
type Decision struct {
	// Allowed: act now (a token was taken).
	Allowed bool
	// Paused: a circuit breaker of the subject's pool or gateway is open.
	Paused bool
	// Reason says why not, naming the scope or the rate.
	Reason string
}

// Scopes of the brakes table's rows.
const (
	// RateScope is the fleet-wide token bucket's row.
	RateScope       = "rate"
	tenantRatePfx   = "rate:"
	poolPrefix      = "pool:"
	gatewayPrefix   = "gateway:"
	gatewayTenantIn = "/tenant:"
)

// TenantRateScope is the row of tenant's token bucket.
func TenantRateScope(tenant string) string { return tenantRatePfx + tenant }

// PoolScope is the scope of pool id's circuit breaker.
func PoolScope(id string) string { return poolPrefix + id }

// GatewayScope is the scope of the circuit breaker of tenant's nodes that
// gateway id last held: "gateway:<id>/tenant:<tenant>".
func GatewayScope(id, tenant string) string { return gatewayPrefix + id + gatewayTenantIn + tenant }

// ErrBadConfig is returned for a [Config] out of range (a negative rate,
// a threshold above 1); the config package refuses those first, naming
// the key.
var ErrBadConfig = errors.New("brakes: bad configuration")

// Normalize returns cfg with its defaults filled in, or [ErrBadConfig]
// naming the bad field.
func (cfg Config) Normalize() (Config, error) {
	if cfg.Rate == 0 {
		cfg.Rate = DefaultRate
	}
	if cfg.Burst == 0 {
		cfg.Burst = DefaultBurst
	}
	if cfg.UnhealthyThreshold == 0 {
		cfg.UnhealthyThreshold = DefaultUnhealthyThreshold
	}
	if cfg.TenantRate == 0 {
		cfg.TenantRate = cfg.Rate / 2
	}
	if cfg.TenantBurst == 0 {
		cfg.TenantBurst = max(1, cfg.Burst/2)
	}
	if cfg.LongLostAfter == 0 {
		cfg.LongLostAfter = DefaultLongLostAfter
	}
	switch {
	case cfg.Rate < 0 || math.IsNaN(cfg.Rate) || math.IsInf(cfg.Rate, 0):
		return cfg, fmt.Errorf("%w: Rate %g, expected more than 0", ErrBadConfig, cfg.Rate)
	case cfg.Burst < 0:
		return cfg, fmt.Errorf("%w: Burst %d, expected at least 1", ErrBadConfig, cfg.Burst)
	case !(cfg.UnhealthyThreshold > 0 && cfg.UnhealthyThreshold <= 1):
		return cfg, fmt.Errorf("%w: UnhealthyThreshold %g, expected more than 0 and at most 1", ErrBadConfig, cfg.UnhealthyThreshold)
	case !(cfg.TenantRate > 0 && cfg.TenantRate <= cfg.Rate):
		return cfg, fmt.Errorf("%w: TenantRate %g, expected more than 0 and at most Rate (%g)", ErrBadConfig, cfg.TenantRate, cfg.Rate)
	case cfg.TenantBurst < 0 || cfg.TenantBurst > cfg.Burst:
		return cfg, fmt.Errorf("%w: TenantBurst %d, expected at least 1 and at most Burst (%d)", ErrBadConfig, cfg.TenantBurst, cfg.Burst)
	case cfg.LongLostAfter < 0:
		return cfg, fmt.Errorf("%w: LongLostAfter %s, expected a positive duration", ErrBadConfig, cfg.LongLostAfter)
	}
	return cfg, nil
}

// ErrNotBuilt is no longer returned.
//
// Deprecated: the brakes are built; kept for callers written against the
// contract before they were.
var ErrNotBuilt = errors.New("brakes: not built yet")

// tokenSlack absorbs float error in the refill (10 s × 0.1/s is a token).
const tokenSlack = 1e-9

// Allow decides whether an action on s may run now: not while a breaker of
// its pool or of its tenant's nodes behind its gateway is open; otherwise
// only if both its tenant's bucket and the fleet-wide bucket have a token
// at now, which it takes from both. Call it in the transaction that acts,
// so a rolled-back action gives its tokens back.
//
// The buckets' rows are locked (SELECT … FOR UPDATE) until tx ends, the
// tenant's first and the fleet's last (one order, so no deadlock), so
// concurrent actors across processes take tokens one at a time; a bucket
// starts full and refills by (now − refilled_at) × its rate, capped at its
// burst. A refusal writes nothing. A now earlier than the last refill
// (clocks of two processes apart) refills nothing.
func Allow(ctx context.Context, tx pgx.Tx, cfg Config, s Subject, now time.Time) (Decision, error) {
	cfg, err := cfg.Normalize()
	if err != nil {
		return Decision{}, err
	}
	var tenant string
	if err := tx.QueryRow(ctx, `SELECT coalesce((SELECT tenant_id FROM nodes WHERE id = $1), (SELECT tenant_id FROM pools WHERE id = $2), '')`,
		s.NodeID, s.PoolID).Scan(&tenant); err != nil {
		return Decision{}, fmt.Errorf("read the tenant of %s: %w", s.NodeID, err)
	}
	scopes := []string{PoolScope(s.PoolID)}
	if s.GatewayID != "" {
		scopes = append(scopes, GatewayScope(s.GatewayID, tenant))
	}
	var scope, reason string
	var notReady, total int
	// 'pool:' sorts after 'gateway:': DESC names the pool first.
	err = tx.QueryRow(ctx, `SELECT scope, not_ready, total, reason FROM brakes
		WHERE scope = ANY($1) AND paused ORDER BY scope DESC LIMIT 1`, scopes).Scan(&scope, &notReady, &total, &reason)
	switch {
	case err == nil:
		if reason == "" {
			reason = fmt.Sprintf("%s: %d of %d nodes not ready", scope, notReady, total)
		}
		return Decision{Paused: true, Reason: "eviction paused: " + reason}, nil
	case !errors.Is(err, pgx.ErrNoRows):
		return Decision{}, fmt.Errorf("read circuit breakers of %s: %w", s.NodeID, err)
	}

	buckets := []bucket{
		{scope: TenantRateScope(tenant), rate: cfg.TenantRate, burst: cfg.TenantBurst,
			refusal: fmt.Sprintf("tenant %s's eviction rate nodes.tenantEvictionRate=%g reached (nodes.tenantEvictionBurst=%d)", tenant, cfg.TenantRate, cfg.TenantBurst)},
		{scope: RateScope, rate: cfg.Rate, burst: cfg.Burst,
			refusal: fmt.Sprintf("eviction rate nodes.evictionRate=%g reached (nodes.evictionBurst=%d)", cfg.Rate, cfg.Burst)},
	}
	refusal := ""
	for i := range buckets {
		b := &buckets[i]
		tokens, at, err := lockBucket(ctx, tx, b.scope, b.burst, now)
		if err != nil {
			return Decision{}, err
		}
		if elapsed := now.Sub(at).Seconds(); elapsed > 0 {
			tokens = math.Min(float64(b.burst), tokens+elapsed*b.rate)
		}
		if tokens < 1-tokenSlack {
			// The fleet's refusal, the later, wins: it is the one that
			// binds every tenant.
			next := time.Duration((1 - tokens) / b.rate * float64(time.Second)).Round(time.Millisecond)
			refusal = fmt.Sprintf("%s: the next node in %s", b.refusal, next)
			continue
		}
		b.tokens = math.Max(0, tokens-1)
		b.at = now
		if at.After(now) {
			b.at = at
		}
	}
	if refusal != "" {
		return Decision{Reason: refusal}, nil
	}
	for _, b := range buckets {
		if _, err := tx.Exec(ctx, `UPDATE brakes SET tokens = $1, refilled_at = $2 WHERE scope = $3`, b.tokens, b.at, b.scope); err != nil {
			return Decision{}, fmt.Errorf("take an eviction token of %s: %w", b.scope, err)
		}
	}
	return Decision{Allowed: true}, nil
}

// bucket is one token bucket [Allow] takes from.
type bucket struct {
	scope   string
	rate    float64
	burst   int
	refusal string
	tokens  float64
	at      time.Time
}

// lockBucket locks the token bucket's row scope, creating it full (burst
// tokens) at now the first time.
func lockBucket(ctx context.Context, tx pgx.Tx, scope string, burst int, now time.Time) (float64, time.Time, error) {
	for range 2 {
		var tokens float64
		var at time.Time
		err := tx.QueryRow(ctx, `SELECT tokens, refilled_at FROM brakes WHERE scope = $1 FOR UPDATE`, scope).Scan(&tokens, &at)
		if err == nil {
			return tokens, at, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return 0, time.Time{}, fmt.Errorf("lock the eviction bucket %s: %w", scope, err)
		}
		// Another transaction inserting it at once: DO NOTHING waits for
		// it, and the next SELECT sees its row.
		if _, err := tx.Exec(ctx, `INSERT INTO brakes (scope, tokens, refilled_at) VALUES ($1, $2, $3)
			ON CONFLICT (scope) DO NOTHING`, scope, float64(burst), now); err != nil {
			return 0, time.Time{}, fmt.Errorf("create the eviction bucket %s: %w", scope, err)
		}
	}
	return 0, time.Time{}, fmt.Errorf("lock the eviction bucket %s: no row after creating it", scope)
}

// Transition is a circuit breaker that [Evaluate] opened or closed.
type Transition struct {
	// Scope is the breaker's row: "pool:<id>" or
	// "gateway:<id>/tenant:<tenant>".
	Scope string
	// Kind is "pool" or "gateway"; ID the pool's or the gateway's id.
	Kind, ID string
	// TenantID is whom the event is for: the pool's tenant, the tenant of
	// a gateway's scope, or [iam.RootTenant] (a pool since deleted, a
	// gateway row stored before breakers were per tenant).
	TenantID string
	// Opened: actions in the scope are paused from now; false: resumed.
	Opened bool
	// NotReady of Total nodes (not retired, not commissioning, not lost
	// for longer than LongLostAfter) were not ready.
	NotReady, Total int
}

// evaluateSQL recomputes every breaker in one statement: one scan of the
// nodes in service (not retired, not a machine's ramdisk in commissioning,
// which goes away on purpose; not Lost since before $4, which no longer
// count) grouped by pool and by gateway and tenant (GROUPING SETS),
// joined with the stored breakers, locked. It inserts a breaker that
// opens, updates a stored one whose counts or state changed, deletes a
// closed one whose scope has no node left (a gateway gone, a pool
// emptied), and returns the scopes whose state changed, with the tenant of
// their event. It also deletes the tenants' token buckets that are full
// again (refilled before $5; one an actor holds is skipped, never waited
// for): a missing bucket is a full one. $1 is the
// threshold, $2 now, $3 the root tenant.
const evaluateSQL = `
WITH c AS (
	SELECT CASE WHEN grouping(n.pool_id) = 0 THEN 'pool:' || n.pool_id
	            ELSE 'gateway:' || n.gateway_id || '/tenant:' || n.tenant_id END AS scope,
	       (count(*) FILTER (WHERE n.ready IN ('Unknown', 'Lost')))::int AS not_ready, count(*)::int AS total
	  FROM nodes n WHERE n.state NOT IN ('retired', 'commissioning') AND NOT (n.ready = 'Lost' AND n.ready_since < $4)
	 GROUP BY GROUPING SETS ((n.pool_id), (n.gateway_id, n.tenant_id))
	HAVING grouping(n.pool_id) = 0 OR n.gateway_id <> ''),
b AS (SELECT scope, paused, not_ready, total FROM brakes WHERE left(scope, 5) = 'pool:' OR left(scope, 8) = 'gateway:' FOR UPDATE),
w AS (
	SELECT coalesce(c.scope, b.scope) AS scope, coalesce(c.not_ready, 0) AS not_ready, coalesce(c.total, 0) AS total,
	       coalesce(c.total > 0 AND c.not_ready::numeric > $1::float8::numeric * c.total, false) AS paused,
	       b.scope IS NOT NULL AS stored, coalesce(b.paused, false) AS was,
	       coalesce(b.not_ready, -1) AS old_not_ready, coalesce(b.total, -1) AS old_total
	  FROM c FULL JOIN b ON b.scope = c.scope),
idle AS (
	DELETE FROM brakes WHERE scope IN (
		SELECT scope FROM brakes WHERE left(scope, 5) = 'rate:' AND refilled_at < $5 FOR UPDATE SKIP LOCKED)),
gone AS (
	DELETE FROM brakes d USING w
	 WHERE d.scope = w.scope AND w.stored AND NOT w.was AND NOT w.paused AND w.total = 0),
up AS (
	INSERT INTO brakes (scope, paused, not_ready, total, reason, since)
	SELECT scope, paused, not_ready, total,
	       CASE WHEN paused THEN format('%s: %s of %s nodes not ready, more than nodes.unhealthyThreshold=%s', scope, not_ready, total, $1::float8) ELSE '' END,
	       $2
	  FROM w
	 WHERE (paused OR stored) AND NOT (stored AND NOT was AND NOT paused AND total = 0)
	   AND (paused <> was OR not_ready <> old_not_ready OR total <> old_total)
	ON CONFLICT (scope) DO UPDATE SET paused = excluded.paused, not_ready = excluded.not_ready, total = excluded.total,
	       reason = excluded.reason,
	       since = CASE WHEN brakes.paused = excluded.paused THEN brakes.since ELSE excluded.since END)
SELECT w.scope, w.paused, w.not_ready, w.total, coalesce(p.tenant_id, $3)
  FROM w LEFT JOIN pools p ON left(w.scope, 5) = 'pool:' AND p.id = substr(w.scope, 6)
 WHERE w.paused <> w.was
 ORDER BY w.scope`

// Evaluate recomputes every pool's circuit breaker, and every gateway's
// per tenant, from the nodes (not retired; not Lost for longer than
// cfg.LongLostAfter; not ready is Ready Unknown or Lost; a gateway's nodes
// are those whose gateway_id names it, the gateway that last held the
// session), in one statement however many nodes: a scope is paused while
// more than cfg.UnhealthyThreshold of its nodes are not ready. It stores
// the scopes that are or were paused, and returns the breakers that opened
// or closed, by scope; it drops the tenants' buckets that are full again.
// Call it in the transaction that changes Ready (the liveness job), so the
// breakers and the events agree with it; now is when a change happened.
func Evaluate(ctx context.Context, tx pgx.Tx, cfg Config, now time.Time) ([]Transition, error) {
	cfg, err := cfg.Normalize()
	if err != nil {
		return nil, err
	}
	longLost := now.Add(-cfg.LongLostAfter)
	full := now.Add(-time.Duration(float64(cfg.TenantBurst) / cfg.TenantRate * float64(time.Second)))
	rows, err := tx.Query(ctx, evaluateSQL, cfg.UnhealthyThreshold, now, iam.RootTenant, longLost, full)
	if err != nil {
		return nil, fmt.Errorf("evaluate circuit breakers: %w", err)
	}
	var out []Transition
	for rows.Next() {
		var t Transition
		if err := rows.Scan(&t.Scope, &t.Opened, &t.NotReady, &t.Total, &t.TenantID); err != nil {
			rows.Close()
			return nil, fmt.Errorf("evaluate circuit breakers: %w", err)
		}
		t.Kind, t.ID, _ = strings.Cut(t.Scope, ":")
		if t.Kind == "gateway" {
			t.TenantID = iam.RootTenant
			if gw, tenant, ok := strings.Cut(t.ID, gatewayTenantIn); ok {
				t.ID, t.TenantID = gw, tenant
			}
		}
		out = append(out, t)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("evaluate circuit breakers: %w", err)
	}
	return out, nil
}

// Breaker is a stored circuit breaker.
type Breaker struct {
	Scope           string
	Paused          bool
	NotReady, Total int
	Reason          string
	Since           time.Time
}

// Querier is what [Breakers] reads through: a pool, a connection or a
// transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Breakers lists the stored circuit breakers (paused ones, and closed ones
// whose scope still has nodes), by scope: what the bc_eviction_paused gauge
// and operators read.
func Breakers(ctx context.Context, q Querier) ([]Breaker, error) {
	rows, err := q.Query(ctx, `SELECT scope, paused, not_ready, total, reason, since FROM brakes
		WHERE left(scope, 5) = 'pool:' OR left(scope, 8) = 'gateway:' ORDER BY scope`)
	if err != nil {
		return nil, fmt.Errorf("list circuit breakers: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Breaker])
	if err != nil {
		return nil, fmt.Errorf("list circuit breakers: %w", err)
	}
	return out, nil
}
