package nodespec_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	nodestore "github.com/bettercompute/bettercompute/pkg/nodes"
	desired "github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// relabel does what nodes.update does: it replaces node_1's labels and
// invalidates its desired state in one transaction.
func (e *env) relabel(t *testing.T, labels map[string]string) {
	t.Helper()
	err := reconcile.InTx(t.Context(), e.pool, nil, func(tx pgx.Tx, q *reconcile.Queue) error {
		if err := nodestore.SetLabels(t.Context(), tx, "root", "node_1", labels); err != nil {
			return err
		}
		return desired.Invalidate(t.Context(), q, "node_1")
	})
	if err != nil {
		t.Fatal(err)
	}
}

// storedSpec reads node_1's stored spec as text, byte for byte.
func (e *env) storedSpec(t *testing.T) string {
	t.Helper()
	var s string
	if err := e.pool.QueryRow(t.Context(), `SELECT spec::text FROM nodes WHERE id = 'node_1'`).Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

func TestLabelUpdatesBumpOnlyWhenASectionChanges(t *testing.T) {
	t.Parallel()

	t.Run("the same labels again do not bump", func(t *testing.T) {
		t.Parallel()
		e := setup(t, nil, "adopted")
		e.change(t, "")
		e.tick(t, desired.Kind)
		if _, gen, _ := e.spec(t); gen != 1 {
			t.Fatalf("first spec: generation %d", gen)
		}
		before := e.storedSpec(t)

		e.relabel(t, map[string]string{"rack": "r1"})
		if tr := e.tick(t, desired.Kind); tr.Done != 1 {
			t.Fatalf("the update enqueued no nodespec work: %+v", tr)
		}
		spec, gen, specErr := e.spec(t)
		if gen != 1 || specErr != "" || spec.GetIdentity().GetLabels()["rack"] != "r1" {
			t.Fatalf("after a no-op update: generation %d (%q), spec %v", gen, specErr, spec)
		}
		// The recomputed spec compared equal to the stored one, which stays
		// as it was.
		if after := e.storedSpec(t); after != before {
			t.Fatalf("stored spec rewritten:\n%s\n%s", before, after)
		}
		e.deliveries(t, "node_1", 1)

		// A real change still bumps once: the identity section carries
		// the labels.
		e.relabel(t, map[string]string{"rack": "r2"})
		e.tick(t, desired.Kind)
		if spec, gen, _ := e.spec(t); gen != 2 || spec.GetIdentity().GetLabels()["rack"] != "r2" {
			t.Fatalf("after a label change: generation %d, spec %v", gen, spec)
		}
	})

	t.Run("a label no section uses does not bump", func(t *testing.T) {
		t.Parallel()
		// A registry whose only section (site) ignores the labels.
		reg := &desired.Registry{}
		err := reg.Register("site", func(context.Context, reconcile.Querier, desired.Node) (*agentv1.NodeSpec, error) {
			return &agentv1.NodeSpec{Site: &agentv1.SiteSettings{LogLevel: proto.String("info")}}, nil
		})
		if err != nil {
			t.Fatal(err)
		}
		e := setup(t, reg, "adopted")
		e.change(t, "")
		e.tick(t, desired.Kind)
		before := e.storedSpec(t)
		if _, gen, _ := e.spec(t); gen != 1 {
			t.Fatalf("first spec: generation %d", gen)
		}

		e.relabel(t, map[string]string{"rack": "r9", "team": "ml"})
		e.tick(t, desired.Kind)
		if _, gen, specErr := e.spec(t); gen != 1 || specErr != "" {
			t.Fatalf("after a label change no section uses: generation %d (%q)", gen, specErr)
		}
		if after := e.storedSpec(t); after != before {
			t.Fatalf("stored spec rewritten:\n%s\n%s", before, after)
		}
		e.deliveries(t, "node_1", 1)
	})
}
