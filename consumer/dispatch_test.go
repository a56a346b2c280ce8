package consumer

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// nakCounter is a delivered message that only counts its naks.
type nakCounter struct {
	jetstream.Msg
	naks atomic.Int32
}

func (m *nakCounter) Nak() error { m.naks.Add(1); return nil }

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
	select {
	case got := <-d.ready:
		if got != soon {
			t.Fatal("another item came back")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the retry did not come back")
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
