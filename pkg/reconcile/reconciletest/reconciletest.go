// Package reconciletest is for tests of code that runs on the reconciler
// runtime: what a test needs and production must not call.
package reconciletest

import (
	"github.com/bettercompute/bettercompute/pkg/reconcile"
	"github.com/bettercompute/bettercompute/pkg/reconcile/internal/testhook"
)

// Kill stops rt's loops without releasing anything, as a crash would: its
// worker rows and leases stay until they expire, and runs in flight settle
// nothing. A later Stop does nothing. For chaos tests.
func Kill(rt *reconcile.Runtime) { testhook.Kill(rt) }
