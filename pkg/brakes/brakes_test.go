package brakes_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/brakes"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func exec(t testing.TB, db *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	if _, err := db.Exec(context.Background(), sql, args...); err != nil {
		t.Fatal(err)
	}
}

// fleet inserts pools pools (pool_000…, pool_000 of tenant acme, the rest
// root) and nodes nodes spread over them round-robin, each held last by
// gateway gw-<i % gateways> (none when gateways is 0), adopted and Ready.
func fleet(t testing.TB, db *pgxpool.Pool, pools, gateways, nodes int) {
	t.Helper()
	exec(t, db, `INSERT INTO tenants (id, parent_id, name) VALUES ('acme', 'root', 'acme')`)
	exec(t, db, `INSERT INTO pools (id, tenant_id, name, class)
		SELECT format('pool_%s', lpad(i::text, 3, '0')), CASE WHEN i = 0 THEN 'acme' ELSE 'root' END, format('p%s', i), 'gpu'
		  FROM generate_series(0, $1 - 1) i`, pools)
	exec(t, db, `INSERT INTO nodes (id, tenant_id, pool_id, state, shard, hardware_key, gateway_id, last_seen_at)
		SELECT format('node_%s', lpad(i::text, 5, '0')), 'root', format('pool_%s', lpad((i % $2)::text, 3, '0')), 'adopted',
		       i % 256, format('hw-%s', i), CASE WHEN $3 = 0 THEN '' ELSE format('gw-%s', i % greatest($3, 1)) END, now()
		  FROM generate_series(0, $1 - 1) i`, nodes, pools, gateways)
}

