package nodes

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Writes of the nodes table other than joinservice's ([Create], [Reclaim]):
// the gateway, the inventory and nodespec controllers, the API and the
// command queue each call the function for their write in their own
// transaction, under their own fence. A test fails when a statement writing
// nodes appears outside this package.

// Session is what opening a session did to a node.
type Session struct {
	// Epoch is the node's new session epoch.
	Epoch int64
	// ObservedGeneration is the highest generation the node has reported,
	// never above its stored generation (a row that was is capped here).
	ObservedGeneration int64
	// PrevBootID and PrevJournalID are the boot and journal the node had
	// before this session.
	PrevBootID, PrevJournalID string
	// PrevAgentVersion is the bcd version the node's previous session
	// reported ("" before its first).
	PrevAgentVersion string
}

// OpenSession records a new session of node id, held by gateway gatewayID,
// from boot bootID with journal journalID: it bumps the session epoch (so an
// older session, on any gateway, is superseded and its late writes, fenced on
// the epoch, change nothing), marks the node seen, and returns the new epoch
// with the boot and journal the node had before. The node stays locked until
// q's transaction ends. It wraps [pgx.ErrNoRows] when there is no node id.
func OpenSession(ctx context.Context, q Querier, id, gatewayID, bootID, journalID, agentVersion string) (Session, error) {
	var s Session
	err := q.QueryRow(ctx, `
		WITH old AS (SELECT id, boot_id, journal_id, agent_version FROM nodes WHERE id = $1 FOR UPDATE)
		UPDATE nodes n SET session_epoch = session_epoch + 1, gateway_id = $2, boot_id = $3, journal_id = $4,
		       last_seen_at = now(), observed_generation = least(n.observed_generation, n.generation), agent_version = $5
		  FROM old WHERE n.id = old.id
		RETURNING n.session_epoch, n.observed_generation, old.boot_id, old.journal_id, old.agent_version`,
		id, gatewayID, bootID, journalID, agentVersion).Scan(&s.Epoch, &s.ObservedGeneration, &s.PrevBootID, &s.PrevJournalID, &s.PrevAgentVersion)
	if err != nil {
		return Session{}, fmt.Errorf("bump session epoch of node %s: %w", id, err)
	}
	return s, nil
}

// SessionRef names one session of a node.
type SessionRef struct {
	NodeID string
	Epoch  int64
}

// Liveness is one session as the gateway holding it knows it.
type Liveness struct {
	NodeID string
	Epoch  int64
	// Seen says the session was heard from since the last write.
	Seen bool
}

// WriteLiveness sets last_seen_at to now on the node of every session in
// sessions that was seen and is still its node's current one, and returns
// the sessions that are not (a newer session of the same node superseded
// them, or the node is gone) — in one statement, however many sessions. It
// locks the nodes in id order, as every writer of many nodes does: a
// gateway's 10,000 sessions locked in hash order deadlocked with the
// nodespec controller's batches, which PostgreSQL breaks only after
// deadlock_timeout.
func WriteLiveness(ctx context.Context, q Querier, sessions []Liveness) ([]SessionRef, error) {
	if len(sessions) == 0 {
		return nil, nil
	}
	ids := make([]string, len(sessions))
	epochs := make([]int64, len(sessions))
	seen := make([]bool, len(sessions))
	for i, s := range sessions {
		ids[i], epochs[i], seen[i] = s.NodeID, s.Epoch, s.Seen
	}
	rows, err := q.Query(ctx, `
		WITH s AS (SELECT * FROM unnest($1::text[], $2::bigint[], $3::bool[]) AS s(id, epoch, seen)),
		     l AS MATERIALIZED (
			SELECT n.id FROM nodes n JOIN s ON s.id = n.id AND n.session_epoch = s.epoch AND s.seen
			 ORDER BY n.id FOR NO KEY UPDATE OF n),
		     u AS (
			UPDATE nodes n SET last_seen_at = now() FROM l WHERE n.id = l.id
			RETURNING n.id)
		SELECT s.id, s.epoch FROM s LEFT JOIN nodes n ON n.id = s.id
		 WHERE n.session_epoch IS DISTINCT FROM s.epoch`, ids, epochs, seen)
	if err != nil {
		return nil, fmt.Errorf("liveness: %w", err)
	}
	stale, err := pgx.CollectRows(rows, pgx.RowToStructByPos[SessionRef])
	if err != nil {
		return nil, fmt.Errorf("liveness: %w", err)
	}
	return stale, nil
}

