// Package nodespec is the nodespec controller: it computes every adopted
// node's desired state (bettercompute.agent.v1.NodeSpec) from the parts the
// modules contribute (pkg/nodespec's Registry), stores its proto3 JSON in
// nodes.spec, and bumps nodes.generation only when the canonical JSON
// changed. A merge conflict is stored on the node (nodes.spec_error) without
// bumping the generation.
//
// Code that changes a node's desired state calls pkg/nodespec.Invalidate in
// its transaction.
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

	nodestore "github.com/bettercompute/bettercompute/pkg/nodes"
	desired "github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/pools"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/rollouts"
)

// Built-in contributor modules, registered first by [Builtin].
const (
	ModuleSystem = "system"
	ModulePool   = "pool"
)

// Config configures the controller.
type Config struct {
	// Registry holds the contributors; nil means [Builtin]'s.
	Registry *desired.Registry
}

// Builtin returns a registry with the system's contributors: "system"
// (identity, from the nodes row) and "pool" (site, health, runtime and
// agent, from the pool's settings). Modules register theirs after.
func Builtin() *desired.Registry {
	r := &desired.Registry{}
	_ = r.Register(ModuleSystem, identity)
	_ = r.RegisterBatch(ModulePool, poolSettings)
	return r
}

// Reconciler returns the node-sharded nodespec reconciler.
func Reconciler(cfg Config) reconcile.Reconciler {
	c := &controller{reg: cfg.Registry}
	if c.reg == nil {
		c.reg = Builtin()
	}
	return reconcile.Reconciler{Name: desired.Kind, ShardBy: reconcile.ShardByNode, Role: reconcile.RoleNodeSpec,
		Run: c.run, RunBatch: c.runBatch, Keys: keys}
}

// keys lists the nodes past adoption in shards, for resync.
func keys(ctx context.Context, q reconcile.Querier, shards []int) ([]string, error) {
	return nodestore.IDsPastAdoptionInShards(ctx, q, shards)
}

type controller struct {
	reg *desired.Registry
}

// run recomputes one node's spec in its own transaction.
func (c *controller) run(ctx context.Context, rc *reconcile.RunContext, nodeID string) (reconcile.Result, error) {
	var changes []desired.Change
	err := rc.InTx(ctx, func(tx pgx.Tx, q *reconcile.Queue) error {
		var err error
		changes, err = c.recompute(ctx, tx, q, rc.Logger, []string{nodeID})
		return err
	})
	if err != nil {
		return reconcile.Done, err
	}
	c.notify(ctx, rc.Logger, changes)
	return reconcile.Done, nil
}

// runBatch recomputes a batch of nodes in one transaction, in a handful of
// statements whatever its size: a fleet-wide change costs a commit per
// batch, not per node. Any error rolls the whole batch back, and the
// runtime then runs each node on its own.
func (c *controller) runBatch(ctx context.Context, bc *reconcile.BatchContext, nodeIDs []string) error {
	var changes []desired.Change
	err := bc.InTx(ctx, func(tx pgx.Tx, q *reconcile.Queue) error {
		var err error
		changes, err = c.recompute(ctx, tx, q, bc.Logger, nodeIDs)
		return err
	})
	if err != nil {
		return err
	}
	c.notify(ctx, bc.Logger, changes)
	return nil
}

// notify logs committed generation changes (the transaction woke the
// gateways holding the nodes).
func (c *controller) notify(ctx context.Context, log *slog.Logger, changes []desired.Change) {
	if len(changes) == 0 {
		return
	}
	for _, ch := range changes {
		log.DebugContext(ctx, "desired state changed", "key", ch.NodeID, "generation", ch.Generation)
	}
	log.InfoContext(ctx, "desired state changed", "nodes", len(changes))
}

