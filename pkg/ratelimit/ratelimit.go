// Package ratelimit keeps a token bucket per key (an identity, a client
// address) on one clock, with a bounded number of keys: forgetting buckets
// when the table is full only ever lets more through, never less.
package ratelimit

import (
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// maxKeys bounds the buckets kept; at the bound all are forgotten.
const maxKeys = 100_000

// Keyed is a token bucket per key.
type Keyed struct {
	mu    sync.Mutex
	rps   rate.Limit
	burst int
	now   func() time.Time
	by    map[string]*rate.Limiter
}

// New returns buckets of rps tokens a second, burst deep, on the clock now
// (nil: time.Now).
func New(rps float64, burst int, now func() time.Time) *Keyed {
	if now == nil {
		now = time.Now
	}
	return &Keyed{rps: rate.Limit(rps), burst: max(burst, 1), now: now, by: map[string]*rate.Limiter{}}
}

func (k *Keyed) bucket(key string) *rate.Limiter {
	lim, ok := k.by[key]
	if !ok {
		if len(k.by) >= maxKeys {
			clear(k.by)
		}
		lim = rate.NewLimiter(k.rps, k.burst)
		k.by[key] = lim
	}
	return lim
}

// Allow takes a token of key's bucket, if it has one.
func (k *Keyed) Allow(key string) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.bucket(key).AllowN(k.now(), 1)
}

// Exhausted reports whether key's bucket has no token left, without taking
// one: a check before the work whose failures Allow then counts.
func (k *Keyed) Exhausted(key string) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.bucket(key).TokensAt(k.now()) < 1
}
