package instances

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// accrue folds the instance-hours held since accrued_at into the usage
// columns of instance id (all live ones when id is "") and restarts the
// accrual now.
func accrue(ctx context.Context, q Querier, id string) (int, error) {
	tag, err := q.Exec(ctx, `
		UPDATE instances i SET
			vcpu_hours = i.vcpu_hours + i.vcpus * `+heldHours+`,
			memory_mib_hours = i.memory_mib_hours + i.memory_mib * `+heldHours+`,
			disk_gib_hours = i.disk_gib_hours + i.disk_gib * `+heldHours+`,
			gpu_hours = i.gpu_hours + i.gpu_count * `+heldHours+`,
			accrued_at = now()
		 WHERE ($1 = '' OR i.id = $1) AND i.accrued_at IS NOT NULL AND i.state NOT IN ('pending', 'deleting', 'deleted')`, id)
	if err != nil {
		return 0, fmt.Errorf("accrue usage: %w", err)
	}
	return int(tag.RowsAffected()), nil
}

// Accrue folds the usage of every live instance up to now (reads add what
// accrued since, so this only bounds the arithmetic); the vps.usage job
// runs it. It returns how many instances it touched.
func Accrue(ctx context.Context, q Querier) (int, error) { return accrue(ctx, q, "") }

// SetPower sets instance id's desired power state (PowerRunning or
// PowerStopped) and bumps its generation; false when it already was (no
// change). A deleted or deleting instance is CONFLICT on instanceId.
func SetPower(ctx context.Context, q Querier, id, power string) (Instance, bool, error) {
	if power != PowerRunning && power != PowerStopped {
		return Instance{}, false, fault.New(fault.InvalidInput, "power", "expected running or stopped, got %q", power)
	}
	in, err := Lock(ctx, q, id)
	if err != nil {
		return Instance{}, false, err
	}
	if !Live(in.State) {
		return Instance{}, false, fault.New(fault.Conflict, "instanceId", "instance %s is %s", id, in.State)
	}
	if in.Power == power {
		return in, false, nil
	}
	if _, err := q.Exec(ctx, `UPDATE instances SET power = $2, generation = generation + 1, updated_at = now() WHERE id = $1`, id, power); err != nil {
		return Instance{}, false, fmt.Errorf("set power of %s: %w", id, err)
	}
	in, err = Lock(ctx, q, id)
	return in, true, err
}

// Resize changes instance id's size to size in tx: it claims the
// difference on its host atomically (more of a dimension only if the host
// has it free: NO_CAPACITY naming the dimension otherwise; less is
// released), checks the quotas where it grows (QUOTA_EXCEEDED), and bumps
// the generation. False when the size is unchanged. Only a placed instance
// (on a host) can be resized: CONFLICT on instanceId otherwise. A disk
// only grows (INVALID_INPUT on diskGiB). Each error
// leaves tx as it was.
func Resize(ctx context.Context, tx pgx.Tx, id string, size Size) (Instance, bool, error) {
	if err := ValidSize(size); err != nil {
		return Instance{}, false, err
	}
	in, err := Lock(ctx, tx, id)
	if err != nil {
		return Instance{}, false, err
	}
	if !Live(in.State) || in.NodeID == "" {
		return Instance{}, false, fault.New(fault.Conflict, "instanceId", "instance %s is %s and not on a host; only a placed instance can be resized", id, in.State)
	}
	if in.Size == size {
		return in, false, nil
	}
	if size.DiskGiB < in.DiskGiB {
		return Instance{}, false, fault.New(fault.InvalidInput, "diskGiB", "a disk only grows: %d GiB now, asked for %d", in.DiskGiB, size.DiskGiB)
	}
	delta := Size{VCPUs: size.VCPUs - in.VCPUs, MemoryMiB: size.MemoryMiB - in.MemoryMiB, DiskGiB: size.DiskGiB - in.DiskGiB, GPUs: size.GPUs - in.GPUs}
	sp, err := tx.Begin(ctx)
	if err != nil {
		return Instance{}, false, err
	}
	if err := resize(ctx, sp, in, size, delta); err != nil {
		if rerr := sp.Rollback(ctx); rerr != nil {
			return Instance{}, false, rerr
		}
		return Instance{}, false, err
	}
	if err := sp.Commit(ctx); err != nil {
		return Instance{}, false, err
	}
	in, err = Lock(ctx, tx, id)
	return in, true, err
}

func resize(ctx context.Context, tx pgx.Tx, in Instance, size, delta Size) error {
	if err := lockPool(ctx, tx, in.TenantID, in.PoolID); err != nil {
		return err
	}
	if _, err := accrue(ctx, tx, in.ID); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `UPDATE instances SET vcpus = $2, memory_mib = $3, disk_gib = $4, gpu_count = $5,
		generation = generation + 1, updated_at = now() WHERE id = $1`, in.ID, size.VCPUs, size.MemoryMiB, size.DiskGiB, size.GPUs); err != nil {
		return fmt.Errorf("resize %s: %w", in.ID, err)
	}
	if err := checkQuotas(ctx, tx, in.TenantID, in.PoolID, delta); err != nil {
		return err
	}
	// Lock the host, then claim only what still fits: a refusal names the
	// first dimension short.
	var free [4]int64
	err := tx.QueryRow(ctx, `SELECT h.vcpus_total - h.vcpus_used, h.memory_mib_total - h.memory_mib_used, h.disk_gib_total - h.disk_gib_used,
		CASE WHEN $3 <= 0 THEN 0 ELSE `+freeGPUsOf("$2")+` END
		FROM host_capacity h WHERE h.node_id = $1 FOR UPDATE`, in.NodeID, in.GPUModel, delta.GPUs).Scan(&free[0], &free[1], &free[2], &free[3])
	if err != nil {
		return fmt.Errorf("lock host %s: %w", in.NodeID, err)
	}
	want := delta.vec()
	for d := range dims {
		if want[d] > free[d] {
			return fault.New(fault.NoCapacity, dims[d].field, "host %s has %d %s free; the resize needs %d more", in.NodeID, free[d], dims[d].unit, want[d])
		}
	}
	ok, err := claim(ctx, tx, in.ID, in.NodeID, delta, in.Size, in.GPUModel)
	if err != nil {
		return err
	}
	if !ok {
		return fault.New(fault.NoCapacity, "gpuCount", "host %s has fewer than %d more GPUs free", in.NodeID, delta.GPUs)
	}
	return nil
}

