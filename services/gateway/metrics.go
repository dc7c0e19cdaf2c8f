package gateway

import "github.com/prometheus/client_golang/prometheus"

// SessionsMetric is the gauge of the daemon sessions one gateway holds: what
// a gateway's autoscaler scales on (deploy/kubernetes, a pods metric), since
// an idle session costs memory and almost no CPU.
const SessionsMetric = "bettercompute_gateway_sessions"

// Collector returns the gateway's metrics, read at scrape: the sessions it
// holds ([SessionsMetric]).
func (g *Gateway) Collector() prometheus.Collector {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: SessionsMetric,
		Help: "Daemon sessions this gateway holds.",
	}, func() float64 { return float64(g.Sessions()) })
}
