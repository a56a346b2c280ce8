package relay

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// Close during Run stops the Run as a cancellation does and waits for it: the batch in
// flight is published and settled on the lease connection before Close releases it (Close
// closed that connection under the batch's settle, and Run went on claiming afterwards,
// unfenced and unwatched). A closed relay does not run again.
func TestCloseStopsARunningRelayAndWaitsForIt(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.relay(&Config{Subjects: []string{"orders.>"}})
	inHook, release := make(chan struct{}), make(chan struct{})
	r.hooks.afterPublish = func(context.Context, int) error {
		select {
		case <-inHook:
		default:
			close(inHook)
		}
		<-release
		return nil
	}
	e.enqueue(outbox.Message{Subject: "orders.created"}, outbox.Message{Subject: "orders.created"})
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	<-inHook // a batch is published, not yet settled
	waiting := make(chan struct{})
	r.run.mu.Lock()
	r.run.waitingForRun = func() { close(waiting) }
	r.run.mu.Unlock()
	closed := make(chan struct{})
	go func() { r.Close(); close(closed) }()
	second := make(chan struct{})
	go func() { r.Close(); close(second) }() // a concurrent Close waits for the first
	select {
	case <-waiting: // Close stopped Run and waits for it
	case <-closed:
		t.Fatal("Close returned while Run's batch was still in flight")
	case <-time.After(30 * time.Second):
		t.Fatal("Close did not stop the running Run")
	}
	select {
	case <-closed:
		t.Fatal("Close returned while Run's batch was still in flight")
	case <-second:
		t.Fatal("a concurrent Close returned before the relay was released")
	case err := <-done:
		t.Fatalf("Run returned %v before its batch in flight was settled", err)
	default:
	}
	close(release)
	select {
	case <-closed:
	case <-time.After(30 * time.Second):
		t.Fatal("Close did not return once the batch was settled")
	}
	<-second
	if err := <-done; err != nil {
		t.Fatalf("Run stopped by Close = %v, want nil", err)
	}
	if st, ready := r.Stats(), e.count("state = 'ready'"); st.Published != 2 || ready != 0 {
		t.Fatalf("%d rows settled as published, %d still ready: want the batch in flight's 2 settled", st.Published, ready)
	}
	if p := r.Partitions(); len(p) != 0 {
		t.Fatalf("closed relay holds partitions %v", p)
	}
	if err := r.Run(context.Background()); !errors.Is(err, ErrClosed) {
		t.Fatalf("Run after Close = %v, want ErrClosed", err)
	}
	r.Close() // a second Close does nothing
}

// Lease (and Partitions, and the /readyz probe built on them) answers while a lease round
// waits for PostgreSQL: it returns what the last round left.
func TestLeaseDoesNotWaitForARoundUnderWay(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.relay(nil)
	e.enqueue(outbox.Message{Subject: "orders.created"})
	if n, err := r.runOnce(context.Background()); n != 1 || err != nil {
		t.Fatalf("runOnce = %d, %v", n, err)
	}
	held := r.Lease().Held
	if len(held) == 0 {
		t.Fatal("no partition held after a claim")
	}
	entered, release := make(chan struct{}), make(chan struct{})
	go func() {
		r.lease.mu.Lock() // as a lease round waiting for PostgreSQL does
		close(entered)
		<-release
		r.lease.unlock()
	}()
	<-entered
	got := make(chan LeaseStatus, 1)
	go func() { got <- r.Lease() }()
	select {
	case st := <-got:
		if len(st.Held) != len(held) {
			t.Fatalf("Lease during a round = %+v, want the last round's %v", st, held)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Lease waited for the lease round under way")
	}
	if p := r.Partitions(); len(p) != len(held) {
		t.Fatalf("Partitions during a round = %v, want %v", p, held)
	}
	close(release)
}

// The background asks a claim starts end with Run: goBackground's work is waited for, and its
// context ends when Run's does.
func TestBackgroundAsksEndWithRun(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.relay(&Config{Subjects: []string{"orders.>"}})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	testsvc.Eventually(t, 20*time.Second, "the relay to run", func() bool { return r.Health() == HealthOK })
	started, ended := make(chan struct{}), make(chan error, 1)
	r.run.goBackground(time.Hour, func(actx context.Context) {
		close(started)
		<-actx.Done() // an ask that does not answer
		ended <- actx.Err()
	})
	<-started
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run = %v", err)
	}
	select {
	case err := <-ended:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("the ask's context ended with %v, want context.Canceled", err)
		}
	default:
		t.Fatal("Run returned before the background ask it started had ended")
	}
	// Without a running Run (runOnce), the ask runs before goBackground returns.
	ran := false
	r.run.goBackground(time.Second, func(context.Context) { ran = true })
	if !ran {
		t.Fatal("goBackground without a running Run did not run its work at once")
	}
}
