//go:build unix

package demo

import (
	"os"
	"syscall"
)

// freezeSignal and thawSignal freeze a child (the chaos run's SIGSTOP fault) and resume it.
var freezeSignal, thawSignal os.Signal = syscall.SIGSTOP, syscall.SIGCONT
