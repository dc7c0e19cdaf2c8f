// Package lifecycle holds the node lifecycle's reconcilers. Among them the
// liveness job: a node's Ready condition follows how long ago a gateway
// last heard from it, and the eviction brakes' circuit breakers (pkg/brakes)
// follow Ready.
package lifecycle

import (
	"cmp"
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/bettercompute/bettercompute/pkg/brakes"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/reconcile"
)

// LivenessKind is the liveness job's kind in the work queue.
const LivenessKind = "liveness"

// Defaults of [Config].
const (
	DefaultNotReadyAfter = 40 * time.Second
	DefaultLostAfter     = 2 * time.Minute
	DefaultEvery         = 5 * time.Second
	// DefaultLimit bounds the nodes one transaction changes; a pass that
	// hits it runs again a second later (SyncAgain), not a period later.
	DefaultLimit = 1000
)

// Config configures the liveness job (config nodes.*).
type Config struct {
	// NotReadyAfter: a node unseen this long is Unknown; 0 means 40s.
	NotReadyAfter time.Duration
	// LostAfter: a node unseen this long is Lost; 0 means 2m.
	LostAfter time.Duration
	// Every is the period of its key "all"; 0 means 5s.
	Every time.Duration
	// Limit bounds the nodes changed per transaction; 0 means 1,000.
	Limit int
	// UnhealthyThreshold: a pool or gateway with more than this fraction of
	// its nodes not ready has its eviction brake on (config
	// nodes.unhealthyThreshold); 0 means 0.55.
	UnhealthyThreshold float64
	// Brakes configures the breakers' evaluation (nodes.longLostAfter; its
	// UnhealthyThreshold, when set, wins over the field above) and the
	// tenants' buckets it drops once full.
	Brakes brakes.Config
	// Now is the clock of the breakers' since; nil means time.Now.
	Now func() time.Time
}

// Liveness is the liveness job: a ShardByNone reconciler of the controllers
// role (lease singleton:liveness) with the one periodic key "all". Each
// run, in one transaction, changes every node whose Ready condition no
// longer matches its last heartbeat ([nodes.UpdateReadiness], one
// statement), recomputes every pool's and gateway's eviction circuit
// breaker (per tenant for a gateway) from Ready ([brakes.Evaluate], one statement), and writes the
// nodes' node.not_ready, node.lost and node.ready events with the
// breakers' fleet.eviction_paused and fleet.eviction_resumed (one
// statement): three statements a pass however many nodes. It reads only
// the database, so it converges with the bus down: the runtime polls the
// queue and enqueues the periodic key on its own timer.
func Liveness(cfg Config) reconcile.Reconciler {
	cfg.NotReadyAfter = cmp.Or(cfg.NotReadyAfter, DefaultNotReadyAfter)
	cfg.LostAfter = cmp.Or(cfg.LostAfter, DefaultLostAfter)
	cfg.Every = cmp.Or(cfg.Every, DefaultEvery)
	cfg.Limit = cmp.Or(cfg.Limit, DefaultLimit)
	cfg.UnhealthyThreshold = cmp.Or(cfg.Brakes.UnhealthyThreshold, cfg.UnhealthyThreshold, brakes.DefaultUnhealthyThreshold)
	cfg.Brakes.UnhealthyThreshold = cfg.UnhealthyThreshold
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	l := &liveness{cfg: cfg}
	return reconcile.Reconciler{
		Name:     LivenessKind,
		ShardBy:  reconcile.ShardByNone,
		Role:     reconcile.RoleControllers,
		Run:      l.run,
		Periodic: []reconcile.Periodic{{Key: "all", Every: cfg.Every}},
	}
}

type liveness struct{ cfg Config }

