//go:build !linux

package bcd

import "syscall"

// trialAttr is nil where the kernel cannot tie a child's life to its
// parent's.
func trialAttr() *syscall.SysProcAttr { return nil }
