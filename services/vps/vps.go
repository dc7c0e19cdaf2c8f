// Package vps is the control-plane side of VPS instances on hosted pools
// (DESIGN §14): the nodespec contributor that lists a vps-host's instances
// in its NodeSpec "instances" section, and the vps role's reconcilers:
//
//   - vps.hosts (singleton): brings every vps-host's capacity row in line
//     with its inventory (host.cpuCount, memoryBytes, diskBytes) and its
//     pool's settings (instances.SyncHosts). Its periodic key "all" syncs
//     every hosted pool; a pool id syncs that pool (enqueue it after a
//     change of the pool's settings or of a host's inventory).
//   - vps.usage (singleton, periodic): folds instance-hours into the
//     usage columns (instances.Accrue) and prunes instances deleted past
//     the retention (instances.Prune).
//
// An instance's desired state reaches its host through the nodespec
// controller (the API invalidates the host's spec in the transaction that
// changes the instance, and the controller and the gateways resync from the
// database); what the host runs comes back with its Observed reports,
// which the gateway stores (instances.ObserveHosts).
package vps

import (
	"cmp"
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/config"
	"github.com/bettercompute/bettercompute/pkg/instances"
	"github.com/bettercompute/bettercompute/pkg/nodespec"
	poolstore "github.com/bettercompute/bettercompute/pkg/pools"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// Module is the vps contributor's name in the nodespec registry.
const Module = "vps"

// Work kinds.
const (
	KindHosts = "vps.hosts"
	KindUsage = "vps.usage"
)

// KeyAll is the periodic key of vps.hosts and vps.usage.
const KeyAll = "all"

// Config configures the vps reconcilers. Zero values take the defaults
// given.
type Config struct {
	// HostsEvery is vps.hosts' period: how soon a host's changed
	// inventory shows in its capacity; default 30s.
	HostsEvery time.Duration
	// UsageEvery is vps.usage's period; default 1m.
	UsageEvery time.Duration
	// Retention is how long a deleted instance is kept before vps.usage
	// prunes it; default instances.DefaultRetention (30 days).
	Retention time.Duration
}

// Register adds the vps contributor to reg: the instances section.
func Register(reg *nodespec.Registry) error { return reg.RegisterBatch(Module, Contribute) }

// Contribute is the vps module's part of nodes' desired state: the
// instances section of every node that hosts instances, listing each live
// one (desired power, size, image, hostname, SSH keys, user data, GPUs by
// UUID, generation). A deleted instance is left out, which its host takes
// as delete; a node hosting none gets no section (its runtime, if any, then
// runs none). One statement finds the hosting nodes among nodes.
func Contribute(ctx context.Context, q reconcile.Querier, nodes []nodespec.Node) ([]*agentv1.NodeSpec, error) {
	out := make([]*agentv1.NodeSpec, len(nodes))
	ids := make([]string, len(nodes))
	for i, n := range nodes {
		ids[i] = n.ID
		out[i] = &agentv1.NodeSpec{}
	}
	hosting, err := instances.Hosting(ctx, q, ids)
	if err != nil {
		return nil, err
	}
	if len(hosting) == 0 {
		return out, nil
	}
	index := make(map[string]int, len(nodes))
	for i, id := range ids {
		index[id] = i
	}
	for _, node := range hosting {
		ins, err := instances.HostInstances(ctx, q, node)
		if err != nil {
			return nil, err
		}
		out[index[node]] = &agentv1.NodeSpec{Instances: Section(ins)}
	}
	return out, nil
}

// Section is the instances section of a host running ins.
func Section(ins []instances.Instance) *agentv1.Instances {
	sec := &agentv1.Instances{}
	for _, in := range ins {
		pb := &agentv1.Instance{
			Id: in.ID, Image: in.Image, Vcpus: uint32(in.VCPUs), MemoryBytes: uint64(in.MemoryMiB) << 20,
			DiskGib: uint32(in.DiskGiB), State: in.Power, SshAuthorizedKeys: in.SSHKeys, UserData: in.UserData,
			Generation: in.Generation,
		}
		for _, g := range in.GPUDevices {
			pb.GpuUuids = append(pb.GpuUuids, g.DeviceID)
		}
		sec.Instances = append(sec.Instances, pb)
	}
	return sec
}

// Reconcilers returns the vps role's reconcilers.
func Reconcilers(cfg Config) []reconcile.Reconciler {
	cfg.HostsEvery = cmp.Or(cfg.HostsEvery, 30*time.Second)
	cfg.UsageEvery = cmp.Or(cfg.UsageEvery, time.Minute)
	cfg.Retention = cmp.Or(cfg.Retention, instances.DefaultRetention)
	role := string(config.RoleVPS)
	return []reconcile.Reconciler{
		{Name: KindHosts, ShardBy: reconcile.ShardByNone, Role: role, Run: runHosts,
			Periodic: []reconcile.Periodic{{Key: KeyAll, Every: cfg.HostsEvery}}},
		{Name: KindUsage, ShardBy: reconcile.ShardByNone, Role: role,
			Run: func(ctx context.Context, rc *reconcile.RunContext, _ string) (reconcile.Result, error) {
				return runUsage(ctx, rc, cfg.Retention)
			},
			Periodic: []reconcile.Periodic{{Key: KeyAll, Every: cfg.UsageEvery}}},
	}
}

// runHosts syncs the host capacity of pool key, or of every hosted pool
// for KeyAll.
func runHosts(ctx context.Context, rc *reconcile.RunContext, key string) (reconcile.Result, error) {
	err := rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
		pools := []string{key}
		if key == KeyAll {
			var err error
			if pools, err = poolstore.IDsOfClass(ctx, tx, poolstore.ClassVPSHost); err != nil {
				return err
			}
		}
		changed := 0
		for _, p := range pools {
			n, err := instances.SyncHosts(ctx, tx, p)
			if err != nil {
				return err
			}
			changed += n
		}
		if changed > 0 {
			rc.Logger.InfoContext(ctx, "host capacity synced", "pools", len(pools), "hosts", changed)
		}
		return nil
	})
	return reconcile.Done, err
}

// runUsage accrues instance-hours and prunes old deleted instances.
func runUsage(ctx context.Context, rc *reconcile.RunContext, retention time.Duration) (reconcile.Result, error) {
	err := rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
		if _, err := instances.Accrue(ctx, tx); err != nil {
			return err
		}
		n, err := instances.Prune(ctx, tx, retention)
		if err != nil {
			return err
		}
		if n > 0 {
			rc.Logger.InfoContext(ctx, "pruned deleted instances", "instances", n)
		}
		return nil
	})
	return reconcile.Done, err
}
