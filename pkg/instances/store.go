package instances

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/iam"
)

// Querier runs statements: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Pool classes (pkg/pools).
const (
	classVPSHost  = "vps-host"
	classProvider = "provider"
)

func notPlaceable(tenant, pool string) error {
	return fault.New(fault.NotFound, "poolId", "no pool %q that tenant %s can place instances in (its own pools, or an ancestor's shared with its descendants)", pool, tenant)
}

// PoolOf checks that tenant may place instances in pool (its own, or an
// ancestor's shared with descendants; else NOT_FOUND on poolId) and returns
// its class: a gpu pool is INVALID_INPUT on poolId. [Place] checks again
// in its transaction.
func PoolOf(ctx context.Context, q Querier, tenant, pool string) (string, error) {
	var owner, class, sharing string
	err := q.QueryRow(ctx, `SELECT tenant_id, class, sharing FROM pools WHERE id = $1`, pool).Scan(&owner, &class, &sharing)
	if errors.Is(err, pgx.ErrNoRows) || (err == nil && owner != tenant && (sharing != "descendants" || iam.Below(tenant, owner) == nil)) {
		return "", notPlaceable(tenant, pool)
	}
	if err != nil {
		return "", fmt.Errorf("read pool: %w", err)
	}
	if class != classVPSHost && class != classProvider {
		return "", fault.New(fault.InvalidInput, "poolId", "pool %s is a %s pool; instances run in vps-host and provider pools", pool, class)
	}
	return class, nil
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

// PlaceOptions tune [Place] and [Resize].
type PlaceOptions struct {
	// LostAfter: a host unseen this long is not chosen; 0 means
	// [DefaultLostAfter].
	LostAfter time.Duration
}

// Create inserts in and places it in tx ([Insert], then [Place]) and
// returns the host.
func Create(ctx context.Context, tx pgx.Tx, in *Instance, o PlaceOptions) (string, error) {
	if err := Insert(ctx, tx, *in); err != nil {
		return "", err
	}
	return Place(ctx, tx, in, o)
}

// Place claims every dimension of pending instance in on one host of its
// hosted pool, in tx, and moves it to placed: it locks the quotas that
// apply (tenant and ancestors in the pool) and checks them with the
// instance counted, makes sure every node of the pool has its
// host_capacity row, picks a host (fewest partial: a host already in use
// first, then the tightest fit, then by id; eligible hosts are adopted, not
// draining, schedulable and seen within LostAfter), adds the size to its
// used counters and claims its GPUs. It returns the host (whose desired
// state the caller invalidates).
//
// Nothing fits: NO_CAPACITY naming the dimension that is short (vcpus,
// memoryMiB, diskGiB, gpuCount; poolId when the pool has no schedulable
// host). Over a quota: QUOTA_EXCEEDED naming the dimension, with the
// limit. A pool the tenant may not use: NOT_FOUND on poolId. Each error
// leaves tx as it was before the call.
func Place(ctx context.Context, tx pgx.Tx, in *Instance, o PlaceOptions) (string, error) {
	if o.LostAfter <= 0 {
		o.LostAfter = DefaultLostAfter
	}
	sp, err := tx.Begin(ctx)
	if err != nil {
		return "", err
	}
	node, err := place(ctx, sp, in, o)
	if err != nil {
		if rerr := sp.Rollback(ctx); rerr != nil {
			return "", rerr
		}
		return "", err
	}
	if err := sp.Commit(ctx); err != nil {
		return "", err
	}
	in.NodeID, in.State, in.Reason = node, StatePlaced, ""
	return node, nil
}

func place(ctx context.Context, tx pgx.Tx, in *Instance, o PlaceOptions) (string, error) {
	if err := lockPool(ctx, tx, in.TenantID, in.PoolID); err != nil {
		return "", err
	}
	if err := checkQuotas(ctx, tx, in.TenantID, in.PoolID, in.Size); err != nil {
		return "", err
	}
	if err := ensureHosts(ctx, tx, in.PoolID); err != nil {
		return "", err
	}
	node, err := claimHost(ctx, tx, in, o.LostAfter)
	if err != nil {
		return "", err
	}
	_, err = tx.Exec(ctx, `UPDATE instances SET node_id = $2, state = 'placed', reason = '', placed_at = now(), accrued_at = now(),
		updated_at = now() WHERE id = $1`, in.ID, node)
	if err != nil {
		return "", fmt.Errorf("mark placed: %w", err)
	}
	return node, nil
}

// lockPool checks that tenant may place in pool (see [PoolOf]), that the
// pool is hosted, and locks the quotas of tenant and its ancestors in the
// pool: creates and resizes under a quota run one at a time, so the usage
// checkQuotas reads stays true until commit. In a shared pool (an
// ancestor's) a quota of the tenant or of an ancestor below the owner must
// exist: there is no default instance quota.
func lockPool(ctx context.Context, tx pgx.Tx, tenant, pool string) error {
	var owner, class, sharing string
	err := tx.QueryRow(ctx, `SELECT tenant_id, class, sharing FROM pools WHERE id = $1`, pool).Scan(&owner, &class, &sharing)
	if errors.Is(err, pgx.ErrNoRows) {
		return notPlaceable(tenant, pool)
	}
	if err != nil {
		return fmt.Errorf("read pool: %w", err)
	}
	rows, err := tx.Query(ctx, `SELECT tenant_id FROM instance_quotas WHERE pool_id = $1 AND tenant_id = ANY($2) ORDER BY tenant_id FOR UPDATE`,
		pool, iam.Ancestors(tenant))
	if err != nil {
		return fmt.Errorf("lock instance quotas: %w", err)
	}
	locked, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("lock instance quotas: %w", err)
	}
	if owner != tenant {
		chain := iam.Below(tenant, owner)
		if chain == nil || sharing != "descendants" {
			return notPlaceable(tenant, pool)
		}
		if !slices.ContainsFunc(locked, func(t string) bool { return slices.Contains(chain, t) }) {
			return fault.New(fault.QuotaExceeded, "vcpus",
				"pool %s is tenant %s's, shared with its descendants; instances there need an instance quota for tenant %s or an ancestor below %s: ask tenant %s for one",
				pool, owner, tenant, owner, owner)
		}
	}
	switch class {
	case classVPSHost:
		return nil
	case classProvider:
		return fault.New(fault.Unsupported, "poolId", "provider pools are not built yet")
	default:
		return fault.New(fault.InvalidInput, "poolId", "pool %s is a %s pool; instances run in vps-host and provider pools", pool, class)
	}
}