// Observation is one session's report of how far its node converged.
type Observation struct {
	NodeID string
	// Epoch is the reporting session's: a superseded session's report is
	// not stored.
	Epoch int64
	// Generation is the generation the node says it has applied.
	Generation int64
	// SectionStatus is the report's per-section status, a JSON array of
	// [SectionStatus].
	SectionStatus json.RawMessage
}

// Observed is what [RecordObserved] did with one observation.
type Observed struct {
	// Stored is false for a superseded session's report: nothing was
	// written and the other fields are zero.
	Stored   bool
	TenantID string
	// Generation and ObservedGeneration are the node's after the write.
	Generation         int64
	ObservedGeneration int64
	// PoolID is the node's pool.
	PoolID string
	// PrevDrifted: the section status this report replaced had a section
	// reported drifted (a reason starting [DriftedReasonPrefix]), so the
	// node's Drifted condition may clear now.
	PrevDrifted bool
	// UpgradeFailed is the node's UpgradeFailed reason after the write
	// ("" when it does not hold); NewUpgradeFailed says this report set
	// it (it did not hold before).
	UpgradeFailed    string
	NewUpgradeFailed bool
}

// UpgradeFailedPrefix starts the reason of an agent section that reports
// a latched failed upgrade (FAILED_TERMINAL): bcd keeps the latch until
// nodes.clearUpgrade, and the node's UpgradeFailed condition holds as long
// as its report says so.
const UpgradeFailedPrefix = "UpgradeFailed:"

// maxUpgradeFailed bounds the stored UpgradeFailed reason.
const maxUpgradeFailed = 1024

