package backoff

import (
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
