package chaos

import (
	"os/exec"
	"syscall"
)

// dieWithParent has the kernel SIGKILL cmd when the test process dies, so
// a test killed by its timeout (or by CI) leaves no control plane running.
func dieWithParent(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
