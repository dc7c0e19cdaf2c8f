package nodespec

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// Kind is the controller's kind in the work queue (pkg/nodespec.Kind).
const Kind = nodespec.Kind

// Built-in contributor modules, registered first by [Builtin].
const (
	ModuleSystem = "system"
	ModulePool   = "pool"
)

// Config configures the controller.
type Config struct {
	// Registry holds the contributors; nil means [Builtin]'s.
	Registry *Registry
	// Changed, when set, is called after the commit that moved node's
	// generation to generation: the hook that pokes the gateway holding the
	// node's session. A lost call only delays delivery, which finds nodes
	// behind their generation from the database.
	Changed func(ctx context.Context, nodeID string, generation int64)
}

// Builtin returns a registry with the system's contributors: "system"
// (identity, from the nodes row) and "pool" (site and health, from the
// pool's settings). Modules register theirs after.
func Builtin() *Registry {
	r := &Registry{}
	_ = r.Register(ModuleSystem, identity)
	_ = r.Register(ModulePool, poolSettings)
	return r
}

// Reconciler returns the node-sharded nodespec reconciler.
func Reconciler(cfg Config) reconcile.Reconciler {
	c := &controller{reg: cfg.Registry, changed: cfg.Changed}
	if c.reg == nil {
		c.reg = Builtin()
	}
	return reconcile.Reconciler{Name: Kind, ShardBy: reconcile.ShardByNode, Role: reconcile.RoleNodeSpec,
		Run: c.run, RunBatch: c.runBatch, Keys: keys}
}

