package nodes

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Values of a node's Ready condition (nodes.ready).
const (
	// ReadyTrue: a gateway heard from the node within notReadyAfter.
	ReadyTrue = "True"
	// ReadyUnknown: no gateway has heard from it for notReadyAfter.
	ReadyUnknown = "Unknown"
	// ReadyLost: no gateway has heard from it for lostAfter.
	ReadyLost = "Lost"
)

// ConditionReady is the type of the Ready condition.
const ConditionReady = "Ready"

// Readiness says how [UpdateReadiness] derives Ready from last_seen_at.
type Readiness struct {
	// NotReadyAfter: a node unseen this long is Unknown.
	NotReadyAfter time.Duration
	// LostAfter: a node unseen this long is Lost.
	LostAfter time.Duration
	// Limit bounds the nodes changed by one call; 0 means 1,000.
	Limit int
}

// readyExpr is what a node's Ready should be: $1 is notReadyAfter, $2
// lostAfter.
const readyExpr = `(CASE
	WHEN coalesce(n.last_seen_at, n.created_at) >= now() - $1::interval THEN 'True'
	WHEN coalesce(n.last_seen_at, n.created_at) >= now() - $2::interval THEN 'Unknown'
	ELSE 'Lost' END)`

// ReadyChange is one node whose Ready condition [UpdateReadiness] changed.
type ReadyChange struct {
	NodeID   string
	TenantID string
	PoolID   string
	// From and To are the condition's values before and after.
	From, To string
	Reason   string
	Since    time.Time
	// LastSeenAt is when a gateway last heard from the node; nil if never.
	LastSeenAt *time.Time
}

// UpdateReadiness sets the Ready condition of every node (retired ones
// aside) whose condition no longer matches how long ago a gateway last heard
// from it — True within r.NotReadyAfter, Unknown within r.LostAfter, Lost
// after — and returns the changes, in node id order, at most r.Limit of
// them: one statement however many nodes. A node that never had a session
// counts from its creation. Time is the database's, as for last_seen_at.
//
// Ready has columns of its own (nodes.ready, ready_reason, ready_since), so
// this write and the inventory controller's [SetState] of nodes.conditions
// never overwrite each other. The nodes are locked in id order, as every
// writer of many nodes locks them, and the new value is computed from the
// row as locked: a heartbeat that landed meanwhile is seen.
func UpdateReadiness(ctx context.Context, q Querier, r Readiness) ([]ReadyChange, error) {
	if r.Limit <= 0 {
		r.Limit = 1000
	}
	unknown := fmt.Sprintf("no heartbeat through any gateway for more than %s", r.NotReadyAfter)
	lost := fmt.Sprintf("no heartbeat through any gateway for more than %s", r.LostAfter)
	rows, err := q.Query(ctx, `
		WITH l AS MATERIALIZED (
			SELECT n.id, n.ready AS old FROM nodes n
			 WHERE n.state <> 'retired' AND n.ready <> `+readyExpr+`
			 ORDER BY n.id LIMIT $3 FOR NO KEY UPDATE OF n),
		u AS (
			UPDATE nodes n SET ready = `+readyExpr+`, ready_since = now(),
			       ready_reason = CASE `+readyExpr+` WHEN 'True' THEN '' WHEN 'Unknown' THEN $4 ELSE $5 END
			  FROM l WHERE n.id = l.id AND n.ready <> `+readyExpr+`
			RETURNING n.id, n.tenant_id, n.pool_id, l.old, n.ready, n.ready_reason, n.ready_since, n.last_seen_at)
		SELECT * FROM u ORDER BY id`, r.NotReadyAfter, r.LostAfter, r.Limit, unknown, lost)
	if err != nil {
		return nil, fmt.Errorf("update readiness: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[ReadyChange])
	if err != nil {
		return nil, fmt.Errorf("update readiness: %w", err)
	}
	return out, nil
}

// ReadyCondition returns n's Ready condition as a [Condition]: Status is
// true only for [ReadyTrue].
func (n Node) ReadyCondition() Condition {
	return Condition{Type: ConditionReady, Status: n.Ready == ReadyTrue, Reason: n.ReadyReason, Since: n.ReadySince}
}