// checkQuotas fails with QUOTA_EXCEEDED naming the dimension if a quota of
// tenant or an ancestor in pool is over its limit in a dimension in which
// delta (what the create or resize adds, already written) is positive. The
// caller holds the quota rows' locks ([lockPool]).
func checkQuotas(ctx context.Context, tx pgx.Tx, tenant, pool string, delta Size) error {
	rows, err := tx.Query(ctx, `
		SELECT q.tenant_id, q.vcpus, q.memory_mib, q.disk_gib, q.gpus,
		       coalesce(sum(i.vcpus), 0), coalesce(sum(i.memory_mib), 0), coalesce(sum(i.disk_gib), 0), coalesce(sum(i.gpu_count), 0)
		  FROM instance_quotas q
		  LEFT JOIN instances i ON i.pool_id = q.pool_id AND i.state NOT IN ('deleting', 'deleted')
		       AND (q.tenant_id = 'root' OR i.tenant_id = q.tenant_id OR starts_with(i.tenant_id, q.tenant_id || '.'))
		 WHERE q.pool_id = $1 AND q.tenant_id = ANY($2)
		 GROUP BY q.tenant_id, q.vcpus, q.memory_mib, q.disk_gib, q.gpus
		 ORDER BY length(q.tenant_id) DESC`, pool, iam.Ancestors(tenant))
	if err != nil {
		return fmt.Errorf("check instance quotas: %w", err)
	}
	defer rows.Close()
	want := delta.vec()
	for rows.Next() {
		var t string
		var limit [4]*int64
		var used [4]int64
		if err := rows.Scan(&t, &limit[0], &limit[1], &limit[2], &limit[3], &used[0], &used[1], &used[2], &used[3]); err != nil {
			return err
		}
		for d := range dims {
			if want[d] > 0 && limit[d] != nil && used[d] > *limit[d] {
				return fault.New(fault.QuotaExceeded, dims[d].field,
					"instance quota of tenant %s in pool %s is %d %s; %d in use, this asks for %d more",
					t, pool, *limit[d], dims[d].unit, used[d]-want[d], want[d])
			}
		}
	}
	return rows.Err()
}

