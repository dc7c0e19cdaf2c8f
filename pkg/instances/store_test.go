package instances_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/instances"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/pkg/pools"
)

// host is a small host's size: 8 vCPUs, 16 GiB, 100 GiB of disk (the
// pool's host size, minus a reserve of 1 vCPU, 1 GiB and 10 GiB).
var host = instances.Size{VCPUs: 8, MemoryMiB: 16384, DiskGiB: 100}

// setup opens a fresh database with the vps-host pool "pool_v" (root)
// sized so that each host has [host] to give, and hosts adopted,
// schedulable and live, each with gpus H200s.
func setup(t *testing.T, hosts, gpus int) *pgxpool.Pool {
	t.Helper()
	pool, err := db.Open(t.Context(), db.Config{URL: pgtest.NewDB(t), MaxConns: 40})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	fixture.Pool(t, pool, fixture.PoolOpts{ID: "pool_v", Class: pools.ClassVPSHost})
	err = instances.SetSettings(t.Context(), pool, "pool_v", instances.Settings{
		Host:    instances.Size{VCPUs: host.VCPUs + 1, MemoryMiB: host.MemoryMiB + 1024, DiskGiB: host.DiskGiB + 10},
		Reserve: instances.Size{VCPUs: 1, MemoryMiB: 1024, DiskGiB: 10},
	})
	if err != nil {
		t.Fatal(err)
	}
	for i := range hosts {
		addHost(t, pool, fmt.Sprintf("node_%02d", i), "adopted", gpus)
	}
	return pool
}

func addHost(t *testing.T, pool *pgxpool.Pool, id, state string, gpus int) {
	t.Helper()
	fixture.Node(t, pool, fixture.NodeOpts{ID: id, Pool: "pool_v", State: state, Live: true, Gateway: "gw-1"})
	for g := range gpus {
		fixture.Device(t, pool, fixture.DeviceOpts{Node: id, Index: g, PCIBusID: fmt.Sprintf("0000:%02x:00.0", 0x18+g)})
	}
}

func mustExec(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	if _, err := pool.Exec(t.Context(), sql, args...); err != nil {
		t.Fatal(err)
	}
}

func fieldOf(err error) string {
	if fe, ok := fault.As(err); ok {
		return fe.Field
	}
	return ""
}

func wantFault(t *testing.T, err error, code fault.Code, field string) {
	t.Helper()
	if fault.CodeOf(err) != code || fieldOf(err) != field {
		t.Fatalf("got %v (field %q), want %s on %q", err, fieldOf(err), code, field)
	}
}

// create inserts and places an instance in one transaction, as admission's
// second transaction does.
func create(ctx context.Context, pool *pgxpool.Pool, id, tenant string, s instances.Size) (instances.Instance, error) {
	in := instances.Instance{ID: id, TenantID: tenant, PoolID: "pool_v", Size: s, Image: "ubuntu-24.04"}
	err := db.InTx(ctx, pool, db.TxOptions{}, func(tx pgx.Tx) error {
		_, err := instances.Create(ctx, tx, &in, instances.PlaceOptions{})
		return err
	})
	return in, err
}

// hostRow is one host_capacity row.
type hostRow struct {
	node                    string
	total, used, instSum    instances.Size
	instances, liveInstance int
}

