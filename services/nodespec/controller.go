package nodespec

import (
	"bytes"
	"context"
	"errors"
	"fmt"

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
	return reconcile.Reconciler{Name: Kind, ShardBy: reconcile.ShardByNode, Role: reconcile.RoleNodeSpec, Run: c.run, Keys: keys}
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

// run recomputes node nodeID's spec and stores it, bumping the generation,
// only when its canonical JSON differs from the stored one (or none was
// stored yet: adoption writes generation 1). A conflict is stored in
// spec_error and leaves spec and generation alone.
func (c *controller) run(ctx context.Context, rc *reconcile.RunContext, nodeID string) (reconcile.Result, error) {
	var bumped int64
	err := rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
		bumped = 0
		var n Node
		var stored []byte
		var gen int64
		var specErr *string
		err := tx.QueryRow(ctx, `SELECT tenant_id, pool_id, state, labels, spec::text, generation, spec_error
			FROM nodes WHERE id = $1 FOR UPDATE`, nodeID).Scan(&n.TenantID, &n.PoolID, &n.State, &n.Labels, &stored, &gen, &specErr)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil // gone
		}
		if err != nil {
			return fmt.Errorf("read node: %w", err)
		}
		if n.State == "adopting" {
			return nil // desired state applies once adopted
		}
		n.ID = nodeID
		spec, err := c.reg.Compute(ctx, tx, n)
		var conflict *ConflictError
		if errors.As(err, &conflict) {
			rc.Logger.WarnContext(ctx, "desired state conflict", "error", err)
			_, err = tx.Exec(ctx, `UPDATE nodes SET spec_error = $2, updated_at = now()
				WHERE id = $1 AND spec_error IS DISTINCT FROM $2`, nodeID, conflict.Error())
			return err
		}
		if err != nil {
			return err
		}
		want, err := Canonical(spec)
		if err != nil {
			return err
		}
		have, err := CanonicalJSON(stored)
		if err != nil {
			return fmt.Errorf("stored spec: %w", err)
		}
		if gen > 0 && bytes.Equal(want, have) {
			if specErr != nil {
				_, err = tx.Exec(ctx, `UPDATE nodes SET spec_error = NULL, updated_at = now() WHERE id = $1`, nodeID)
			}
			return err
		}
		var tenant string
		err = tx.QueryRow(ctx, `UPDATE nodes SET spec = $2::jsonb, generation = generation + 1, spec_error = NULL, updated_at = now()
			WHERE id = $1 RETURNING generation, tenant_id`, nodeID, string(want)).Scan(&bumped, &tenant)
		if err != nil {
			return fmt.Errorf("store spec: %w", err)
		}
		_, err = outbox.Write(ctx, tx, outbox.Event{TenantID: tenant, Type: "node.spec.changed", Resource: nodeID,
			Payload: map[string]any{"nodeId": nodeID, "generation": bumped}})
		return err
	})
	if err != nil {
		return reconcile.Done, err
	}
	if bumped > 0 {
		rc.Logger.InfoContext(ctx, "desired state changed", "generation", bumped)
		if c.changed != nil {
			c.changed(ctx, nodeID, bumped)
		}
	}
	return reconcile.Done, nil
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
