// Package backoff computes retry delays: exponential, capped, with symmetric jitter.
package backoff

import (
	"math"
	"math/rand/v2"
	"time"
)

// MaxDelay is the largest BackoffMax the components' configurations accept (relay,
// consumer, check-back): a day. A retry spaced further apart is no retry an operator would
// wait for, and the bound keeps every sum a delay enters (a duplicate window, a due time)
// far from overflowing.
const MaxDelay = 24 * time.Hour

// Exponential is the delay before attempt n+1 after n failures: base·2^(n-1), capped at max,
// times a random factor in [1-jitter, 1+jitter]. A jittered delay above max is reflected
// below it, so that it never exceeds max and delays at the cap stay as spread as the others.
// The jitter spreads retries so that a recovering broker or producer is not stormed; jitter
// is in [0, 1), and 0, a negative value (txoutbox.Off) or NaN means none; a jitter of 1 or
// more counts as just below 1. Every component uses it.
//
// It saturates: however large n and max (up to math.MaxInt64), the delay never overflows
// and, for a positive base and max, lies in [min(base, max)·(1-jitter), max] and is never
// zero. n below 1 counts as 1; max caps base too (a base above max gives max, jittered); a
// base or max of zero or less gives 0.
func Exponential(n int, base, max time.Duration, jitter float64) time.Duration {
	if base <= 0 || max <= 0 {
		return 0
	}
	limit := max
	d := min(base, limit)
	for i := 1; i < n && d < limit; i++ {
		if d > limit/2 {
			d = limit // doubling would pass the cap (or overflow)
			break
		}
		d *= 2
	}
	if jitter > 0 { // NaN: none
		jitter = math.Min(jitter, maxJitter)
		off := clamp(float64(d) * jitter * (2*rand.Float64() - 1)) // |off| ≤ jitter·d < d
		if headroom := limit - d; off > headroom {
			d = limit - (off - headroom) // reflected below the cap: delays at the cap stay spread
		} else {
			d += off
		}
	}
	if d < 1 {
		d = 1 // a positive base never gives a busy loop
	}
	return d
}

// maxJitter is the largest jitter used: below 1, so that a jittered delay stays positive.
var maxJitter = math.Nextafter(1, 0)

// clamp converts f to a Duration, saturating at the int64 bounds.
func clamp(f float64) time.Duration {
	switch {
	case f >= math.MaxInt64: // float64(math.MaxInt64) is 2^63, one past the largest int64
		return math.MaxInt64
	case f <= math.MinInt64:
		return math.MinInt64
	}
	return time.Duration(f)
}
