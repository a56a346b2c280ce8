package relay

import (
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// initTestSignals turns on the relay's test signals; call it before Run.
func (r *Relay) initTestSignals() {
	r.testSignals.backoff.Init()
}

// waitBackoff waits for a backoff of the run loop that satisfies ok (nil: any).
func waitBackoff(t *testing.T, r *Relay, timeout time.Duration, what string, ok func(backoffEvent) bool) backoffEvent {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ev := testsvc.Receive(t, r.testSignals.backoff.C(), time.Until(deadline), what)
		if ok == nil || ok(ev) {
			return ev
		}
	}
}
