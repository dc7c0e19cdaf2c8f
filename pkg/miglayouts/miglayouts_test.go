package miglayouts_test

import (
	"errors"
	"reflect"
	"slices"
	"testing"

	"github.com/bettercompute/bettercompute/proto/migcatalog"

	"github.com/bettercompute/bettercompute/pkg/db"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/miglayouts"
	"github.com/bettercompute/bettercompute/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// TestStoreRoundTrip: a pool's and a node's layouts come back in order, as
// stored; replacing and clearing replace the whole list; draining marks
// are new once.
func TestStoreRoundTrip(t *testing.T) {
	t.Parallel()
	pool, err := db.Open(t.Context(), db.Config{URL: pgtest.NewDB(t), MaxConns: 4})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	fixture.Pool(t, pool, fixture.PoolOpts{ID: "pool_a"})
	fixture.Node(t, pool, fixture.NodeOpts{ID: "node_1", Pool: "pool_a"})
	ctx := t.Context()
	poolLayouts := []miglayouts.Layout{
		{Name: "b", Selector: miglayouts.Selector{Model: "H200 141GB"}, Profiles: []string{"3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb"}},
		{Name: "a", Selector: miglayouts.Selector{Indices: []int{7, 0}}, Disabled: true},
	}
	nodeLayouts := []miglayouts.Layout{{Name: "quote\"d", Selector: miglayouts.Selector{Indices: []int{3}}, Profiles: []string{"1g.18gb+me"}}}
	if err := miglayouts.SetPool(ctx, pool, "pool_a", poolLayouts); err != nil {
		t.Fatal(err)
	}
	if err := miglayouts.SetNode(ctx, pool, "node_1", nodeLayouts); err != nil {
		t.Fatal(err)
	}
	got, err := miglayouts.Of(ctx, pool, []string{"pool_a"}, []string{"node_1"})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got.Pools["pool_a"], poolLayouts) || !reflect.DeepEqual(got.Nodes["node_1"], nodeLayouts) {
		t.Fatalf("read back %+v", got)
	}
	if err := miglayouts.SetPool(ctx, pool, "pool_a", poolLayouts[1:]); err != nil {
		t.Fatal(err)
	}
	if err := miglayouts.SetNode(ctx, pool, "node_1", nil); err != nil {
		t.Fatal(err)
	}
	got, err = miglayouts.Of(ctx, pool, []string{"pool_a"}, []string{"node_1"})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got.Pools["pool_a"], poolLayouts[1:]) || len(got.Nodes) != 0 {
		t.Fatalf("after replacing and clearing %+v", got)
	}

	w := func(gpus ...string) []miglayouts.Waiting {
		var out []miglayouts.Waiting
		for _, g := range gpus {
			out = append(out, miglayouts.Waiting{GPU: g, Devices: []string{g}})
		}
		return out
	}
	fresh, err := miglayouts.MarkDraining(ctx, pool, "node_1", w("GPU-b", "GPU-a"))
	if err != nil || !slices.Equal(fresh, []string{"GPU-a", "GPU-b"}) {
		t.Fatalf("first marks %v %v", fresh, err)
	}
	fresh, err = miglayouts.MarkDraining(ctx, pool, "node_1", w("GPU-a", "GPU-c"))
	if err != nil || !slices.Equal(fresh, []string{"GPU-c"}) {
		t.Fatalf("second marks %v %v, want only GPU-c new", fresh, err)
	}
	// A mark whose devices change is not new (no second event).
	fresh, err = miglayouts.MarkDraining(ctx, pool, "node_1", []miglayouts.Waiting{{GPU: "GPU-c", Devices: []string{"MIG-1", "MIG-2"}}})
	if err != nil || len(fresh) != 0 {
		t.Fatalf("marks with new devices %v %v, want none new", fresh, err)
	}
	if err := miglayouts.ClearDraining(ctx, pool, []string{"node_1"}, map[string][]string{"node_1": {"GPU-c"}}); err != nil {
		t.Fatal(err)
	}
	fresh, err = miglayouts.MarkDraining(ctx, pool, "node_1", w("GPU-a", "GPU-c"))
	if err != nil || !slices.Equal(fresh, []string{"GPU-a"}) {
		t.Fatalf("marks after clearing all but GPU-c: %v %v", fresh, err)
	}
	got, err = miglayouts.Of(ctx, pool, nil, []string{"node_1"})
	if err != nil || !got.Draining["node_1"] || len(got.Nodes) != 0 {
		t.Fatalf("a node with marks and no layouts: %+v %v", got, err)
	}
	if err := miglayouts.ClearDraining(ctx, pool, []string{"node_1"}, nil); err != nil {
		t.Fatal(err)
	}
	if got, err = miglayouts.Of(ctx, pool, nil, []string{"node_1"}); err != nil || got.Draining["node_1"] {
		t.Fatalf("marks after clearing them all: %+v %v", got, err)
	}
}

// TestResolveAndValidate: a node's layout wins over its pool's for the
// GPUs it matches; a node's index selector is checked against the node's
// GPUs and their model.
func TestResolveAndValidate(t *testing.T) {
	t.Parallel()
	h200, _ := migcatalog.ByName("H200 141GB")
	gpus := []miglayouts.GPU{{UUID: "GPU-0", Index: 0, Model: h200}, {UUID: "GPU-1", Index: 1, Model: h200}, {UUID: "GPU-2", Index: 2}}
	node := []miglayouts.Layout{{Name: "n", Selector: miglayouts.Selector{Indices: []int{1}}, Profiles: []string{"7g.141gb"}}}
	pool := []miglayouts.Layout{{Name: "p", Selector: miglayouts.Selector{Model: "h200 141gb"}, Profiles: []string{"1g.18gb"}}}
	got := miglayouts.Resolve(node, pool, gpus)
	if got["GPU-0"].Name != "p" || got["GPU-1"].Name != "n" || len(got) != 2 {
		t.Fatalf("resolved %+v", got)
	}
	var f *fault.Error
	err := miglayouts.Validate([]miglayouts.Layout{{Name: "x", Selector: miglayouts.Selector{Indices: []int{2}}, Profiles: []string{"7g.141gb"}}}, "mig", gpus)
	if !errors.As(err, &f) || f.Field != "mig.layouts[0].gpuSelector.indices" {
		t.Fatalf("a GPU of no MIG model: %v", err)
	}
	if err := miglayouts.Validate(node, "mig", gpus); err != nil {
		t.Fatal(err)
	}
}
