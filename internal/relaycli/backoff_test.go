package relaycli

import (
	"testing"
	"time"
)

// waitReady's rounds grow from 100ms to 2s, jittered: it doubled by hand without jitter, so
// that daemons started together asked PostgreSQL and NATS together, round after round.
func TestWaitDelayIsTheSharedJitteredBackoff(t *testing.T) {
	t.Parallel()
	for pass, want := range map[int]time.Duration{1: 100 * time.Millisecond, 3: 400 * time.Millisecond, 6: 2 * time.Second, 1 << 20: 2 * time.Second} {
		lo := time.Duration(float64(want) * (1 - waitJitter))
		hi := min(time.Duration(float64(want)*(1+waitJitter)), 2*time.Second)
		seen := map[time.Duration]bool{}
		for range 100 {
			d := waitDelay(pass)
			if d < lo || d > hi {
				t.Fatalf("waitDelay(%d) = %s, want in [%s, %s]", pass, d, lo, hi)
			}
			seen[d] = true
		}
		if len(seen) < 50 {
			t.Fatalf("waitDelay(%d): %d distinct delays in 100, want them jittered", pass, len(seen))
		}
	}
}