// hostTotals computes a host's totals: its inventory's host size where it
// reports one (host.cpuCount, host.memoryBytes, host.diskBytes), else the
// pool's host size, minus the pool's reserve, never below 0.
const hostTotals = `
	greatest(0, coalesce(nullif(ni.report->'host'->>'cpuCount', '')::numeric::int, s.host_vcpus, 0) - coalesce(s.reserve_vcpus, 0)),
	greatest(0, coalesce((nullif(ni.report->'host'->>'memoryBytes', '')::numeric / 1048576)::bigint, s.host_memory_mib, 0) - coalesce(s.reserve_memory_mib, 0)),
	greatest(0, coalesce((nullif(ni.report->'host'->>'diskBytes', '')::numeric / 1073741824)::bigint, s.host_disk_gib, 0) - coalesce(s.reserve_disk_gib, 0))`

// ensureHosts inserts the host_capacity rows that nodes of pool lack. It
// locks nothing that exists (ON CONFLICT DO NOTHING), so concurrent
// creates do not queue on it; [SyncHosts] refreshes existing totals.
func ensureHosts(ctx context.Context, tx pgx.Tx, pool string) error {
	_, err := tx.Exec(ctx, `
		INSERT INTO host_capacity (node_id, pool_id, vcpus_total, memory_mib_total, disk_gib_total)
		SELECT n.id, n.pool_id, `+hostTotals+`
		  FROM nodes n LEFT JOIN node_inventory ni ON ni.node_id = n.id LEFT JOIN vps_pool_settings s ON s.pool_id = n.pool_id
		 WHERE n.pool_id = $1 AND n.state <> 'retired' AND NOT EXISTS (SELECT 1 FROM host_capacity h WHERE h.node_id = n.id)
		ON CONFLICT (node_id) DO NOTHING`, pool)
	if err != nil {
		return fmt.Errorf("add hosts of %s: %w", pool, err)
	}
	return nil
}

// SyncHosts brings the host_capacity rows of every node of pool in line
// with their inventory and the pool's settings ([Settings]) and returns
// how many changed. A total below what is in use is kept at the used
// amount: the host takes nothing more until instances leave. Run it after
// a change of the pool's settings or of a host's inventory.
func SyncHosts(ctx context.Context, q Querier, pool string) (int, error) {
	tag, err := q.Exec(ctx, `
		INSERT INTO host_capacity AS h (node_id, pool_id, vcpus_total, memory_mib_total, disk_gib_total)
		SELECT n.id, n.pool_id, `+hostTotals+`
		  FROM nodes n LEFT JOIN node_inventory ni ON ni.node_id = n.id LEFT JOIN vps_pool_settings s ON s.pool_id = n.pool_id
		 WHERE n.pool_id = $1 AND n.state <> 'retired'
		 ORDER BY n.id
		ON CONFLICT (node_id) DO UPDATE SET
			vcpus_total = greatest(EXCLUDED.vcpus_total, h.vcpus_used),
			memory_mib_total = greatest(EXCLUDED.memory_mib_total, h.memory_mib_used),
			disk_gib_total = greatest(EXCLUDED.disk_gib_total, h.disk_gib_used),
			pool_id = EXCLUDED.pool_id, updated_at = now()
		 WHERE (h.vcpus_total, h.memory_mib_total, h.disk_gib_total, h.pool_id) IS DISTINCT FROM
		       (greatest(EXCLUDED.vcpus_total, h.vcpus_used), greatest(EXCLUDED.memory_mib_total, h.memory_mib_used),
		        greatest(EXCLUDED.disk_gib_total, h.disk_gib_used), EXCLUDED.pool_id)`, pool)
	if err != nil {
		return 0, fmt.Errorf("sync hosts of %s: %w", pool, err)
	}
	return int(tag.RowsAffected()), nil
}

