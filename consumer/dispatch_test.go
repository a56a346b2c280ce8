package consumer

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// nakCounter is a delivered message that only counts its naks and in-progress acks.
type nakCounter struct {
	jetstream.Msg
	naks     atomic.Int32
	progress atomic.Int32
}

func (m *nakCounter) Nak() error { m.naks.Add(1); return nil }

// InProgress counts the in-progress acks too.
func (m *nakCounter) InProgress() error { m.progress.Add(1); return nil }

// A pending in-place retry is stopped by shutdown (which naks its message), and a retry that
// fires forgets its timer: nothing outlives Run.
func TestShutdownStopsRetryTimers(t *testing.T) {
	t.Parallel()
	c := &Consumer{cfg: (&Config{Stream: "S", Durable: "d"}).WithDefaults()}
	d := newDispatcher(c)
	hold := func() (*item, *nakCounter) {
		raw := &nakCounter{}
		it := &item{raw: raw, managed: true}
		d.sem <- struct{}{}
		d.mu.Lock()
		d.held[it] = struct{}{}
		d.mu.Unlock()
		return it, raw
	}
	pending := func() int { d.mu.Lock(); defer d.mu.Unlock(); return len(d.timers) }

	soon, _ := hold()
	d.settle(soon, result{outcome: outcomeRetryLocal, delay: time.Millisecond})
	if got := testsvc.Receive(t, d.ready, 5*time.Second, "the retry to come back"); got != soon {
		t.Fatal("another item came back")
	}
	if n := pending(); n != 0 {
		t.Fatalf("timers after the retry fired: %d, want 0", n)
	}

	late, raw := hold()
	d.settle(late, result{outcome: outcomeUnavailable, delay: time.Hour})
	if n := pending(); n != 1 {
		t.Fatalf("pending timers: %d, want 1", n)
	}
	d.shutdown()
	if n := pending(); n != 0 {
		t.Fatalf("timers after shutdown: %d, want 0", n)
	}
	if n := raw.naks.Load(); n != 1 {
		t.Fatalf("naks of the message waiting for its retry: %d, want 1", n)
	}
}

// A keepalive round sends one in-progress ack to each held message not touched for
// InProgressInterval, none to one touched more recently, and none to a settled message;
// a message admitted since is acked at the next round.
func TestKeepaliveOnce(t *testing.T) {
	t.Parallel()
	c := &Consumer{cfg: (&Config{Stream: "S", Durable: "d", AckWait: 30 * time.Second, InProgressInterval: 10 * time.Second}).WithDefaults()}
	c.testSignals.keptAlive.Init()
	d := newDispatcher(c)
	hold := func() (*item, *nakCounter) {
		raw := &nakCounter{}
		it := &item{raw: raw, managed: true}
		d.mu.Lock()
		d.held[it] = struct{}{}
		d.mu.Unlock()
		return it, raw
	}
	_, running := hold()
	settled, final := hold()
	_ = settled.final(func() error { return nil })
	t0 := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	round := func(at time.Duration, want int) {
		t.Helper()
		if n := d.keepaliveOnce(t0.Add(at)); n != want {
			t.Fatalf("round at +%s: %d due, want %d", at, n, want)
		}
	}
	round(0, 2) // both were never touched (the settled one is due but gets no ack)
	if r, f := running.progress.Load(), final.progress.Load(); r != 1 || f != 0 {
		t.Fatalf("in-progress acks: running %d, settled %d; want 1 and 0", r, f)
	}
	if got := <-c.testSignals.keptAlive.C(); got != 2 {
		t.Fatalf("keptAlive signalled %d, want 2", got)
	}
	round(5*time.Second, 0) // touched half an interval ago
	_, admitted := hold()
	round(9*time.Second, 1) // the new one alone
	round(10*time.Second, 2)
	if r, a, f := running.progress.Load(), admitted.progress.Load(), final.progress.Load(); r != 2 || a != 1 || f != 0 {
		t.Fatalf("in-progress acks: running %d, admitted %d, settled %d; want 2, 1 and 0", r, a, f)
	}
}
