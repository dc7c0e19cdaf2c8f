// Package poll waits, in tests, for asynchronous work to show: it polls a
// condition until it holds or a deadline passes. It is the one such loop of
// the repository's tests; a test that can be signalled instead should be.
package poll

import (
	"testing"
	"time"
)

// Interval is how often [Until] and [UntilNil] check their condition.
const Interval = 10 * time.Millisecond

// Until calls cond, then again every [Interval], until it returns true; if
// within passes first it fails t, saying what it waited for. Call it from
// t's goroutine (it may call t.Fatalf).
func Until(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", within, what)
		}
		time.Sleep(Interval)
	}
}

// UntilNil is [Until] for a condition that can say why it does not hold
// yet: it calls check until it returns nil, and on timeout fails t with
// check's last error.
func UntilNil(t testing.TB, within time.Duration, what string, check func() error) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		err := check()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s: %v", within, what, err)
		}
		time.Sleep(Interval)
	}
}
