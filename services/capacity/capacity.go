// Package capacity is the control-plane side of GPU reservations: the
// nodespec contributor that turns a node's active bookings into its devices
// section, and the scheduler role's reconcilers:
//
//   - capacity.bind (node-sharded): moves placed reservations to bound once
//     every booked node has observed a generation that exposes them. The
//     gateway enqueues it when a node's observed generation is stored;
//     resync finds nodes with placed reservations.
//   - capacity.reservations (pool-sharded, the pool-lease placer): expires
//     reservations past their end time, places pending ones that are due,
//     and applies the lost-node policy.
//   - capacity.tick (singleton, periodic): finds pools with due placer work.
//   - capacity.rollup and capacity.usage (singletons, periodic): free,
//     booked and unavailable atoms per pool and model, booked GPUs and
//     GPU-hours per tenant and reservation.
package capacity

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/brakes"
	capstore "github.com/bettercompute/bettercompute/pkg/capacity"
	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/pkg/nodespec"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/shard"
)

// Module is the capacity contributor's name in the nodespec registry.
const Module = "capacity"

// Config configures the capacity reconcilers. Zero values take the
// defaults given.
type Config struct {
	// Placer is "pool-lease" (the default, the only one built).
	Placer string
	// LostNode is the lost-node policy: wait (default), replace or fail.
	LostNode string
	// LostAfter: placement books no node unseen this long; default 2m. The
	// lost-node policy reads Ready = Lost instead, which the liveness job
	// sets after the same nodes.lostAfter.
	LostAfter time.Duration
	// TickEvery is capacity.tick's period; default 5s.
	TickEvery time.Duration
	// RollupEvery is capacity.rollup's and capacity.usage's period; default
	// 30s.
	RollupEvery time.Duration
	// Brakes rate-limit the lost-node policy's actions on unseen nodes and
	// pause them while a pool or gateway is mostly not ready (config
	// nodes.evictionRate, nodes.evictionBurst; the breakers are the
	// liveness job's). Zero values take pkg/brakes' defaults.
	Brakes brakes.Config
	// Now is the brakes' clock; nil means time.Now. Tests pass a fake one.
	Now func() time.Time
}

func (c *Config) defaults() error {
	c.Placer = cmp.Or(c.Placer, "pool-lease")
	if c.Placer != "pool-lease" {
		return fault.New(fault.Unsupported, "capacity.placer", "placer %q is not built yet (built: pool-lease)", c.Placer)
	}
	c.LostNode = cmp.Or(c.LostNode, capstore.LostNodeWait)
	if !capstore.ValidLostNode(c.LostNode) {
		return fault.New(fault.InvalidConfig, "capacity.lostNode", "expected wait, replace or fail, got %q", c.LostNode)
	}
	c.LostAfter = cmp.Or(c.LostAfter, capstore.DefaultLostAfter)
	c.TickEvery = cmp.Or(c.TickEvery, 5*time.Second)
	c.RollupEvery = cmp.Or(c.RollupEvery, 30*time.Second)
	if c.Brakes.Rate < 0 {
		return fault.New(fault.InvalidConfig, "nodes.evictionRate", "expected more than 0 nodes per second, got %g", c.Brakes.Rate)
	}
	if c.Brakes.Burst < 0 {
		return fault.New(fault.InvalidConfig, "nodes.evictionBurst", "expected at least 1 node, got %d", c.Brakes.Burst)
	}
	b, err := c.Brakes.Normalize()
	if err != nil {
		return fault.New(fault.InvalidConfig, "nodes.unhealthyThreshold", "%v", err)
	}
	c.Brakes = b
	if c.Now == nil {
		c.Now = time.Now
	}
	return nil
}

// Register adds the capacity contributor to reg: the devices section.
func Register(reg *nodespec.Registry) error { return reg.RegisterBatch(Module, Contribute) }