// recompute recomputes the specs of nodeIDs in tx (locked in id order) and
// stores each whose canonical JSON differs from the stored one (or that had
// none yet: adoption writes generation 1), bumping its generation, and
// returns those it moved, each woken through q (its gateway delivers it
// after commit). Nodes gone or still adopting are skipped. A
// conflict is stored in the node's spec_error and leaves its spec and
// generation alone. Each contributor is asked once for all the nodes, the
// changed specs are stored in one statement and their events written in
// another.
func (c *controller) recompute(ctx context.Context, tx pgx.Tx, q *reconcile.Queue, log *slog.Logger, nodeIDs []string) ([]desired.Change, error) {
	locked, err := nodestore.LockForSpec(ctx, tx, nodeIDs)
	if err != nil {
		return nil, err
	}
	locked = slices.DeleteFunc(locked, func(n nodestore.SpecState) bool { return n.State == "adopting" }) // desired state applies once adopted
	if len(locked) == 0 {
		return nil, nil
	}
	nodes := make([]desired.Node, len(locked))
	for i, n := range locked {
		nodes[i] = desired.Node{ID: n.ID, TenantID: n.TenantID, PoolID: n.PoolID, State: n.State, Labels: n.Labels}
	}
	// The pool's part and capacity.mig both read the nodes' rollout
	// layers: once for the batch.
	computed, err := c.reg.ComputeBatch(rollouts.WithLayersMemo(ctx), tx, nodes)
	if err != nil {
		return nil, err
	}
	var store []nodestore.SpecWrite
	for i, n := range locked {
		var conflict *desired.ConflictError
		if errors.As(computed[i].Err, &conflict) {
			log.WarnContext(ctx, "desired state conflict", "key", n.ID, "error", conflict)
			if err := nodestore.SetSpecError(ctx, tx, n.ID, conflict.Error()); err != nil {
				return nil, err
			}
			continue
		}
		if computed[i].Err != nil {
			return nil, fmt.Errorf("node %s: %w", n.ID, computed[i].Err)
		}
		want, err := desired.Canonical(computed[i].Spec)
		if err != nil {
			return nil, fmt.Errorf("node %s: %w", n.ID, err)
		}
		have, err := desired.CanonicalJSON(n.Spec)
		if err != nil {
			return nil, fmt.Errorf("node %s: stored spec: %w", n.ID, err)
		}
		if n.Generation > 0 && bytes.Equal(want, have) {
			if n.SpecError != "" {
				if err := nodestore.ClearSpecError(ctx, tx, n.ID); err != nil {
					return nil, err
				}
			}
			continue
		}
		store = append(store, nodestore.SpecWrite{ID: n.ID, Spec: want})
	}
	stored, err := nodestore.StoreSpecs(ctx, tx, store)
	if err != nil {
		return nil, err
	}
	changes := make([]desired.Change, len(stored))
	events := make([]outbox.Event, len(stored))
	for i, st := range stored {
		changes[i] = desired.Change{NodeID: st.ID, Generation: st.Generation, GatewayID: st.GatewayID}
		q.WakeNodeSpec(st.ID, st.GatewayID)
		events[i] = outbox.Event{TenantID: st.TenantID, Type: "node.spec.changed", Resource: st.ID,
			Payload: map[string]any{"nodeId": st.ID, "generation": st.Generation}}
	}
	return changes, outbox.WriteMany(ctx, tx, events)
}

// identity is the system's part: the node's identity section.
func identity(_ context.Context, _ reconcile.Querier, n desired.Node) (*agentv1.NodeSpec, error) {
	return &agentv1.NodeSpec{Identity: &agentv1.NodeIdentity{
		NodeId: n.ID, TenantId: n.TenantID, PoolId: n.PoolID, Labels: n.Labels,
	}}, nil
}

