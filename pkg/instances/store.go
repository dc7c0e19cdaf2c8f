package instances

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Insert writes a new instance in (state pending, desired power running
// unless set, generation 1).
func Insert(ctx context.Context, q Querier, in Instance) error {
	keys := in.SSHKeys
	if keys == nil {
		keys = []string{}
	}
	power := in.Power
	if power == "" {
		power = PowerRunning
	}
	_, err := q.Exec(ctx, `
		INSERT INTO instances (id, tenant_id, pool_id, vcpus, memory_mib, disk_gib, gpu_count, gpu_model, image, ssh_keys,
			user_data, power, idempotency_key)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)`,
		in.ID, in.TenantID, in.PoolID, in.VCPUs, in.MemoryMiB, in.DiskGiB, in.GPUs, in.GPUModel, in.Image, keys,
		in.UserData, power, in.IdempotencyKey)
	if err != nil {
		return fmt.Errorf("insert instance: %w", err)
	}
	return nil
}

// cols are an instance's columns; the usage columns add what accrued since
// accrued_at, so reads are current without a job.
const cols = `i.id, i.tenant_id, i.pool_id, coalesce(i.node_id, ''), i.vcpus, i.memory_mib, i.disk_gib, i.gpu_count, i.gpu_model,
	i.image, i.ssh_keys, i.user_data, i.power, i.state, i.reason, i.generation, i.observed_generation, i.observed_state,
	i.observed_reason, i.observed_at, i.provider_machine_id, i.idempotency_key,
	i.vcpu_hours + i.vcpus * ` + heldHours + `, i.memory_mib_hours + i.memory_mib * ` + heldHours + `,
	i.disk_gib_hours + i.disk_gib * ` + heldHours + `, i.gpu_hours + i.gpu_count * ` + heldHours + `,
	i.created_at, i.updated_at, i.placed_at, i.deleted_at`

// heldHours is how long instance i has held capacity since it last
// accrued, in hours: capacity is held from placement until delete, whatever
// the power state (a stopped instance keeps its host's resources).
const heldHours = `(CASE WHEN i.accrued_at IS NOT NULL AND i.state NOT IN ('pending', 'deleting', 'deleted')
	THEN greatest(0, extract(epoch FROM now() - i.accrued_at)) / 3600 ELSE 0 END)`

func scan(row pgx.Row) (Instance, error) {
	var in Instance
	err := row.Scan(&in.ID, &in.TenantID, &in.PoolID, &in.NodeID, &in.VCPUs, &in.MemoryMiB, &in.DiskGiB, &in.GPUs, &in.GPUModel,
		&in.Image, &in.SSHKeys, &in.UserData, &in.Power, &in.State, &in.Reason, &in.Generation, &in.ObservedGeneration,
		&in.ObservedState, &in.ObservedReason, &in.ObservedAt, &in.ProviderMachineID, &in.IdempotencyKey,
		&in.Usage.VCPUHours, &in.Usage.MemoryMiBHours, &in.Usage.DiskGiBHours, &in.Usage.GPUHours,
		&in.CreatedAt, &in.UpdatedAt, &in.PlacedAt, &in.DeletedAt)
	return in, err
}

// Get reads instance id of tenant with its GPUs; a missing one (or
// another tenant's) is NOT_FOUND on instanceId.
func Get(ctx context.Context, q Querier, tenant, id string) (Instance, error) {
	return get(ctx, q, `SELECT `+cols+` FROM instances i WHERE i.id = $1 AND i.tenant_id = $2`, id, tenant)
}

// Lock reads instance id FOR UPDATE, whatever its tenant.
func Lock(ctx context.Context, q Querier, id string) (Instance, error) {
	return get(ctx, q, `SELECT `+cols+` FROM instances i WHERE i.id = $1 FOR UPDATE`, id)
}

func get(ctx context.Context, q Querier, sql string, args ...any) (Instance, error) {
	in, err := scan(q.QueryRow(ctx, sql, args...))
	if errors.Is(err, pgx.ErrNoRows) {
		return Instance{}, fault.New(fault.NotFound, "instanceId", "no instance %q", args[0])
	}
	if err != nil {
		return Instance{}, fmt.Errorf("read instance: %w", err)
	}
	if err := loadGPUs(ctx, q, []*Instance{&in}); err != nil {
		return Instance{}, err
	}
	return in, nil
}

// loadGPUs fills the GPUs of ins: the active claims, or for a deleted
// instance the ones it released last.
func loadGPUs(ctx context.Context, q Querier, ins []*Instance) error {
	var ids []string
	byID := map[string]*Instance{}
	for _, in := range ins {
		if in.GPUs > 0 {
			ids = append(ids, in.ID)
			byID[in.ID] = in
		}
	}
	if len(ids) == 0 {
		return nil
	}
	rows, err := q.Query(ctx, `
		SELECT g.instance_id, g.node_id, g.device_id, g.model, g.pci_bus_id FROM instance_gpus g JOIN instances i ON i.id = g.instance_id
		 WHERE g.instance_id = ANY($1) AND (g.active OR (i.state IN ('deleting', 'deleted') AND g.released_at = i.updated_at))
		 ORDER BY g.instance_id, g.node_id, g.device_id`, ids)
	if err != nil {
		return fmt.Errorf("read instance GPUs: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var id string
		var g GPU
		if err := rows.Scan(&id, &g.NodeID, &g.DeviceID, &g.Model, &g.PCIBusID); err != nil {
			return err
		}
		byID[id].GPUDevices = append(byID[id].GPUDevices, g)
	}
	return rows.Err()
}

// ListFilter narrows [List].
type ListFilter struct {
	TenantID, PoolID, State string
	// After is the id of the last instance of the previous page.
	After string
	Limit int
}

// List pages through a tenant's instances, newest first.
func List(ctx context.Context, q Querier, f ListFilter) ([]Instance, error) {
	rows, err := q.Query(ctx, `SELECT `+cols+` FROM instances i
		WHERE i.tenant_id = $1 AND ($2 = '' OR i.pool_id = $2) AND ($3 = '' OR i.state = $3)
		  AND ($4 = '' OR (i.created_at, i.id) < (SELECT created_at, id FROM instances WHERE id = $4))
		ORDER BY i.created_at DESC, i.id DESC LIMIT $5`, f.TenantID, f.PoolID, f.State, f.After, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("list instances: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Instance, error) { return scan(r) })
	if err != nil {
		return nil, fmt.Errorf("list instances: %w", err)
	}
	ptrs := make([]*Instance, len(out))
	for i := range out {
		ptrs[i] = &out[i]
	}
	return out, loadGPUs(ctx, q, ptrs)
}

// HostInstances lists the instances host node must run (placed there and
// not deleted), by id: the NodeSpec "instances" section's contents.
func HostInstances(ctx context.Context, q Querier, node string) ([]Instance, error) {
	rows, err := q.Query(ctx, `SELECT `+cols+` FROM instances i
		WHERE i.node_id = $1 AND i.state NOT IN ('deleting', 'deleted') ORDER BY i.id`, node)
	if err != nil {
		return nil, fmt.Errorf("instances of %s: %w", node, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Instance, error) { return scan(r) })
	if err != nil {
		return nil, fmt.Errorf("instances of %s: %w", node, err)
	}
	ptrs := make([]*Instance, len(out))
	for i := range out {
		ptrs[i] = &out[i]
	}
	return out, loadGPUs(ctx, q, ptrs)
}
