package bcd

import "syscall"

// trialAttr makes a build on trial die with the daemon that runs it: a
// daemon killed mid-trial leaves no second daemon behind.
func trialAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} }