// eligible is the condition on host_capacity h and nodes n for a host that
// placement may choose, with $2 the lost-after interval: adopted (not
// draining), schedulable (observed generation at least 1), seen within it.
//
// The node is reached through its primary key only: its pool is compared
// with IS NOT DISTINCT FROM (both columns are NOT NULL, so it means =),
// which no index serves. With "n.pool_id = $1" or "= h.pool_id" the
// planner, without statistics (autovacuum off, a fresh pool), scans
// nodes_pool for every host — every node of the pool per host: 100 ms
// per create at 1,000 hosts instead of 1.4 ms.
const eligible = `h.pool_id = $1 AND n.id = h.node_id AND n.pool_id IS NOT DISTINCT FROM h.pool_id AND n.state = 'adopted'
	AND n.observed_generation >= 1 AND n.last_seen_at > now() - $2::interval`

// freeGPUsOf counts host h's GPUs free for instances of the model in
// parameter model (e.g. "$3"): healthy, present, not quarantined, whole
// (not MIG-enabled) and not claimed.
func freeGPUsOf(model string) string {
	return `(SELECT count(*) FROM devices d
	WHERE d.node_id = h.node_id AND d.kind = 'gpu' AND d.healthy AND d.missing_since IS NULL AND d.quarantined_at IS NULL
	  AND NOT d.mig_enabled AND (` + model + ` = '' OR d.model = ` + model + ` OR starts_with(d.model, ` + model + ` || ' '))
	  AND NOT EXISTS (SELECT 1 FROM instance_gpus g WHERE g.node_id = d.node_id AND g.device_id = d.id AND g.active))`
}

// freeGPUs is [freeGPUsOf] the model in $3.
var freeGPUs = freeGPUsOf("$3")

// claimHost picks and claims a host for in, see [Place]. A host a
// concurrent create holds is passed over (SKIP LOCKED); only when no other
// fits does it wait for one. The row lock serializes the claims on one
// host, the conditional update claims only what still fits, and the
// CHECK constraints stand behind both.
func claimHost(ctx context.Context, tx pgx.Tx, in *Instance, lostAfter time.Duration) (string, error) {
	var exclude []string
	for attempt := 0; attempt < 16; attempt++ {
		node := ""
		for _, wait := range []bool{false, true} {
			n, err := pickHost(ctx, tx, in, lostAfter, exclude, wait)
			if err != nil {
				return "", err
			}
			if n != "" {
				node = n
				break
			}
		}
		if node == "" {
			return "", shortage(ctx, tx, in, lostAfter, exclude)
		}
		ok, err := claimOn(ctx, tx, in, node)
		if err != nil {
			return "", err
		}
		if ok {
			return node, nil
		}
		exclude = append(exclude, node) // its GPUs went to a concurrent create
	}
	return "", fault.New(fault.Unavailable, "gpuCount", "placement kept losing GPUs to concurrent creates; retry")
}

// pickHost locks and returns the best host for in, "" when none fits (that
// it could lock, unless wait).
func pickHost(ctx context.Context, tx pgx.Tx, in *Instance, lostAfter time.Duration, exclude []string, wait bool) (string, error) {
	if exclude == nil {
		exclude = []string{}
	}
	lock := `FOR UPDATE OF h SKIP LOCKED`
	if wait {
		lock = `FOR UPDATE OF h`
	}
	var node string
	err := tx.QueryRow(ctx, `
		SELECT h.node_id FROM host_capacity h, nodes n
		 WHERE `+eligible+` AND NOT (h.node_id = ANY($8))
		   AND h.vcpus_total - h.vcpus_used >= $4 AND h.memory_mib_total - h.memory_mib_used >= $5
		   AND h.disk_gib_total - h.disk_gib_used >= $6 AND ($7 = 0 OR `+freeGPUs+` >= $7)
		 ORDER BY h.instances > 0 DESC, h.vcpus_total - h.vcpus_used, h.memory_mib_total - h.memory_mib_used,
		          h.disk_gib_total - h.disk_gib_used, h.node_id
		 LIMIT 1 `+lock,
		in.PoolID, lostAfter, in.GPUModel, in.VCPUs, in.MemoryMiB, in.DiskGiB, in.GPUs, exclude).Scan(&node)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("pick host: %w", err)
	}
	return node, nil
}

