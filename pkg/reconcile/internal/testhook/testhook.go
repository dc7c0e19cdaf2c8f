// Package testhook carries package reconcile's test-only entry points to
// package reconciletest, so that they stay off the production types. Package
// reconcile sets each hook once, in init.
package testhook

// Kill stops a *reconcile.Runtime as a crash would.
var Kill func(rt any)
