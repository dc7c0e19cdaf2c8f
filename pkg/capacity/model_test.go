package capacity_test

import (
	"fmt"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/capacity"
)

func node(id string, free, booked int) capacity.NodeFree {
	n := capacity.NodeFree{NodeID: id, Booked: booked}
	for i := range free {
		n.Free = append(n.Free, capacity.Atom{NodeID: id, DeviceID: fmt.Sprintf("%s-gpu%d", id, i), Index: i})
	}
	return n
}

func nodesOf(atoms []capacity.Atom) map[string]int {
	out := map[string]int{}
	for _, a := range atoms {
		out[a.NodeID]++
	}
	return out
}

func TestPlan(t *testing.T) {
	t.Parallel()
	t.Run("packs onto the partially used node that fits best", func(t *testing.T) {
		t.Parallel()
		got, short := capacity.Plan([]capacity.NodeFree{node("a", 8, 0), node("b", 3, 5), node("c", 2, 6)}, 3, false)
		if short != nil {
			t.Fatal(short)
		}
		if n := nodesOf(got); len(n) != 1 || n["b"] != 3 {
			t.Fatalf("want 3 on b (best fit), got %v", n)
		}
	})
	t.Run("spans as few nodes as it can", func(t *testing.T) {
		t.Parallel()
		got, short := capacity.Plan([]capacity.NodeFree{node("a", 8, 0), node("b", 8, 0), node("c", 2, 6)}, 10, false)
		if short != nil {
			t.Fatal(short)
		}
		if n := nodesOf(got); len(n) != 2 || len(got) != 10 {
			t.Fatalf("want 10 on 2 nodes, got %v", n)
		}
	})
	t.Run("same node picks one node or says what the best node has", func(t *testing.T) {
		t.Parallel()
		_, short := capacity.Plan([]capacity.NodeFree{node("a", 4, 4), node("b", 6, 2)}, 8, true)
		if short == nil || short.Have != 6 || short.Want != 8 {
			t.Fatalf("want a shortage of 8 with 6 on the best node, got %+v", short)
		}
		short.Model = "NVIDIA H200"
		if want := "need 8 × NVIDIA H200 on one node; the best node has 6 free"; short.Error() != want {
			t.Fatalf("message %q, want %q", short.Error(), want)
		}
		got, short := capacity.Plan([]capacity.NodeFree{node("a", 4, 4), node("b", 6, 2)}, 5, true)
		if short != nil || len(nodesOf(got)) != 1 || nodesOf(got)["b"] != 5 {
			t.Fatalf("want 5 on b, got %v %v", nodesOf(got), short)
		}
	})
	t.Run("not enough in total is a shortage with the total", func(t *testing.T) {
		t.Parallel()
		_, short := capacity.Plan([]capacity.NodeFree{node("a", 1, 7), node("b", 2, 6)}, 4, false)
		if short == nil || short.Have != 3 {
			t.Fatalf("want a shortage with 3 free, got %+v", short)
		}
	})
	t.Run("never picks an atom twice", func(t *testing.T) {
		t.Parallel()
		got, _ := capacity.Plan([]capacity.NodeFree{node("a", 8, 0), node("b", 5, 3), node("c", 7, 1)}, 20, false)
		seen := map[string]bool{}
		for _, a := range got {
			if seen[a.DeviceID] {
				t.Fatalf("atom %s twice", a.DeviceID)
			}
			seen[a.DeviceID] = true
		}
		if len(got) != 20 {
			t.Fatalf("got %d atoms", len(got))
		}
	})
}

func TestPlanLeavesFewestPartiallyUsedNodes(t *testing.T) {
	t.Parallel()
	// 6 GPUs with 4 free on a used node and 8 on an empty one: fill the used
	// node, 2 on the other (one partially used node, not two).
	got, short := capacity.Plan([]capacity.NodeFree{node("a", 4, 4), node("b", 8, 0)}, 6, false)
	if short != nil {
		t.Fatal(short)
	}
	if n := nodesOf(got); n["a"] != 4 || n["b"] != 2 {
		t.Fatalf("want 4 on a and 2 on b, got %v", n)
	}
	// A partially used node that holds the request beats an empty one.
	got, _ = capacity.Plan([]capacity.NodeFree{node("a", 8, 0), node("b", 6, 2)}, 2, false)
	if n := nodesOf(got); n["b"] != 2 {
		t.Fatalf("want 2 on b, got %v", n)
	}
}