// claimOn adds in's size to locked host node and claims its GPUs, under a
// savepoint; false (the savepoint rolled back) when the host's GPUs no
// longer suffice.
func claimOn(ctx context.Context, tx pgx.Tx, in *Instance, node string) (bool, error) {
	sp, err := tx.Begin(ctx)
	if err != nil {
		return false, err
	}
	ok, err := claim(ctx, sp, in.ID, node, in.Size, Size{}, in.GPUModel)
	if err != nil || !ok {
		if rerr := sp.Rollback(ctx); err == nil {
			err = rerr
		}
		return false, err
	}
	return true, sp.Commit(ctx)
}

// claim changes host node's used counters by delta (more or less, one
// instance more when was is zero) and claims delta.GPUs more GPUs of model
// for instance id (or releases -delta.GPUs); false when the GPUs are not
// there. A counter over its total is NO_CAPACITY naming the dimension (the
// CHECK constraint's refusal).
func claim(ctx context.Context, tx pgx.Tx, id, node string, delta, was Size, model string) (bool, error) {
	newInstance := 0
	if was == (Size{}) {
		newInstance = 1
	}
	_, err := tx.Exec(ctx, `UPDATE host_capacity SET vcpus_used = vcpus_used + $2, memory_mib_used = memory_mib_used + $3,
		disk_gib_used = disk_gib_used + $4, instances = instances + $5, updated_at = now() WHERE node_id = $1`,
		node, delta.VCPUs, delta.MemoryMiB, delta.DiskGiB, newInstance)
	if err != nil {
		return false, checkViolation(err, node, delta)
	}
	switch {
	case delta.GPUs > 0:
		tag, err := tx.Exec(ctx, `
			INSERT INTO instance_gpus (instance_id, node_id, device_id, model, pci_bus_id)
			SELECT $1, d.node_id, d.id, d.model, d.pci_bus_id FROM devices d
			 WHERE d.node_id = $2 AND d.kind = 'gpu' AND d.healthy AND d.missing_since IS NULL AND d.quarantined_at IS NULL
			   AND NOT d.mig_enabled AND ($3 = '' OR d.model = $3 OR starts_with(d.model, $3 || ' '))
			   AND NOT EXISTS (SELECT 1 FROM instance_gpus g WHERE g.node_id = d.node_id AND g.device_id = d.id AND g.active)
			 ORDER BY d.index, d.id LIMIT $4
			ON CONFLICT DO NOTHING`, id, node, model, delta.GPUs)
		if err != nil {
			return false, fmt.Errorf("claim GPUs on %s: %w", node, err)
		}
		return int(tag.RowsAffected()) == delta.GPUs, nil
	case delta.GPUs < 0:
		_, err := tx.Exec(ctx, `
			UPDATE instance_gpus SET active = false, released_at = now()
			 WHERE (instance_id, node_id, device_id) IN (
			       SELECT instance_id, node_id, device_id FROM instance_gpus WHERE instance_id = $1 AND active
			        ORDER BY device_id DESC LIMIT $2)`, id, -delta.GPUs)
		if err != nil {
			return false, fmt.Errorf("release GPUs on %s: %w", node, err)
		}
	}
	return true, nil
}

// checkViolation turns a host_capacity CHECK violation into NO_CAPACITY
// naming its dimension.
func checkViolation(err error, node string, delta Size) error {
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "23514" {
		want := delta.vec()
		for i, c := range []string{"host_capacity_vcpus", "host_capacity_memory", "host_capacity_disk"} {
			if pe.ConstraintName == c {
				return fault.New(fault.NoCapacity, dims[i].field, "host %s does not have %d more %s free", node, want[i], dims[i].unit)
			}
		}
	}
	return fmt.Errorf("claim capacity on %s: %w", node, err)
}

