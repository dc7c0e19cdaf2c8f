// Package rollouts stores rollouts (tables rollouts and rollout_nodes): a
// change of a pool's settings that the rollout job (services/lifecycle)
// rolls out to the pool's nodes in batches, and each node's place and state
// in it. See docs/rollouts.md.
//
// While a rollout is progressing or paused, the nodespec controller's pool
// part and the capacity.mig contributor read [Layers]: a node of a
// released batch gets the rollout's sections (and MIG layouts) instead of
// the pool's. A rollout with a selector that succeeded stays the layer of
// every node it planned (the pool's settings never change), until a later
// pool-wide rollout of the same section succeeds or it is rolled back.
// Nothing else of a node's desired state depends on a rollout.
package rollouts

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/miglayouts"
)

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Kind is the rollout job's kind in the work queue; its keys are pool ids.
const Kind = "rollout"

// A rollout's states.
const (
	Pending     = "pending"
	Progressing = "progressing"
	Paused      = "paused"
	Succeeded   = "succeeded"
	Failed      = "failed"
	Cancelled   = "cancelled"
	RolledBack  = "rolled-back"
)

// Active are the states of a pool's one active rollout.
var Active = []string{Pending, Progressing, Paused}

// A node's states in a rollout.
const (
	NodeWaiting  = "waiting"
	NodeUpdating = "updating"
	NodeHealthy  = "healthy"
	NodeFailed   = "failed"
	NodeSkipped  = "skipped"
)

// Sections a change may name: the pool settings the rollout layer applies
// (site, health, runtime, agent) and the pool's MIG layouts (mig).
var Sections = []string{"site", "health", "runtime", "mig", "agent"}

// Change is a pool settings patch: the sections Mask names, each the
// proto3 JSON of its NodeSpec section ('{}' clears it), and the pool's MIG
// layouts when Mask names "mig".
type Change struct {
	Mask    []string        `json:"mask"`
	Site    json.RawMessage `json:"site,omitempty"`
	Health  json.RawMessage `json:"health,omitempty"`
	Runtime json.RawMessage `json:"runtime,omitempty"`
	Mig     *Mig            `json:"mig,omitempty"`
	// Agent is the NodeSpec agent section (its signed release manifest);
	// AgentVersion the manifest's version, which a node's Hello must
	// report before it counts healthy.
	Agent        json.RawMessage `json:"agent,omitempty"`
	AgentVersion string          `json:"agentVersion,omitempty"`
}

// Mig is a change's MIG layouts: the pool's, whole (empty clears them).
type Mig struct {
	Layouts []miglayouts.Layout `json:"layouts"`
}

// Names reports whether the change's mask names section.
func (c Change) Names(section string) bool { return slices.Contains(c.Mask, section) }

