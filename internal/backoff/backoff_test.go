package backoff

import (
	"math"
	"testing"
	"time"
)

func TestExponentialGrowsAndTheCapHoldsAfterJitter(t *testing.T) {
	t.Parallel()
	const base, max, jitter = 100 * time.Millisecond, time.Second, 0.2
	for n := 1; n <= 12; n++ {
		want := min(base<<(n-1), max)
		lo := time.Duration(float64(want) * (1 - jitter))
		hi := min(time.Duration(float64(want)*(1+jitter)), max)
		seen := map[time.Duration]bool{}
		for range 200 {
			d := Exponential(n, base, max, jitter)
			if d < lo || d > hi {
				t.Fatalf("Exponential(%d) = %s, want in [%s, %s]", n, d, lo, hi)
			}
			seen[d] = true
		}
		if len(seen) < 100 { // at the cap too: retries must not synchronise on max
			t.Fatalf("Exponential(%d): %d distinct delays in 200, want them spread", n, len(seen))
		}
	}
	if d := Exponential(3, base, max, 0); d != 400*time.Millisecond {
		t.Fatalf("no jitter: %s, want 400ms", d)
	}
}

// Large attempt counts and caps saturate: no overflow (which made Exponential(80, 1s,
// MaxInt64, 0.2) return 0s, a retry loop with no delay), the cap holds, and the delay never
// falls below base·(1-jitter).
func TestExponentialSaturates(t *testing.T) {
	t.Parallel()
	const maxD = time.Duration(math.MaxInt64)
	for _, tc := range []struct {
		n         int
		base, max time.Duration
		jitter    float64
	}{
		{80, time.Second, maxD, 0.2},
		{80, time.Second, maxD, 0},
		{math.MaxInt, time.Second, maxD, 0.5},
		{64, 1, maxD, 0.2},
		{63, maxD / 3, maxD, 0.99},
		{2, maxD, maxD, 0.2},
		{1, maxD, maxD, 0},
		{100, time.Second, MaxDelay, 0.2},
		{100, time.Millisecond, 3 * time.Millisecond, 0.2},
	} {
		lo := time.Duration(float64(tc.base) * (1 - tc.jitter))
		for range 200 {
			d := Exponential(tc.n, tc.base, tc.max, tc.jitter)
			if d < lo || d > tc.max || d <= 0 {
				t.Fatalf("Exponential(%d, %s, %s, %g) = %s, want in [%s, %s]", tc.n, tc.base, tc.max, tc.jitter, d, lo, tc.max)
			}
		}
	}
	if d := Exponential(80, time.Second, maxD, 0); d != maxD {
		t.Fatalf("no jitter, past the cap: %s, want the cap %s", d, maxD)
	}
	if d := Exponential(40, time.Second, MaxDelay, txoffJitter); d != MaxDelay {
		t.Fatalf("jitter off, past the cap: %s, want %s", d, MaxDelay)
	}
}

// txoffJitter is txoutbox.Off as a jitter (this package does not import txoutbox).
const txoffJitter = -1

// Odd arguments give a sane delay rather than a panic, a negative delay or a busy loop.
func TestExponentialOddArguments(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		n         int
		base, max time.Duration
		jitter    float64
		lo, hi    time.Duration
	}{
		{"n zero counts as 1", 0, time.Second, time.Minute, 0, time.Second, time.Second},
		{"n negative counts as 1", -5, time.Second, time.Minute, 0, time.Second, time.Second},
		{"max caps base too", 3, time.Second, time.Millisecond, 0, time.Millisecond, time.Millisecond},
		{"max caps base too, jittered", 3, time.Second, time.Millisecond, 0.2, 800 * time.Microsecond, time.Millisecond},
		{"max zero", 5, time.Second, 0, 0.2, 0, 0},
		{"NaN jitter is none", 2, time.Second, time.Minute, math.NaN(), 2 * time.Second, 2 * time.Second},
		{"jitter of 1 stays positive", 1, 2, 2, 1, 1, 2},
		{"+Inf jitter stays positive", 5, time.Second, time.Minute, math.Inf(1), 1, time.Minute},
		{"base zero", 5, 0, time.Minute, 0.2, 0, 0},
		{"base negative", 5, -time.Second, time.Minute, 0.2, 0, 0},
	} {
		for range 100 {
			if d := Exponential(tc.n, tc.base, tc.max, tc.jitter); d < tc.lo || d > tc.hi {
				t.Fatalf("%s: %s, want in [%s, %s]", tc.name, d, tc.lo, tc.hi)
			}
		}
	}
}
