package reconcile

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	runs         *prometheus.CounterVec
	runSeconds   *prometheus.HistogramVec
	leaseChanges *prometheus.CounterVec
	ownedShards  *prometheus.GaugeVec
	resynced     *prometheus.CounterVec
	pokes        prometheus.Counter
}

func newMetrics(reg prometheus.Registerer, pool *pgxpool.Pool) *metrics {
	m := &metrics{
		runs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "bettercompute_reconcile_runs_total",
			Help: "Reconciler runs by kind and outcome (done, sync_again, error; fenced settles have no kind).",
		}, []string{"kind", "outcome"}),
		runSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "bettercompute_reconcile_run_duration_seconds",
			Help:    "How long reconciler runs take.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 4, 10),
		}, []string{"kind"}),
		leaseChanges: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "bettercompute_reconcile_lease_changes_total",
			Help: "Shard and singleton leases acquired, released and lost, by membership.",
		}, []string{"membership", "change"}),
		ownedShards: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "bettercompute_reconcile_owned_shards",
			Help: "Shards whose leases this worker holds, by membership.",
		}, []string{"membership"}),
		resynced: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "bettercompute_reconcile_resynced_keys_total",
			Help: "Keys re-enqueued by resync, by membership.",
		}, []string{"membership"}),
		pokes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "bettercompute_reconcile_pokes_received_total",
			Help: "Pokes received over NATS for kinds this process runs.",
		}),
	}
	if reg != nil {
		reg.MustRegister(m.runs, m.runSeconds, m.leaseChanges, m.ownedShards, m.resynced, m.pokes, &queueCollector{pool: pool})
	}
	return m
}

// queueCollector reads queue depth and the oldest key's age per kind from the
// database at scrape time.
type queueCollector struct{ pool *pgxpool.Pool }

var (
	queueDepthDesc = prometheus.NewDesc("bettercompute_reconcile_queue_depth",
		"Keys in the work queue, by kind (due or not).", []string{"kind"}, nil)
	queueOldestDesc = prometheus.NewDesc("bettercompute_reconcile_queue_oldest_seconds",
		"Age of the oldest queued key, by kind.", []string{"kind"}, nil)
)

func (c *queueCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- queueDepthDesc
	ch <- queueOldestDesc
}

func (c *queueCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	rows, err := c.pool.Query(ctx, `
		SELECT kind, count(*), extract(epoch FROM now() - min(enqueued_at))::float8
		  FROM work_queue GROUP BY kind`)
	if err != nil {
		return
	}
	defer rows.Close()
	for rows.Next() {
		var kind string
		var n int64
		var age float64
		if rows.Scan(&kind, &n, &age) != nil {
			return
		}
		ch <- prometheus.MustNewConstMetric(queueDepthDesc, prometheus.GaugeValue, float64(n), kind)
		ch <- prometheus.MustNewConstMetric(queueOldestDesc, prometheus.GaugeValue, age, kind)
	}
}
