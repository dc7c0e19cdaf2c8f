package gateway

import "github.com/prometheus/client_golang/prometheus"

// SessionsMetric is the gauge of the daemon sessions one gateway holds: what
// a gateway's autoscaler scales on (deploy/kubernetes, a pods metric), since
// an idle session costs memory and almost no CPU.
const SessionsMetric = "bettercompute_gateway_sessions"

// Names of the session counters.
const (
	SessionsOpenedMetric = "bettercompute_gateway_sessions_opened_total"
	SessionsEndedMetric  = "bettercompute_gateway_sessions_ended_total"
)

// Collector returns the gateway's metrics, read at scrape: the sessions it
// holds ([SessionsMetric]) and the sessions it opened and ended since it
// started ([SessionsOpenedMetric], [SessionsEndedMetric]; their rates show
// a reconnect storm that the gauge alone hides).
func (g *Gateway) Collector() prometheus.Collector {
	return collectors{
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: SessionsMetric,
			Help: "Daemon sessions this gateway holds.",
		}, func() float64 { return float64(g.Sessions()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: SessionsOpenedMetric,
			Help: "Daemon sessions this gateway opened (a Hello accepted) since it started.",
		}, func() float64 { return float64(g.opened.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: SessionsEndedMetric,
			Help: "Daemon sessions of this gateway that ended (the daemon left, was superseded, revoked or timed out, or the gateway stopped) since it started.",
		}, func() float64 { return float64(g.ended.Load()) }),
	}
}

// collectors is several collectors registered as one.
type collectors []prometheus.Collector

// Describe implements prometheus.Collector.
func (cs collectors) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range cs {
		c.Describe(ch)
	}
}

// Collect implements prometheus.Collector.
func (cs collectors) Collect(ch chan<- prometheus.Metric) {
	for _, c := range cs {
		c.Collect(ch)
	}
}