func inTx[T any](t testing.TB, db *pgxpool.Pool, f func(tx pgx.Tx) (T, error)) T {
	t.Helper()
	var out T
	err := pgx.BeginFunc(context.Background(), db, func(tx pgx.Tx) error {
		var err error
		out, err = f(tx)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func evaluate(t testing.TB, db *pgxpool.Pool, threshold float64, now time.Time) []brakes.Transition {
	t.Helper()
	return inTx(t, db, func(tx pgx.Tx) ([]brakes.Transition, error) {
		return brakes.Evaluate(context.Background(), tx, threshold, now)
	})
}

func allow(t testing.TB, db *pgxpool.Pool, cfg brakes.Config, s brakes.Subject, now time.Time) brakes.Decision {
	t.Helper()
	return inTx(t, db, func(tx pgx.Tx) (brakes.Decision, error) { return brakes.Allow(context.Background(), tx, cfg, s, now) })
}

func breakers(t testing.TB, db *pgxpool.Pool) map[string]brakes.Breaker {
	t.Helper()
	bs, err := brakes.Breakers(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]brakes.Breaker{}
	for _, b := range bs {
		m[b.Scope] = b
	}
	return m
}

// TestAllowRate drives the bucket with a fake clock: a full bucket of
// Burst, then one token per 1/Rate seconds; a refusal names the setting; a
// rolled-back action gives its token back.
func TestAllowRate(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	cfg := brakes.Config{} // 0.1 nodes/s, burst 1
	s := brakes.Subject{NodeID: "node_1", PoolID: "pool_a"}
	t0 := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	if d := allow(t, db, cfg, s, t0); !d.Allowed || d.Paused {
		t.Fatalf("a full bucket: %+v", d)
	}
	for i := 0; i < 10; i++ {
		d := allow(t, db, cfg, s, t0.Add(time.Duration(i)*time.Second))
		if d.Allowed || d.Paused || !strings.Contains(d.Reason, "eviction rate nodes.evictionRate=0.1 reached") {
			t.Fatalf("at t+%ds: %+v", i, d)
		}
	}
	if d := allow(t, db, cfg, s, t0.Add(10*time.Second)); !d.Allowed {
		t.Fatalf("at t+10s: %+v", d)
	}
	if d := allow(t, db, cfg, s, t0.Add(10*time.Second)); d.Allowed {
		t.Fatalf("a second at t+10s: %+v", d)
	}

	// A rolled-back action gives its token back.
	t1 := t0.Add(20 * time.Second)
	err := pgx.BeginFunc(t.Context(), db, func(tx pgx.Tx) error {
		d, err := brakes.Allow(t.Context(), tx, cfg, s, t1)
		if err != nil || !d.Allowed {
			t.Fatalf("at t+20s: %+v %v", d, err)
		}
		return errors.New("roll back")
	})
	if err == nil {
		t.Fatal("no rollback")
	}
	if d := allow(t, db, cfg, s, t1); !d.Allowed {
		t.Fatalf("after a rollback: %+v", d)
	}

	// Burst: a long quiet time fills the bucket to Burst, not beyond.
	burst := brakes.Config{Rate: 0.1, Burst: 3}
	t2 := t1.Add(time.Hour)
	for i := range 3 {
		if d := allow(t, db, burst, s, t2); !d.Allowed {
			t.Fatalf("burst %d: %+v", i, d)
		}
	}
	if d := allow(t, db, burst, s, t2); d.Allowed || !strings.Contains(d.Reason, "nodes.evictionBurst=3") {
		t.Fatalf("past the burst: %+v", d)
	}
	// A clock behind the last refill refills nothing.
	if d := allow(t, db, burst, s, t2.Add(-time.Hour)); d.Allowed {
		t.Fatalf("a clock an hour behind: %+v", d)
	}
	if _, err := (brakes.Config{Rate: -1}).Normalize(); !errors.Is(err, brakes.ErrBadConfig) {
		t.Fatalf("rate -1: %v", err)
	}
}

// TestEvaluate opens and closes the pool and gateway breakers as nodes go
// not ready and come back, writes each transition once, and Allow refuses
// in an open scope, naming it and its counts.
func TestEvaluate(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	// 2 pools × 10 nodes; gateways gw-0 (even nodes) and gw-1 (odd).
	fleet(t, db, 2, 2, 20)
	now := time.Now()
	if ts := evaluate(t, db, 0, now); len(ts) != 0 {
		t.Fatalf("a healthy fleet: %+v", ts)
	}
	if bs := breakers(t, db); len(bs) != 0 {
		t.Fatalf("a healthy fleet stores no breaker: %+v", bs)
	}

	// pool_000 holds the even nodes: 6 of its 10 not ready (Lost and
	// Unknown both count) opens it and gw-0 (6 of 10), not pool_001 or gw-1.
	exec(t, db, `UPDATE nodes SET ready = 'Lost' WHERE id IN ('node_00000', 'node_00002', 'node_00004', 'node_00006', 'node_00008')`)
	exec(t, db, `UPDATE nodes SET ready = 'Unknown' WHERE id = 'node_00010'`)
	ts := evaluate(t, db, 0, now)
	if len(ts) != 2 {
		t.Fatalf("transitions: %+v", ts)
	}
	want := []brakes.Transition{
		{Scope: "gateway:gw-0", Kind: "gateway", ID: "gw-0", TenantID: "root", Opened: true, NotReady: 6, Total: 10},
		{Scope: "pool:pool_000", Kind: "pool", ID: "pool_000", TenantID: "acme", Opened: true, NotReady: 6, Total: 10},
	}
	for i := range want {
		if ts[i] != want[i] {
			t.Fatalf("transition %d: %+v, want %+v", i, ts[i], want[i])
		}
	}
	if ts := evaluate(t, db, 0, now); len(ts) != 0 {
		t.Fatalf("a second pass repeats transitions: %+v", ts)
	}
	b := breakers(t, db)["pool:pool_000"]
	if !b.Paused || b.NotReady != 6 || b.Total != 10 || !strings.Contains(b.Reason, "6 of 10") {
		t.Fatalf("pool breaker: %+v", b)
	}

	d := allow(t, db, brakes.Config{}, brakes.Subject{NodeID: "node_00000", PoolID: "pool_000", GatewayID: "gw-0"}, now)
	if d.Allowed || !d.Paused || !strings.Contains(d.Reason, "pool:pool_000") || !strings.Contains(d.Reason, "6 of 10") {
		t.Fatalf("allow in a paused pool: %+v", d)
	}
	// A node of pool_001 last held by gw-0 is paused by its gateway.
	d = allow(t, db, brakes.Config{}, brakes.Subject{NodeID: "node_00001", PoolID: "pool_001", GatewayID: "gw-0"}, now)
	if !d.Paused || !strings.Contains(d.Reason, "gateway:gw-0") {
		t.Fatalf("allow under a paused gateway: %+v", d)
	}
	// …and by nothing when gw-1 held it.
	if d := allow(t, db, brakes.Config{}, brakes.Subject{NodeID: "node_00001", PoolID: "pool_001", GatewayID: "gw-1"}, now); !d.Allowed {
		t.Fatalf("allow elsewhere: %+v", d)
	}

	// More than the threshold, not equal: at 0.6, 6 of 10 is not paused.
	if ts := evaluate(t, db, 0.6, now); len(ts) != 2 || ts[0].Opened || ts[1].Opened {
		t.Fatalf("threshold 0.6 closes both: %+v", ts)
	}
	if ts := evaluate(t, db, 0.55, now); len(ts) != 2 || !ts[0].Opened {
		t.Fatalf("threshold 0.55 reopens both: %+v", ts)
	}

	// Retired nodes do not count: retiring 4 healthy nodes of pool_000 and
	// gw-0 makes them 6 of 6.
	exec(t, db, `UPDATE nodes SET state = 'retired' WHERE id IN ('node_00012', 'node_00014', 'node_00016', 'node_00018')`)
	if ts := evaluate(t, db, 0, now); len(ts) != 0 {
		t.Fatalf("still paused: %+v", ts)
	}
	if b := breakers(t, db)["pool:pool_000"]; b.NotReady != 6 || b.Total != 6 {
		t.Fatalf("counts after retiring: %+v", b)
	}
	// Nor do machines' ramdisks in commissioning (they go away on
	// purpose): two of the lost nodes commissioning make it 4 of 4.
	exec(t, db, `UPDATE nodes SET state = 'commissioning' WHERE id IN ('node_00000', 'node_00002')`)
	if ts := evaluate(t, db, 0, now); len(ts) != 0 {
		t.Fatalf("still paused: %+v", ts)
	}
	if b := breakers(t, db)["pool:pool_000"]; b.NotReady != 4 || b.Total != 4 {
		t.Fatalf("counts with two commissioning: %+v, want 4 of 4", b)
	}
	exec(t, db, `UPDATE nodes SET state = 'adopted' WHERE id IN ('node_00000', 'node_00002')`)
	if ts := evaluate(t, db, 0, now); len(ts) != 0 {
		t.Fatalf("still paused: %+v", ts)
	}

	// The nodes return: both close, once; the closed rows stay (they were
	// paused), so the gauge shows 0.
	exec(t, db, `UPDATE nodes SET ready = 'True'`)
	ts = evaluate(t, db, 0, now.Add(time.Minute))
	if len(ts) != 2 || ts[0].Opened || ts[1].Opened || ts[0].NotReady != 0 || ts[1].Total != 6 {
		t.Fatalf("recovery: %+v", ts)
	}
	if ts := evaluate(t, db, 0, now.Add(time.Minute)); len(ts) != 0 {
		t.Fatalf("after recovery: %+v", ts)
	}
	if b := breakers(t, db)["pool:pool_000"]; b.Paused || b.Reason != "" || !b.Since.Equal(now.Add(time.Minute).Truncate(time.Microsecond)) {
		t.Fatalf("closed breaker: %+v", b)
	}
	if d := allow(t, db, brakes.Config{}, brakes.Subject{NodeID: "node_00000", PoolID: "pool_000", GatewayID: "gw-0"}, now.Add(time.Hour)); !d.Allowed {
		t.Fatalf("allow after recovery: %+v", d)
	}

	// A gateway that no longer holds any node: its closed row goes. One
	// that was paused closes first (a resumed transition), then goes.
	exec(t, db, `UPDATE nodes SET ready = 'Lost' WHERE gateway_id = 'gw-1'`)
	if ts := evaluate(t, db, 0, now); len(ts) != 2 {
		t.Fatalf("gw-1 and pool_001 lost: %+v", ts)
	}
	exec(t, db, `UPDATE nodes SET gateway_id = 'gw-2', ready = 'True' WHERE gateway_id IN ('gw-0', 'gw-1')`)
	ts = evaluate(t, db, 0, now)
	if len(ts) != 2 || ts[0].Scope != "gateway:gw-1" || ts[0].Opened || ts[0].Total != 0 || ts[1].Scope != "pool:pool_001" {
		t.Fatalf("gw-1 gone: %+v", ts)
	}
	evaluate(t, db, 0, now)
	bs := breakers(t, db)
	if _, ok := bs["gateway:gw-1"]; ok {
		t.Fatalf("gone gateways' rows stay: %+v", bs)
	}
	if _, ok := bs["gateway:gw-0"]; ok {
		t.Fatalf("gone gateways' rows stay: %+v", bs)
	}
	if _, ok := bs["pool:pool_000"]; !ok {
		t.Fatalf("a pool with nodes keeps its row: %+v", bs)
	}
}

// BenchmarkEvaluate is one Evaluate (its own transaction) over 10,000
// nodes in 100 pools behind 5 gateways, 30 % of them not ready: steady (no
// breaker changes, nothing written), then with a pool's breaker flipping
// every pass.
func BenchmarkEvaluate(b *testing.B) {
	db := pgtest.New(b)
	fleet(b, db, 100, 5, 10000)
	exec(b, db, `UPDATE nodes SET ready = 'Unknown' WHERE id::text LIKE '%3' OR id::text LIKE '%7' OR id::text LIKE '%9'`)
	exec(b, db, `ANALYZE nodes`)
	now := time.Now()
	b.Run("steady", func(b *testing.B) {
		for b.Loop() {
			evaluate(b, db, 0, now)
		}
	})
	b.Run("flapping", func(b *testing.B) {
		// pool_000's 100 nodes all Lost one pass, all Ready the next: a
		// breaker opens or closes every pass.
		i := 0
		for b.Loop() {
			b.StopTimer()
			exec(b, db, `UPDATE nodes SET ready = $1 WHERE pool_id = 'pool_000'`, []string{"Lost", "True"}[i%2])
			b.StartTimer()
			if ts := evaluate(b, db, 0, now); len(ts) != 1 {
				b.Fatalf("pass %d: %+v", i, ts)
			}
			i++
		}
	})
}
