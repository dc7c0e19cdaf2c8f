package instances

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

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
