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

// GPU is a GPU as the node's inventory report describes it.
type GPU struct {
	ID, Model, Serial, PCIBusID string
	Index                       int32
	MemoryBytes                 int64
	MIGEnabled, Healthy         bool
	HealthReason                string
}

// StoreGPUs upserts node's reported GPUs (present again: missing_since
// cleared) and marks every other GPU of the node missing since now.
func StoreGPUs(ctx context.Context, q Querier, node string, gpus []GPU) error {
	var (
		ids, models, serials, buses, reasons []string
		indexes                              []int32
		memory                               []int64
		mig, healthy                         []bool
	)
	for _, g := range gpus {
		ids, models, serials, buses, reasons = append(ids, g.ID), append(models, g.Model), append(serials, g.Serial), append(buses, g.PCIBusID), append(reasons, g.HealthReason)
		indexes, memory = append(indexes, g.Index), append(memory, g.MemoryBytes)
		mig, healthy = append(mig, g.MIGEnabled), append(healthy, g.Healthy)
	}
	if len(ids) > 0 {
		_, err := q.Exec(ctx, `
			INSERT INTO devices (node_id, id, kind, index, model, serial, memory_bytes, pci_bus_id, mig_enabled, healthy, health_reason)
			SELECT $1, g.id, 'gpu', g.index, g.model, g.serial, g.memory_bytes, g.pci_bus_id, g.mig_enabled, g.healthy, g.health_reason
			  FROM unnest($2::text[], $3::int[], $4::text[], $5::text[], $6::bigint[], $7::text[], $8::bool[], $9::bool[], $10::text[])
			       AS g(id, index, model, serial, memory_bytes, pci_bus_id, mig_enabled, healthy, health_reason)
			ON CONFLICT (node_id, id) DO UPDATE SET
			    index = EXCLUDED.index, model = EXCLUDED.model, serial = EXCLUDED.serial,
			    memory_bytes = EXCLUDED.memory_bytes, pci_bus_id = EXCLUDED.pci_bus_id,
			    mig_enabled = EXCLUDED.mig_enabled, healthy = EXCLUDED.healthy,
			    health_reason = EXCLUDED.health_reason, missing_since = NULL, updated_at = now()`,
			node, ids, indexes, models, serials, memory, buses, mig, healthy, reasons)
		if err != nil {
			return fmt.Errorf("upsert %d devices: %w", len(ids), err)
		}
	}
	_, err := q.Exec(ctx, `
		UPDATE devices SET missing_since = now(), updated_at = now()
		 WHERE node_id = $1 AND kind = 'gpu' AND missing_since IS NULL AND NOT (id = ANY($2))`, node, ids)
	if err != nil {
		return fmt.Errorf("mark missing devices: %w", err)
	}
	return nil
}

// KindMig is the kind of a MIG slice's devices row (a GPU's is "gpu").
const KindMig = "mig"

// ReportedSlice is a MIG slice as the node's inventory report describes
// it: Parent is its GPU's UUID; ComputeSlices come from proto/migcatalog.
type ReportedSlice struct {
	ID, Parent, Profile string
	Start               int32
	MemoryBytes         int64
	ComputeSlices       int32
	GPUInstanceID       int32
}

// StoreMigSlices upserts node's reported MIG slices as devices of kind mig
// (present again: missing_since cleared) and marks every other slice of
// the node missing since now, as [StoreGPUs] does for GPUs. Call it after
// StoreGPUs in the same transaction.
func StoreMigSlices(ctx context.Context, q Querier, node string, ss []ReportedSlice) error {
	var (
		parents, profiles []string
		starts, cs, gis   []int32
		memory            []int64
	)
	ids := []string{} // not NULL: with none, every slice goes missing
	for _, s := range ss {
		ids, parents, profiles = append(ids, s.ID), append(parents, s.Parent), append(profiles, s.Profile)
		starts, cs, gis, memory = append(starts, s.Start), append(cs, s.ComputeSlices), append(gis, s.GPUInstanceID), append(memory, s.MemoryBytes)
	}
	if len(ids) > 0 {
		// A slice takes its parent's index and model, so it sorts and
		// reads with it.
		_, err := q.Exec(ctx, `
			INSERT INTO devices (node_id, id, kind, index, model, memory_bytes, parent_id, profile, mig_start, compute_slices, gpu_instance_id)
			SELECT $1, s.id, 'mig', coalesce(p.index, 0), coalesce(p.model, ''), s.memory_bytes, s.parent, s.profile, s.start, s.cs, s.gi
			  FROM unnest($2::text[], $3::text[], $4::text[], $5::int[], $6::bigint[], $7::int[], $8::int[])
			       AS s(id, parent, profile, start, memory_bytes, cs, gi)
			  LEFT JOIN devices p ON p.node_id = $1 AND p.id = s.parent AND p.kind = 'gpu'
			ON CONFLICT (node_id, id) DO UPDATE SET
			    index = EXCLUDED.index, model = EXCLUDED.model, memory_bytes = EXCLUDED.memory_bytes,
			    parent_id = EXCLUDED.parent_id, profile = EXCLUDED.profile, mig_start = EXCLUDED.mig_start,
			    compute_slices = EXCLUDED.compute_slices, gpu_instance_id = EXCLUDED.gpu_instance_id,
			    missing_since = NULL, updated_at = now()
			 WHERE devices.kind = 'mig'`,
			node, ids, parents, profiles, starts, memory, cs, gis)
		if err != nil {
			return fmt.Errorf("upsert %d MIG slices: %w", len(ids), err)
		}
	}
	_, err := q.Exec(ctx, `
		UPDATE devices SET missing_since = now(), updated_at = now()
		 WHERE node_id = $1 AND kind = 'mig' AND missing_since IS NULL AND NOT (id = ANY($2))`, node, ids)
	if err != nil {
		return fmt.Errorf("mark missing MIG slices: %w", err)
	}
	return nil
}

