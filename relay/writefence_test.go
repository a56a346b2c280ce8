package relay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox"
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
	nc, err := nats.Connect(e.nats.Conn.ConnectedUrl(), opts...)
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
	// A hand-off that failed (nats.go refused the message, or dropped its buffer with it)
	// left nothing to write: it is not pending, and the number is taken back.
	n := s.handing(4)
	s.handFailed(n)
	setGen(5)
	if stale() {
		t.Fatal("a failed hand-off is checked as if its bytes were in the client's buffer")
	}
	if again := s.handing(5); again != n {
		t.Fatalf("the hand-off after a failed one got number %d, want %d (taken back)", again, n)
	}
	s.handedOff()
	// A failed hand-off after a pending one leaves that one pending.
	s.handFailed(s.handing(5))
	setGen(6)
	if !stale() {
		t.Fatal("a message handed before a failed hand-off is no longer checked")
	}
	s.answered(n)

	// A relay closed with messages pending stays checked until the connection drops its
	// buffer, then is forgotten.
	s2 := wf.bind(expiry, quietLogger(), nil)
	s2.handing(6)
	s2.handedOff()
	wf.unbind(s2)
	if !wf.bound(s2) {
		t.Fatal("a relay closed with a message pending is no longer checked")
	}
	(&fencedConn{Conn: nopConn{}, f: wf}).Close()
	if wf.bound(s2) || !wf.bound(s) {
		t.Fatalf("after the connection dropped its buffer: closed relay bound %v (want false), open relay bound %v (want true)", wf.bound(s2), wf.bound(s))
	}
}

// bound reports whether the fence checks s.
func (f *WriteFence) bound(s *fenceState) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Contains(f.relays, s)
}

// A hand-off nats.go refuses (here a message over the server's max_payload, which the relay
// makes dead at once) puts no bytes in the client's buffer: a release of the partitions
// afterwards does not make the next write close a healthy connection.
func TestWriteFenceIgnoresFailedHandOffs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	const maxPayload = 64 << 10
	e := &env{t: t, db: db, nats: startSmallNATS(t, maxPayload), client: client}
	r, nc := fencedRelay(t, e, NewWriteFence(nil), false, &Config{Partitions: 2, LeaseInterval: time.Second, MaxMessageBytes: txoutbox.Off})
	e.enqueue(outbox.Message{Subject: "orders.created", Payload: []byte("fits")},
		outbox.Message{Subject: "orders.created", Payload: make([]byte, maxPayload+1)})
	if _, err := r.runOnce(ctx); err != nil {
		t.Fatal(err)
	}
	if n := e.count("state = 'dead'"); n != 1 {
		t.Fatalf("%d dead rows, want the one over max_payload (its hand-off failed)", n)
	}
	r.lease.mu.Lock()
	r.lease.lostLocked() // a release: the generation the failed hand-off was made under ends
	r.lease.mu.Unlock()
	if _, err := r.pub.AccountInfo(ctx); err != nil {
		t.Fatalf("a JetStream request after the release: %v", err)
	}
	if st := r.Stats(); st.Fenced != 0 || nc.Stats().Reconnects != 0 {
		t.Fatalf("fenced writes %d, reconnects %d; want none: the failed hand-off wrote nothing", st.Fenced, nc.Stats().Reconnects)
	}
}

// A publish can write to the socket itself: nats.go flushes its buffer inside the publish
// when the buffer is full (a message of 32 KiB or more). A fenced write there (the lease
// ended between the hand-off and the flush) is the connection's failure, not the message's:
// the row gets no attempt and no last_error, stays ready, and is published once later.
func TestFencedWriteInsideAPublishIsNoAttempt(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	wf := NewWriteFence(nil)
	var arm atomic.Bool
	var r *Relay
	wf.beforeWrite = func() {
		if arm.CompareAndSwap(true, false) { // the lease ends just before the flush's write
			r.lease.mu.Lock()
			r.lease.validUntil = time.Now().Add(-time.Millisecond)
			r.lease.publishSnapLocked()
			r.lease.mu.Unlock()
		}
	}
	r, nc := fencedRelay(t, e, wf, false, &Config{Partitions: 2, LeaseInterval: time.Second, PublishTimeout: 300 * time.Millisecond})
	big := make([]byte, nats.DefaultWriteBufSize+1024)
	e.enqueue(outbox.Message{Subject: "orders.created", Key: "a", Payload: big},
		outbox.Message{Subject: "orders.created", Key: "a", Payload: []byte("after")})
	warm, err := r.pub.PublishAsync("warmup.none", nil, jetstream.WithRetryAttempts(0)) // the PubAck subscription, written before the test
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-warm.Ok():
	case <-warm.Err():
	}
	_, gen, rows, err := r.claim(ctx, nil)
	if err != nil || len(rows) != 2 {
		t.Fatalf("claim = %d rows, %v", len(rows), err)
	}
	arm.Store(true)
	res := r.publish(ctx, rows, nil, gen)
	if len(res.failed) != 0 || len(res.published) != 0 || !errors.Is(res.brokerErr, ErrStaleWrite) {
		t.Fatalf("failed %d, published %d, broker error %v; want no row failed, none published, the broker error ErrStaleWrite",
			len(res.failed), len(res.published), res.brokerErr)
	}
	if got := r.Stats().Fenced; got != 1 {
		t.Fatalf("Stats().Fenced = %d, want 1", got)
	}
	testsvc.Eventually(t, 10*time.Second, "the fenced connection to reconnect", func() bool {
		return nc.Stats().Reconnects > 0 && nc.IsConnected()
	})
	drain(t, r)
	msgs := e.streamMsgs("ORDERS")
	if len(msgs) != 2 || len(msgs[0].Data) != len(big) || string(msgs[1].Data) != "after" {
		t.Fatalf("the stream holds %d messages; want the big one, then \"after\"", len(msgs))
	}
	var attempts int
	if err := e.db.Pool.QueryRow(ctx, "SELECT coalesce(max(attempts), 0) FROM txoutbox_messages").Scan(&attempts); err != nil {
		t.Fatal(err)
	}
	if attempts != 0 {
		t.Fatalf("a row left holds %d attempts, want 0", attempts)
	}
}

