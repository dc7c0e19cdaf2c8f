//go:build !linux

package chaos

import "os/exec"

// dieWithParent is Linux's parent-death signal; elsewhere the processes
// are only killed by the test's cleanup.
func dieWithParent(*exec.Cmd) {}