// hosts reads every host's totals and used counters, and what the live
// instances placed on it add up to.
func hosts(t *testing.T, pool *pgxpool.Pool) []hostRow {
	t.Helper()
	rows, err := pool.Query(t.Context(), `
		SELECT h.node_id, h.vcpus_total, h.memory_mib_total, h.disk_gib_total, h.vcpus_used, h.memory_mib_used, h.disk_gib_used, h.instances,
		       coalesce(sum(i.vcpus), 0), coalesce(sum(i.memory_mib), 0), coalesce(sum(i.disk_gib), 0), count(i.id),
		       (SELECT count(*) FROM devices d WHERE d.node_id = h.node_id),
		       (SELECT count(*) FROM instance_gpus g WHERE g.node_id = h.node_id AND g.active)
		  FROM host_capacity h LEFT JOIN instances i ON i.node_id = h.node_id AND i.state NOT IN ('deleting', 'deleted')
		 GROUP BY h.node_id ORDER BY h.node_id`)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (hostRow, error) {
		var h hostRow
		err := r.Scan(&h.node, &h.total.VCPUs, &h.total.MemoryMiB, &h.total.DiskGiB, &h.used.VCPUs, &h.used.MemoryMiB, &h.used.DiskGiB,
			&h.instances, &h.instSum.VCPUs, &h.instSum.MemoryMiB, &h.instSum.DiskGiB, &h.liveInstance, &h.total.GPUs, &h.used.GPUs)
		return h, err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// checkHosts fails unless every host's used counters equal what its live
// instances hold and stay within its totals in every dimension.
func checkHosts(t *testing.T, pool *pgxpool.Pool) []hostRow {
	t.Helper()
	hs := hosts(t, pool)
	for _, h := range hs {
		if h.used.VCPUs != h.instSum.VCPUs || h.used.MemoryMiB != h.instSum.MemoryMiB || h.used.DiskGiB != h.instSum.DiskGiB || h.instances != h.liveInstance {
			t.Errorf("%s: used %+v (%d instances) but its instances hold %+v (%d)", h.node, h.used, h.instances, h.instSum, h.liveInstance)
		}
		if h.used.VCPUs > h.total.VCPUs || h.used.MemoryMiB > h.total.MemoryMiB || h.used.DiskGiB > h.total.DiskGiB || h.used.GPUs > h.total.GPUs {
			t.Errorf("%s oversubscribed: used %+v of %+v", h.node, h.used, h.total)
		}
	}
	return hs
}

func TestHostCapacityFromPoolSettingsMinusReserve(t *testing.T) {
	t.Parallel()
	pool := setup(t, 1, 0)
	if _, err := create(t.Context(), pool, "inst_a", "root", instances.Size{VCPUs: 1, MemoryMiB: 1, DiskGiB: 1}); err != nil {
		t.Fatal(err)
	}
	hs := hosts(t, pool)
	if len(hs) != 1 || hs[0].total.VCPUs != host.VCPUs || hs[0].total.MemoryMiB != host.MemoryMiB || hs[0].total.DiskGiB != host.DiskGiB {
		t.Fatalf("host totals %+v, want %+v", hs, host)
	}
	t.Run("an inventory's host size wins over the pool's", func(t *testing.T) {
		mustExec(t, pool, `INSERT INTO node_inventory (node_id, session_epoch, report) VALUES ('node_00', 1,
			'{"host": {"cpuCount": 33, "memoryBytes": "68719476736", "diskBytes": "1099511627776"}}')`)
		if _, err := instances.SyncHosts(t.Context(), pool, "pool_v"); err != nil {
			t.Fatal(err)
		}
		h := hosts(t, pool)[0]
		if want := (instances.Size{VCPUs: 32, MemoryMiB: 65536 - 1024, DiskGiB: 1024 - 10}); h.total.VCPUs != want.VCPUs || h.total.MemoryMiB != want.MemoryMiB || h.total.DiskGiB != want.DiskGiB {
			t.Fatalf("totals %+v, want %+v", h.total, want)
		}
	})
	t.Run("a total never drops below what is used", func(t *testing.T) {
		mustExec(t, pool, `UPDATE node_inventory SET report = '{"host": {"cpuCount": 1, "memoryBytes": "0", "diskBytes": "0"}}'`)
		if _, err := instances.SyncHosts(t.Context(), pool, "pool_v"); err != nil {
			t.Fatal(err)
		}
		h := hosts(t, pool)[0]
		if h.total.VCPUs != 1 || h.total.MemoryMiB != 1 || h.total.DiskGiB != 1 {
			t.Fatalf("totals %+v, want the used 1/1/1", h.total)
		}
		_, err := create(t.Context(), pool, "inst_b", "root", instances.Size{VCPUs: 1, MemoryMiB: 1, DiskGiB: 1})
		wantFault(t, err, fault.NoCapacity, "vcpus")
	})
}

func TestTheConstraintRefusesOversubscription(t *testing.T) {
	t.Parallel()
	pool := setup(t, 1, 2)
	if _, err := create(t.Context(), pool, "inst_a", "root", instances.Size{VCPUs: 1, MemoryMiB: 1, DiskGiB: 1, GPUs: 1}); err != nil {
		t.Fatal(err)
	}
	if err := instances.Insert(t.Context(), pool, instances.Instance{ID: "inst_b", TenantID: "root", PoolID: "pool_v",
		Size: instances.Size{VCPUs: 1, MemoryMiB: 1, DiskGiB: 1}, Image: "img"}); err != nil {
		t.Fatal(err)
	}
	// Whatever code writes, the database refuses a counter over its total
	// (or below 0) in every dimension, and a second claim of one GPU.
	for _, c := range []struct{ sql, constraint string }{
		{`UPDATE host_capacity SET vcpus_used = vcpus_total + 1`, "host_capacity_vcpus"},
		{`UPDATE host_capacity SET memory_mib_used = memory_mib_total + 1`, "host_capacity_memory"},
		{`UPDATE host_capacity SET disk_gib_used = disk_gib_total + 1`, "host_capacity_disk"},
		{`UPDATE host_capacity SET vcpus_used = -1`, "host_capacity_vcpus"},
		{`INSERT INTO instance_gpus (instance_id, node_id, device_id) SELECT 'inst_b', node_id, device_id FROM instance_gpus`,
			"instance_gpus_active_device"},
	} {
		_, err := pool.Exec(t.Context(), c.sql)
		var pe *pgconn.PgError
		if !errors.As(err, &pe) || pe.ConstraintName != c.constraint {
			t.Errorf("%s: got %v, want a violation of %s", c.sql, err, c.constraint)
		}
	}
}

func TestConcurrentCreatesNeverOversubscribe(t *testing.T) {
	t.Parallel()
	// Each race: 20 creates on 2 hosts where only `fit` instances fit per
	// host, bound by one dimension; the losers get NO_CAPACITY naming it.
	for _, tc := range []struct {
		name  string
		size  instances.Size
		gpus  int
		fit   int
		field string
	}{
		{"vcpus", instances.Size{VCPUs: 3, MemoryMiB: 1024, DiskGiB: 10}, 0, 2, "vcpus"},
		{"memory", instances.Size{VCPUs: 1, MemoryMiB: 5000, DiskGiB: 10}, 0, 3, "memoryMiB"},
		{"disk", instances.Size{VCPUs: 1, MemoryMiB: 1024, DiskGiB: 45}, 0, 2, "diskGiB"},
		{"gpus", instances.Size{VCPUs: 1, MemoryMiB: 1024, DiskGiB: 10, GPUs: 2}, 5, 2, "gpuCount"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pool := setup(t, 2, tc.gpus)
			const n = 20
			var wg sync.WaitGroup
			errs := make([]error, n)
			for i := range n {
				wg.Go(func() {
					_, errs[i] = create(t.Context(), pool, fmt.Sprintf("inst_%02d", i), "root", tc.size)
				})
			}
			wg.Wait()
			won := 0
			for i, err := range errs {
				switch {
				case err == nil:
					won++
				case fault.CodeOf(err) == fault.NoCapacity && fieldOf(err) == tc.field:
				default:
					t.Errorf("create %d: %v (field %q), want success or NO_CAPACITY on %s", i, err, fieldOf(err), tc.field)
				}
			}
			if won != 2*tc.fit {
				t.Errorf("%d creates won, want %d (%d per host)", won, 2*tc.fit, tc.fit)
			}
			for _, h := range checkHosts(t, pool) {
				if h.liveInstance != tc.fit {
					t.Errorf("%s holds %d instances, want %d", h.node, h.liveInstance, tc.fit)
				}
				if h.used.GPUs != tc.fit*tc.size.GPUs {
					t.Errorf("%s has %d GPUs claimed, want %d", h.node, h.used.GPUs, tc.fit*tc.size.GPUs)
				}
			}
		})
	}
	t.Run("mixed sizes", func(t *testing.T) {
		t.Parallel()
		pool := setup(t, 2, 2)
		sizes := []instances.Size{
			{VCPUs: 3, MemoryMiB: 1024, DiskGiB: 10}, {VCPUs: 1, MemoryMiB: 7000, DiskGiB: 10},
			{VCPUs: 1, MemoryMiB: 1024, DiskGiB: 40}, {VCPUs: 1, MemoryMiB: 1024, DiskGiB: 10, GPUs: 1},
		}
		var wg sync.WaitGroup
		errs := make([]error, 24)
		for i := range errs {
			wg.Go(func() {
				_, errs[i] = create(t.Context(), pool, fmt.Sprintf("inst_%02d", i), "root", sizes[i%len(sizes)])
			})
		}
		wg.Wait()
		for i, err := range errs {
			if err != nil && fault.CodeOf(err) != fault.NoCapacity {
				t.Errorf("create %d: %v", i, err)
			}
		}
		checkHosts(t, pool)
	})
}

func TestPlacement(t *testing.T) {
	t.Parallel()
	t.Run("packs onto the partially used host", func(t *testing.T) {
		t.Parallel()
		pool := setup(t, 3, 0)
		small := instances.Size{VCPUs: 2, MemoryMiB: 1024, DiskGiB: 10}
		a, err := create(t.Context(), pool, "inst_a", "root", small)
		if err != nil {
			t.Fatal(err)
		}
		b, err := create(t.Context(), pool, "inst_b", "root", small)
		if err != nil {
			t.Fatal(err)
		}
		if a.NodeID == "" || a.NodeID != b.NodeID || a.State != instances.StatePlaced {
			t.Fatalf("a on %q (%s), b on %q: want both on one host", a.NodeID, a.State, b.NodeID)
		}
	})
	t.Run("never places on a draining, unschedulable or unseen host", func(t *testing.T) {
		t.Parallel()
		pool := setup(t, 0, 0)
		addHost(t, pool, "node_drain", "draining", 0)
		addHost(t, pool, "node_new", "adopted", 0)
		mustExec(t, pool, `UPDATE nodes SET observed_generation = 0 WHERE id = 'node_new'`)
		addHost(t, pool, "node_lost", "adopted", 0)
		mustExec(t, pool, `UPDATE nodes SET last_seen_at = now() - interval '1 hour' WHERE id = 'node_lost'`)
		_, err := create(t.Context(), pool, "inst_a", "root", instances.Size{VCPUs: 1, MemoryMiB: 1, DiskGiB: 1})
		wantFault(t, err, fault.NoCapacity, "poolId")
		addHost(t, pool, "node_ok", "adopted", 0)
		in, err := create(t.Context(), pool, "inst_b", "root", instances.Size{VCPUs: 1, MemoryMiB: 1, DiskGiB: 1})
		if err != nil || in.NodeID != "node_ok" {
			t.Fatalf("placed on %q (%v), want node_ok", in.NodeID, err)
		}
	})
	t.Run("no capacity names the short dimension", func(t *testing.T) {
		t.Parallel()
		pool := setup(t, 2, 1)
		for _, tc := range []struct {
			size  instances.Size
			field string
			msg   string
		}{
			{instances.Size{VCPUs: 9, MemoryMiB: 1, DiskGiB: 1}, "vcpus", "need 9 vCPUs on one host; the most free on a schedulable host of pool pool_v is 8"},
			{instances.Size{VCPUs: 1, MemoryMiB: 16385, DiskGiB: 1}, "memoryMiB", "need 16385 MiB of memory"},
			{instances.Size{VCPUs: 1, MemoryMiB: 1, DiskGiB: 101}, "diskGiB", "need 101 GiB of disk"},
			{instances.Size{VCPUs: 1, MemoryMiB: 1, DiskGiB: 1, GPUs: 2}, "gpuCount", "need 2 GPUs"},
		} {
			_, err := create(t.Context(), pool, "inst_x", "root", tc.size)
			wantFault(t, err, fault.NoCapacity, tc.field)
			if !strings.Contains(err.Error(), tc.msg) {
				t.Errorf("message %q lacks %q", err, tc.msg)
			}
		}
		in := instances.Instance{ID: "inst_m", TenantID: "root", PoolID: "pool_v", Size: instances.Size{VCPUs: 1, MemoryMiB: 1, DiskGiB: 1, GPUs: 1},
			GPUModel: "NVIDIA B200", Image: "img"}
		err := db.InTx(t.Context(), pool, db.TxOptions{}, func(tx pgx.Tx) error {
			_, err := instances.Create(t.Context(), tx, &in, instances.PlaceOptions{})
			return err
		})
		wantFault(t, err, fault.NoCapacity, "gpuCount")
		checkHosts(t, pool)
	})
	t.Run("claims GPUs by device with their PCI address", func(t *testing.T) {
		t.Parallel()
		pool := setup(t, 1, 4)
		in, err := create(t.Context(), pool, "inst_g", "root", instances.Size{VCPUs: 1, MemoryMiB: 1, DiskGiB: 1, GPUs: 2})
		if err != nil {
			t.Fatal(err)
		}
		got, err := instances.Get(t.Context(), pool, "root", in.ID)
		if err != nil || len(got.GPUDevices) != 2 || got.GPUDevices[0].PCIBusID == "" {
			t.Fatalf("GPUs %+v (%v), want 2 with PCI addresses", got.GPUDevices, err)
		}
		mustExec(t, pool, `UPDATE devices SET quarantined_at = now() WHERE node_id = 'node_00'`)
		_, err = create(t.Context(), pool, "inst_h", "root", instances.Size{VCPUs: 1, MemoryMiB: 1, DiskGiB: 1, GPUs: 1})
		wantFault(t, err, fault.NoCapacity, "gpuCount")
	})
	t.Run("a gpu pool and a provider pool are refused", func(t *testing.T) {
		t.Parallel()
		pool := setup(t, 1, 0)
		fixture.Pool(t, pool, fixture.PoolOpts{ID: "pool_g", Class: pools.ClassGPU})
		fixture.Pool(t, pool, fixture.PoolOpts{ID: "pool_p", Class: pools.ClassProvider})
		if _, err := instances.PoolOf(t.Context(), pool, "root", "pool_g"); fault.CodeOf(err) != fault.InvalidInput || fieldOf(err) != "poolId" {
			t.Fatalf("gpu pool: %v", err)
		}
		if c, err := instances.PoolOf(t.Context(), pool, "root", "pool_p"); err != nil || c != "provider" {
			t.Fatalf("provider pool: %q %v", c, err)
		}
		in := instances.Instance{ID: "inst_p", TenantID: "root", PoolID: "pool_p", Size: instances.Size{VCPUs: 1, MemoryMiB: 1, DiskGiB: 1}, Image: "img"}
		err := db.InTx(t.Context(), pool, db.TxOptions{}, func(tx pgx.Tx) error {
			_, err := instances.Create(t.Context(), tx, &in, instances.PlaceOptions{})
			return err
		})
		wantFault(t, err, fault.Unsupported, "poolId")
		if _, err := instances.PoolOf(t.Context(), pool, "root", "pool_nope"); fault.CodeOf(err) != fault.NotFound {
			t.Fatalf("unknown pool: %v", err)
		}
	})
}

func i64(v int64) *int64 { return &v }

func TestQuotas(t *testing.T) {
	t.Parallel()
	pool := setup(t, 4, 4)
	fixture.Tenant(t, pool, fixture.TenantOpts{ID: "acme"})
	fixture.Tenant(t, pool, fixture.TenantOpts{ID: "acme.ml"})
	mustExec(t, pool, `UPDATE pools SET sharing = 'descendants'`)
	one := instances.Size{VCPUs: 2, MemoryMiB: 2048, DiskGiB: 20, GPUs: 1}
	for _, tc := range []struct {
		field string
		quota instances.Quota
	}{
		{"vcpus", instances.Quota{VCPUs: i64(3)}},
		{"memoryMiB", instances.Quota{MemoryMiB: i64(3000)}},
		{"diskGiB", instances.Quota{DiskGiB: i64(30)}},
		{"gpuCount", instances.Quota{GPUs: i64(1)}},
	} {
		t.Run(tc.field, func(t *testing.T) {
			qt := tc.quota
			qt.PoolID, qt.TenantID = "pool_v", "acme"
			if _, _, err := instances.SetQuota(t.Context(), pool, qt); err != nil {
				t.Fatal(err)
			}
			// The descendant's instances count against the ancestor's quota.
			a, err := create(t.Context(), pool, "inst_"+tc.field+"_a", "acme.ml", one)
			if err != nil {
				t.Fatal(err)
			}
			_, err = create(t.Context(), pool, "inst_"+tc.field+"_b", "acme", one)
			wantFault(t, err, fault.QuotaExceeded, tc.field)
			if !strings.Contains(err.Error(), "instance quota of tenant acme in pool pool_v") {
				t.Errorf("message %q does not say whose quota", err)
			}
			// Another tenant is not bound by it.
			if _, err := create(t.Context(), pool, "inst_"+tc.field+"_root", "root", one); err != nil {
				t.Fatalf("root: %v", err)
			}
			// Deleting frees the quota.
			if _, _, err := instances.Delete(t.Context(), pool, a.ID); err != nil {
				t.Fatal(err)
			}
			c, err := create(t.Context(), pool, "inst_"+tc.field+"_c", "acme", one)
			if err != nil {
				t.Fatalf("after delete: %v", err)
			}
			if _, _, err := instances.Delete(t.Context(), pool, c.ID); err != nil {
				t.Fatal(err)
			}
			if _, ok, err := instances.SetQuota(t.Context(), pool, instances.Quota{PoolID: "pool_v", TenantID: "acme"}); ok || err != nil {
				t.Fatalf("remove quota: %v %v", ok, err)
			}
		})
	}
	t.Run("concurrent creates never exceed a quota", func(t *testing.T) {
		if _, _, err := instances.SetQuota(t.Context(), pool, instances.Quota{PoolID: "pool_v", TenantID: "acme.ml", VCPUs: i64(4)}); err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		errs := make([]error, 10)
		for i := range errs {
			wg.Go(func() {
				_, errs[i] = create(t.Context(), pool, fmt.Sprintf("inst_q%02d", i), "acme.ml", instances.Size{VCPUs: 1, MemoryMiB: 1, DiskGiB: 1})
			})
		}
		wg.Wait()
		won := 0
		for _, err := range errs {
			if err == nil {
				won++
			} else if fault.CodeOf(err) != fault.QuotaExceeded || fieldOf(err) != "vcpus" {
				t.Errorf("got %v, want QUOTA_EXCEEDED on vcpus", err)
			}
		}
		if won != 4 {
			t.Errorf("%d won, want 4", won)
		}
	})
}

func TestSharedPoolNeedsAnInstanceQuota(t *testing.T) {
	t.Parallel()
	pool := setup(t, 1, 0)
	fixture.Tenant(t, pool, fixture.TenantOpts{ID: "acme"})
	s := instances.Size{VCPUs: 1, MemoryMiB: 1, DiskGiB: 1}
	_, err := create(t.Context(), pool, "inst_a", "acme", s)
	wantFault(t, err, fault.NotFound, "poolId")
	mustExec(t, pool, `UPDATE pools SET sharing = 'descendants'`)
	_, err = create(t.Context(), pool, "inst_a", "acme", s)
	wantFault(t, err, fault.QuotaExceeded, "vcpus")
	if _, _, err := instances.SetQuota(t.Context(), pool, instances.Quota{PoolID: "pool_v", TenantID: "acme", VCPUs: i64(1)}); err != nil {
		t.Fatal(err)
	}
	if _, err := create(t.Context(), pool, "inst_a", "acme", s); err != nil {
		t.Fatal(err)
	}
}

func TestDeleteResizePower(t *testing.T) {
	t.Parallel()
	pool := setup(t, 1, 4)
	ctx := t.Context()
	a, err := create(ctx, pool, "inst_a", "root", instances.Size{VCPUs: 4, MemoryMiB: 8192, DiskGiB: 50, GPUs: 1})
	if err != nil {
		t.Fatal(err)
	}
	resize := func(s instances.Size) (instances.Instance, bool, error) {
		var out instances.Instance
		var changed bool
		err := db.InTx(ctx, pool, db.TxOptions{}, func(tx pgx.Tx) error {
			var err error
			out, changed, err = instances.Resize(ctx, tx, a.ID, s)
			return err
		})
		return out, changed, err
	}
	t.Run("resize up claims the difference or fails naming the dimension", func(t *testing.T) {
		got, changed, err := resize(instances.Size{VCPUs: 8, MemoryMiB: 16384, DiskGiB: 100, GPUs: 3})
		if err != nil || !changed || got.Generation != 2 || len(got.GPUDevices) != 3 {
			t.Fatalf("resize: %+v %v %v", got, changed, err)
		}
		h := checkHosts(t, pool)[0]
		if h.used.VCPUs != 8 || h.used.MemoryMiB != 16384 || h.used.DiskGiB != 100 || h.used.GPUs != 3 {
			t.Fatalf("used %+v", h.used)
		}
		for _, tc := range []struct {
			size  instances.Size
			field string
		}{
			{instances.Size{VCPUs: 9, MemoryMiB: 16384, DiskGiB: 100, GPUs: 3}, "vcpus"},
			{instances.Size{VCPUs: 8, MemoryMiB: 16385, DiskGiB: 100, GPUs: 3}, "memoryMiB"},
			{instances.Size{VCPUs: 8, MemoryMiB: 16384, DiskGiB: 101, GPUs: 3}, "diskGiB"},
			{instances.Size{VCPUs: 8, MemoryMiB: 16384, DiskGiB: 100, GPUs: 5}, "gpuCount"},
			{instances.Size{VCPUs: 0, MemoryMiB: 16384, DiskGiB: 100}, "vcpus"},
		} {
			_, _, err := resize(tc.size)
			code := fault.NoCapacity
			if tc.size.VCPUs == 0 {
				code = fault.InvalidInput
			}
			wantFault(t, err, code, tc.field)
		}
		if got, _ := instances.Get(ctx, pool, "root", a.ID); got.Generation != 2 || got.VCPUs != 8 {
			t.Fatalf("a refused resize changed the instance: %+v", got)
		}
	})
	t.Run("resize down releases the difference", func(t *testing.T) {
		_, _, err := resize(instances.Size{VCPUs: 1, MemoryMiB: 1024, DiskGiB: 99})
		wantFault(t, err, fault.InvalidInput, "diskGiB")
		got, _, err := resize(instances.Size{VCPUs: 1, MemoryMiB: 1024, DiskGiB: 100})
		if err != nil || len(got.GPUDevices) != 0 || got.Generation != 3 {
			t.Fatalf("resize down: %+v %v", got, err)
		}
		h := checkHosts(t, pool)[0]
		if h.used.VCPUs != 1 || h.used.MemoryMiB != 1024 || h.used.GPUs != 0 {
			t.Fatalf("used %+v", h.used)
		}
		if _, changed, err := resize(instances.Size{VCPUs: 1, MemoryMiB: 1024, DiskGiB: 100}); changed || err != nil {
			t.Fatalf("same size: %v %v", changed, err)
		}
	})
	t.Run("power changes only desired state and the generation", func(t *testing.T) {
		got, changed, err := instances.SetPower(ctx, pool, a.ID, instances.PowerStopped)
		if err != nil || !changed || got.Power != instances.PowerStopped || got.Generation != 4 || got.State != instances.StatePlaced {
			t.Fatalf("stop: %+v %v %v", got, changed, err)
		}
		if _, changed, _ := instances.SetPower(ctx, pool, a.ID, instances.PowerStopped); changed {
			t.Fatal("stopping a stopped instance changed it")
		}
		if h := checkHosts(t, pool)[0]; h.used.VCPUs != 1 {
			t.Fatalf("stop released capacity: %+v", h.used)
		}
		_, _, err = instances.SetPower(ctx, pool, a.ID, "paused")
		wantFault(t, err, fault.InvalidInput, "power")
	})
	t.Run("observations move the state", func(t *testing.T) {
		if st, changed, err := instances.Observe(ctx, pool, a.ID, instances.Observation{Generation: 3, State: "running"}); err != nil || changed || st != instances.StatePlaced {
			t.Fatalf("an old generation moved it: %s %v %v", st, changed, err)
		}
		if st, changed, err := instances.Observe(ctx, pool, a.ID, instances.Observation{Generation: 4, State: "stopped"}); err != nil || !changed || st != instances.StateStopped {
			t.Fatalf("observe stopped: %s %v %v", st, changed, err)
		}
	})
	t.Run("delete releases capacity in the same transaction", func(t *testing.T) {
		got, changed, err := instances.Delete(ctx, pool, a.ID)
		if err != nil || !changed || got.State != instances.StateDeleting || got.Generation != 5 {
			t.Fatalf("delete: %+v %v %v", got, changed, err)
		}
		h := checkHosts(t, pool)[0]
		if h.used != (instances.Size{}) || h.instances != 0 {
			t.Fatalf("after delete used %+v (%d instances)", h.used, h.instances)
		}
		if _, changed, _ := instances.Delete(ctx, pool, a.ID); changed {
			t.Fatal("a second delete changed it")
		}
		_, _, err = instances.SetPower(ctx, pool, a.ID, instances.PowerRunning)
		wantFault(t, err, fault.Conflict, "instanceId")
		if _, err := create(ctx, pool, "inst_full", "root", host); err != nil {
			t.Fatalf("the whole host after delete: %v", err)
		}
		if st, _, err := instances.Observe(ctx, pool, a.ID, instances.Observation{Generation: 5, State: "absent"}); err != nil || st != instances.StateDeleted {
			t.Fatalf("observe absent: %s %v", st, err)
		}
	})
	t.Run("usage accrues and deleted rows are pruned", func(t *testing.T) {
		mustExec(t, pool, `UPDATE instances SET accrued_at = now() - interval '2 hours' WHERE id = 'inst_full'`)
		us, err := instances.UsageOf(ctx, pool, "pool_v")
		if err != nil || len(us) != 1 {
			t.Fatalf("usage %+v %v", us, err)
		}
		if u := us[0].Usage; u.VCPUHours < 15.9 || u.MemoryMiBHours < 2*16384-1 || us[0].Held.VCPUs != host.VCPUs {
			t.Fatalf("usage %+v, want about 16 vCPU-hours", us[0])
		}
		if n, err := instances.Accrue(ctx, pool); err != nil || n != 1 {
			t.Fatalf("accrue: %d %v", n, err)
		}
		full, _ := instances.Get(ctx, pool, "root", "inst_full")
		if full.Usage.VCPUHours < 15.9 {
			t.Fatalf("accrued %+v", full.Usage)
		}
		if n, err := instances.Prune(ctx, pool, 0); err != nil || n != 0 {
			t.Fatalf("pruned a recent delete: %d %v", n, err)
		}
		mustExec(t, pool, `UPDATE instances SET deleted_at = now() - interval '31 days' WHERE id = $1`, a.ID)
		if n, err := instances.Prune(ctx, pool, 0); err != nil || n != 1 {
			t.Fatalf("prune: %d %v", n, err)
		}
		if _, err := instances.Get(ctx, pool, "root", a.ID); fault.CodeOf(err) != fault.NotFound {
			t.Fatalf("pruned instance still there: %v", err)
		}
	})
	t.Run("capacity sums the hosts", func(t *testing.T) {
		c, err := instances.Capacity(ctx, pool, "pool_v", 0)
		if err != nil || c.Hosts != 1 || c.Total.VCPUs != host.VCPUs || c.Free.VCPUs != 0 || c.Total.GPUs != 4 || c.Free.GPUs != 4 {
			t.Fatalf("capacity %+v %v", c, err)
		}
	})
}

func TestValidate(t *testing.T) {
	t.Parallel()
	ok := instances.Instance{Size: instances.Size{VCPUs: 1, MemoryMiB: 1, DiskGiB: 1}, Image: "img", SSHKeys: []string{"ssh-ed25519 AAAAC3Nza x@y"}}
	if err := instances.Validate(ok); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		field  string
		change func(*instances.Instance)
	}{
		{"vcpus", func(i *instances.Instance) { i.VCPUs = 0 }},
		{"vcpus", func(i *instances.Instance) { i.VCPUs = instances.MaxVCPUs + 1 }},
		{"memoryMiB", func(i *instances.Instance) { i.MemoryMiB = 0 }},
		{"diskGiB", func(i *instances.Instance) { i.DiskGiB = -1 }},
		{"gpuCount", func(i *instances.Instance) { i.GPUs = instances.MaxGPUs + 1 }},
		{"gpuModel", func(i *instances.Instance) { i.GPUModel = "NVIDIA H200" }},
		{"image", func(i *instances.Instance) { i.Image = " " }},
		{"sshKeys", func(i *instances.Instance) { i.SSHKeys = []string{"not a key"} }},
		{"sshKeys", func(i *instances.Instance) { i.SSHKeys = []string{"ssh-rsa AAAA\nssh-rsa BBBB"} }},
		{"userData", func(i *instances.Instance) { i.UserData = strings.Repeat("x", instances.MaxUserDataBytes+1) }},
	} {
		in := ok
		tc.change(&in)
		wantFault(t, instances.Validate(in), fault.InvalidInput, tc.field)
	}
}
