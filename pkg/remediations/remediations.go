// Package remediations stores the remediation ladder's journal (table
// remediations, migrations 00019 and 00020): one row per step the health
// job takes on a node — gpu.reset, node.reboot, needs_repair — with its
// command, the GPUs it is for, its state and why. The ladder's brakes count
// from these rows: ladders started on a node in a window (its gpu.reset
// rows not cleared by nodes.clearRepair) and steps running per pool.
//
// Finished rows are kept 30 days ([Retention]) and then removed by [Prune],
// which the health job runs periodically.
package remediations

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/pkg/iam"
	"github.com/bettercompute/bettercompute/proto/commandkinds"
)

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Steps of the ladder, in order: the first two are the command kinds they
// queue.
const (
	StepGPUReset    = commandkinds.GPUReset
	StepNodeReboot  = commandkinds.NodeReboot
	StepNeedsRepair = "needs_repair"
)

// States of a step.
const (
	Running   = "running"
	Succeeded = "succeeded"
	Failed    = "failed"
)

// Retention is how long finished rows are kept (the budget's window is 7
// days).
const Retention = 30 * 24 * time.Hour

// MaxReason bounds a step's reason as stored.
const MaxReason = 4096

// Remediation is one step.
type Remediation struct {
	ID         string
	TenantID   string
	NodeID     string
	PoolID     string
	Step       string
	State      string
	CommandID  string
	Devices    []string
	Reason     string
	StartedAt  time.Time
	FinishedAt *time.Time
	ClearedAt  *time.Time
	// Cause is why the ladder runs: [CauseQuarantine] (the default when
	// empty) or [CauseMIG].
	Cause string
}

// Causes of a ladder (remediations.cause, migration 00038).
const (
	// CauseQuarantine: quarantined GPUs (gpu.reset, then node.reboot,
	// then needs_repair).
	CauseQuarantine = "quarantine"
	// CauseMIG: a GPU's MIG mode change waits for a reset (one step:
	// gpu.reset, or node.reboot when the pool's MIG resetPolicy says so).
	CauseMIG = "mig"
)

const cols = `id, tenant_id, node_id, pool_id, step, state, command_id, devices, reason, started_at, finished_at, cleared_at, cause`

func scan(r pgx.Row) (Remediation, error) {
	var m Remediation
	err := r.Scan(&m.ID, &m.TenantID, &m.NodeID, &m.PoolID, &m.Step, &m.State, &m.CommandID, &m.Devices, &m.Reason,
		&m.StartedAt, &m.FinishedAt, &m.ClearedAt, &m.Cause)
	return m, err
}

func cut(s string) string {
	if len(s) > MaxReason {
		return s[:MaxReason]
	}
	return s
}

// Start inserts m as a step started at now: running, or already finished
// when m.State is Succeeded or Failed (a needs_repair step). An empty ID
// gets a new rem_… id.
func Start(ctx context.Context, q Querier, m Remediation, now time.Time) (Remediation, error) {
	if m.ID == "" {
		m.ID = iam.NewID("rem")
	}
	if m.State == "" {
		m.State = Running
	}
	if m.Devices == nil {
		m.Devices = []string{}
	}
	if m.Cause == "" {
		m.Cause = CauseQuarantine
	}
	var finished *time.Time
	if m.State != Running {
		finished = &now
	}
	out, err := scan(q.QueryRow(ctx, `
		INSERT INTO remediations (id, tenant_id, node_id, pool_id, step, state, command_id, devices, reason, started_at, finished_at, cause)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) RETURNING `+cols,
		m.ID, m.TenantID, m.NodeID, m.PoolID, m.Step, m.State, m.CommandID, m.Devices, cut(m.Reason), now, finished, m.Cause))
	if err != nil {
		return Remediation{}, fmt.Errorf("start remediation %s on %s: %w", m.Step, m.NodeID, err)
	}
	return out, nil
}

// SetCommand records the command a running step sent.
func SetCommand(ctx context.Context, q Querier, id, commandID string) error {
	_, err := q.Exec(ctx, `UPDATE remediations SET command_id = $2 WHERE id = $1`, id, commandID)
	if err != nil {
		return fmt.Errorf("set command of remediation %s: %w", id, err)
	}
	return nil
}

// Finish ends running step id in state (Succeeded or Failed) with reason at
// now; false when it was not running.
func Finish(ctx context.Context, q Querier, id, state, reason string, now time.Time) (bool, error) {
	if state != Succeeded && state != Failed {
		return false, fmt.Errorf("finish remediation %s: state %q is not final", id, state)
	}
	tag, err := q.Exec(ctx, `UPDATE remediations SET state = $2, reason = $3, finished_at = $4
		WHERE id = $1 AND state = 'running'`, id, state, cut(reason), now)
	if err != nil {
		return false, fmt.Errorf("finish remediation %s: %w", id, err)
	}
	return tag.RowsAffected() == 1, nil
}

