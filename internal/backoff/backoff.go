// Package backoff computes retry delays: exponential, capped, with symmetric jitter.
package backoff

import (
	"math/rand/v2"
	"time"
)

// Exponential is the delay before attempt n+1 after n failures: base·2^(n-1), capped at max,
// times a random factor in [1-jitter, 1+jitter]. A jittered delay above max is reflected
// below it, so that it never exceeds max and delays at the cap stay as spread as the others.
// The jitter spreads retries so that a recovering broker or producer is not stormed; jitter
// is in [0, 1), and 0 or a negative value (txoutbox.Off) means none. Every component uses it.
func Exponential(n int, base, max time.Duration, jitter float64) time.Duration {
	d := base
	for i := 1; i < n && d < max; i++ {
		d *= 2
	}
	d = min(d, max)
	if jitter > 0 {
		d = time.Duration(float64(d) * (1 + jitter*(2*rand.Float64()-1)))
		if d > max {
			d = 2*max - d // reflected below the cap: delays at the cap stay spread
		}
	}
	return d
}
