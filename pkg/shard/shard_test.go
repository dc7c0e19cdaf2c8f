package shard_test

import (
	"fmt"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/shard"
)

func name(s int) string { return fmt.Sprintf("shard:%d", s) }

func TestOfIsStableAndSpread(t *testing.T) {
	t.Parallel()
	counts := make([]int, shard.Count)
	for i := range 256 * 100 {
		k := fmt.Sprintf("node_%d", i)
		s := shard.Of(k)
		if s < 0 || s >= shard.Count || shard.Of(k) != s {
			t.Fatalf("Of(%q) = %d", k, s)
		}
		counts[s]++
	}
	for s, n := range counts {
		if n < 50 || n > 160 { // mean 100; a broken hash piles keys up
			t.Errorf("shard %d has %d of 25600 keys", s, n)
		}
	}
}

func TestAssignPartitionsAndMovesLittle(t *testing.T) {
	t.Parallel()
	two := []string{"controllers/a", "controllers/b"}
	three := append([]string{"controllers/c"}, two...)

	owners := func(workers []string) map[int]string {
		m := map[int]string{}
		for _, w := range workers {
			for _, s := range shard.Assign(w, workers, name) {
				if prev, dup := m[s]; dup {
					t.Fatalf("shard %d assigned to %s and %s", s, prev, w)
				}
				m[s] = w
			}
		}
		if len(m) != shard.Count {
			t.Fatalf("%d of %d shards assigned", len(m), shard.Count)
		}
		return m
	}
	o2, o3 := owners(two), owners(three)
	moved := 0
	for s := range shard.Count {
		if o2[s] != o3[s] {
			moved++
			if o3[s] != "controllers/c" {
				t.Errorf("shard %d moved between the old workers (%s → %s)", s, o2[s], o3[s])
			}
		}
	}
	if moved < 40 || moved > 130 { // about a third should move to the newcomer
		t.Errorf("%d shards moved to the third worker", moved)
	}
	if got := shard.Assign("controllers/z", two, name); got != nil {
		t.Errorf("a non-member was assigned %v", got)
	}
	if shard.Owner("x", nil) != "" {
		t.Error("no workers must mean no owner")
	}
}