// A write that stalls past the lease's expiry (a peer that stopped reading) while the lease
// was renewed meanwhile goes on under the new expiry: only an ended lease fences it.
func TestWriteFenceLetsAStalledWriteGoOnUnderARenewedLease(t *testing.T) {
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
			accepted <- c
		}
	}()
	// The lease expires 300 ms after the write's first check, and is renewed (an hour on)
	// when asked after that.
	var mu sync.Mutex
	var first time.Time
	expiry := func(gen uint64) (time.Time, bool) {
		mu.Lock()
		defer mu.Unlock()
		if first.IsZero() {
			first = time.Now().Add(300 * time.Millisecond)
		}
		if time.Now().Before(first) {
			return first, true
		}
		return time.Now().Add(time.Hour), true
	}
	// The peer reads only once a socket write has stalled until its deadline (the event the
	// test is about), whatever the scheduler does meanwhile: the stall always happens.
	var deadlineHits atomic.Int32 // the socket writes that ended at a deadline
	read := make(chan struct{})
	var readOnce sync.Once
	wf := NewWriteFence(dialFunc(func(network, address string) (net.Conn, error) {
		c, err := net.Dial(network, address)
		return &deadlineCounter{Conn: c, hits: &deadlineHits, onHit: func() { readOnce.Do(func() { close(read) }) }}, err
	}))
	var fenced atomic.Int32
	s := wf.bind(expiry, quietLogger(), func() { fenced.Add(1) })
	c, err := wf.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	peer := <-accepted
	defer peer.Close()
	go func() {
		<-read
		_, _ = io.Copy(io.Discard, peer)
	}()
	s.handing(1)
	s.handedOff()
	big := make([]byte, 64<<20) // far more than the sockets' buffers hold
	n, err := c.Write(big)
	if err != nil || n != len(big) || fenced.Load() != 0 {
		t.Fatalf("a write stalled past an expiry the lease was renewed beyond: %d of %d bytes, %v, fenced %d; want all written", n, len(big), err, fenced.Load())
	}
	if deadlineHits.Load() == 0 {
		t.Fatal("no socket write stalled until the lease's first expiry: the test proves nothing")
	}
}

type dialFunc func(network, address string) (net.Conn, error)

func (f dialFunc) Dial(network, address string) (net.Conn, error) { return f(network, address) }

// deadlineCounter counts the writes that end at their deadline.
type deadlineCounter struct {
	net.Conn
	hits  *atomic.Int32
	onHit func() // called at each, when set
}

func (c *deadlineCounter) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		c.hits.Add(1)
		if c.onHit != nil {
			c.onHit()
		}
	}
	return n, err
}

