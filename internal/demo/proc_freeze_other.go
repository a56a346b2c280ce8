//go:build !unix

package demo

import "os"

// freezeSignal and thawSignal are nil where there is no SIGSTOP: proc.freeze does nothing.
var freezeSignal, thawSignal os.Signal
