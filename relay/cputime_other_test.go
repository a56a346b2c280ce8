//go:build !unix

package relay

import "time"

// cpuTime is not measured here: the benchmarks report 0 CPU ns/op.
func cpuTime() time.Duration { return 0 }