// RunningOn returns node's running step, and false when none runs.
func RunningOn(ctx context.Context, q Querier, node string) (Remediation, bool, error) {
	m, err := scan(q.QueryRow(ctx, `SELECT `+cols+` FROM remediations WHERE node_id = $1 AND state = 'running'
		ORDER BY started_at DESC, id DESC LIMIT 1`, node))
	if errors.Is(err, pgx.ErrNoRows) {
		return Remediation{}, false, nil
	}
	if err != nil {
		return Remediation{}, false, fmt.Errorf("running remediation of %s: %w", node, err)
	}
	return m, true, nil
}

// OfNode lists node's steps, oldest first (a ladder's steps in ladder
// order when started at the same time).
func OfNode(ctx context.Context, q Querier, node string) ([]Remediation, error) {
	rows, err := q.Query(ctx, `SELECT `+cols+` FROM remediations WHERE node_id = $1
		ORDER BY started_at, array_position(ARRAY['gpu.reset', 'node.reboot', 'needs_repair'], step), id`, node)
	if err != nil {
		return nil, fmt.Errorf("remediations of %s: %w", node, err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Remediation, error) { return scan(r) })
}

// LaddersSince counts the ladders started on node at or after since that
// count against its budget: its gpu.reset steps (each quarantine ladder
// starts with one) and its MIG steps (each one a ladder), not cleared by
// nodes.clearRepair.
func LaddersSince(ctx context.Context, q Querier, node string, since time.Time) (int, error) {
	var n int
	err := q.QueryRow(ctx, `SELECT count(*) FROM remediations
		WHERE node_id = $1 AND (step = 'gpu.reset' OR cause = 'mig') AND cleared_at IS NULL AND started_at >= $2`, node, since).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("count ladders of %s: %w", node, err)
	}
	return n, nil
}

// RunningInPool counts the steps running on pool's nodes other than
// except.
func RunningInPool(ctx context.Context, q Querier, pool, except string) (int, error) {
	var n int
	err := q.QueryRow(ctx, `SELECT count(*) FROM remediations WHERE pool_id = $1 AND state = 'running' AND node_id <> $2`,
		pool, except).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("count running remediations of %s: %w", pool, err)
	}
	return n, nil
}

// Clear marks node's rows cleared at now (nodes.clearRepair): they no
// longer count against its budget. It returns how many it marked.
func Clear(ctx context.Context, q Querier, node string, now time.Time) (int, error) {
	tag, err := q.Exec(ctx, `UPDATE remediations SET cleared_at = $2 WHERE node_id = $1 AND cleared_at IS NULL`, node, now)
	if err != nil {
		return 0, fmt.Errorf("clear remediations of %s: %w", node, err)
	}
	return int(tag.RowsAffected()), nil
}

// Prune deletes up to limit finished rows that finished before before
// (now minus [Retention], for the health job) and returns how many.
func Prune(ctx context.Context, q Querier, before time.Time, limit int) (int, error) {
	tag, err := q.Exec(ctx, `DELETE FROM remediations WHERE id IN (
		SELECT id FROM remediations WHERE finished_at IS NOT NULL AND finished_at < $1 ORDER BY finished_at LIMIT $2)`, before, limit)
	if err != nil {
		return 0, fmt.Errorf("prune remediations: %w", err)
	}
	return int(tag.RowsAffected()), nil
}

// RecordClear records a nodes.clearRepair of node at now, for its own
// budget ([ClearsSince]); nothing resets it.
func RecordClear(ctx context.Context, q Querier, tenant, node string, now time.Time) error {
	if _, err := q.Exec(ctx, `INSERT INTO repair_clears (node_id, tenant_id, cleared_at) VALUES ($1, $2, $3)`, node, tenant, now); err != nil {
		return fmt.Errorf("record the repair clear of %s: %w", node, err)
	}
	return nil
}

// ClearsSince counts node's nodes.clearRepair calls at or after since.
func ClearsSince(ctx context.Context, q Querier, node string, since time.Time) (int, error) {
	var n int
	if err := q.QueryRow(ctx, `SELECT count(*) FROM repair_clears WHERE node_id = $1 AND cleared_at >= $2`, node, since).Scan(&n); err != nil {
		return 0, fmt.Errorf("count repair clears of %s: %w", node, err)
	}
	return n, nil
}

// PruneClears deletes up to limit recorded clears older than before (now
// minus [Retention], for the health job) and returns how many.
func PruneClears(ctx context.Context, q Querier, before time.Time, limit int) (int, error) {
	tag, err := q.Exec(ctx, `DELETE FROM repair_clears WHERE ctid IN (
		SELECT ctid FROM repair_clears WHERE cleared_at < $1 ORDER BY cleared_at LIMIT $2)`, before, limit)
	if err != nil {
		return 0, fmt.Errorf("prune repair clears: %w", err)
	}
	return int(tag.RowsAffected()), nil
}