// keys lists the nodes past adoption in shards, for resync.
func keys(ctx context.Context, q reconcile.Querier, shards []int) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT id FROM nodes WHERE shard = ANY($1) AND state <> 'adopting'`, shards)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

type controller struct {
	reg     *Registry
	changed func(ctx context.Context, nodeID string, generation int64)
}

// run recomputes one node's spec in its own transaction.
func (c *controller) run(ctx context.Context, rc *reconcile.RunContext, nodeID string) (reconcile.Result, error) {
	var bumped int64
	err := rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
		var err error
		bumped, err = c.recompute(ctx, tx, rc.Logger, nodeID)
		return err
	})
	if err != nil {
		return reconcile.Done, err
	}
	c.notify(ctx, rc.Logger, nodeID, bumped)
	return reconcile.Done, nil
}

// runBatch recomputes a batch of nodes in one transaction: a fleet-wide
// change costs a commit per batch, not per node. Nodes are locked in id
// order. Any error rolls the whole batch back, and the runtime then runs
// each node on its own.
func (c *controller) runBatch(ctx context.Context, bc *reconcile.BatchContext, nodeIDs []string) error {
	ids := slices.Sorted(slices.Values(nodeIDs))
	bumped := make([]int64, len(ids))
	err := bc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
		for i, id := range ids {
			var err error
			if bumped[i], err = c.recompute(ctx, tx, bc.Logger.With("key", id), id); err != nil {
				return fmt.Errorf("node %s: %w", id, err)
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	for i, id := range ids {
		c.notify(ctx, bc.Logger.With("key", id), id, bumped[i])
	}
	return nil
}

// notify tells the gateway hook about a committed generation change.
func (c *controller) notify(ctx context.Context, log *slog.Logger, nodeID string, bumped int64) {
	if bumped == 0 {
		return
	}
	log.InfoContext(ctx, "desired state changed", "generation", bumped)
	if c.changed != nil {
		c.changed(ctx, nodeID, bumped)
	}
}

// recompute recomputes node nodeID's spec in tx and stores it, bumping the
// generation, only when its canonical JSON differs from the stored one (or
// none was stored yet: adoption writes generation 1), and returns the new
// generation (0 when it did not move). A conflict is stored in spec_error
// and leaves spec and generation alone.
func (c *controller) recompute(ctx context.Context, tx pgx.Tx, log *slog.Logger, nodeID string) (int64, error) {
	var n Node
	var stored []byte
	var gen int64
	var specErr *string
	err := tx.QueryRow(ctx, `SELECT tenant_id, pool_id, state, labels, spec::text, generation, spec_error
		FROM nodes WHERE id = $1 FOR UPDATE`, nodeID).Scan(&n.TenantID, &n.PoolID, &n.State, &n.Labels, &stored, &gen, &specErr)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, nil // gone
	}
	if err != nil {
		return 0, fmt.Errorf("read node: %w", err)
	}
	if n.State == "adopting" {
		return 0, nil // desired state applies once adopted
	}
	n.ID = nodeID
	spec, err := c.reg.Compute(ctx, tx, n)
	var conflict *ConflictError
	if errors.As(err, &conflict) {
		log.WarnContext(ctx, "desired state conflict", "error", err)
		_, err = tx.Exec(ctx, `UPDATE nodes SET spec_error = $2, updated_at = now()
			WHERE id = $1 AND spec_error IS DISTINCT FROM $2`, nodeID, conflict.Error())
		return 0, err
	}
	if err != nil {
		return 0, err
	}
	want, err := Canonical(spec)
	if err != nil {
		return 0, err
	}
	have, err := CanonicalJSON(stored)
	if err != nil {
		return 0, fmt.Errorf("stored spec: %w", err)
	}
	if gen > 0 && bytes.Equal(want, have) {
		if specErr != nil {
			_, err = tx.Exec(ctx, `UPDATE nodes SET spec_error = NULL, updated_at = now() WHERE id = $1`, nodeID)
		}
		return 0, err
	}
	var bumped int64
	var tenant string
	err = tx.QueryRow(ctx, `UPDATE nodes SET spec = $2::jsonb, generation = generation + 1, spec_error = NULL, updated_at = now()
		WHERE id = $1 RETURNING generation, tenant_id`, nodeID, string(want)).Scan(&bumped, &tenant)
	if err != nil {
		return 0, fmt.Errorf("store spec: %w", err)
	}
	_, err = outbox.Write(ctx, tx, outbox.Event{TenantID: tenant, Type: "node.spec.changed", Resource: nodeID,
		Payload: map[string]any{"nodeId": nodeID, "generation": bumped}})
	return bumped, err
}

// identity is the system's part: the node's identity section.
func identity(_ context.Context, _ reconcile.Querier, n Node) (*agentv1.NodeSpec, error) {
	return &agentv1.NodeSpec{Identity: &agentv1.NodeIdentity{
		NodeId: n.ID, TenantId: n.TenantID, PoolId: n.PoolID, Labels: n.Labels,
	}}, nil
}

// poolSettings is the pool's part: the site and health settings of the
// node's pool (pools.site, pools.health), each only when set.
func poolSettings(ctx context.Context, q reconcile.Querier, n Node) (*agentv1.NodeSpec, error) {
	var site, health []byte
	err := q.QueryRow(ctx, `SELECT site::text, health::text FROM pools WHERE id = $1`, n.PoolID).Scan(&site, &health)
	if err != nil {
		return nil, fmt.Errorf("read pool %s: %w", n.PoolID, err)
	}
	out := &agentv1.NodeSpec{Site: &agentv1.SiteSettings{}, Health: &agentv1.HealthSettings{}}
	opts := protojson.UnmarshalOptions{DiscardUnknown: true}
	if err := opts.Unmarshal(site, out.Site); err != nil {
		return nil, fmt.Errorf("pool %s site settings: %w", n.PoolID, err)
	}
	if err := opts.Unmarshal(health, out.Health); err != nil {
		return nil, fmt.Errorf("pool %s health settings: %w", n.PoolID, err)
	}
	if proto.Size(out.Site) == 0 {
		out.Site = nil
	}
	if proto.Size(out.Health) == 0 {
		out.Health = nil
	}
	return out, nil
}
