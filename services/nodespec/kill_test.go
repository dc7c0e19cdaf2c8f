package nodespec_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	desired "github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/poll"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/reconcile/reconciletest"
	"github.com/bettercompute/bettercompute/services/nodespec"
)

// TestControllerKilledMidRunBumpsOnce kills the controller while it computes
// a spec change: its transaction rolls back, and the next owner of the shard
// retries the key and bumps the generation exactly once.
func TestControllerKilledMidRunBumpsOnce(t *testing.T) {
	t.Parallel()
	var block atomic.Bool
	entered := make(chan struct{}, 1)
	reg := nodespec.Builtin()
	err := reg.Register("slow", func(ctx context.Context, _ reconcile.Querier, _ desired.Node) (*agentv1.NodeSpec, error) {
		if block.Load() {
			entered <- struct{}{}
			<-ctx.Done() // the worker dies here
			return nil, ctx.Err()
		}
		return nil, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	e := setup(t, reg, "adopted")
	e.change(t, "")
	e.tick(t, desired.Kind)
	if _, gen, _ := e.spec(t); gen != 1 {
		t.Fatalf("generation %d before the change", gen)
	}

	// A second worker runs the controller on its loops; the change reaches
	// it and it dies mid-run.
	block.Store(true)
	a := startWorker(t, e.pool, reg)
	e.change(t, `UPDATE nodes SET labels = '{"rack":"r2"}' WHERE id = 'node_1'`)
	e.rt.Stop() // hand every shard to a
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("the worker never ran the key")
	}
	reconciletest.Kill(a)
	e.exec(t, `UPDATE workers SET expires_at = now() - interval '1 second' WHERE id = $1`, a.WorkerID(reconcile.RoleNodeSpec))
	e.exec(t, `UPDATE leases SET expires_at = now() - interval '1 second' WHERE holder = $1`, a.WorkerID(reconcile.RoleNodeSpec))
	if _, gen, _ := e.spec(t); gen != 1 {
		t.Fatalf("a killed run bumped the generation to %d", gen)
	}

	// The survivor retries the key and bumps once.
	block.Store(false)
	b := startWorker(t, e.pool, reg)
	poll.UntilNil(t, 30*time.Second, "the survivor to bump the generation once", func() error {
		spec, gen, _ := e.spec(t)
		if gen == 2 && spec.GetIdentity().GetLabels()["rack"] == "r2" {
			return nil
		}
		if gen > 2 {
			t.Fatalf("generation %d, labels %v", gen, spec.GetIdentity().GetLabels())
		}
		return fmt.Errorf("generation %d, labels %v", gen, spec.GetIdentity().GetLabels())
	})
	b.Stop()
	if _, gen, _ := e.spec(t); gen != 2 {
		t.Fatalf("generation %d after the retry: bumped more than once", gen)
	}
}

// startWorker runs a controllers runtime with the nodespec controller on its
// timers.
func startWorker(t *testing.T, pool *pgxpool.Pool, reg *desired.Registry) *reconcile.Runtime {
	t.Helper()
	rt, err := reconcile.New(pool, nil, reconcile.Config{
		Roles: []string{reconcile.RoleNodeSpec}, Heartbeat: 100 * time.Millisecond, PollBusDown: 20 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := rt.Register(nodespec.Reconciler(nodespec.Config{Registry: reg})); err != nil {
		t.Fatal(err)
	}
	if err := rt.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rt.Stop)
	return rt
}
