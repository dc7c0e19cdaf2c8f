package brakes_test

import (
	"context"
	"errors"
	"fmt"
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
		return brakes.Evaluate(context.Background(), tx, brakes.Config{UnhealthyThreshold: threshold}, now)
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
	cfg := brakes.Config{TenantRate: 0.1} // 0.1 nodes/s, burst 1, for the tenant too
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
	burst := brakes.Config{Rate: 0.1, Burst: 3, TenantRate: 0.1, TenantBurst: 3}
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
		{Scope: "gateway:gw-0/tenant:root", Kind: "gateway", ID: "gw-0", TenantID: "root", Opened: true, NotReady: 6, Total: 10},
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
	if !d.Paused || !strings.Contains(d.Reason, "gateway:gw-0/tenant:root") {
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
	if len(ts) != 2 || ts[0].Scope != "gateway:gw-1/tenant:root" || ts[0].Opened || ts[0].Total != 0 || ts[1].Scope != "pool:pool_001" {
		t.Fatalf("gw-1 gone: %+v", ts)
	}
	evaluate(t, db, 0, now)
	bs := breakers(t, db)
	if _, ok := bs["gateway:gw-1/tenant:root"]; ok {
		t.Fatalf("gone gateways' rows stay: %+v", bs)
	}
	if _, ok := bs["gateway:gw-0/tenant:root"]; ok {
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

// tenants inserts tenants acme and evil under root, a pool of each
// (pool_acme, pool_evil) and nodes of each behind the one shared gateway
// gw-shared: acme's node_acme_<i> and evil's node_evil_<i>, adopted and
// Ready.
func tenants(t testing.TB, db *pgxpool.Pool, acme, evil int) {
	t.Helper()
	exec(t, db, `INSERT INTO tenants (id, parent_id, name) VALUES ('acme', 'root', 'acme'), ('evil', 'root', 'evil')`)
	exec(t, db, `INSERT INTO pools (id, tenant_id, name, class) VALUES ('pool_acme', 'acme', 'a', 'gpu'), ('pool_evil', 'evil', 'e', 'gpu')`)
	exec(t, db, `INSERT INTO nodes (id, tenant_id, pool_id, state, shard, hardware_key, gateway_id, last_seen_at)
		SELECT format('node_%s_%s', t, i), t, 'pool_' || t, 'adopted', i % 256, format('hw-%s-%s', t, i), 'gw-shared', now()
		  FROM (VALUES ('acme', $1::int), ('evil', $2::int)) AS v(t, n), generate_series(0, v.n - 1) i`, acme, evil)
}

// TestOneTenantsLostNodesDoNotTripAnotherTenantsBreaker: tenant evil's 20
// nodes behind the gateway it shares with acme all go Lost (simulated
// nodes that simply stop). On the old code that held the gateway's one
// breaker open (21 of 24 not ready) and acme's lost node was never
// replaced; now the gateway's breaker is per tenant, so acme's 1 of 4 is
// acted on. And evil's own pool, paused while its nodes are lost, is not
// paused for ever: nodes Lost for longer than nodes.longLostAfter leave
// the ratio.
func TestOneTenantsLostNodesDoNotTripAnotherTenantsBreaker(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	tenants(t, db, 4, 20)
	now := time.Now()
	exec(t, db, `UPDATE nodes SET ready = 'Lost', ready_since = $1 WHERE tenant_id = 'evil' OR id = 'node_acme_0'`, now)
	ts := evaluate(t, db, 0, now)
	want := []brakes.Transition{
		{Scope: "gateway:gw-shared/tenant:evil", Kind: "gateway", ID: "gw-shared", TenantID: "evil", Opened: true, NotReady: 20, Total: 20},
		{Scope: "pool:pool_evil", Kind: "pool", ID: "pool_evil", TenantID: "evil", Opened: true, NotReady: 20, Total: 20},
	}
	if len(ts) != len(want) {
		t.Fatalf("transitions: %+v, want %+v", ts, want)
	}
	for i := range want {
		if ts[i] != want[i] {
			t.Fatalf("transition %d: %+v, want %+v", i, ts[i], want[i])
		}
	}
	if d := allow(t, db, brakes.Config{}, brakes.Subject{NodeID: "node_acme_0", PoolID: "pool_acme", GatewayID: "gw-shared"}, now); !d.Allowed {
		t.Fatalf("acme's lost node behind the shared gateway: %+v", d)
	}
	// The gateway and pool of evil are paused for evil.
	if d := allow(t, db, brakes.Config{}, brakes.Subject{NodeID: "node_evil_0", PoolID: "pool_evil", GatewayID: "gw-shared"}, now); !d.Paused {
		t.Fatalf("evil's lost node: %+v", d)
	}
	// A caller naming another pool for acme's node still gets acme's
	// gateway scope: the tenant is the node's, read from the database.
	if d := allow(t, db, brakes.Config{}, brakes.Subject{NodeID: "node_acme_1", PoolID: "pool_acme", GatewayID: "gw-shared"}, now.Add(20*time.Second)); !d.Allowed {
		t.Fatalf("acme's node: %+v", d)
	}

	// An hour and a second later evil's nodes are long lost: out of the
	// ratio, so both of evil's breakers close (0 of 0) and its lost nodes
	// are acted on, at the rate.
	later := now.Add(brakes.DefaultLongLostAfter + time.Second)
	ts = evaluate(t, db, 0, later)
	if len(ts) != 2 || ts[0].Opened || ts[1].Opened || ts[0].Total != 0 || ts[1].Total != 0 {
		t.Fatalf("long-lost nodes still hold evil's breakers: %+v", ts)
	}
	if d := allow(t, db, brakes.Config{}, brakes.Subject{NodeID: "node_evil_0", PoolID: "pool_evil", GatewayID: "gw-shared"}, later); !d.Allowed {
		t.Fatalf("evil's long-lost node: %+v", d)
	}
	// acme's one lost node is 1 of 3 counted, once it too is long lost 0 of 3.
	if b := breakers(t, db)["gateway:gw-shared/tenant:acme"]; b.Paused {
		t.Fatalf("acme's gateway breaker: %+v", b)
	}
}

// TestOneTenantCannotDrainFleetRemediationBucket: tenant evil asks the
// brakes for five of its lost (or remediating: nodes.clearRepair restarts
// their ladders) nodes every second, always before acme asks for its one.
// On the old code the one fleet-wide bucket (0.1/s, burst 1) gave every
// token to evil and acme never got one in 200 s; now evil's own bucket
// (half the fleet's rate by default) runs dry first, and acme gets the
// rest of the fleet's.
func TestOneTenantCannotDrainFleetRemediationBucket(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	tenants(t, db, 1, 5)
	cfg := brakes.Config{} // the defaults: fleet 0.1/s burst 1, a tenant 0.05/s burst 1
	t0 := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	var evil, acme int
	var evilRefusal string
	for sec := range 200 {
		now := t0.Add(time.Duration(sec) * time.Second)
		for i := range 5 {
			d := allow(t, db, cfg, brakes.Subject{NodeID: fmt.Sprintf("node_evil_%d", i), PoolID: "pool_evil", GatewayID: "gw-shared"}, now)
			if d.Allowed {
				evil++
			} else if strings.Contains(d.Reason, "tenant evil") {
				evilRefusal = d.Reason
			}
		}
		if d := allow(t, db, cfg, brakes.Subject{NodeID: "node_acme_0", PoolID: "pool_acme", GatewayID: "gw-shared"}, now); d.Allowed {
			acme++
		}
	}
	// evil: its burst, then one per 20 s; the fleet: one per 10 s.
	if evil > 11 {
		t.Fatalf("evil took %d tokens in 200 s, more than its share (11)", evil)
	}
	if acme < 9 {
		t.Fatalf("acme got %d tokens in 200 s (evil %d); want at least 9 of the fleet's 21", acme, evil)
	}
	if !strings.Contains(evilRefusal, "nodes.tenantEvictionRate=0.05") {
		t.Fatalf("evil's refusal names no tenant rate: %q", evilRefusal)
	}
	t.Logf("200 s: evil %d tokens, acme %d", evil, acme)
}
