package app

import "github.com/prometheus/client_golang/prometheus"

// registry is what the process's metrics are registered on and scraped
// from: Options.Registry, or a view of it that also tells an observer (see
// [App.ObserveRegistrations]).
type registry interface {
	prometheus.Registerer
	prometheus.Gatherer
}

// ObserveRegistrations has f see every collector a role registers on the
// process's registry from now on, once the registry accepted it. It lets a
// caller (the dashboards' test, deploy/grafana) know every metric the
// process can export, vectors with no series yet included, which a Gather
// misses: the collector's Describe names them all. Collectors registered in
// [New] (the Go and process collectors, bettercompute_build_info) are not
// seen; a Gather reports them. Call it after New and before Start; f must
// not register anything itself.
func (a *App) ObserveRegistrations(f func(prometheus.Collector)) {
	a.reg = observedRegistry{registry: a.reg, seen: f}
}

// observedRegistry is a registry that hands each collector it accepted to
// seen.
type observedRegistry struct {
	registry
	seen func(prometheus.Collector)
}

// Register registers c and, once the registry accepted it, shows it to the
// observer.
func (r observedRegistry) Register(c prometheus.Collector) error {
	if err := r.registry.Register(c); err != nil {
		return err
	}
	r.seen(c)
	return nil
}

// MustRegister registers each of cs as Register does, panicking on the
// first the registry refuses, as prometheus.Registry.MustRegister does.
func (r observedRegistry) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}
