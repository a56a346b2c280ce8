package relay

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
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

// leaseRoundDueNow makes the next lease round due at once, instead of waiting out the lease
// interval.
func (r *Relay) leaseRoundDueNow() {
	r.lease.mu.Lock()
	r.lease.nextRound = time.Time{}
	r.lease.mu.Unlock()
}

// waitingOnLock reports whether a backend named app waits on a lock within timeout. It does
// not fail the test, so that goroutines other than the test's may call it.
func waitingOnLock(ctx context.Context, admin *pgxpool.Pool, app string, timeout time.Duration) bool {
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); <-tick.C {
		var n int
		if err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'`, app).Scan(&n); err == nil && n > 0 {
			return true
		}
	}
	return false
}
