package relay

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// expiringCtx is a context whose deadline the test makes pass when it chooses (expire):
// its Err is then context.DeadlineExceeded, as a context.WithDeadline's is once its deadline
// has passed, without the test guessing how long the code under test takes to get there.
type expiringCtx struct {
	context.Context
	done chan struct{}
	once sync.Once
}

func newExpiringCtx() *expiringCtx {
	return &expiringCtx{Context: context.Background(), done: make(chan struct{})}
}

func (c *expiringCtx) expire()                     { c.once.Do(func() { close(c.done) }) }
func (c *expiringCtx) Done() <-chan struct{}       { return c.done }
func (c *expiringCtx) Deadline() (time.Time, bool) { return time.Now().Add(time.Hour), true }
func (c *expiringCtx) Value(key any) any           { return c.Context.Value(key) }
func (c *expiringCtx) Err() error {
	select {
	case <-c.done:
		return context.DeadlineExceeded
	default:
		return nil
	}
}

// A ctx whose deadline passes ends Run with nil, as a cancellation does, both while Run waits
// at its start-up stream check and once it publishes (the wait returned DeadlineExceeded:
// only context.Canceled was taken for a stop).
func TestRunReturnsNilWhenItsDeadlinePasses(t *testing.T) {
	t.Parallel()
	e := newEnv(t)

	t.Run("during the start-up check", func(t *testing.T) {
		logs := &testsvc.LogBuffer{}
		r := e.relayWithoutPostgres(t, logs)
		ctx := newExpiringCtx()
		done := make(chan error, 1)
		go func() { done <- r.Run(ctx) }()
		testsvc.Eventually(t, 20*time.Second, "the relay to wait at its start-up stream check", func() bool {
			select {
			case err := <-done:
				t.Fatalf("Run returned %v while PostgreSQL did not answer, want it to wait", err)
			default:
			}
			return strings.Contains(logs.String(), "waiting for PostgreSQL to answer the start-up stream check")
		})
		// Health says what the wait is for, and starting again once Run has returned.
		if h := r.Health(); h != HealthPostgresUnavailable {
			t.Errorf("Health while waiting for PostgreSQL at start = %s, want %s", h, HealthPostgresUnavailable)
		}
		ctx.expire()
		if err := <-done; err != nil {
			t.Fatalf("Run, its deadline passed during the start-up check = %v, want nil", err)
		}
		if h := r.Health(); h != HealthStarting {
			t.Errorf("Health after Run returned from its start-up wait = %s, want %s", h, HealthStarting)
		}
	})

	t.Run("while publishing", func(t *testing.T) {
		r := e.relay(&Config{Subjects: []string{"orders.>"}})
		ctx := newExpiringCtx()
		done := make(chan error, 1)
		go func() { done <- r.Run(ctx) }()
		testsvc.Eventually(t, 20*time.Second, "the relay to publish", func() bool {
			select {
			case err := <-done:
				t.Fatalf("Run returned %v, want it to run", err)
			default:
			}
			return r.Health() == HealthOK
		})
		ctx.expire()
		if err := <-done; err != nil {
			t.Fatalf("Run, its deadline passed while publishing = %v, want nil", err)
		}
	})
}

// The start-up check's wait grows from 100ms to 2s with the relay's jitter (it doubled by
// hand, without jitter, so relays started together asked JetStream together).
func TestStreamCheckDelayIsTheSharedBackoff(t *testing.T) {
	t.Parallel()
	r := &Relay{cfg: (&Config{}).WithDefaults()}
	seen := map[time.Duration]bool{}
	for range 100 {
		d := r.streamCheckDelay(10)
		if d < 1600*time.Millisecond || d > 2*time.Second {
			t.Fatalf("streamCheckDelay(10) = %s, want in [1.6s, 2s]", d)
		}
		seen[d] = true
	}
	if len(seen) < 50 {
		t.Fatalf("streamCheckDelay(10): %d distinct delays in 100, want them jittered", len(seen))
	}
	r = &Relay{cfg: (&Config{BackoffJitter: txoutbox.Off}).WithDefaults()}
	for pass, want := range map[int]time.Duration{1: 100 * time.Millisecond, 2: 200 * time.Millisecond, 5: 1600 * time.Millisecond, 6: 2 * time.Second, 1000: 2 * time.Second} {
		if d := r.streamCheckDelay(pass); d != want {
			t.Errorf("streamCheckDelay(%d) without jitter = %s, want %s", pass, d, want)
		}
	}
}