// Without returns c without the sections of drop (mask and content);
// every section field is dropped by its JSON name, so a section added to
// Change needs nothing here.
func (c Change) Without(drop []string) Change {
	if !slices.ContainsFunc(c.Mask, func(sec string) bool { return slices.Contains(drop, sec) }) {
		return c
	}
	b, err := json.Marshal(c)
	if err != nil {
		return Change{}
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(b, &fields); err != nil {
		return Change{}
	}
	for _, sec := range drop {
		delete(fields, sec)
	}
	mask := slices.DeleteFunc(slices.Clone(c.Mask), func(sec string) bool { return slices.Contains(drop, sec) })
	fields["mask"], _ = json.Marshal(mask)
	b, _ = json.Marshal(fields)
	var out Change
	if err := json.Unmarshal(b, &out); err != nil {
		return Change{}
	}
	return out
}

// Gate is a command each released node must pass before it counts
// healthy: Command ("diag.nvml") at Level, within TimeoutMs of being
// queued.
type Gate struct {
	Command   string `json:"command"`
	Level     string `json:"level,omitempty"`
	TimeoutMs int64  `json:"timeoutMs"`
}

// Timeout is the gate's deadline from when it is queued.
func (g Gate) Timeout() time.Duration { return time.Duration(g.TimeoutMs) * time.Millisecond }

// Section returns the change's section name (nil when the mask does not name it).
func (c Change) Section(name string) json.RawMessage {
	switch name {
	case "site":
		return c.Site
	case "health":
		return c.Health
	case "runtime":
		return c.Runtime
	case "agent":
		return c.Agent
	}
	return nil
}

// BatchSize is one batch: Percent of the rollout's nodes (rounded up) or
// Count nodes.
type BatchSize struct {
	Percent int `json:"percent,omitempty"`
	Count   int `json:"count,omitempty"`
}

// Strategy is how the nodes are cut into batches and how fast they go.
type Strategy struct {
	Batches []BatchSize `json:"batches"`
	// BakeMs is how long a converged batch stays healthy before the next.
	BakeMs int64 `json:"bakeMs"`
	// MaxUnavailable bounds the pool's unavailable nodes; 0 is no bound.
	MaxUnavailable int `json:"maxUnavailable"`
}

// Bake is the strategy's bake as a duration.
func (s Strategy) Bake() time.Duration { return time.Duration(s.BakeMs) * time.Millisecond }

// Threshold is a number of nodes: Percent of the counted nodes (rounded
// up) or Count.
type Threshold struct {
	Percent int
	Count   int
}

// Of returns the threshold as a number of nodes out of total.
func (t Threshold) Of(total int) int {
	if t.Percent > 0 {
		return (total*t.Percent + 99) / 100
	}
	return t.Count
}

// Rollout is one rollout.
type Rollout struct {
	ID, TenantID, PoolID string
	State                string
	Selector             map[string]string
	Change               Change
	// Previous is the pool's sections the change names, as they were when
	// the rollout was made.
	Previous         Change
	Strategy         Strategy
	Gates            []Gate
	Success, Failure Threshold
	CurrentBatch     int
	BatchReleasedAt  *time.Time
	BatchConvergedAt *time.Time
	Message          string
	CreatedAt        time.Time
	UpdatedAt        time.Time
}

const cols = `id, tenant_id, pool_id, state, selector, change, previous, strategy, gates,
	success_percent, success_count, failure_percent, failure_count, current_batch,
	batch_released_at, batch_converged_at, message, created_at, updated_at`

func scan(row pgx.Row) (Rollout, error) {
	var r Rollout
	var selector, change, previous, strategy, gates []byte
	err := row.Scan(&r.ID, &r.TenantID, &r.PoolID, &r.State, &selector, &change, &previous, &strategy, &gates,
		&r.Success.Percent, &r.Success.Count, &r.Failure.Percent, &r.Failure.Count, &r.CurrentBatch,
		&r.BatchReleasedAt, &r.BatchConvergedAt, &r.Message, &r.CreatedAt, &r.UpdatedAt)
	if err != nil {
		return Rollout{}, err
	}
	for _, f := range []struct {
		b  []byte
		to any
	}{{selector, &r.Selector}, {change, &r.Change}, {previous, &r.Previous}, {strategy, &r.Strategy}, {gates, &r.Gates}} {
		if err := json.Unmarshal(f.b, f.to); err != nil {
			return Rollout{}, fmt.Errorf("rollout %s: %w", r.ID, err)
		}
	}
	return r, nil
}

func collect(rows pgx.Rows, err error) ([]Rollout, error) {
	if err != nil {
		return nil, fmt.Errorf("read rollouts: %w", err)
	}
	defer rows.Close()
	var out []Rollout
	for rows.Next() {
		r, err := scan(rows)
		if err != nil {
			return nil, fmt.Errorf("read rollouts: %w", err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read rollouts: %w", err)
	}
	return out, nil
}

// Create stores r, pending, with the pool's current sections its change
// names as Previous (the pool's MIG layouts are the caller's
// r.Previous.Mig, read in the same transaction). A pool with an active
// rollout is CONFLICT on poolId naming it.
func Create(ctx context.Context, q Querier, r Rollout) (Rollout, error) {
	if r.Selector == nil {
		r.Selector = map[string]string{}
	}
	if r.Change.Mask == nil {
		r.Change.Mask = []string{}
	}
	selector, _ := json.Marshal(r.Selector)
	change, err := json.Marshal(r.Change)
	if err != nil {
		return Rollout{}, fmt.Errorf("encode change: %w", err)
	}
	strategy, err := json.Marshal(r.Strategy)
	if err != nil {
		return Rollout{}, fmt.Errorf("encode strategy: %w", err)
	}
	if r.Gates == nil {
		r.Gates = []Gate{}
	}
	gates, _ := json.Marshal(r.Gates)
	prevMig := []byte("null")
	if r.Change.Names("mig") {
		if r.Previous.Mig == nil {
			r.Previous.Mig = &Mig{}
		}
		if r.Previous.Mig.Layouts == nil {
			r.Previous.Mig.Layouts = []miglayouts.Layout{}
		}
		prevMig, _ = json.Marshal(r.Previous.Mig)
	}
	if r.Failure == (Threshold{}) {
		r.Failure.Count = 1
	}
	var active string
	err = q.QueryRow(ctx, `SELECT id FROM rollouts WHERE pool_id = $1 AND state = ANY($2) FOR UPDATE`, r.PoolID, Active).Scan(&active)
	if err == nil {
		return Rollout{}, fault.New(fault.Conflict, "poolId", "pool %s has an active rollout %s: pause, cancel or wait for it", r.PoolID, active)
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return Rollout{}, fmt.Errorf("read active rollout: %w", err)
	}
	out, err := scan(q.QueryRow(ctx, `
		INSERT INTO rollouts (id, tenant_id, pool_id, selector, change, previous, strategy,
			success_percent, success_count, failure_percent, failure_count, gates)
		SELECT $1, $2, p.id, $4, $5,
			jsonb_build_object('mask', $5::jsonb->'mask')
			  || CASE WHEN $5::jsonb->'mask' ? 'site' THEN jsonb_build_object('site', p.site) ELSE '{}' END
			  || CASE WHEN $5::jsonb->'mask' ? 'health' THEN jsonb_build_object('health', p.health) ELSE '{}' END
			  || CASE WHEN $5::jsonb->'mask' ? 'runtime' THEN jsonb_build_object('runtime', p.runtime) ELSE '{}' END
			  || CASE WHEN $5::jsonb->'mask' ? 'mig' THEN jsonb_build_object('mig', $12::jsonb) ELSE '{}' END
			  || CASE WHEN $5::jsonb->'mask' ? 'agent' THEN jsonb_build_object('agent', p.agent) ELSE '{}' END,
			$6, $7, $8, $9, $10, $11
		FROM pools p WHERE p.id = $3 AND p.tenant_id = $2
		RETURNING `+cols,
		r.ID, r.TenantID, r.PoolID, selector, change, strategy,
		r.Success.Percent, r.Success.Count, r.Failure.Percent, r.Failure.Count, gates, prevMig))
	var pe *pgconn.PgError
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return Rollout{}, fault.New(fault.NotFound, "poolId", "pool %q not found in tenant %s", r.PoolID, r.TenantID)
	case errors.As(err, &pe) && pe.Code == "23505":
		return Rollout{}, fault.New(fault.Conflict, "poolId", "pool %s has an active rollout", r.PoolID)
	case err != nil:
		return Rollout{}, fmt.Errorf("create rollout: %w", err)
	}
	return out, nil
}

// Get reads rollout id of tenant.
func Get(ctx context.Context, q Querier, tenant, id string) (Rollout, error) {
	r, err := scan(q.QueryRow(ctx, `SELECT `+cols+` FROM rollouts WHERE tenant_id = $1 AND id = $2`, tenant, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Rollout{}, fault.New(fault.NotFound, "rolloutId", "rollout %q not found in tenant %s", id, tenant)
	}
	if err != nil {
		return Rollout{}, fmt.Errorf("read rollout %s: %w", id, err)
	}
	return r, nil
}

// List returns tenant's rollouts (of pool, when not empty) in id order
// after after, at most limit.
func List(ctx context.Context, q Querier, tenant, pool, after string, limit int) ([]Rollout, error) {
	return collect(q.Query(ctx, `SELECT `+cols+` FROM rollouts
		WHERE tenant_id = $1 AND ($2 = '' OR pool_id = $2) AND id > $3 ORDER BY id LIMIT $4`, tenant, pool, after, limit))
}

// Later returns a rollout of r's pool made after r, if any.
func Later(ctx context.Context, q Querier, r Rollout) (string, bool, error) {
	var id string
	err := q.QueryRow(ctx, `SELECT id FROM rollouts WHERE pool_id = $1 AND id <> $2 AND created_at >= $3
		ORDER BY created_at DESC LIMIT 1`, r.PoolID, r.ID, r.CreatedAt).Scan(&id)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", false, nil
	}
	if err != nil {
		return "", false, fmt.Errorf("rollouts after %s: %w", r.ID, err)
	}
	return id, true, nil
}

// ActiveOf returns pool's active rollout locked FOR UPDATE until q's
// transaction ends; ok is false when it has none.
func ActiveOf(ctx context.Context, q Querier, pool string) (Rollout, bool, error) {
	r, err := scan(q.QueryRow(ctx, `SELECT `+cols+` FROM rollouts WHERE pool_id = $1 AND state = ANY($2) FOR UPDATE`, pool, Active))
	if errors.Is(err, pgx.ErrNoRows) {
		return Rollout{}, false, nil
	}
	if err != nil {
		return Rollout{}, false, fmt.Errorf("read active rollout of %s: %w", pool, err)
	}
	return r, true, nil
}

// ActivePools returns every pool with an active rollout (the job's resync).
func ActivePools(ctx context.Context, q Querier) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT pool_id FROM rollouts WHERE state = ANY($1)`, Active)
	if err != nil {
		return nil, fmt.Errorf("pools with a rollout: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("pools with a rollout: %w", err)
	}
	return ids, nil
}

// Transition moves rollout id of tenant from one of from to state with
// message, and returns it; in any other state it is CONFLICT on rolloutId.
func Transition(ctx context.Context, q Querier, tenant, id string, from []string, state, message string) (Rollout, error) {
	r, err := scan(q.QueryRow(ctx, `UPDATE rollouts SET state = $4, message = $5, updated_at = now()
		WHERE tenant_id = $1 AND id = $2 AND state = ANY($3) RETURNING `+cols, tenant, id, from, state, message))
	if errors.Is(err, pgx.ErrNoRows) {
		cur, gerr := Get(ctx, q, tenant, id)
		if gerr != nil {
			return Rollout{}, gerr
		}
		return Rollout{}, fault.New(fault.Conflict, "rolloutId", "rollout %s is %s; expected %v", id, cur.State, from)
	}
	if err != nil {
		return Rollout{}, fmt.Errorf("update rollout %s: %w", id, err)
	}
	return r, nil
}

// Progress stores the job's bookkeeping of r: its state, message, current
// batch and the batch's release and convergence times.
func Progress(ctx context.Context, q Querier, r Rollout) error {
	_, err := q.Exec(ctx, `UPDATE rollouts SET state = $2, message = $3, current_batch = $4,
		batch_released_at = $5, batch_converged_at = $6, updated_at = now() WHERE id = $1`,
		r.ID, r.State, r.Message, r.CurrentBatch, r.BatchReleasedAt, r.BatchConvergedAt)
	if err != nil {
		return fmt.Errorf("update rollout %s: %w", r.ID, err)
	}
	return nil
}

// Candidate is a node a rollout may go to, with its failure domains.
type Candidate struct {
	ID, Gateway, Rack, Zone string
}

// Candidates returns the pool's nodes past adoption and not retired that
// carry every label of selector, in id order.
func Candidates(ctx context.Context, q Querier, pool string, selector map[string]string) ([]Candidate, error) {
	sel, _ := json.Marshal(selector)
	if selector == nil {
		sel = []byte("{}")
	}
	rows, err := q.Query(ctx, `SELECT id, gateway_id, coalesce(labels->>'rack', ''), coalesce(labels->>'zone', '')
		FROM nodes WHERE pool_id = $1 AND state NOT IN ('adopting', 'retired') AND labels @> $2::jsonb ORDER BY id`, pool, sel)
	if err != nil {
		return nil, fmt.Errorf("rollout candidates of %s: %w", pool, err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Candidate])
	if err != nil {
		return nil, fmt.Errorf("rollout candidates of %s: %w", pool, err)
	}
	return out, nil
}

// Planned is a node's batch in a rollout's plan.
type Planned struct {
	NodeID string
	Batch  int
}

// Plan writes rollout's plan (every node waiting) in one statement.
func Plan(ctx context.Context, q Querier, rollout string, plan []Planned) error {
	ids := make([]string, len(plan))
	batches := make([]int32, len(plan))
	for i, p := range plan {
		ids[i], batches[i] = p.NodeID, int32(p.Batch)
	}
	_, err := q.Exec(ctx, `INSERT INTO rollout_nodes (rollout_id, node_id, batch)
		SELECT $1, u.id, u.batch FROM unnest($2::text[], $3::int[]) AS u(id, batch)
		ON CONFLICT DO NOTHING`, rollout, ids, batches)
	if err != nil {
		return fmt.Errorf("plan rollout %s: %w", rollout, err)
	}
	return nil
}

// NodeStatus is a planned node's state in its rollout and its health now.
type NodeStatus struct {
	NodeID string
	Batch  int
	State  string
	Acked  bool
	Reason string
	// HasContent: the node's desired state holds the rollout's site, health
	// and runtime sections and it reported that generation, every section
	// converged (a change of MIG layouts the job checks itself: the mig
	// section is their placement).
	HasContent bool
	// Generation is the node's desired-state generation now.
	Generation int64
	// Gate is how the node's gate commands stand: "" (none queued),
	// "running", "passed", or why one did not pass.
	Gate string
	// Unhealthy says why the node is not healthy now ("" when it is): Ready
	// not True, GPUsHealthy false, NeedsRepair, a GPU quarantined, a failed
	// section, a state other than adopted, or — once released — a
	// remediation started since its release (a fault the health job found
	// and repaired between two runs of the job still counts).
	Unhealthy string
	// Unavailable: drained or draining, a GPU quarantined, lost, or
	// remediating.
	Unavailable bool
}

// Nodes returns the planned nodes of rollout r with their health, in batch
// and id order, in one statement.
func Nodes(ctx context.Context, q Querier, r Rollout) ([]NodeStatus, error) {
	change, _ := json.Marshal(r.Change)
	rows, err := q.Query(ctx, `
		SELECT rn.node_id, rn.batch, rn.state, rn.acked, rn.reason,
			n.observed_generation >= n.generation AND n.generation > 0
			  -- section_status is an array of {section, state, reason,
			  -- generation}, state the proto enum's name.
			  AND NOT jsonb_path_exists(n.section_status, '$[*] ? (@.state != "SECTION_STATE_CONVERGED")')
			  AND (NOT $2::jsonb->'mask' ? 'site' OR coalesce(n.spec->'site', '{}') = $2::jsonb->'site')
			  AND (NOT $2::jsonb->'mask' ? 'health' OR coalesce(n.spec->'health', '{}') = $2::jsonb->'health')
			  AND (NOT $2::jsonb->'mask' ? 'runtime' OR coalesce(n.spec->'runtime', '{}') = $2::jsonb->'runtime')
			  -- An upgrade: the agent section converged and the Hello
			  -- reports the manifest's version.
			  AND (NOT $2::jsonb->'mask' ? 'agent' OR (coalesce(n.spec->'agent', '{}') = $2::jsonb->'agent'
			    AND ($2::jsonb->>'agentVersion' IS NULL OR n.agent_version = $2::jsonb->>'agentVersion')
			    AND ($2::jsonb->'agent' = '{}' OR jsonb_path_exists(n.section_status,
			      '$[*] ? (@.section == "agent" && @.state == "SECTION_STATE_CONVERGED")')))),
			n.generation,
			CASE WHEN cardinality(rn.gate_commands) = 0 THEN ''
			  ELSE coalesce((SELECT 'gate ' || c.kind || ' (' || c.id || ') ' || c.state || ': ' || c.reason FROM commands c
			      WHERE c.node_id = rn.node_id AND c.id = ANY(rn.gate_commands) AND c.state IN ('failed', 'expired', 'cancelled')
			      ORDER BY c.id LIMIT 1),
			    CASE WHEN (SELECT count(*) FROM commands c WHERE c.node_id = rn.node_id AND c.id = ANY(rn.gate_commands)
			      AND c.state = 'succeeded') = cardinality(rn.gate_commands) THEN 'passed' ELSE 'running' END) END,
			CASE
			  WHEN n.state <> 'adopted' THEN 'node is ' || n.state
			  WHEN n.ready <> 'True' THEN 'Ready is ' || n.ready
			  WHEN n.needs_repair THEN 'NeedsRepair: ' || n.needs_repair_reason
			  WHEN n.upgrade_failed <> '' THEN n.upgrade_failed
			  WHEN n.conditions @> '[{"type": "GPUsHealthy", "status": false}]' THEN 'GPUsHealthy is False'
			  WHEN EXISTS (SELECT 1 FROM devices d WHERE d.node_id = n.id AND d.quarantined_at IS NOT NULL) THEN 'a GPU is quarantined'
			  WHEN jsonb_path_exists(n.section_status, '$[*] ? (@.state like_regex "^SECTION_STATE_FAILED")')
			    THEN 'a section failed: ' || (SELECT s->>'section' || ' ' || coalesce(s->>'reason', '') FROM jsonb_array_elements(
			      CASE WHEN jsonb_typeof(n.section_status) = 'array' THEN n.section_status ELSE '[]' END) s
			      WHERE s->>'state' LIKE 'SECTION_STATE_FAILED%' LIMIT 1)
			  WHEN rn.released_at IS NOT NULL AND EXISTS (SELECT 1 FROM remediations m
			    WHERE m.node_id = n.id AND m.started_at >= rn.released_at) THEN 'remediated since its change'
			  ELSE '' END,
			n.state IN ('draining', 'drained') OR n.ready = 'Lost'
			  OR EXISTS (SELECT 1 FROM devices d WHERE d.node_id = n.id AND d.quarantined_at IS NOT NULL)
			  OR EXISTS (SELECT 1 FROM remediations m WHERE m.node_id = n.id AND m.state = 'running')
		FROM rollout_nodes rn JOIN nodes n ON n.id = rn.node_id
		WHERE rn.rollout_id = $1 ORDER BY rn.batch, rn.node_id`, r.ID, change)
	if err != nil {
		return nil, fmt.Errorf("nodes of rollout %s: %w", r.ID, err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[NodeStatus])
	if err != nil {
		return nil, fmt.Errorf("nodes of rollout %s: %w", r.ID, err)
	}
	return out, nil
}

// UnavailableOutside counts the pool's nodes not planned in rollout that
// are unavailable: drained or draining, with a GPU quarantined, lost, or
// remediating (the planned ones the job counts itself).
func UnavailableOutside(ctx context.Context, q Querier, pool, rollout string) (int, error) {
	var n int
	err := q.QueryRow(ctx, `SELECT count(*) FROM nodes n
		WHERE n.pool_id = $1 AND n.state NOT IN ('adopting', 'retired')
		  AND NOT EXISTS (SELECT 1 FROM rollout_nodes rn WHERE rn.rollout_id = $2 AND rn.node_id = n.id)
		  AND (n.state IN ('draining', 'drained') OR n.ready = 'Lost'
		    OR EXISTS (SELECT 1 FROM devices d WHERE d.node_id = n.id AND d.quarantined_at IS NOT NULL)
		    OR EXISTS (SELECT 1 FROM remediations m WHERE m.node_id = n.id AND m.state = 'running'))`, pool, rollout).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("unavailable nodes of %s: %w", pool, err)
	}
	return n, nil
}

// SetNodes moves nodes of rollout to state with reason, in one statement.
// Moving to updating stamps the release.
func SetNodes(ctx context.Context, q Querier, rollout string, nodes []string, state, reason string) error {
	if len(nodes) == 0 {
		return nil
	}
	_, err := q.Exec(ctx, `UPDATE rollout_nodes SET state = $3, reason = $4,
		released_at = CASE WHEN $3 = 'updating' THEN now() ELSE released_at END
		WHERE rollout_id = $1 AND node_id = ANY($2)`, rollout, nodes, state, reason)
	if err != nil {
		return fmt.Errorf("set the state of rollout %s's nodes: %w", rollout, err)
	}
	return nil
}

// SetGateCommands records the gate commands queued for node in rollout.
func SetGateCommands(ctx context.Context, q Querier, rollout, node string, commands []string) error {
	_, err := q.Exec(ctx, `UPDATE rollout_nodes SET gate_commands = $3 WHERE rollout_id = $1 AND node_id = $2`, rollout, node, commands)
	if err != nil {
		return fmt.Errorf("record the gates of %s in rollout %s: %w", node, rollout, err)
	}
	return nil
}

// AckFailures acknowledges rollout's failed nodes: they no longer count
// towards its failure threshold.
func AckFailures(ctx context.Context, q Querier, rollout string) error {
	_, err := q.Exec(ctx, `UPDATE rollout_nodes SET acked = true WHERE rollout_id = $1 AND state = 'failed'`, rollout)
	if err != nil {
		return fmt.Errorf("acknowledge failures of rollout %s: %w", rollout, err)
	}
	return nil
}

// Touched returns the nodes of rollout whose batch was released (they had
// the new content), in id order.
func Touched(ctx context.Context, q Querier, rollout string) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT node_id FROM rollout_nodes
		WHERE rollout_id = $1 AND state IN ('updating', 'healthy', 'failed') ORDER BY node_id`, rollout)
	if err != nil {
		return nil, fmt.Errorf("touched nodes of rollout %s: %w", rollout, err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("touched nodes of rollout %s: %w", rollout, err)
	}
	return ids, nil
}

// Layers returns, for those of nodes that have any, the rollout changes
// that replace their pool's sections, oldest first (a later one wins per
// section): the change of a progressing or paused rollout for the nodes of
// its released batches, and the change of a succeeded rollout with a
// selector for every node it planned, less the sections a later pool-wide
// rollout of the pool that succeeded names (its change is the pool's
// settings now). One statement.
func Layers(ctx context.Context, q Querier, nodes []string) (map[string][]Change, error) {
	memo, _ := ctx.Value(layersKey{}).(*layersMemo)
	key := strings.Join(nodes, ",")
	if memo != nil {
		if m, ok := memo.byNodes[key]; ok {
			return m, nil
		}
	}
	out, err := layers(ctx, q, nodes)
	if err == nil && memo != nil {
		memo.byNodes[key] = out
	}
	return out, err
}

// layersKey holds a *layersMemo in a context.
type layersKey struct{}

// layersMemo keeps Layers' answers for one computation of a batch of
// nodes' desired state, where two contributors (the pool's sections and
// capacity.mig) ask for the same nodes in the same transaction.
type layersMemo struct {
	byNodes map[string]map[string][]Change
}

// WithLayersMemo returns ctx in which Layers answers a second call for
// the same nodes from the first: for one desired-state computation (one
// transaction), never across them. The maps returned are shared: callers
// only read them.
func WithLayersMemo(ctx context.Context) context.Context {
	return context.WithValue(ctx, layersKey{}, &layersMemo{byNodes: map[string]map[string][]Change{}})
}

func layers(ctx context.Context, q Querier, nodes []string) (map[string][]Change, error) {
	rows, err := q.Query(ctx, `SELECT rn.node_id, r.change,
			CASE WHEN r.state = 'succeeded' THEN coalesce((SELECT jsonb_agg(DISTINCT m) FROM rollouts l,
			    jsonb_array_elements_text(l.change->'mask') m
			  WHERE l.pool_id = r.pool_id AND l.state = 'succeeded' AND l.selector = '{}'
			    AND (l.created_at, l.id) > (r.created_at, r.id)), '[]') ELSE '[]' END
		FROM rollout_nodes rn JOIN rollouts r ON r.id = rn.rollout_id
		WHERE rn.node_id = ANY($1) AND (
		  (r.state IN ('progressing', 'paused') AND rn.state IN ('updating', 'healthy', 'failed'))
		  OR (r.state = 'succeeded' AND r.selector <> '{}'))
		ORDER BY rn.node_id, r.created_at, r.id`, nodes)
	if err != nil {
		return nil, fmt.Errorf("rollout layers: %w", err)
	}
	defer rows.Close()
	out := map[string][]Change{}
	for rows.Next() {
		var id string
		var b, superseded []byte
		if err := rows.Scan(&id, &b, &superseded); err != nil {
			return nil, fmt.Errorf("rollout layers: %w", err)
		}
		var c Change
		var drop []string
		if err := json.Unmarshal(b, &c); err != nil {
			return nil, fmt.Errorf("rollout layer of %s: %w", id, err)
		}
		if err := json.Unmarshal(superseded, &drop); err != nil {
			return nil, fmt.Errorf("rollout layer of %s: %w", id, err)
		}
		if c = c.Without(drop); len(c.Mask) > 0 {
			out[id] = append(out[id], c)
		}
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("rollout layers: %w", err)
	}
	return out, nil
}

// PlanOf returns every node of rollout's plan, in id order.
func PlanOf(ctx context.Context, q Querier, rollout string) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT node_id FROM rollout_nodes WHERE rollout_id = $1 ORDER BY node_id`, rollout)
	if err != nil {
		return nil, fmt.Errorf("nodes of rollout %s: %w", rollout, err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("nodes of rollout %s: %w", rollout, err)
	}
	return ids, nil
}

// Membership is a node's place in its pool's active rollout.
type Membership struct {
	RolloutID string
	Batch     int
	Released  bool
}

// MembershipOf returns node's place in an active rollout; ok is false when
// it is in none.
func MembershipOf(ctx context.Context, q Querier, node string) (Membership, bool, error) {
	var m Membership
	err := q.QueryRow(ctx, `SELECT rn.rollout_id, rn.batch, rn.state <> 'waiting' AND rn.state <> 'skipped'
		FROM rollout_nodes rn JOIN rollouts r ON r.id = rn.rollout_id
		WHERE rn.node_id = $1 AND r.state = ANY($2)`, node, Active).Scan(&m.RolloutID, &m.Batch, &m.Released)
	if errors.Is(err, pgx.ErrNoRows) {
		return Membership{}, false, nil
	}
	if err != nil {
		return Membership{}, false, fmt.Errorf("rollout of node %s: %w", node, err)
	}
	return m, true, nil
}

// Batch is one batch's counts.
type Batch struct {
	Index                                     int
	Nodes, Released, Healthy, Failed, Skipped int
	ReleasedAt                                *time.Time
}

// Batches returns the counts of rollout's batches, in order.
func Batches(ctx context.Context, q Querier, rollout string) ([]Batch, error) {
	rows, err := q.Query(ctx, `SELECT batch, count(*),
			count(*) FILTER (WHERE state IN ('updating', 'healthy', 'failed')),
			count(*) FILTER (WHERE state = 'healthy'), count(*) FILTER (WHERE state = 'failed'),
			count(*) FILTER (WHERE state = 'skipped'), min(released_at)
		FROM rollout_nodes WHERE rollout_id = $1 GROUP BY batch ORDER BY batch`, rollout)
	if err != nil {
		return nil, fmt.Errorf("batches of rollout %s: %w", rollout, err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Batch])
	if err != nil {
		return nil, fmt.Errorf("batches of rollout %s: %w", rollout, err)
	}
	return out, nil
}

// NodesIn returns rollout's nodes in state, in id order.
func NodesIn(ctx context.Context, q Querier, rollout, state string) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT node_id FROM rollout_nodes WHERE rollout_id = $1 AND state = $2 ORDER BY node_id`, rollout, state)
	if err != nil {
		return nil, fmt.Errorf("nodes of rollout %s: %w", rollout, err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("nodes of rollout %s: %w", rollout, err)
	}
	return ids, nil
}