// shortage explains why nothing fits in: NO_CAPACITY naming the first
// dimension that no eligible host has enough of, or, when each fits
// somewhere but none holds all, the dimension the fewest hosts have.
func shortage(ctx context.Context, q Querier, in *Instance, lostAfter time.Duration, exclude []string) error {
	var hosts int64
	var best, fitting [4]int64
	err := q.QueryRow(ctx, `
		SELECT count(*), coalesce(max(vf), 0), coalesce(max(mf), 0), coalesce(max(df), 0), coalesce(max(gf), 0),
		       count(*) FILTER (WHERE vf >= $4), count(*) FILTER (WHERE mf >= $5), count(*) FILTER (WHERE df >= $6),
		       count(*) FILTER (WHERE gf >= $7)
		  FROM (SELECT h.vcpus_total - h.vcpus_used AS vf, h.memory_mib_total - h.memory_mib_used AS mf,
		               h.disk_gib_total - h.disk_gib_used AS df, CASE WHEN $7 = 0 THEN 0 ELSE `+freeGPUs+` END AS gf
		          FROM host_capacity h, nodes n WHERE `+eligible+`) f`,
		in.PoolID, lostAfter, in.GPUModel, in.VCPUs, in.MemoryMiB, in.DiskGiB, in.GPUs).
		Scan(&hosts, &best[0], &best[1], &best[2], &best[3], &fitting[0], &fitting[1], &fitting[2], &fitting[3])
	if err != nil {
		return fmt.Errorf("explain shortage: %w", err)
	}
	if hosts == 0 {
		return fault.New(fault.NoCapacity, "poolId", "pool %s has no schedulable host", in.PoolID)
	}
	want := in.vec()
	for d := range dims {
		if best[d] < want[d] {
			what := dims[d].unit
			if d == 3 && in.GPUModel != "" {
				what = in.GPUModel + " GPUs"
			}
			return fault.New(fault.NoCapacity, dims[d].field, "need %d %s on one host; the most free on a schedulable host of pool %s is %d",
				want[d], what, in.PoolID, best[d])
		}
	}
	if len(exclude) > 0 {
		return fault.New(fault.NoCapacity, "gpuCount", "need %d GPUs on one host; concurrent creates took the free ones", in.GPUs)
	}
	d := 0
	for i := range dims {
		if want[i] > 0 && fitting[i] < fitting[d] {
			d = i
		}
	}
	return fault.New(fault.NoCapacity, dims[d].field,
		"no schedulable host of pool %s has %d vCPUs, %d MiB of memory, %d GiB of disk and %d GPUs free at once (%d of %d hosts have the %s)",
		in.PoolID, in.VCPUs, in.MemoryMiB, in.DiskGiB, in.GPUs, fitting[d], hosts, dims[d].unit)
}

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

// Settings are a pool's VPS settings: the size to assume for a host whose
// inventory does not report it, and what each host keeps for itself.
type Settings struct {
	Host, Reserve Size
}

// GetSettings reads pool's settings (zero when never set).
func GetSettings(ctx context.Context, q Querier, pool string) (Settings, error) {
	var s Settings
	err := q.QueryRow(ctx, `SELECT host_vcpus, host_memory_mib, host_disk_gib, reserve_vcpus, reserve_memory_mib, reserve_disk_gib
		FROM vps_pool_settings WHERE pool_id = $1`, pool).Scan(&s.Host.VCPUs, &s.Host.MemoryMiB, &s.Host.DiskGiB,
		&s.Reserve.VCPUs, &s.Reserve.MemoryMiB, &s.Reserve.DiskGiB)
	if errors.Is(err, pgx.ErrNoRows) {
		return Settings{}, nil
	}
	return s, err
}

// ValidSettings checks settings, naming the bad field under prefix (e.g.
// "vps.reserve.vcpus").
func ValidSettings(s Settings, prefix string) error {
	for _, v := range []struct {
		name string
		size Size
	}{{"host", s.Host}, {"reserve", s.Reserve}} {
		name, vec := v.name, v.size.vec()
		for d, n := range vec[:3] {
			if n < 0 || n > [3]int64{64 * MaxVCPUs, 64 * MaxMemoryMiB, 64 * MaxDiskGiB}[d] {
				return fault.New(fault.InvalidInput, prefix+"."+name+"."+dims[d].field, "expected 0 or more, within bounds, got %d", n)
			}
		}
	}
	return nil
}