// RecordObserved stores a batch of convergence reports in one statement and
// returns what it did with each, in order. The node keeps the highest
// observed generation ever reported, so a late or replayed report never
// lowers it, capped at the node's stored generation: a node reporting a
// generation it was never sent (2^62, say) would otherwise never be sent a
// later one, and its bookings would count as bound. Its section status
// becomes the report's. A report whose epoch
// is no longer its node's (a superseded session's) changes nothing. Several
// reports of one session in a batch count as their highest generation with
// the last one's section status, and each sees the node as the batch left
// it. The node's UpgradeFailed condition (nodes.upgrade_failed) follows
// the report: its agent section's reason while that is FAILED_TERMINAL
// starting [UpgradeFailedPrefix], "" otherwise.
//
// The nodes are locked in id order, as writers of several nodes in one
// transaction must lock them, so two batches never deadlock on each other.
func RecordObserved(ctx context.Context, q Querier, obs []Observation) ([]Observed, error) {
	out := make([]Observed, len(obs))
	if len(obs) == 0 {
		return out, nil
	}
	ids := make([]string, len(obs))
	epochs := make([]int64, len(obs))
	gens := make([]int64, len(obs))
	status := make([]string, len(obs))
	for i, o := range obs {
		ids[i], epochs[i], gens[i], status[i] = o.NodeID, o.Epoch, o.Generation, string(o.SectionStatus)
		if len(o.SectionStatus) == 0 {
			status[i] = "[]"
		}
	}
	// v folds the reports of one session into one row (UPDATE … FROM
	// would apply only one of them, chosen arbitrarily); l takes the locks
	// in id order (a locking CTE is evaluated once, before the update that
	// joins it).
	rows, err := q.Query(ctx, `
		WITH s AS (
			SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::text[]) WITH ORDINALITY AS s(id, epoch, observed, status, ord)),
		v AS (
			SELECT DISTINCT ON (id, epoch) id, epoch, max(observed) OVER (PARTITION BY id, epoch) AS observed, status,
			       coalesce((SELECT left(x->>'reason', $8) FROM jsonb_array_elements(CASE WHEN jsonb_typeof(status::jsonb) = 'array' THEN status::jsonb ELSE '[]' END) x
			          WHERE x->>'section' = 'agent' AND x->>'state' = $6 AND starts_with(x->>'reason', $7) LIMIT 1), '') AS upgrade_failed
			  FROM s ORDER BY id, epoch, ord DESC),
		l AS MATERIALIZED (
			SELECT n.id, coalesce(jsonb_path_exists(n.section_status, '$[*] ? (@.reason starts with $p)', jsonb_build_object('p', $5::text)), false) AS drifted,
			       n.upgrade_failed AS prev_upgrade_failed
			  FROM nodes n JOIN v ON v.id = n.id AND v.epoch = n.session_epoch
			 ORDER BY n.id FOR NO KEY UPDATE OF n),
		u AS (
			UPDATE nodes n SET observed_generation = least(greatest(n.observed_generation, v.observed), n.generation), section_status = v.status::jsonb,
			       upgrade_failed = v.upgrade_failed,
			       upgrade_failed_at = CASE WHEN v.upgrade_failed = '' THEN NULL ELSE coalesce(n.upgrade_failed_at, now()) END,
			       updated_at = now()
			  FROM v JOIN l ON l.id = v.id
			 WHERE n.id = v.id AND n.session_epoch = v.epoch
			RETURNING n.id, n.session_epoch, n.tenant_id, n.generation, n.observed_generation, n.pool_id, l.drifted,
			          n.upgrade_failed, l.prev_upgrade_failed = '' AND n.upgrade_failed <> '' AS new_upgrade_failed)
		SELECT s.ord, u.tenant_id, u.generation, u.observed_generation, u.pool_id, u.drifted, u.upgrade_failed, u.new_upgrade_failed
		  FROM s JOIN u ON u.id = s.id AND u.session_epoch = s.epoch`, ids, epochs, gens, status, DriftedReasonPrefix,
		SectionFailedTerminal, UpgradeFailedPrefix, maxUpgradeFailed)
	if err != nil {
		return nil, fmt.Errorf("store observed generations: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var ord int64
		var o Observed
		if err := rows.Scan(&ord, &o.TenantID, &o.Generation, &o.ObservedGeneration, &o.PoolID, &o.PrevDrifted, &o.UpgradeFailed, &o.NewUpgradeFailed); err != nil {
			return nil, fmt.Errorf("store observed generations: %w", err)
		}
		o.Stored = true
		out[ord-1] = o
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("store observed generations: %w", err)
	}
	return out, nil
}

// SetLabels replaces the labels of node id of tenant; a node of another
// tenant, or none, is left alone. The caller invalidates the node's desired
// state in the same transaction (its identity section carries the labels).
func SetLabels(ctx context.Context, q Querier, tenant, id string, labels map[string]string) error {
	if labels == nil {
		labels = map[string]string{}
	}
	if _, err := q.Exec(ctx, `UPDATE nodes SET labels = $3, updated_at = now() WHERE tenant_id = $1 AND id = $2`,
		tenant, id, labels); err != nil {
		return fmt.Errorf("update node %s: %w", id, err)
	}
	return nil
}

// SetHostname records the hostname node id's inventory reported.
func SetHostname(ctx context.Context, q Querier, id, hostname string) error {
	if _, err := q.Exec(ctx, `UPDATE nodes SET hostname = $2 WHERE id = $1`, id, hostname); err != nil {
		return fmt.Errorf("set hostname of node %s: %w", id, err)
	}
	return nil
}

// SetState sets node id's state and conditions: what the inventory
// controller concluded from its latest report.
func SetState(ctx context.Context, q Querier, id, state string, conditions []Condition) error {
	b, err := json.Marshal(conditions)
	if err != nil {
		return err
	}
	if _, err := q.Exec(ctx, `UPDATE nodes SET conditions = $2, state = $3, updated_at = now() WHERE id = $1`, id, b, state); err != nil {
		return fmt.Errorf("update node %s: %w", id, err)
	}
	return nil
}

// SetSpecError records why node id's desired state could not be computed,
// leaving its spec and generation alone; a node that already says so is not
// written (its updated_at stays).
func SetSpecError(ctx context.Context, q Querier, id, msg string) error {
	if _, err := q.Exec(ctx, `UPDATE nodes SET spec_error = $2, updated_at = now()
		WHERE id = $1 AND spec_error IS DISTINCT FROM $2`, id, msg); err != nil {
		return fmt.Errorf("set spec error of node %s: %w", id, err)
	}
	return nil
}

// ClearSpecError clears node id's spec error: its stored spec is current
// again.
func ClearSpecError(ctx context.Context, q Querier, id string) error {
	if _, err := q.Exec(ctx, `UPDATE nodes SET spec_error = NULL, updated_at = now() WHERE id = $1`, id); err != nil {
		return fmt.Errorf("clear spec error of node %s: %w", id, err)
	}
	return nil
}

// NextCommandSeq takes node id's next command sequence number
// (nodes.next_cmd_seq, incremented in the same statement, so the node stays
// locked until q's transaction ends and no two commands share a number) and
// returns it with the node's tenant. It wraps [pgx.ErrNoRows] when there is
// no node id.
func NextCommandSeq(ctx context.Context, q Querier, id string) (seq int64, tenant string, err error) {
	err = q.QueryRow(ctx, `UPDATE nodes SET next_cmd_seq = next_cmd_seq + 1 WHERE id = $1 RETURNING next_cmd_seq - 1, tenant_id`,
		id).Scan(&seq, &tenant)
	if err != nil {
		return 0, "", fmt.Errorf("next command seq of node %s: %w", id, err)
	}
	return seq, tenant, nil
}
