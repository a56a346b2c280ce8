package relay

import (
	"context"
	"errors"
	"net"
	"sync"
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
			close(resume) // the client wakes and writes
			res := <-done
			r.hooks.afterLeaseCheck = nil
			if !fenced {
				// The relay got the late message's PubAck: it is stored.
				if stored := len(e.streamMsgs("ORDERS")); len(res.published) != 1 || stored != 1 || r.Stats().Fenced != 0 {
					t.Fatalf("without the fence: published %d, the stream holds %d messages, fenced writes %d; "+
						"want the 1 written after the lease ended (the gap the fence closes)", len(res.published), stored, r.Stats().Fenced)
				}
				return
			}
			if len(res.published) != 0 || res.withheld != 2 || res.brokerErr == nil {
				t.Fatalf("published %d, withheld %d, broker error %v; want none published, the other 2 withheld, the first's PubAck missing",
					len(res.published), res.withheld, res.brokerErr)
			}
			if got := r.Stats().Fenced; got != 1 {
				t.Fatalf("Stats().Fenced = %d, want 1", got)
			}
			// The write was refused before any byte left, and the relay awaited the PubAck
			// until its timeout: nothing is on its way.
			if stored := len(e.streamMsgs("ORDERS")); stored != 0 {
				t.Fatalf("the stream holds %d messages; want none: the write after the lease ended must not happen", stored)
			}
			testsvc.Eventually(t, 10*time.Second, "the fenced connection to reconnect", nc.IsConnected)
			// A relay with a valid lease (a claim renews it) publishes every row once.
			drain(t, r)
			msgs := e.streamMsgs("ORDERS")
			var order []string
			for _, m := range msgs {
				if m.Header.Get(outbox.HeaderKey) == "a" {
					order = append(order, string(m.Data))
				}
			}
			if len(msgs) != 3 || len(order) != 2 || order[0] != "1" || order[1] != "2" {
				t.Fatalf("after a drain the stream holds %d messages, key a's %v; want 3, key a's [1 2]", len(msgs), order)
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

// nats.go dials again when its connection failed, sometimes without closing the one that
// failed (a handshake the server refused): a dial is always allowed and starts from an empty
// buffer, and closing an earlier connection afterwards leaves the current one's pending
// messages checked.
func TestWriteFenceDialSupersedesTheLastConnection(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	wf := NewWriteFence(nil)
	s := wf.bind(func(gen uint64) (time.Time, bool) { return time.Time{}, false }, quietLogger(), nil) // every lease ended
	stale := func() bool { st, _ := wf.check(); return len(st) > 0 }
	c1, err := wf.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	s.handing(1)
	s.handedOff()
	c2, err := wf.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatalf("a second dial with the first connection not closed: %v", err)
	}
	defer c2.Close()
	if stale() {
		t.Fatal("a message handed before the new connection was dialled is still checked: its bytes were in the old buffer")
	}
	s.handing(1)
	s.handedOff()
	_ = c1.Close()
	if !stale() {
		t.Fatal("closing the old connection marked the new connection's pending message as gone")
	}
}

// A write that may carry a message handed under a lease gets that lease's expiry as its
// deadline: one stalled on a full socket buffer (a peer that does not read) fails when the
// lease expires, sending nothing more, and closes the connection; a write with nothing
// pending is not bounded.
func TestWriteFenceBoundsAStalledWriteByTheLease(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			accepted <- c // never read: the client's socket buffer fills up
		}
	}()
	wf := NewWriteFence(nil)
	until := time.Now().Add(300 * time.Millisecond)
	s := wf.bind(func(gen uint64) (time.Time, bool) { return until, gen == 1 }, quietLogger(), nil)
	c, err := wf.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	peer := <-accepted
	defer peer.Close()
	if _, err := c.Write([]byte("nothing pending\r\n")); err != nil {
		t.Fatalf("a write with nothing pending: %v", err)
	}
	s.handing(1)
	s.handedOff()
	big := make([]byte, 64<<20)
	n, err := c.Write(big)
	if !errors.Is(err, ErrStaleWrite) || n >= len(big) {
		t.Fatalf("a write stalled past the lease's expiry wrote %d of %d bytes: %v; want ErrStaleWrite before the end", n, len(big), err)
	}
	if time.Now().Before(until) {
		t.Fatal("the stalled write ended before the lease expired")
	}
	if _, err := c.Write([]byte("x")); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("a write after the fenced one: %v, want net.ErrClosed (the connection is closed)", err)
	}
}

// The fence's bookkeeping: a message stays pending until the server answers it or a later
// message, whatever waves without an answer come between (a wave whose rows were all
// withheld, or timed out, proves nothing was written); the oldest pending message's lease
// generation is the one checked; a closed connection drops what it held, except a hand-off
// still under way.
func TestWriteFenceBookkeeping(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	current, until := uint64(1), time.Now().Add(time.Hour)
	expiry := func(gen uint64) (time.Time, bool) {
		mu.Lock()
		defer mu.Unlock()
		return until, gen == current
	}
	setGen := func(g uint64) { mu.Lock(); current = g; mu.Unlock() }
	wf := NewWriteFence(nil)
	s := wf.bind(expiry, quietLogger(), nil)
	stale := func() bool { st, _ := wf.check(); return len(st) > 0 }

	// Wave 1 under generation 1: message 1 answered, message 2 timed out.
	s.handing(1)
	s.handedOff()
	m2 := s.handing(1)
	s.handedOff()
	s.answered(m2 - 1)
	// Wave 2: every row withheld (nothing handed, nothing answered). The lease moves on.
	setGen(2)
	if !stale() {
		t.Fatal("message 2 (handed under generation 1, never answered) is not checked after the generation changed")
	}
	// Generation 2 hands message 3, which the server answers: 2 went before it on the same
	// connection, so both have left.
	m3 := s.handing(2)
	s.handedOff()
	s.answered(m3)
	if stale() {
		t.Fatal("still stale after a later message was answered")
	}
	// Two generations pending: the oldest one is checked.
	s.handing(2)
	s.handedOff()
	setGen(3)
	m5 := s.handing(3)
	s.handedOff()
	if !stale() {
		t.Fatal("message 4 (generation 2) is not checked while generation 3 is current")
	}
	s.answered(m5)
	if stale() {
		t.Fatal("stale after the newest message was answered")
	}
	// A hand-off under way when the connection closes stays pending; the rest is dropped.
	s.handing(3)
	s.handedOff()
	s.handing(3) // not returned yet
	(&fencedConn{Conn: nopConn{}, f: wf}).Close()
	setGen(4)
	if !stale() {
		t.Fatal("the hand-off under way at the close is not checked")
	}
	s.handedOff()
	s.answered(s.handing(4))
	if stale() {
		t.Fatal("stale with everything answered")
	}
}

// nopConn is a net.Conn that is already gone.
type nopConn struct{ net.Conn }

func (nopConn) Close() error { return nil }
