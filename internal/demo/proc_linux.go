package demo

import (
	"os/exec"
	"syscall"
)

// setChildAttrs makes the kernel kill a child when the orchestrator dies, so that no relay
// or consumer outlives an interrupted chaos run.
func setChildAttrs(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
