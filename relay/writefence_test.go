package relay

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// fencedRelay returns a relay of e publishing on a connection of its own, dialled through wf;
// with buffering, the connection buffers publishes while it reconnects (New then leaves the
// fence off).
func fencedRelay(t *testing.T, e *env, wf *WriteFence, buffering bool, cfg *Config) (*Relay, *nats.Conn) {
	t.Helper()
	opts := []nats.Option{nats.SetCustomDialer(wf), nats.MaxReconnects(-1), nats.ReconnectWait(20 * time.Millisecond)}
	if !buffering {
		opts = append(opts, nats.ReconnectBufSize(-1))
	}
	nc, err := nats.Connect(e.nats.URL(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Schema = e.db.Schema
	cfg.Logger = quietLogger()
	r, err := New(e.db.Pool, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	r.initTestSignals()
	t.Cleanup(r.Close)
	return r, nc
}

// A relay paused after it handed a message to the NATS client and before the client wrote
// it to the socket (the client's flusher blocked in its write: a SIGSTOP there) wakes with
// its lease ended. Without the write fence the message goes out when it wakes, however late
// (the gap the lease check leaves); through a WriteFence the write is refused, the connection
// closed and reconnected, and the message is published once, later, by a relay holding the
// lease.
func TestWriteFenceStopsBytesWrittenAfterTheLeaseEnded(t *testing.T) {
	t.Parallel()
	for _, fenced := range []bool{true, false} {
		name := "fenced"
		if !fenced {
			name = "no fence"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			ctx := context.Background()
			wf := NewWriteFence(nil)
			var arm atomic.Bool
			paused, resume := make(chan struct{}), make(chan struct{})
			wf.beforeWrite = func() {
				if arm.CompareAndSwap(true, false) {
					close(paused)
					<-resume
				}
			}
			r, nc := fencedRelay(t, e, wf, !fenced, &Config{Partitions: 2, LeaseInterval: time.Second, PublishTimeout: 300 * time.Millisecond})
			if got := r.fence != nil; got != fenced {
				t.Fatalf("relay bound to the fence: %v, want %v", got, fenced)
			}
			e.enqueue(outbox.Message{Subject: "orders.created", Key: "a", Payload: []byte("1")},
				outbox.Message{Subject: "orders.created", Key: "a", Payload: []byte("2")},
				outbox.Message{Subject: "orders.created", Payload: []byte("unkeyed")})
			// Make the client subscribe to its PubAcks before the test: the first write armed
			// below is then the one carrying the first row, not the subscription.
			warm, err := r.pub.PublishAsync("warmup.none", nil, jetstream.WithRetryAttempts(0))
			if err != nil {
				t.Fatal(err)
			}
			select {
			case <-warm.Ok():
			case <-warm.Err():
			}
			_, gen, rows, err := r.claim(ctx, nil)
			if err != nil || len(rows) != 3 {
				t.Fatalf("claim = %d rows, %v", len(rows), err)
			}
			// The first row (key a's first) passes its lease check and is handed over; the
			// client's write carrying it pauses, and the lease ends during the pause. The
			// second row of the wave (the unkeyed one) waits at its first lease check until
			// then, so its check before the hand-off fails.
			checks := 0
			expired := make(chan struct{})
			r.hooks.afterLeaseCheck = func() {
				switch checks++; checks {
				case 1:
					arm.Store(true)
				case 2:
					<-expired
				}
			}
			done := make(chan *batchResult)
			go func() { done <- r.publish(ctx, rows, nil, gen) }()
			<-paused
			r.lease.mu.Lock()
			r.lease.validUntil = time.Now().Add(-time.Millisecond)
			r.lease.publishSnapLocked()
			r.lease.mu.Unlock()
			close(expired)
			close(resume)
			res := <-done
			r.hooks.afterLeaseCheck = nil
			// Whatever reached the server is stored by now: the relay awaited its PubAck.
			stored := len(e.streamMsgs("ORDERS"))
			if !fenced {
				if len(res.published) != 1 || stored != 1 || r.Stats().Fenced != 0 {
					t.Fatalf("without the fence: published %d, the stream holds %d messages, fenced writes %d; "+
						"want the 1 written after the lease ended (the gap the fence closes)", len(res.published), stored, r.Stats().Fenced)
				}
				return
			}
			if len(res.published) != 0 || res.withheld != 2 || res.brokerErr == nil {
				t.Fatalf("published %d, withheld %d, broker error %v; want none published, the other 2 withheld, the first's PubAck missing",
					len(res.published), res.withheld, res.brokerErr)
			}
			if stored != 0 {
				t.Fatalf("the stream holds %d messages; want none: the write after the lease ended must not happen", stored)
			}
			if got := r.Stats().Fenced; got != 1 {
				t.Fatalf("Stats().Fenced = %d, want 1", got)
			}
			testsvc.Eventually(t, 10*time.Second, "the fenced connection to reconnect", nc.IsConnected)
			// A relay with a valid lease (a claim renews it) publishes every row once.
			drain(t, r)
			msgs := e.streamMsgs("ORDERS")
			if len(msgs) != 3 || string(msgs[0].Data) != "1" && string(msgs[1].Data) != "1" {
				t.Fatalf("after a drain the stream holds %d messages, want 3, key a's in order", len(msgs))
			}
			if got := r.Stats().Fenced; got != 1 {
				t.Fatalf("Stats().Fenced = %d after the drain, want still 1", got)
			}
		})
	}
}

// In normal work the fence never fires: a drain of many batches, with a partition released
// between batches (the lease generation moves on while nothing is left unwritten) and
// JetStream requests after it, sends everything on one connection.
func TestWriteFenceQuietInNormalWork(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	wf := NewWriteFence(nil)
	r, nc := fencedRelay(t, e, wf, false, &Config{Partitions: 2, LeaseInterval: time.Second, BatchSize: 100})
	var msgs []outbox.Message
	for i := range 1000 {
		m := outbox.Message{Subject: "orders.created", Payload: []byte{byte(i)}}
		if i%2 == 0 {
			m.Key = string(rune('a' + i%7))
		}
		msgs = append(msgs, m)
	}
	e.enqueue(msgs...)
	for i := 0; ; i++ {
		n, err := r.runOnce(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			break
		}
		if i%3 == 1 {
			r.lease.mu.Lock()
			r.lease.lostLocked() // as a release would: batches claimed before send nothing more
			r.lease.mu.Unlock()
			if _, err := r.pub.AccountInfo(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	if got := len(e.streamMsgs("ORDERS")); got != len(msgs) {
		t.Fatalf("the stream holds %d messages, want %d", got, len(msgs))
	}
	if st := r.Stats(); st.Fenced != 0 || nc.Stats().Reconnects != 0 {
		t.Fatalf("fenced writes %d, reconnects %d; want none", st.Fenced, nc.Stats().Reconnects)
	}
}
