package console_test

import (
	"context"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
	"github.com/bettercompute/bettercompute/services/api"
	"github.com/bettercompute/bettercompute/services/app"
	"github.com/bettercompute/bettercompute/services/dev"
)

// BenchmarkFleetPage measures the fleet page's server time (one GET
// /console/ through the api role's port, every nodes.list page, the pools
// and their capacity) with BC_BENCH_NODES nodes (10,000 by default) of 8
// GPUs each, inserted straight into a dev control plane's database: 80 %
// in pool "big", 20 % in pool "small". "all" renders the whole fleet (groups:
// more nodes than MaxTiles), "small" the pool filter that draws its 2,000
// tiles.
//
//	cd services && go test ./console -run XXX -bench FleetPage
func BenchmarkFleetPage(b *testing.B) {
	n := 10000
	if v := os.Getenv("BC_BENCH_NODES"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 10 {
			b.Fatalf("BC_BENCH_NODES=%q: want an integer of at least 10", v)
		}
	}
	port, none := 0, 0
	dbURL := pgtest.NewDB(b)
	cfg := &config.Config{
		Database: config.Database{URL: dbURL},
		Server:   config.Server{Host: "127.0.0.1", Port: &port},
		Dev:      config.Dev{DataDir: b.TempDir(), SimNodes: &none},
		Gateway:  config.Gateway{Listen: "127.0.0.1:0"},
	}
	cfg.Defaults()
	env, err := dev.StartWith(b.Context(), cfg, app.Options{API: api.Tuning{RatePerSecond: 1e6, RateBurst: 1e6}})
	if err != nil {
		b.Fatal(err)
	}
	defer env.Stop(context.Background())
	f := &htFixture{env: env, base: env.BaseURL()}
	pools := map[string]string{}
	for _, name := range []string{"big", "small"} {
		var out struct{ Pool struct{ ID string } }
		if err := htAPI(b, f, env.Credential, "pools/create", map[string]any{"tenantId": "root", "name": name, "class": "gpu"}, &out); err != nil {
			b.Fatal(err)
		}
		pools[name] = out.Pool.ID
	}
	db, err := pgxpool.New(b.Context(), dbURL)
	if err != nil {
		b.Fatal(err)
	}
	defer db.Close()
	small := n / 5
	if _, err := db.Exec(b.Context(), `INSERT INTO nodes (id, tenant_id, pool_id, shard, hardware_key, state, hostname, labels,
			generation, observed_generation, last_seen_at)
		SELECT 'node_' || lpad(g::text, 6, '0'), 'root', CASE WHEN g <= $2 THEN $3 ELSE $4 END, g % 256, 'hw_' || g, 'adopted',
		       'gpu-' || g, jsonb_build_object('rack', 'r' || (g % 40)), 1, 1,
		       CASE WHEN g % 50 = 0 THEN now() - interval '1 hour' ELSE now() END
		  FROM generate_series(1, $1) g`, n, small, pools["small"], pools["big"]); err != nil {
		b.Fatal(err)
	}
	if _, err := db.Exec(b.Context(), `INSERT INTO devices (node_id, id, kind, index, model, memory_bytes)
		SELECT n.id, 'GPU-' || n.id || '-' || i, 'gpu', i, 'NVIDIA H200', 150754820096
		  FROM nodes n, generate_series(0, 7) i`); err != nil {
		b.Fatal(err)
	}
	s := htLogin(b, f, env.Credential)
	for _, bc := range []struct{ name, query, want string }{
		{"all", "", `class="tile-group"`},
		{"small", "?pool=small", `class="tile"`},
	} {
		b.Run(bc.name, func(b *testing.B) {
			var total time.Duration
			pages := 0
			for b.Loop() {
				start := time.Now()
				resp, body := htDo(b, f, htReq{path: "/console/" + bc.query, session: s})
				total += time.Since(start)
				pages++
				if resp.StatusCode != http.StatusOK || !strings.Contains(body, bc.want) {
					b.Fatalf("fleet page: %d, %d bytes", resp.StatusCode, len(body))
				}
				if bc.name == "small" && strings.Count(body, `class="tile"`) != small {
					b.Fatalf("%d tiles, want %d", strings.Count(body, `class="tile"`), small)
				}
			}
			b.ReportMetric(float64(total.Milliseconds())/float64(pages), "ms/page")
			b.ReportMetric(float64(n), "nodes")
		})
	}
}