// Delete deletes instance id: its capacity and GPUs on its host are
// released in the same transaction and it moves to deleting (the host
// removes it, then [Observe] moves it to deleted), or straight to deleted
// when it was on no host. Its generation is bumped. It returns the
// instance and false when it was already deleting or deleted (nothing
// changed).
func Delete(ctx context.Context, q Querier, id string) (Instance, bool, error) {
	in, err := Lock(ctx, q, id)
	if err != nil {
		return Instance{}, false, err
	}
	if !Live(in.State) {
		return in, false, nil
	}
	if _, err := accrue(ctx, q, id); err != nil {
		return Instance{}, false, err
	}
	state := StateDeleted
	if in.NodeID != "" {
		state = StateDeleting
	}
	_, err = q.Exec(ctx, `
		WITH i AS (
			UPDATE instances SET state = $2, reason = '', generation = generation + 1, updated_at = now(),
			       deleted_at = CASE WHEN $2 = 'deleted' THEN now() END
			 WHERE id = $1 RETURNING id, updated_at),
		g AS (
			UPDATE instance_gpus SET active = false, released_at = i.updated_at FROM i
			 WHERE instance_gpus.instance_id = i.id AND instance_gpus.active RETURNING 1)
		SELECT count(*) FROM g`, id, state)
	if err != nil {
		return Instance{}, false, fmt.Errorf("delete %s: %w", id, err)
	}
	if in.NodeID != "" {
		if _, err := q.Exec(ctx, `UPDATE host_capacity SET vcpus_used = vcpus_used - $2, memory_mib_used = memory_mib_used - $3,
			disk_gib_used = disk_gib_used - $4, instances = instances - 1, updated_at = now() WHERE node_id = $1`,
			in.NodeID, in.VCPUs, in.MemoryMiB, in.DiskGiB); err != nil {
			return Instance{}, false, fmt.Errorf("release capacity of %s on %s: %w", id, in.NodeID, err)
		}
	}
	in, err = Lock(ctx, q, id)
	return in, true, err
}

// Observation is what a host (or provider) reported about an instance.
type Observation struct {
	// Generation is the instance generation the report is about.
	Generation int64
	// State is running, stopped, failed or absent (not on the host).
	State  string
	Reason string
}

// Observe records obs for instance id and moves its state: placed,
// running, stopped or failed follow a report of running, stopped or failed
// at the current generation; a deleting instance reported absent is
// deleted. A report of an older generation is stored but moves nothing.
// It returns the new state and whether it changed.
func Observe(ctx context.Context, q Querier, id string, obs Observation) (string, bool, error) {
	var old string
	err := q.QueryRow(ctx, `SELECT state FROM instances WHERE id = $1 FOR UPDATE`, id).Scan(&old)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", false, fault.New(fault.NotFound, "instanceId", "no instance %q", id)
	}
	if err != nil {
		return "", false, fmt.Errorf("observe %s: %w", id, err)
	}
	var state string
	err = q.QueryRow(ctx, `
		UPDATE instances i SET observed_generation = greatest(i.observed_generation, $2), observed_state = $3,
		       observed_reason = $4, observed_at = now(),
		       state = CASE
		           WHEN i.state = 'deleting' AND $3 = 'absent' THEN 'deleted'
		           WHEN i.state IN ('placed', 'running', 'stopped', 'failed') AND $2 >= i.generation
		                AND $3 IN ('running', 'stopped', 'failed') THEN $3
		           ELSE i.state END,
		       reason = CASE WHEN i.state NOT IN ('deleting', 'deleted') AND $3 = 'failed' AND $2 >= i.generation THEN $4 ELSE i.reason END,
		       deleted_at = CASE WHEN i.state = 'deleting' AND $3 = 'absent' THEN now() ELSE i.deleted_at END
		 WHERE i.id = $1 RETURNING i.state`, id, obs.Generation, obs.State, obs.Reason).Scan(&state)
	if err != nil {
		return "", false, fmt.Errorf("observe %s: %w", id, err)
	}
	return state, state != old, nil
}

// Prune removes deleted instances deleted more than olderThan ago (0 means
// [DefaultRetention]), with their GPU claims and authorization projection
// rows, and returns how many; the vps.usage job runs it.
func Prune(ctx context.Context, q Querier, olderThan time.Duration) (int, error) {
	if olderThan <= 0 {
		olderThan = DefaultRetention
	}
	var n int
	err := q.QueryRow(ctx, `
		WITH d AS (DELETE FROM instances WHERE state = 'deleted' AND deleted_at < now() - $1::interval RETURNING id),
		p AS (DELETE FROM authz_projection WHERE type = 'Instance' AND id IN (SELECT id FROM d))
		SELECT count(*) FROM d`, olderThan).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("prune instances: %w", err)
	}
	return n, nil
}