// Contribute is the capacity module's part of nodes' desired state: the
// devices section, exactly each node's active bookings by reservation, read
// for every node in one statement.
func Contribute(ctx context.Context, q reconcile.Querier, nodes []nodespec.Node) ([]*agentv1.NodeSpec, error) {
	ids := make([]string, len(nodes))
	for i, n := range nodes {
		ids[i] = n.ID
	}
	byNode, err := capstore.NodesAssignments(ctx, q, ids)
	if err != nil {
		return nil, err
	}
	out := make([]*agentv1.NodeSpec, len(nodes))
	for i, n := range nodes {
		a := byNode[n.ID]
		if a == nil {
			out[i] = &agentv1.NodeSpec{}
			continue
		}
		sec := &agentv1.DeviceAssignments{}
		for _, rsv := range a.Order {
			sec.Assignments = append(sec.Assignments, &agentv1.DeviceAssignment{ReservationId: rsv, GpuUuids: a.Devices[rsv]})
		}
		out[i] = &agentv1.NodeSpec{Devices: sec}
	}
	return out, nil
}

// Reconcilers returns the scheduler role's capacity reconcilers.
func Reconcilers(cfg Config) ([]reconcile.Reconciler, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	p := &placer{cfg: cfg}
	return []reconcile.Reconciler{
		{Name: capstore.KindBind, ShardBy: reconcile.ShardByNode, Role: reconcile.RoleScheduler, Run: runBind, Keys: bindKeys},
		{Name: capstore.KindReservations, ShardBy: reconcile.ShardByPool, Role: reconcile.RoleScheduler, Run: p.run, Keys: poolKeys},
		{Name: capstore.KindTick, ShardBy: reconcile.ShardByNone, Role: reconcile.RoleScheduler, Run: p.tick,
			Periodic: []reconcile.Periodic{{Key: "all", Every: cfg.TickEvery}}},
		{Name: capstore.KindRollup, ShardBy: reconcile.ShardByNone, Role: reconcile.RoleScheduler, Run: p.rollup,
			Periodic: []reconcile.Periodic{{Key: "all", Every: cfg.RollupEvery}}},
		{Name: capstore.KindUsage, ShardBy: reconcile.ShardByNone, Role: reconcile.RoleScheduler, Run: p.usage,
			Periodic: []reconcile.Periodic{{Key: "all", Every: cfg.RollupEvery}}},
	}, nil
}

// bindKeys lists nodes in shards with bookings of placed reservations.
func bindKeys(ctx context.Context, q reconcile.Querier, shards []int) ([]string, error) {
	return capstore.NodesAwaitingBindInShards(ctx, q, shards)
}

// poolKeys lists GPU pools in shards with live reservations.
func poolKeys(ctx context.Context, q reconcile.Querier, shards []int) ([]string, error) {
	ids, err := capstore.PoolsWithLiveReservations(ctx, q)
	if err != nil {
		return nil, err
	}
	return inShards(ids, shards), nil
}

// AwaitingBind returns which of nodeIDs have a booking waiting to bind, in
// tx: the nodes whose convergence needs the bind check (capstore.KindBind), which
// the gateway enqueues with their Observed reports.
func AwaitingBind(ctx context.Context, tx pgx.Tx, nodeIDs []string) ([]string, error) {
	return capstore.AwaitingBind(ctx, tx, nodeIDs)
}

// runBind binds the placed reservations with bookings on node whose booked
// nodes all expose them.
func runBind(ctx context.Context, rc *reconcile.RunContext, node string) (reconcile.Result, error) {
	err := rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
		bound, err := capstore.Bind(ctx, tx, node)
		if err != nil {
			return err
		}
		for _, b := range bound {
			if err := event(ctx, tx, b[1], "reservation.bound", map[string]any{"reservationId": b[0]}); err != nil {
				return err
			}
		}
		if len(bound) > 0 {
			rc.Logger.InfoContext(ctx, "reservations bound", "n", len(bound))
		}
		return nil
	})
	return reconcile.Done, err
}

// event writes an outbox event of tenant about the reservation
// payload["reservationId"] (every reservation.* event of this package has it).
func event(ctx context.Context, tx pgx.Tx, tenant, typ string, payload map[string]any) error {
	rsv, _ := payload["reservationId"].(string)
	if _, err := outbox.Write(ctx, tx, outbox.Event{TenantID: tenant, Type: typ, Resource: rsv, Payload: payload}); err != nil {
		return fmt.Errorf("write %s event: %w", typ, err)
	}
	return nil
}

// inShards keeps the keys whose shard is in shards.
func inShards(keys []string, shards []int) []string {
	out := keys[:0]
	for _, k := range keys {
		if slices.Contains(shards, shard.Of(k)) {
			out = append(out, k)
		}
	}
	return out
}