// poolSettings is the pool's part: the site, health, runtime and agent
// settings of each node's pool (pools.site, pools.health, pools.runtime,
// pools.agent: its bcd release manifest), each only when set; every pool
// of the batch is read once. A node in a released batch of its pool's
// progressing or paused rollout, or planned by a succeeded rollout with a
// selector, gets the rollout's sections instead (pkg/rollouts.Layers, one
// statement for the batch; oldest first, so the latest wins per section).
func poolSettings(ctx context.Context, q reconcile.Querier, nodes []desired.Node) ([]*agentv1.NodeSpec, error) {
	var ids []string
	for _, n := range nodes {
		if !slices.Contains(ids, n.PoolID) {
			ids = append(ids, n.PoolID)
		}
	}
	settings, err := pools.NodeSettingsOf(ctx, q, ids)
	if err != nil {
		return nil, err
	}
	parts := map[string]*agentv1.NodeSpec{}
	for _, ps := range settings {
		out := &agentv1.NodeSpec{Site: &agentv1.SiteSettings{}, Health: &agentv1.HealthSettings{}, Runtime: &agentv1.RuntimeSettings{},
			Agent: &agentv1.AgentSettings{}}
		opts := protojson.UnmarshalOptions{DiscardUnknown: true}
		if err := opts.Unmarshal(ps.Site, out.Site); err != nil {
			return nil, fmt.Errorf("pool %s site settings: %w", ps.ID, err)
		}
		if err := opts.Unmarshal(ps.Health, out.Health); err != nil {
			return nil, fmt.Errorf("pool %s health settings: %w", ps.ID, err)
		}
		if err := opts.Unmarshal(ps.Runtime, out.Runtime); err != nil {
			return nil, fmt.Errorf("pool %s runtime settings: %w", ps.ID, err)
		}
		if err := opts.Unmarshal(ps.Agent, out.Agent); err != nil {
			return nil, fmt.Errorf("pool %s agent settings: %w", ps.ID, err)
		}
		if proto.Size(out.Site) == 0 {
			out.Site = nil
		}
		if proto.Size(out.Health) == 0 {
			out.Health = nil
		}
		if proto.Size(out.Runtime) == 0 {
			out.Runtime = nil
		}
		if proto.Size(out.Agent) == 0 {
			out.Agent = nil
		}
		parts[ps.ID] = out
	}
	nodeIDs := make([]string, len(nodes))
	for i, n := range nodes {
		nodeIDs[i] = n.ID
	}
	layers, err := rollouts.Layers(ctx, q, nodeIDs)
	if err != nil {
		return nil, err
	}
	out := make([]*agentv1.NodeSpec, len(nodes))
	for i, n := range nodes {
		p, ok := parts[n.PoolID]
		if !ok {
			return nil, fmt.Errorf("read pool %s: %w", n.PoolID, pgx.ErrNoRows)
		}
		// Each node gets its own copy: the merge writes into parts.
		out[i] = proto.CloneOf(p)
		for _, c := range layers[n.ID] {
			if err := applyLayer(out[i], c); err != nil {
				return nil, fmt.Errorf("node %s: rollout layer: %w", n.ID, err)
			}
		}
	}
	return out, nil
}

// applyLayer replaces the sections a rollout's change names in part (the
// pool's part of a node in a released batch) with the change's, each whole
// as pools.update would (docs/rollouts.md).
func applyLayer(part *agentv1.NodeSpec, c rollouts.Change) error {
	opts := protojson.UnmarshalOptions{DiscardUnknown: true}
	for _, sec := range c.Mask {
		var msg proto.Message
		switch sec {
		case "site":
			part.Site = &agentv1.SiteSettings{}
			msg = part.Site
		case "health":
			part.Health = &agentv1.HealthSettings{}
			msg = part.Health
		case "runtime":
			part.Runtime = &agentv1.RuntimeSettings{}
			msg = part.Runtime
		case "agent":
			part.Agent = &agentv1.AgentSettings{}
			msg = part.Agent
		default:
			continue
		}
		if err := opts.Unmarshal(c.Section(sec), msg); err != nil {
			return fmt.Errorf("%s: %w", sec, err)
		}
	}
	if proto.Size(part.Site) == 0 {
		part.Site = nil
	}
	if proto.Size(part.Health) == 0 {
		part.Health = nil
	}
	if proto.Size(part.Runtime) == 0 {
		part.Runtime = nil
	}
	if proto.Size(part.Agent) == 0 {
		part.Agent = nil
	}
	return nil
}
