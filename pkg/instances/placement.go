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

// Refused reports whether err is a placement's NO_CAPACITY, QUOTA_EXCEEDED
// or NOT_FOUND rather than a failure to retry.
func Refused(err error) bool {
	c := fault.CodeOf(err)
	return c == fault.NoCapacity || c == fault.QuotaExceeded || c == fault.NotFound
}
