// Package retry holds what the daemon's dial-out loops share: jittered
// exponential back-off between attempts, a sleep that ends with its
// context, and the host part of a gateway address (the default name to
// verify on its certificate). The node session (agent/session) and the site
// agent (agent/site) both reconnect and renew with it.
package retry

import (
	"context"
	"math/rand/v2"
	"net"
	"time"
)

// Backoff is exponential back-off with ±50 % jitter, from Min up to Max.
// The zero value of its state starts at Min.
type Backoff struct {
	Min, Max time.Duration
	cur      time.Duration
}

// Longest makes the next delays Max (jittered): for an attempt that is
// not expected to succeed soon.
func (b *Backoff) Longest() { b.cur = b.Max }

// Reset starts again from Min.
func (b *Backoff) Reset() { b.cur = 0 }

// Next returns the next delay: the current step jittered uniformly over
// [step/2, step·3/2), capped at Max; the step doubles each call.
func (b *Backoff) Next() time.Duration {
	if b.cur == 0 {
		b.cur = b.Min
	}
	step := b.cur
	b.cur = min(b.cur*2, b.Max)
	return min(step/2+rand.N(step+1), b.Max)
}

// Sleep waits d or until ctx ends; it reports whether d passed.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// HostOf returns the host of a host:port address, or addr itself.
func HostOf(addr string) string {
	if h, _, err := net.SplitHostPort(addr); err == nil {
		return h
	}
	return addr
}