// SetSettings stores pool's settings and brings its hosts' totals in line
// ([SyncHosts]).
func SetSettings(ctx context.Context, q Querier, pool string, s Settings) error {
	_, err := q.Exec(ctx, `
		INSERT INTO vps_pool_settings (pool_id, host_vcpus, host_memory_mib, host_disk_gib, reserve_vcpus, reserve_memory_mib, reserve_disk_gib)
		VALUES ($1, $2, $3, $4, $5, $6, $7)
		ON CONFLICT (pool_id) DO UPDATE SET host_vcpus = EXCLUDED.host_vcpus, host_memory_mib = EXCLUDED.host_memory_mib,
			host_disk_gib = EXCLUDED.host_disk_gib, reserve_vcpus = EXCLUDED.reserve_vcpus,
			reserve_memory_mib = EXCLUDED.reserve_memory_mib, reserve_disk_gib = EXCLUDED.reserve_disk_gib, updated_at = now()`,
		pool, s.Host.VCPUs, s.Host.MemoryMiB, s.Host.DiskGiB, s.Reserve.VCPUs, s.Reserve.MemoryMiB, s.Reserve.DiskGiB)
	if err != nil {
		return fmt.Errorf("set vps settings of %s: %w", pool, err)
	}
	_, err = SyncHosts(ctx, q, pool)
	return err
}

// Quota bounds what a tenant (with its descendants) holds in a pool; a nil
// dimension is unbounded.
type Quota struct {
	PoolID, TenantID                string
	VCPUs, MemoryMiB, DiskGiB, GPUs *int64
	UpdatedAt                       time.Time
}

// SetQuota sets a quota (all dimensions nil removes it; false then).
func SetQuota(ctx context.Context, q Querier, qt Quota) (Quota, bool, error) {
	if qt.VCPUs == nil && qt.MemoryMiB == nil && qt.DiskGiB == nil && qt.GPUs == nil {
		_, err := q.Exec(ctx, `DELETE FROM instance_quotas WHERE pool_id = $1 AND tenant_id = $2`, qt.PoolID, qt.TenantID)
		return Quota{}, false, err
	}
	for i, v := range []*int64{qt.VCPUs, qt.MemoryMiB, qt.DiskGiB, qt.GPUs} {
		if v != nil && *v < 0 {
			return Quota{}, false, fault.New(fault.InvalidInput, dims[i].field, "expected 0 or more, got %d", *v)
		}
	}
	err := q.QueryRow(ctx, `
		INSERT INTO instance_quotas (pool_id, tenant_id, vcpus, memory_mib, disk_gib, gpus) VALUES ($1, $2, $3, $4, $5, $6)
		ON CONFLICT (pool_id, tenant_id) DO UPDATE SET vcpus = EXCLUDED.vcpus, memory_mib = EXCLUDED.memory_mib,
			disk_gib = EXCLUDED.disk_gib, gpus = EXCLUDED.gpus, updated_at = now()
		RETURNING updated_at`, qt.PoolID, qt.TenantID, qt.VCPUs, qt.MemoryMiB, qt.DiskGiB, qt.GPUs).Scan(&qt.UpdatedAt)
	if err != nil {
		return Quota{}, false, fmt.Errorf("set instance quota: %w", err)
	}
	return qt, true, nil
}

// ListQuotas lists pool's instance quotas by tenant.
func ListQuotas(ctx context.Context, q Querier, pool string) ([]Quota, error) {
	rows, err := q.Query(ctx, `SELECT pool_id, tenant_id, vcpus, memory_mib, disk_gib, gpus, updated_at FROM instance_quotas
		WHERE pool_id = $1 ORDER BY tenant_id`, pool)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Quota, error) {
		var v Quota
		return v, r.Scan(&v.PoolID, &v.TenantID, &v.VCPUs, &v.MemoryMiB, &v.DiskGiB, &v.GPUs, &v.UpdatedAt)
	})
}

// PoolCapacity is a hosted pool's capacity: Total over every host, Free on
// the schedulable ones.
type PoolCapacity struct {
	Hosts, SchedulableHosts int
	Total, Free             Size
}

