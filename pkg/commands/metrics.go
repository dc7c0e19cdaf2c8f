package commands

import (
	"github.com/prometheus/client_golang/prometheus"
)

// DurationMetric is the histogram of how long commands took to settle.
const DurationMetric = "bettercompute_command_duration_seconds"

// durations is observed where a command reaches a final state (finish), in
// whichever process finished it: the gateway (the node's outcome), the API
// (a cancel), the command-sweeper (expired, timed out). The observation is
// made inside the finishing transaction, so a transaction that then fails to
// commit — rare: its database connection was lost — is counted and the
// retry that settles the command is counted again.
var durations = prometheus.NewHistogramVec(prometheus.HistogramOpts{
	Name:    DurationMetric,
	Help:    "Seconds from a command's request (commands.run, or a controller's) to its final state, by kind and final state (succeeded, failed, expired, cancelled).",
	Buckets: []float64{0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 7200},
}, []string{"kind", "state"})

// Collector returns the command metrics ([DurationMetric]) to register on a
// process's registry. It is one collector per process: registering it on
// several registries (several apps in one test binary) shares its values.
func Collector() prometheus.Collector { return durations }

func observeFinished(c Command) {
	if c.FinishedAt == nil {
		return
	}
	durations.WithLabelValues(c.Kind, string(c.State)).Observe(max(c.FinishedAt.Sub(c.CreatedAt), 0).Seconds())
}
