// Package reconcile is the runtime every controller, placer, sweeper and sink
// of Better Compute runs on: level-triggered reconcilers fed by the
// PostgreSQL work queue, sharded over 256 shards that live workers divide by
// rendezvous hashing under fenced leases, resynced from the database, and
// woken early by pokes over NATS.
//
// Its guarantees are the product's:
//
//   - No wake-up is lost: work is a row enqueued in the same transaction as
//     the change that implies it; a key dirtied during its run runs again.
//   - One runner per shard: a worker runs a shard's keys only under that
//     shard's lease, and every claim and settle checks the lease's fence in
//     the same statement, so a paused or partitioned holder changes nothing.
//   - Convergence without the bus: pokes only make work start sooner; without
//     them the runtime polls (faster while the bus is down) and resyncs every
//     key it owns every 5 minutes plus jitter.
//
// A [Reconciler] is registered with a [Runtime], which runs it on timers
// after [Runtime.Start], or one deterministic pass at a time with
// [Job.Tick] (the tests' and simulator's handle).
package reconcile

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"time"

	"github.com/bettercompute/bettercompute/pkg/config"
)

// Result is what a run asks for next.
type Result int

// Results.
const (
	// Done removes the key (unless it was enqueued again during the run).
	Done Result = iota
	// SyncAgain brings the key back after 1 second.
	SyncAgain
)

// String names the result as the spec does.
func (r Result) String() string {
	if r == SyncAgain {
		return "SYNC_AGAIN"
	}
	return "DONE"
}

// ShardBy says how a reconciler's keys are spread over workers.
type ShardBy string

// Sharding modes.
const (
	// ShardByNode spreads keys (node ids) over the 256 shards.
	ShardByNode ShardBy = "node"
	// ShardByPool spreads keys (pool ids) over the 256 shards.
	ShardByPool ShardBy = "pool"
	// ShardByNone runs every key on one worker, under singleton:<name>.
	ShardByNone ShardBy = "none"
)

// Roles (memberships) a reconciler can declare, named as the configuration
// names them ([config.RuntimeRoles]). Each role's workers divide the shards
// among themselves, under their own leases.
const (
	RoleControllers = string(config.RoleControllers)
	RoleScheduler   = string(config.RoleScheduler)
	// RoleNodeSpec is the nodespec-controller deployable's membership: the
	// desired-state controller scales on its own node shards.
	RoleNodeSpec = string(config.RoleNodeSpecController)
	// RoleCommandSweeper is the command-sweeper deployable's membership: it
	// runs the command-sweeper singleton.
	RoleCommandSweeper = string(config.RoleCommandSweeper)
)

// Roles lists the memberships a runtime can host: [config.RuntimeRoles].
var Roles = func() []string {
	out := make([]string, len(config.RuntimeRoles))
	for i, r := range config.RuntimeRoles {
		out[i] = string(r)
	}
	return out
}()

// Periodic is a key also enqueued every Every, by whichever worker owns it.
type Periodic struct {
	Key   string
	Every time.Duration
}

// Reconciler is a level-triggered loop over keys (the spec's contract).
type Reconciler struct {
	// Name is the reconciler's kind in the work queue ("nodespec",
	// "command-sweeper"): lower case, digits, dots and dashes.
	Name string
	// ShardBy says how keys are spread over workers.
	ShardBy ShardBy
	// Role is the membership that runs it: "controllers" (the default),
	// "scheduler" (placers) or "nodespec-controller".
	Role string
	// Run reconciles one key. It must be idempotent: it may run again for the
	// same state. An error backs the key off (1 s doubling to 5 min).
	Run func(ctx context.Context, rc *RunContext, key string) (Result, error)
	// Periodic keys are enqueued on their period.
	Periodic []Periodic
	// Keys lists the keys in the given shards, for resync; nil means only
	// periodic keys are resynced. For ShardByNone it is called with every
	// shard.
	Keys func(ctx context.Context, q Querier, shards []int) ([]string, error)
	// RunBatch, when set, reconciles several claimed keys at once, in one
	// transaction ([BatchContext.InTx]), so a claim of many keys costs a
	// few commits instead of one per key. It is all or nothing: nil settles
	// every key Done; an error (a lost lease included) is logged and each
	// key is then run on its own with Run, which a batching reconciler must
	// have too. A key that needs SyncAgain is Run's to say.
	RunBatch func(ctx context.Context, rc *BatchContext, keys []string) error
	// BatchSize bounds the keys of one RunBatch call; 0 means 64. A claim
	// is split so that every run slot gets a share.
	BatchSize int
}

// DefaultBatchSize is a RunBatch call's bound when BatchSize is 0.
const DefaultBatchSize = 64

var namePattern = regexp.MustCompile(`^[a-z][a-z0-9.-]*$`)

func (r *Reconciler) validate() error {
	if !namePattern.MatchString(r.Name) {
		return fmt.Errorf("reconciler name %q: want lower case letters, digits, dots and dashes", r.Name)
	}
	switch r.ShardBy {
	case ShardByNode, ShardByPool, ShardByNone:
	default:
		return fmt.Errorf("reconciler %s: shardBy %q: want node, pool or none", r.Name, r.ShardBy)
	}
	if r.Role == "" {
		r.Role = RoleControllers
	}
	if !slices.Contains(Roles, r.Role) {
		return fmt.Errorf("reconciler %s: role %q: want one of %v", r.Name, r.Role, Roles)
	}
	if r.Run == nil {
		return fmt.Errorf("reconciler %s: no Run", r.Name)
	}
	if r.BatchSize < 0 {
		return fmt.Errorf("reconciler %s: batch size %d: want 0 (the default) or more", r.Name, r.BatchSize)
	}
	for _, p := range r.Periodic {
		if p.Key == "" || p.Every <= 0 {
			return fmt.Errorf("reconciler %s: periodic key %q every %s: want a key and a positive period", r.Name, p.Key, p.Every)
		}
	}
	return nil
}

// ErrFenced is returned by [RunContext.InTx] when the run's lease was lost:
// another worker may own the key now, and nothing was written.
var ErrFenced = errors.New("lease lost: write fenced")
