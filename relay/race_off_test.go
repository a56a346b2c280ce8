//go:build !race

package relay

import "time"

// raceAllowance is what timing bounds of the tests allow on top under the race detector.
const raceAllowance time.Duration = 0