// Capacity reads pool's capacity now.
func Capacity(ctx context.Context, q Querier, pool string, lostAfter time.Duration) (PoolCapacity, error) {
	if lostAfter <= 0 {
		lostAfter = DefaultLostAfter
	}
	var c PoolCapacity
	err := q.QueryRow(ctx, `
		SELECT count(*), count(*) FILTER (WHERE ok),
		       coalesce(sum(vcpus_total), 0), coalesce(sum(memory_mib_total), 0), coalesce(sum(disk_gib_total), 0), coalesce(sum(gpus), 0),
		       coalesce(sum(vcpus_total - vcpus_used) FILTER (WHERE ok), 0), coalesce(sum(memory_mib_total - memory_mib_used) FILTER (WHERE ok), 0),
		       coalesce(sum(disk_gib_total - disk_gib_used) FILTER (WHERE ok), 0), coalesce(sum(gf) FILTER (WHERE ok), 0)
		  FROM (SELECT h.*, (n.state = 'adopted' AND n.observed_generation >= 1 AND n.last_seen_at > now() - $2::interval) AS ok,
		               (SELECT count(*) FROM devices d WHERE d.node_id = h.node_id AND d.kind = 'gpu') AS gpus,
		               `+freeGPUs+` AS gf
		          FROM host_capacity h JOIN nodes n ON n.id = h.node_id WHERE h.pool_id = $1) f`, pool, lostAfter, "").
		Scan(&c.Hosts, &c.SchedulableHosts, &c.Total.VCPUs, &c.Total.MemoryMiB, &c.Total.DiskGiB, &c.Total.GPUs,
			&c.Free.VCPUs, &c.Free.MemoryMiB, &c.Free.DiskGiB, &c.Free.GPUs)
	if err != nil {
		return PoolCapacity{}, fmt.Errorf("read capacity of %s: %w", pool, err)
	}
	return c, nil
}

// TenantUsage is what a tenant holds in a pool and its instance-hours.
type TenantUsage struct {
	TenantID string
	Held     Size
	Usage    Usage
}

// UsageOf sums pool's instances per tenant: what the live ones hold and the
// instance-hours of all (pruned instances' hours are gone with them).
func UsageOf(ctx context.Context, q Querier, pool string) ([]TenantUsage, error) {
	rows, err := q.Query(ctx, `
		SELECT i.tenant_id,
		       coalesce(sum(i.vcpus) FILTER (WHERE i.state NOT IN ('deleting', 'deleted')), 0),
		       coalesce(sum(i.memory_mib) FILTER (WHERE i.state NOT IN ('deleting', 'deleted')), 0),
		       coalesce(sum(i.disk_gib) FILTER (WHERE i.state NOT IN ('deleting', 'deleted')), 0),
		       coalesce(sum(i.gpu_count) FILTER (WHERE i.state NOT IN ('deleting', 'deleted')), 0),
		       sum(i.vcpu_hours + i.vcpus * `+heldHours+`), sum(i.memory_mib_hours + i.memory_mib * `+heldHours+`),
		       sum(i.disk_gib_hours + i.disk_gib * `+heldHours+`), sum(i.gpu_hours + i.gpu_count * `+heldHours+`)
		  FROM instances i WHERE i.pool_id = $1 GROUP BY i.tenant_id ORDER BY i.tenant_id`, pool)
	if err != nil {
		return nil, fmt.Errorf("instance usage of %s: %w", pool, err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (TenantUsage, error) {
		var u TenantUsage
		return u, r.Scan(&u.TenantID, &u.Held.VCPUs, &u.Held.MemoryMiB, &u.Held.DiskGiB, &u.Held.GPUs,
			&u.Usage.VCPUHours, &u.Usage.MemoryMiBHours, &u.Usage.DiskGiBHours, &u.Usage.GPUHours)
	})
}

// Refused reports whether err is a placement's NO_CAPACITY, QUOTA_EXCEEDED
// or NOT_FOUND rather than a failure to retry.
func Refused(err error) bool {
	c := fault.CodeOf(err)
	return c == fault.NoCapacity || c == fault.QuotaExceeded || c == fault.NotFound
}