// DeviceState is what a node's conditions are derived from, per device.
type DeviceState struct {
	ID                            string
	Healthy, Missing, Quarantined bool
}

// DeviceStates returns the states of node's devices, by index and id.
func DeviceStates(ctx context.Context, q Querier, node string) ([]DeviceState, error) {
	rows, err := q.Query(ctx, `SELECT id, healthy, missing_since IS NOT NULL, quarantined_at IS NOT NULL
		FROM devices WHERE node_id = $1 AND kind = 'gpu' ORDER BY index, id`, node)
	if err != nil {
		return nil, fmt.Errorf("read devices of %s: %w", node, err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[DeviceState])
}

// migResetSQL is the condition on nodes n that the node's last report has
// a GPU in its mig section waiting for a reset ("GPU-…: reset-required: …"
// in the section's reason, as agent/converge writes it) and the node has
// no NeedsRepair latched: the health job may reset it.
const migResetSQL = `(NOT n.needs_repair AND jsonb_typeof(n.section_status) = 'array'
	AND jsonb_path_exists(n.section_status, '$[*] ? (@.section == "mig" && @.reason like_regex ": reset-required: ")'))`

// NeedingHealthInShards returns the nodes of shards with an unhealthy,
// missing or quarantined GPU, a running remediation step, or a GPU whose
// MIG mode change waits for a reset: the health job's resync keys.
func NeedingHealthInShards(ctx context.Context, q Querier, shards []int) ([]string, error) {
	rows, err := q.Query(ctx, `
		SELECT n.id FROM nodes n WHERE n.shard = ANY($1) AND (
		    EXISTS (SELECT 1 FROM devices d WHERE d.node_id = n.id AND d.kind = 'gpu'
		             AND (d.quarantined_at IS NOT NULL OR NOT d.healthy OR d.missing_since IS NOT NULL))
		 OR EXISTS (SELECT 1 FROM remediations r WHERE r.node_id = n.id AND r.state = 'running')
		 OR `+migResetSQL+`)`, shards)
	if err != nil {
		return nil, fmt.Errorf("nodes needing health: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// WaitingForLadder returns up to 100 adopted nodes of pool other than
// except, in id order, that wait for a remediation ladder: a quarantined
// GPU or a GPU whose MIG mode change waits for a reset, no running step
// and no NeedsRepair.
func WaitingForLadder(ctx context.Context, q Querier, pool, except string) ([]string, error) {
	rows, err := q.Query(ctx, `
		SELECT n.id FROM nodes n
		 WHERE n.pool_id = $1 AND n.id <> $2 AND NOT n.needs_repair AND n.state = 'adopted'
		   AND (EXISTS (SELECT 1 FROM devices d WHERE d.node_id = n.id AND d.quarantined_at IS NOT NULL) OR `+migResetSQL+`)
		   AND NOT EXISTS (SELECT 1 FROM remediations r WHERE r.node_id = n.id AND r.state = 'running')
		 ORDER BY n.id LIMIT 100`, pool, except)
	if err != nil {
		return nil, fmt.Errorf("nodes waiting for a ladder in %s: %w", pool, err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// DesiredState is a node's desired state to deliver: its generation and
// spec (proto3 JSON).
type DesiredState struct {
	ID         string
	Generation int64
	Spec       []byte
}

// DesiredToDeliver returns, of the nodes ids whose sessions are epochs and
// have been delivered generation delivered (three parallel slices), those
// still held by that session whose generation is newer.
func DesiredToDeliver(ctx context.Context, q Querier, ids []string, epochs, delivered []int64) ([]DesiredState, error) {
	rows, err := q.Query(ctx, `
		SELECT n.id, n.generation, n.spec::text FROM nodes n
		  JOIN unnest($1::text[], $2::bigint[], $3::bigint[]) AS s(id, epoch, delivered) ON s.id = n.id
		 WHERE n.session_epoch = s.epoch AND n.generation >= 1 AND n.generation > s.delivered`, ids, epochs, delivered)
	if err != nil {
		return nil, fmt.Errorf("read desired state: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[DesiredState])
	if err != nil {
		return nil, fmt.Errorf("read desired state: %w", err)
	}
	return out, nil
}

// WaitingForMigReset keeps those of ids (nodes whose convergence report
// was just stored) that the health job should look at for MIG: a GPU
// waiting for a reset, or a running MIG remediation step (it succeeds once
// the node reports the GPU laid out).
func WaitingForMigReset(ctx context.Context, q Querier, ids []string) ([]string, error) {
	rows, err := q.Query(ctx, `
		SELECT n.id FROM nodes n WHERE n.id = ANY($1) AND (`+migResetSQL+`
		    OR EXISTS (SELECT 1 FROM remediations r WHERE r.node_id = n.id AND r.state = 'running' AND r.cause = 'mig'))
		 ORDER BY n.id`, ids)
	if err != nil {
		return nil, fmt.Errorf("nodes waiting for a MIG reset: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}