func (l *liveness) run(ctx context.Context, rc *reconcile.RunContext, _ string) (reconcile.Result, error) {
	var n int
	var transitions []brakes.Transition
	err := rc.InTx(ctx, func(tx pgx.Tx, _ *reconcile.Queue) error {
		changes, err := nodes.UpdateReadiness(ctx, tx, nodes.Readiness{
			NotReadyAfter: l.cfg.NotReadyAfter, LostAfter: l.cfg.LostAfter, Limit: l.cfg.Limit,
		})
		if err != nil {
			return err
		}
		n = len(changes)
		// After the Ready changes, in their transaction: the breakers
		// never disagree with Ready.
		transitions, err = brakes.Evaluate(ctx, tx, l.cfg.Brakes, l.cfg.Now())
		if err != nil {
			return err
		}
		es := make([]outbox.Event, 0, len(changes)+len(transitions))
		for _, c := range changes {
			var event string
			switch c.To {
			case nodes.ReadyTrue:
				event = "node.ready"
			case nodes.ReadyUnknown:
				event = "node.not_ready"
			default:
				event = "node.lost"
			}
			payload := map[string]any{"nodeId": c.NodeID, "poolId": c.PoolID, "from": c.From, "to": c.To, "reason": c.Reason}
			if c.LastSeenAt != nil {
				payload["lastSeenAt"] = c.LastSeenAt.UTC().Format(time.RFC3339Nano)
			}
			// A node found Lost straight from True (no pass ran while it was
			// Unknown: the job was down or slow) is announced not ready
			// first, so every node.lost follows a node.not_ready.
			if c.From == nodes.ReadyTrue && c.To == nodes.ReadyLost {
				es = append(es, outbox.Event{TenantID: c.TenantID, Type: "node.not_ready", Resource: c.NodeID, Payload: payload})
			}
			es = append(es, outbox.Event{TenantID: c.TenantID, Type: event, Resource: c.NodeID, Payload: payload})
		}
		for _, t := range transitions {
			event := "fleet.eviction_resumed"
			if t.Opened {
				event = "fleet.eviction_paused"
			}
			es = append(es, outbox.Event{TenantID: t.TenantID, Type: event, Payload: map[string]any{
				"scope": t.Scope, "notReady": t.NotReady, "total": t.Total, "threshold": l.cfg.UnhealthyThreshold,
			}})
		}
		return outbox.WriteMany(ctx, tx, es)
	})
	if err != nil {
		return reconcile.Done, err
	}
	for _, t := range transitions {
		if t.Opened {
			rc.Logger.WarnContext(ctx, "eviction paused", "scope", t.Scope, "notReady", t.NotReady, "total", t.Total, "threshold", l.cfg.UnhealthyThreshold)
		} else {
			rc.Logger.InfoContext(ctx, "eviction resumed", "scope", t.Scope, "notReady", t.NotReady, "total", t.Total)
		}
	}
	if n >= l.cfg.Limit {
		return reconcile.SyncAgain, nil // more to do: back in a second
	}
	return reconcile.Done, nil
}

// BrakesCollector exports the eviction brakes' circuit breakers as the
// Prometheus gauge bc_eviction_paused{scope} (1 while paused, 0 once
// resumed), read from the database at scrape time, so every process
// reports what the liveness job stored wherever it ran.
type BrakesCollector struct{ Pool *pgxpool.Pool }

var pausedDesc = prometheus.NewDesc("bc_eviction_paused",
	"1 while the eviction brake of a scope (pool:<id>, gateway:<id>/tenant:<tenant>) is on: more than nodes.unhealthyThreshold of its nodes are not ready, and nothing acts on its lost nodes; 0 once it resumed.",
	[]string{"scope"}, nil)

// Describe implements prometheus.Collector.
func (c *BrakesCollector) Describe(ch chan<- *prometheus.Desc) { ch <- pausedDesc }

// Collect implements prometheus.Collector.
func (c *BrakesCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	bs, err := brakes.Breakers(ctx, c.Pool)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(pausedDesc, err)
		return
	}
	for _, b := range bs {
		v := 0.0
		if b.Paused {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(pausedDesc, prometheus.GaugeValue, v, b.Scope)
	}
}
