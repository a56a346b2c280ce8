// Package backoff computes retry delays: exponential, capped, with symmetric jitter.
package backoff

import (
	"math/rand/v2"
	"time"
)

// Exponential is base·2^(n-1) times a random factor in [1-jitter, 1+jitter], capped at max:
// the delay before attempt n+1 after n failures. The jitter spreads retries so that a
// recovering broker or producer is not stormed.
func Exponential(n int, base, max time.Duration, jitter float64) time.Duration {
	d := base
	for i := 1; i < n && d < max; i++ {
		d *= 2
	}
	if jitter > 0 {
		d = time.Duration(float64(d) * (1 + jitter*(2*rand.Float64()-1)))
	}
	return min(d, max)
}
