package siteconf

import (
	"net/http"
	"net/url"
	"sync"
)

// Live holds the site settings the daemon last applied, for readers on any
// goroutine: the telemetry exporter (OTLPEndpoint) and the daemon's own
// HTTP clients (Proxy). The daemon passes Set as converge.Site.OnChange.
// The zero value holds zero settings and is ready to use.
type Live struct {
	calls sync.Mutex // serialises Set and Subscribe, so subscribers see settings in order
	mu    sync.Mutex
	cur   Settings
	proxy func(*http.Request) (*url.URL, error)
	subs  []func(Settings)
}

// Set stores s and calls every subscriber with it, in subscription order,
// on the caller's goroutine.
func (l *Live) Set(s Settings) {
	l.calls.Lock()
	defer l.calls.Unlock()
	l.mu.Lock()
	l.cur, l.proxy = s, s.Proxy()
	subs := append([]func(Settings){}, l.subs...)
	l.mu.Unlock()
	for _, f := range subs {
		f(s)
	}
}

// Get returns the settings last Set.
func (l *Live) Get() Settings {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.cur
}

// Subscribe calls f with the settings now and again after every Set. f
// must be quick (it runs on the converging goroutine) and must not call
// Set.
func (l *Live) Subscribe(f func(Settings)) {
	l.calls.Lock()
	defer l.calls.Unlock()
	l.mu.Lock()
	l.subs = append(l.subs, f)
	cur := l.cur
	l.mu.Unlock()
	f(cur)
}

// Proxy is an http.Transport.Proxy that follows the settings: the site's
// HTTP proxy, except for its no_proxy hosts; none before any Set or when
// unset.
func (l *Live) Proxy(r *http.Request) (*url.URL, error) {
	l.mu.Lock()
	p := l.proxy
	l.mu.Unlock()
	if p == nil {
		return nil, nil
	}
	return p(r)
}
