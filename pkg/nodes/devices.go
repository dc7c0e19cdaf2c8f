package nodes

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// GPU quarantine (devices.quarantined_at, written by the health job) and
// the latched NeedsRepair condition (nodes.needs_repair, written by the
// remediation ladder and cleared by nodes.clearRepair).

// MaxQuarantineReason bounds a quarantine reason as stored.
const MaxQuarantineReason = 1024

// MaxNeedsRepairReason bounds a NeedsRepair reason as stored.
const MaxNeedsRepairReason = 4096

// LockForHealth locks node id's row (FOR UPDATE, as the inventory
// controller does) and reads it with its devices, so that one health run
// at a time sees and changes a node's devices. A node that does not exist
// is pgx.ErrNoRows.
func LockForHealth(ctx context.Context, q Querier, id string) (Node, error) {
	n, err := scan(q.QueryRow(ctx, `SELECT `+cols+` FROM nodes WHERE id = $1 FOR UPDATE`, id))
	if err != nil {
		return Node{}, err
	}
	ns := []Node{n}
	if err := withDevices(ctx, q, ns); err != nil {
		return Node{}, err
	}
	return ns[0], nil
}

// Quarantined is one device [Quarantine] took out of service.
type Quarantined struct {
	DeviceID string
	Index    int
	Reason   string
	// Missing: it was quarantined because it is no longer reported.
	Missing bool
}

// Quarantine quarantines, at now, every GPU of node id that is unhealthy or
// missing and not quarantined yet, with the reason (its health reason, or
// that it is missing), and returns them in index order.
func Quarantine(ctx context.Context, q Querier, id string, now time.Time) ([]Quarantined, error) {
	rows, err := q.Query(ctx, `
		UPDATE devices SET quarantined_at = $2, updated_at = now(),
		       quarantine_reason = left(CASE
		           WHEN missing_since IS NOT NULL THEN 'missing: not reported since ' || to_char(missing_since AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')
		           WHEN health_reason <> '' THEN 'unhealthy: ' || health_reason
		           ELSE 'unhealthy' END, $3)
		 WHERE node_id = $1 AND kind = 'gpu' AND quarantined_at IS NULL AND (NOT healthy OR missing_since IS NOT NULL)
		RETURNING id, index, quarantine_reason, missing_since IS NOT NULL`, id, now, MaxQuarantineReason)
	if err != nil {
		return nil, fmt.Errorf("quarantine devices of %s: %w", id, err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Quarantined])
	if err != nil {
		return nil, fmt.Errorf("quarantine devices of %s: %w", id, err)
	}
	sortQuarantined(out)
	return out, nil
}

func sortQuarantined(qs []Quarantined) {
	slices.SortFunc(qs, func(a, b Quarantined) int {
		return cmp.Or(cmp.Compare(a.Index, b.Index), cmp.Compare(a.DeviceID, b.DeviceID))
	})
}

// LiftQuarantine returns to service the quarantined GPUs of node id that
// are healthy and present again, but for those in keep (devices a running
// remediation step is for), and returns their ids, sorted. Only is,
// when not nil, the devices it may lift (a remediation step that
// succeeded lifts its own).
func LiftQuarantine(ctx context.Context, q Querier, id string, keep, only []string) ([]string, error) {
	if keep == nil {
		keep = []string{}
	}
	rows, err := q.Query(ctx, `
		UPDATE devices SET quarantined_at = NULL, quarantine_reason = '', updated_at = now()
		 WHERE node_id = $1 AND quarantined_at IS NOT NULL AND healthy AND missing_since IS NULL
		   AND NOT (id = ANY($2)) AND ($3::text[] IS NULL OR id = ANY($3))
		RETURNING id`, id, keep, only)
	if err != nil {
		return nil, fmt.Errorf("lift quarantine on %s: %w", id, err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, err
	}
	slices.Sort(ids)
	return ids, nil
}

// LatchNeedsRepair latches node id's NeedsRepair condition with reason
// (cut to MaxNeedsRepairReason) at now; with fail it also moves the node
// to state failed (the remediation ladder gave up). False when it was
// latched already (nothing changed).
func LatchNeedsRepair(ctx context.Context, q Querier, id, reason string, fail bool, now time.Time) (bool, error) {
	if len(reason) > MaxNeedsRepairReason {
		reason = reason[:MaxNeedsRepairReason]
	}
	tag, err := q.Exec(ctx, `
		UPDATE nodes SET needs_repair = true, needs_repair_reason = $2, needs_repair_since = $3,
		       state = CASE WHEN $4 AND state <> 'retired' THEN 'failed' ELSE state END, updated_at = now()
		 WHERE id = $1 AND NOT needs_repair`, id, reason, now, fail)
	if err != nil {
		return false, fmt.Errorf("latch NeedsRepair on %s: %w", id, err)
	}
	return tag.RowsAffected() == 1, nil
}

// RepairCleared is what [ClearRepair] changed.
type RepairCleared struct {
	// WasLatched: NeedsRepair was latched.
	WasLatched bool
	// Readopt: the node was failed and is adopting again.
	Readopt bool
	// Reason is the NeedsRepair reason that was cleared.
	Reason string
}

// ClearRepair clears node id's (of tenant) NeedsRepair condition; a failed
// node goes back to adopting, so that its acceptance checks run again. A
// node of another tenant, or none, is NOT_FOUND on "nodeId".
func ClearRepair(ctx context.Context, q Querier, tenant, id string) (RepairCleared, error) {
	var out RepairCleared
	err := q.QueryRow(ctx, `
		WITH old AS (SELECT id, needs_repair, needs_repair_reason, state FROM nodes WHERE id = $1 AND tenant_id = $2 FOR UPDATE),
		u AS (
			UPDATE nodes n SET needs_repair = false, needs_repair_reason = '', needs_repair_since = NULL,
			       state = CASE WHEN n.state = 'failed' THEN 'adopting' ELSE n.state END, updated_at = now()
			  FROM old WHERE n.id = old.id RETURNING n.id)
		SELECT old.needs_repair, old.state = 'failed', old.needs_repair_reason FROM old JOIN u ON u.id = old.id`,
		id, tenant).Scan(&out.WasLatched, &out.Readopt, &out.Reason)
	if errors.Is(err, pgx.ErrNoRows) {
		return RepairCleared{}, fault.New(fault.NotFound, "nodeId", "no node %q", id)
	}
	if err != nil {
		return RepairCleared{}, fmt.Errorf("clear NeedsRepair on %s: %w", id, err)
	}
	return out, nil
}
