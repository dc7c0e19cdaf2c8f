package relay

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
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

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
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
	for _, c := range []prometheus.Collector{m.leading, m.sequenced, m.published, m.fannedOut, m.pruned, m.attempts, m.attemptSeconds} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("relay metrics: %w", err)
		}
	}
	return m, nil
}
