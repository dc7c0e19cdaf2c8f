package api_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"
	"github.com/bettercompute/bettercompute/proto/migcatalog"

	"github.com/bettercompute/bettercompute/pkg/authz"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/fixture"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/services/api"
)

func migMask() *fieldmaskpb.FieldMask { return &fieldmaskpb.FieldMask{Paths: []string{"mig"}} }

func byModel(name string, profiles ...string) *computev1.MigLayoutSpec {
	return &computev1.MigLayoutSpec{Name: "l", GpuSelector: &computev1.MigGpuSelector{Model: name}, Profiles: profiles}
}

// TestMigLayoutsAdmission: pools.update and nodes.update with mask mig
// accept every catalog model's good layouts and refuse impossible ones as
// INVALID_INPUT naming the field, the profile and the GPU model; bounds on
// counts, names and selectors; a node's index selectors are checked
// against its inventory; a good layout reaches the node's mig section.
func TestMigLayoutsAdmission(t *testing.T) {
	t.Parallel()
	h := setup(t, api.Tuning{})
	ctx := as(h.root)
	pools := computev1.NewPoolsServiceClient(h.conn)
	p, err := pools.Create(ctx, &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "mig", Class: "gpu"})
	if err != nil {
		t.Fatal(err)
	}
	poolID := p.GetPool().GetId()
	update := func(layouts ...*computev1.MigLayoutSpec) error {
		_, err := pools.Update(ctx, &computev1.PoolsServiceUpdateRequest{TenantId: "root", PoolId: poolID, UpdateMask: migMask(),
			Mig: &computev1.MigSettings{Layouts: layouts}})
		return err
	}
	refused := func(t *testing.T, err error, field string, says ...string) {
		t.Helper()
		wantCode(t, err, fault.InvalidInput, field)
		for _, s := range says {
			if !strings.Contains(err.Error(), s) {
				t.Fatalf("%v: does not say %q", err, s)
			}
		}
	}

	for _, m := range migcatalog.Models {
		t.Run(m.Name, func(t *testing.T) {
			n := func(i int) string { return m.Profiles[i].Name } // 0:1g 1:1g+me 2:1g×2 slices 3:2g 4:3g 5:4g 6:7g
			for _, good := range [][]string{
				{n(6)}, {n(4), n(3), n(0), n(0)}, {n(0), n(0), n(0), n(0), n(0), n(0), n(0)}, {n(5), n(4)}, {n(2), n(2), n(2), n(2)},
			} {
				if err := update(byModel(m.Name, good...)); err != nil {
					t.Fatalf("%v refused: %v", good, err)
				}
			}
			// Too many of one profile; one that is not this model's; a
			// set that fits no arrangement.
			refused(t, update(byModel(m.Name, n(4), n(4), n(4))), "mig.layouts[0].profiles", n(4), m.Name, "at most 2")
			refused(t, update(byModel(m.Name, n(5), n(5))), "mig.layouts[0].profiles", n(5), m.Name)
			refused(t, update(byModel(m.Name, "9g.999gb")), "mig.layouts[0].profiles", "9g.999gb", m.Name)
			refused(t, update(byModel(m.Name, n(6), n(0))), "mig.layouts[0].profiles", m.Name)
			refused(t, update(byModel(m.Name, n(4), n(3), n(3), n(0))), "mig.layouts[0].profiles", m.Name)
		})
	}
	// The last good layout is what is stored: refusals changed nothing.
	if n := h.count(t, `SELECT count(*) FROM mig_layouts WHERE pool_id = $1 AND model = 'B200' AND cardinality(profiles) = 4`, poolID); n != 1 {
		t.Fatalf("%d stored layouts after the refusals, want the last good one", n)
	}

	t.Run("bounds", func(t *testing.T) {
		many := make([]*computev1.MigLayoutSpec, 17)
		for i := range many {
			many[i] = byModel("H200 141GB", "7g.141gb")
			many[i].Name = fmt.Sprintf("l%d", i)
		}
		refused(t, update(many...), "mig.layouts")
		long := byModel("H200 141GB", "7g.141gb")
		long.Name = strings.Repeat("a", 65)
		refused(t, update(long), "mig.layouts[0].name")
		upper := byModel("H200 141GB", "7g.141gb")
		upper.Name = "Big"
		refused(t, update(upper), "mig.layouts[0].name")
		refused(t, update(byModel("H200 141GB", "7g.141gb"), byModel("H200 141GB", "7g.141gb")), "mig.layouts[1].name", "twice")
		refused(t, update(&computev1.MigLayoutSpec{Name: "l", Profiles: []string{"7g.141gb"}}), "mig.layouts[0].gpuSelector")
		refused(t, update(&computev1.MigLayoutSpec{Name: "l", Profiles: []string{"7g.141gb"},
			GpuSelector: &computev1.MigGpuSelector{Model: "H200 141GB", Indices: []uint32{0}}}), "mig.layouts[0].gpuSelector")
		refused(t, update(byModel("L40S", "1g.12gb")), "mig.layouts[0].gpuSelector.model", "L40S")
		refused(t, update(&computev1.MigLayoutSpec{Name: "l", Profiles: []string{"7g.141gb"},
			GpuSelector: &computev1.MigGpuSelector{Indices: []uint32{8}}}), "mig.layouts[0].gpuSelector.indices")
		refused(t, update(&computev1.MigLayoutSpec{Name: "l", Profiles: []string{"7g.141gb"},
			GpuSelector: &computev1.MigGpuSelector{Indices: []uint32{1, 1}}}), "mig.layouts[0].gpuSelector.indices")
		refused(t, update(byModel("H200 141GB")), "mig.layouts[0].profiles", "required")
		off := byModel("H200 141GB", "7g.141gb")
		off.Disabled = true
		refused(t, update(off), "mig.layouts[0].profiles", "disabled")
		// An index layout in a pool is checked against every catalog
		// model: a 7g fits all of them.
		if err := update(&computev1.MigLayoutSpec{Name: "first", Profiles: []string{"1g.18gb"}, GpuSelector: &computev1.MigGpuSelector{Indices: []uint32{0}}}); err == nil {
			t.Fatal("1g.18gb on GPU 0 of a pool that may hold an A100 accepted")
		} else {
			refused(t, err, "mig.layouts[0].profiles", "1g.18gb", "A100 40GB")
		}
		// Clearing.
		if err := update(); err != nil {
			t.Fatal(err)
		}
		if n := h.count(t, `SELECT count(*) FROM mig_layouts WHERE pool_id = $1`, poolID); n != 0 {
			t.Fatalf("%d layouts after clearing", n)
		}
	})

	t.Run("resetPolicy", func(t *testing.T) {
		set := func(policy string) error {
			_, err := pools.Update(ctx, &computev1.PoolsServiceUpdateRequest{TenantId: "root", PoolId: poolID, UpdateMask: migMask(),
				Mig: &computev1.MigSettings{Layouts: []*computev1.MigLayoutSpec{byModel("H200 141GB", "7g.141gb")}, ResetPolicy: policy}})
			return err
		}
		refused(t, set("power-cycle"), "mig.resetPolicy", "gpu-reset or node-reboot")
		if err := set("node-reboot"); err != nil {
			t.Fatal(err)
		}
		if n := h.count(t, `SELECT count(*) FROM mig_pool_settings WHERE pool_id = $1 AND reset_policy = 'node-reboot'`, poolID); n != 1 {
			t.Fatalf("%d stored node-reboot policies", n)
		}
		// Empty is the default (gpu-reset): no row.
		if err := set(""); err != nil {
			t.Fatal(err)
		}
		if n := h.count(t, `SELECT count(*) FROM mig_pool_settings WHERE pool_id = $1`, poolID); n != 0 {
			t.Fatalf("%d stored policies after the default", n)
		}
		fixture.Node(t, h.db, fixture.NodeOpts{ID: "node_rp", Pool: poolID, State: nodes.StateAdopted, GPUs: 1})
		if err := authz.Put(t.Context(), h.db, authz.Resource{Type: authz.TypeNode, ID: "node_rp", TenantID: "root", PoolID: poolID}); err != nil {
			t.Fatal(err)
		}
		_, err := computev1.NewNodesServiceClient(h.conn).Update(ctx, &computev1.NodesServiceUpdateRequest{TenantId: "root", NodeId: "node_rp",
			UpdateMask: migMask(), Mig: &computev1.MigSettings{ResetPolicy: "gpu-reset"}})
		refused(t, err, "mig.resetPolicy", "pool")
	})

	t.Run("a vps-host pool has none", func(t *testing.T) {
		vp, err := pools.Create(ctx, &computev1.PoolsServiceCreateRequest{TenantId: "root", Name: "hosts", Class: "vps-host"})
		if err != nil {
			t.Fatal(err)
		}
		_, err = pools.Update(ctx, &computev1.PoolsServiceUpdateRequest{TenantId: "root", PoolId: vp.GetPool().GetId(), UpdateMask: migMask(),
			Mig: &computev1.MigSettings{Layouts: []*computev1.MigLayoutSpec{byModel("H200 141GB", "7g.141gb")}}})
		refused(t, err, "mig", "gpu pools")
		fixture.Node(t, h.db, fixture.NodeOpts{ID: "node_host", Pool: vp.GetPool().GetId(), State: nodes.StateAdopted, GPUs: 1})
		if err := authz.Put(t.Context(), h.db, authz.Resource{Type: authz.TypeNode, ID: "node_host", TenantID: "root", PoolID: vp.GetPool().GetId()}); err != nil {
			t.Fatal(err)
		}
		_, err = computev1.NewNodesServiceClient(h.conn).Update(ctx, &computev1.NodesServiceUpdateRequest{TenantId: "root", NodeId: "node_host",
			UpdateMask: migMask(), Mig: &computev1.MigSettings{Layouts: []*computev1.MigLayoutSpec{byModel("H200 141GB", "7g.141gb")}}})
		refused(t, err, "mig", "gpu pools")
	})

	t.Run("nodes.update checks the node's inventory", func(t *testing.T) {
		fixture.Node(t, h.db, fixture.NodeOpts{ID: "node_a100", Pool: poolID, State: nodes.StateAdopted, Live: true, GPUs: 4,
			Labels: map[string]string{"rack": "r1"}, Model: "NVIDIA A100-SXM4-40GB", MemoryBytes: 40 << 30})
		if err := authz.Put(t.Context(), h.db, authz.Resource{Type: authz.TypeNode, ID: "node_a100", TenantID: "root", PoolID: poolID}); err != nil {
			t.Fatal(err)
		}
		nodesC := computev1.NewNodesServiceClient(h.conn)
		node := func(layouts ...*computev1.MigLayoutSpec) error {
			_, err := nodesC.Update(ctx, &computev1.NodesServiceUpdateRequest{TenantId: "root", NodeId: "node_a100", UpdateMask: migMask(),
				Mig: &computev1.MigSettings{Layouts: layouts}})
			return err
		}
		idx := func(profiles []string, ix ...uint32) *computev1.MigLayoutSpec {
			return &computev1.MigLayoutSpec{Name: "l", GpuSelector: &computev1.MigGpuSelector{Indices: ix}, Profiles: profiles}
		}
		refused(t, node(idx([]string{"1g.5gb"}, 5)), "mig.layouts[0].gpuSelector.indices", "no GPU 5")
		refused(t, node(idx([]string{"3g.71gb"}, 0)), "mig.layouts[0].profiles", "3g.71gb", "A100 40GB")
		_, err := nodesC.Update(ctx, &computev1.NodesServiceUpdateRequest{TenantId: "root", NodeId: "node_a100",
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"spec"}}})
		refused(t, err, "updateMask")
		if err := node(idx([]string{"3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"}, 0, 2)); err != nil {
			t.Fatal(err)
		}
		if n := h.count(t, `SELECT count(*) FROM mig_layouts WHERE node_id = 'node_a100'`); n != 1 {
			t.Fatalf("%d node layouts stored", n)
		}
		// A mig-only update leaves the labels alone.
		if n := h.count(t, `SELECT count(*) FROM nodes WHERE id = 'node_a100' AND labels->>'rack' = 'r1'`); n != 1 {
			t.Fatal("a mig-only nodes.update dropped the node's labels")
		}
		poll.UntilNil(t, 20*time.Second, "the node's mig section", func() error {
			got, err := nodesC.GetSpec(ctx, &computev1.NodesServiceGetSpecRequest{TenantId: "root", NodeId: "node_a100"})
			if err != nil {
				t.Fatal(err)
			}
			raw, err := protojson.Marshal(got.GetSpec())
			if err != nil {
				t.Fatal(err)
			}
			var spec agentv1.NodeSpec
			if err := protojson.Unmarshal(raw, &spec); err != nil {
				t.Fatal(err)
			}
			gpus := spec.GetMig().GetGpus()
			if len(gpus) != 2 || gpus[0].GetGpuUuid() != "GPU-node_a100-0" || gpus[1].GetGpuUuid() != "GPU-node_a100-2" || len(gpus[1].GetInstances()) != 4 {
				return fmt.Errorf("mig section %v", spec.GetMig())
			}
			return nil
		})
	})
}
