package relay

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/bettercompute/bettercompute/pkg/outbox"
	"github.com/bettercompute/bettercompute/pkg/webhooks"
)

type metrics struct {
	leading        prometheus.Gauge
	sequenced      prometheus.Counter
	published      prometheus.Counter
	fannedOut      prometheus.Counter
	pruned         prometheus.Counter
	attempts       *prometheus.CounterVec
	attemptSeconds prometheus.Histogram
}

func newMetrics(reg prometheus.Registerer, pool querier) (*metrics, error) {
	m := &metrics{
		leading: prometheus.NewGauge(prometheus.GaugeOpts{Name: "bc_outbox_relay_leading",
			Help: "1 while this process holds the outbox relay's lease."}),
		sequenced: prometheus.NewCounter(prometheus.CounterOpts{Name: "bc_events_sequenced_total",
			Help: "Events given their place in commit order by this relay."}),
		published: prometheus.NewCounter(prometheus.CounterOpts{Name: "bc_events_published_total",
			Help: "Events JetStream acknowledged from this relay."}),
		fannedOut: prometheus.NewCounter(prometheus.CounterOpts{Name: "bc_webhook_deliveries_created_total",
			Help: "Webhook deliveries made by the fan-out."}),
		pruned: prometheus.NewCounter(prometheus.CounterOpts{Name: "bc_events_pruned_total",
			Help: "Events deleted past events.retention."}),
		attempts: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "bc_webhook_attempts_total",
			Help: "Webhook delivery attempts by outcome: succeeded, failed, gone."}, []string{"outcome"}),
		attemptSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "bc_webhook_attempt_seconds",
			Help: "How long a webhook endpoint took to answer.", Buckets: prometheus.DefBuckets}),
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.leading, m.sequenced, m.published, m.fannedOut, m.pruned, m.attempts, m.attemptSeconds, newBacklog(pool)} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("relay metrics: %w", err)
		}
	}
	return m, nil
}

// backlog reports, on each scrape, what waits in the database: events not
// yet sequenced, events not yet published to JetStream, and deliveries due
// now. Each count reads a partial index of what waits, never the whole log.
type backlog struct {
	pool    querier
	waiting *prometheus.Desc
}

// querier is what the collector needs of the pool.
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

func newBacklog(pool querier) *backlog {
	return &backlog{pool: pool, waiting: prometheus.NewDesc("bc_events_waiting",
		"What waits in the database, by stage: unsequenced (for the relay), unpublished (for JetStream), due (webhook deliveries due now).",
		[]string{"stage"}, nil)}
}

func (b *backlog) Describe(ch chan<- *prometheus.Desc) { ch <- b.waiting }

func (b *backlog) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	unseq, unpub, err := outbox.Waiting(ctx, b.pool)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(b.waiting, err)
		return
	}
	due, err := webhooks.DueDeliveries(ctx, b.pool)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(b.waiting, err)
		return
	}
	ch <- prometheus.MustNewConstMetric(b.waiting, prometheus.GaugeValue, float64(unseq), "unsequenced")
	ch <- prometheus.MustNewConstMetric(b.waiting, prometheus.GaugeValue, float64(unpub), "unpublished")
	ch <- prometheus.MustNewConstMetric(b.waiting, prometheus.GaugeValue, float64(due), "due")
}