// Bytes the client wrote may wait in the kernel's send queue (a network cut off): while
// messages have no answer, the connection is checked at their lease's expiry even if
// nothing more is written, and aborted if the lease has ended; a renewed lease moves the
// check to its new expiry, and an answer ends it.
func TestWriteFenceAbortsAConnectionWithUnansweredBytesWhenTheLeaseEnds(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() })
		}
	}()
	// The lease: expiring at first, renewed (an hour on) when asked after first; then, in
	// phase two, expiring at until2 and ended once the test says so.
	// (Each expiry starts at the first question about it: a slow machine cannot let it pass
	// before the write it is meant for.)
	var mu sync.Mutex
	var first, until2 time.Time
	var phase2, ended bool
	renewed := make(chan struct{})
	var renewOnce sync.Once
	expiry := func(gen uint64) (time.Time, bool) {
		mu.Lock()
		defer mu.Unlock()
		if phase2 {
			if until2.IsZero() {
				until2 = time.Now().Add(200 * time.Millisecond)
			}
			return until2, !ended
		}
		if first.IsZero() {
			first = time.Now().Add(200 * time.Millisecond)
		}
		if time.Now().Before(first) {
			return first, true
		}
		renewOnce.Do(func() { close(renewed) })
		return time.Now().Add(time.Hour), true
	}
	wf := NewWriteFence(nil)
	fences := make(chan struct{}, 10)
	s := wf.bind(expiry, quietLogger(), func() { fences <- struct{}{} })
	c, err := wf.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	// Renewed at the first expiry, then answered: never aborted.
	s.handing(1)
	s.handedOff()
	if _, err := c.Write([]byte("PUB a 1\r\n1\r\n")); err != nil {
		t.Fatal(err)
	}
	select {
	case <-renewed: // the check at the first expiry, with nothing else written
	case <-time.After(30 * time.Second):
		t.Fatal("the connection holding an unanswered message was not checked at its lease's expiry")
	}
	select {
	case <-fences:
		t.Fatal("aborted at the first expiry though the lease was renewed")
	default:
	}
	s.answered(1)

	// Unanswered when the lease ends: aborted once, and later writes fail quietly.
	s.handing(1)
	s.handedOff()
	mu.Lock()
	phase2 = true
	mu.Unlock()
	if _, err := c.Write([]byte("PUB a 1\r\n2\r\n")); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	ended = true // a release, or the lease expiring unrenewed
	mu.Unlock()
	select {
	case <-fences:
	case <-time.After(30 * time.Second):
		t.Fatal("the connection holding an unanswered message was not aborted when its lease ended")
	}
	if _, err := c.Write([]byte("PING\r\n")); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("a write after the abort: %v, want net.ErrClosed", err)
	}
	select {
	case <-fences:
		t.Fatal("the same connection fenced twice")
	default:
	}
}

// A connection the NATS client closes itself (a failed ping, a read error: a network cut off)
// while a message handed under a lease has no answer is reset (SO_LINGER 0: what the kernel
// has not sent is dropped, never to reach the server late); with everything answered it
// closes gracefully (FIN: the peer reads EOF).
func TestWriteFenceClosesWithUnansweredBytesByReset(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	peers := make(chan net.Conn, 2)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			peers <- c
		}
	}()
	expiry := func(uint64) (time.Time, bool) { return time.Now().Add(time.Hour), true }
	wf := NewWriteFence(nil)
	s := wf.bind(expiry, quietLogger(), nil)
	// closeAndRead writes one message (answered first when answer), closes the client side and
	// returns what the peer's read gets once it has read the message's bytes.
	closeAndRead := func(answer bool) error {
		t.Helper()
		c, err := wf.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		peer := <-peers
		defer peer.Close()
		n := s.handing(1)
		s.handedOff()
		msg := []byte("PUB a 1\r\n1\r\n")
		if _, err := c.Write(msg); err != nil {
			t.Fatal(err)
		}
		if answer {
			s.answered(n)
		}
		if _, err := io.ReadFull(peer, make([]byte, len(msg))); err != nil {
			t.Fatal(err)
		}
		_ = c.Close()
		_ = peer.SetReadDeadline(time.Now().Add(30 * time.Second))
		_, err = peer.Read(make([]byte, 1))
		return err
	}
	if err := closeAndRead(false); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("peer read after a close with a message unanswered: %v, want a reset", err)
	}
	if err := closeAndRead(true); !errors.Is(err, io.EOF) {
		t.Errorf("peer read after a close with everything answered: %v, want EOF", err)
	}
}

// nopConn is a net.Conn that is already gone.
type nopConn struct{ net.Conn }

func (nopConn) Close() error { return nil }

// The errors of a socket write nats.go makes inside a publish (its buffer full) are the
// connection's, never the message's: the row being handed off gets no attempt. A permission
// violation, which the relay matches to publishes by subject and time, does not prove that
// the server had a message's bytes; a PubAck, an API error or "no responders" does.
func TestWriteErrorsAreTheConnectionsAndOnlyServerRepliesAnswer(t *testing.T) {
	t.Parallel()
	for _, err := range []error{
		ErrStaleWrite,
		fmt.Errorf("nats: %w", ErrStaleWrite),
		net.ErrClosed,
		&net.OpError{Op: "write", Net: "tcp", Err: syscall.EPIPE},
		&net.OpError{Op: "write", Net: "tcp", Err: syscall.ECONNRESET},
		fmt.Errorf("write: %w", os.ErrDeadlineExceeded),
		io.ErrShortWrite,
	} {
		if !isBrokerError(err) {
			t.Errorf("isBrokerError(%v) = false, want true: a failed socket write is the connection's failure", err)
		}
	}
	for _, err := range []error{nats.ErrMaxPayload, &jetstream.APIError{ErrorCode: 10054}, errBadHeaders} {
		if isBrokerError(err) {
			t.Errorf("isBrokerError(%v) = true, want false: the message's own failure", err)
		}
	}
	for err, want := range map[error]bool{
		nil:                            true,
		&jetstream.APIError{Code: 503}: true,
		nats.ErrNoResponders:           true,
		ErrPublishDenied:               false,
		fmt.Errorf("%w: orders.created", ErrPublishDenied): false,
		jetstream.ErrAsyncPublishTimeout:                   false,
	} {
		if got := serverAnswered(err); got != want {
			t.Errorf("serverAnswered(%v) = %v, want %v", err, got, want)
		}
	}
}
