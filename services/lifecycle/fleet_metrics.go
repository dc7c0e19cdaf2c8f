package lifecycle

import (
	"context"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/bettercompute/bettercompute/pkg/nodes"
)

// FleetCollector exports the fleet's nodes as Prometheus gauges, read from
// the database at scrape time (two grouped scans of nodes), so every process
// that registers it reports the same numbers — dashboards take their max:
//
//	bettercompute_nodes{pool, state, ready}            nodes by lifecycle state and Ready (True, Unknown, Lost)
//	bettercompute_node_conditions{pool, type, status}  nodes by each inventory condition's type and status (true, false)
type FleetCollector struct{ Pool *pgxpool.Pool }

// Names of the fleet gauges.
const (
	NodesMetric          = "bettercompute_nodes"
	NodeConditionsMetric = "bettercompute_node_conditions"
)

var (
	nodesDesc = prometheus.NewDesc(NodesMetric,
		"Nodes per pool, lifecycle state (adopting, adopted, draining, drained, failed, retired, commissioning) and Ready condition (True, Unknown, Lost).",
		[]string{"pool", "state", "ready"}, nil)
	conditionsDesc = prometheus.NewDesc(NodeConditionsMetric,
		"Nodes per pool with a condition of this type and status (true or false), as the inventory controller last set it; retired nodes aside.",
		[]string{"pool", "type", "status"}, nil)
)

// Describe implements prometheus.Collector.
func (c *FleetCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- nodesDesc
	ch <- conditionsDesc
}

// Collect implements prometheus.Collector.
func (c *FleetCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	counts, err := nodes.CountByState(ctx, c.Pool)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(nodesDesc, err)
	}
	for _, n := range counts {
		ch <- prometheus.MustNewConstMetric(nodesDesc, prometheus.GaugeValue, float64(n.Nodes), n.PoolID, n.State, n.Ready)
	}
	conds, err := nodes.CountByCondition(ctx, c.Pool)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(conditionsDesc, err)
	}
	for _, n := range conds {
		ch <- prometheus.MustNewConstMetric(conditionsDesc, prometheus.GaugeValue, float64(n.Nodes), n.PoolID, n.Type, strconv.FormatBool(n.Status))
	}
}
