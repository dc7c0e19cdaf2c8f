package main

import (
	"strings"
	"testing"
	"time"
)

// TestParseAndRender: benchmark lines are read with their package and
// every metric; other lines are skipped; the table carries the limits.
func TestParseAndRender(t *testing.T) {
	in := `goos: linux
pkg: github.com/bettercompute/bettercompute/pkg/reconcile
BenchmarkThroughput/batched-2         	    5000	     61234 ns/op	     16907 keys/s
--- FAIL: BenchmarkBroken
pkg: github.com/bettercompute/bettercompute/services/dev
BenchmarkGatewayFleet-2   	       1	158415000000 ns/op	  8.822 change-bus-up-s	 10000 nodes	 512 B/op
ok  	github.com/bettercompute/bettercompute/services/dev	158.415s
`
	rs, err := parse(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 2 {
		t.Fatalf("%d results, want 2: %+v", len(rs), rs)
	}
	if rs[0].pkg != "github.com/bettercompute/bettercompute/pkg/reconcile" || rs[0].name != "BenchmarkThroughput/batched" || rs[0].iters != 5000 {
		t.Errorf("first = %+v", rs[0])
	}
	if len(rs[1].metrics) != 4 || rs[1].metrics[1] != (metric{8.822, "change-bus-up-s"}) {
		t.Errorf("second's metrics = %+v", rs[1].metrics)
	}
	table := render(rs, []limit{{name: "PostgreSQL TPC-B", value: "900 tx/s", how: "pgbench"}}, time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC))
	for _, want := range []string{"| PostgreSQL TPC-B | 900 tx/s |", "| pkg/reconcile | BenchmarkThroughput/batched | 5000 | 61µs/op, 16907 keys/s |", "8.822 change-bus-up-s, 10000 nodes"} {
		if !strings.Contains(table, want) {
			t.Errorf("table lacks %q:\n%s", want, table)
		}
	}
}
