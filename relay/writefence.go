package relay

import (
	"errors"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// ErrStaleWrite is what a connection dialled through a WriteFence returns, instead of
// writing, when the bytes about to leave may hold messages a relay handed to the NATS client
// under a lease that has ended since. The fence closes the connection with it: nats.go drops
// the unwritten bytes and reconnects, the messages' PubAcks never come, and their rows stay
// ready for the relay that holds the partitions now.
var ErrStaleWrite = errors.New("relay: write fence: the bytes to send may hold messages handed to the NATS client under a partition lease that has ended since; the connection is closed instead")

// WriteFence is a nats.CustomDialer for the NATS connection a relay publishes on. It closes
// the gap the relay's lease check leaves (see the README's "Paused relays"): the check runs
// before a message is handed to the NATS client, and the client writes the message's bytes
// to its socket later, from its flusher goroutine. A relay paused between the two (a SIGSTOP,
// a VM pause, CPU starvation) would send the message when it wakes, however late, after
// another relay took its partitions and published the message, past the duplicate window.
//
// Through a WriteFence every write to the socket first checks whether it may carry a message
// handed under a lease that has ended since: one the relay handed to the client and the
// server has not answered yet (every message that left is answered, with a PubAck or an
// error). If so, the connection is closed instead (ErrStaleWrite). A write that may carry
// such messages also gets a deadline at their lease's expiry, so that one stalled on a full
// socket buffer cannot finish after it (if the lease was renewed meanwhile, the write goes on
// under the new expiry). Bytes that did reach the kernel may still wait in its send queue (a
// network cut off, TCP retransmitting): while messages are pending, the connection is checked
// again at their lease's expiry, and a fenced connection is aborted (closed with SO_LINGER 0:
// the kernel discards what it has not sent, and resets the connection). What is left is the
// few instructions between the check and the system call that hands the bytes to the kernel,
// and bytes the kernel sent before the abort that are still on the wire.
//
// The fence is conservative: after a publish whose PubAck never came (a timeout), until the
// server answers a later one, a write once that lease ended or changed (a partition released,
// handed over) closes the connection, once, even if those bytes had left.
//
// Dial one connection through each fence (each dial is taken for that connection's
// reconnect: what the previous one held is gone, so a second connection dialled through the
// same fence would turn the first one's check off), with nats.SetCustomDialer(relay.NewWriteFence(nil))
// and nats.ReconnectBufSize(-1) (a connection that buffers publishes while it reconnects sends
// them later, unchecked: New leaves the fence off for it and says so), and pass it to New,
// which finds the fence in the connection's options. relay run does this. Every relay
// publishing on the connection is checked.
type WriteFence struct {
	dialer nats.CustomDialer

	mu      sync.Mutex
	relays  []*fenceState
	dialled uint64 // connections dialled: the latest is the connection's current one

	// beforeWrite, in tests, runs before each write is checked: blocking in it is a pause of
	// the client between the hand-off and the write.
	beforeWrite func()
}

// NewWriteFence returns a WriteFence that dials with d, or with a net.Dialer of nats.go's
// default connect timeout when d is nil.
func NewWriteFence(d nats.CustomDialer) *WriteFence {
	if d == nil {
		d = &net.Dialer{Timeout: nats.DefaultTimeout}
	}
	return &WriteFence{dialer: d}
}

// Dial implements nats.CustomDialer. nats.go dials when its connection has none that works
// (a connect, a reconnect), and a new connection starts with an empty buffer: whatever the
// previous one held and did not write is gone.
func (f *WriteFence) Dial(network, address string) (net.Conn, error) {
	c, err := f.dialer.Dial(network, address)
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.dialled++
	f.droppedLocked()
	return &fencedConn{Conn: c, f: f, n: f.dialled}, nil
}

// droppedLocked records, for every relay, that the connection's buffer is gone, and stops
// checking the relays closed since whose messages were all in it.
func (f *WriteFence) droppedLocked() {
	kept := f.relays[:0]
	for _, s := range f.relays {
		if !s.dropped() {
			kept = append(kept, s)
		}
	}
	clear(f.relays[len(kept):])
	f.relays = kept
}

// fenceSeg: the messages handed from the first-th on (counting from 1) were handed under
// lease generation gen, up to the next segment.
type fenceSeg struct{ first, gen uint64 }

// fenceState is one relay's side of a WriteFence: the messages it handed to the client that
// may not have left yet, and the lease generations they were handed under.
type fenceState struct {
	expiry  func(gen uint64) (time.Time, bool) // leaser.expiry
	log     *slog.Logger
	onFence func()

	mu       sync.Mutex
	unbound  bool       // the relay closed with messages pending: stop checking once they are gone
	handed   uint64     // messages handed to the client (counted just before each hand-off; a failed hand-off takes its number back)
	returned uint64     // hand-offs that returned with the message appended to the client's buffer
	clean    uint64     // the first clean handed messages are known to have left, or were dropped with their connection
	segs     []fenceSeg // from the segment holding message clean+1 on; empty when clean == handed
}

func (f *WriteFence) bind(expiry func(uint64) (time.Time, bool), log *slog.Logger, onFence func()) *fenceState {
	s := &fenceState{expiry: expiry, log: log, onFence: onFence}
	f.mu.Lock()
	f.relays = append(f.relays, s)
	f.mu.Unlock()
	return s
}

// unbind stops checking s, unless messages it handed may still wait in the client's buffer:
// the connection's last flush, when it closes, must check them too.
func (f *WriteFence) unbind(s *fenceState) {
	s.mu.Lock()
	pending := s.clean != s.handed
	s.unbound = pending
	s.mu.Unlock()
	if pending {
		return // until the connection drops its buffer (droppedLocked)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, x := range f.relays {
		if x == s {
			f.relays = append(f.relays[:i], f.relays[i+1:]...)
			return
		}
	}
}

// handing records that a message claimed under lease generation gen is about to be handed to
// the client, and returns its number. It runs after the lease check, before PublishMsgAsync.
func (s *fenceState) handing(gen uint64) uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.handed++
	if n := len(s.segs); n == 0 || s.segs[n-1].gen != gen {
		s.segs = append(s.segs, fenceSeg{first: s.handed, gen: gen})
	}
	return s.handed
}

// handedOff records that the latest hand-off returned. The relay hands off one message at a
// time, so the first returned messages are the ones whose hand-off returned.
func (s *fenceState) handedOff() {
	s.mu.Lock()
	s.returned++
	s.mu.Unlock()
}

// handFailed records that hand-off n, the latest, returned an error: nats.go refused the
// message before appending it to its buffer (too large, too many PubAcks awaited, the
// connection closed or reconnecting), or dropped its buffer with the message in it when the
// write it made to flush a full buffer failed (a partial write closes the connection, and a
// protocol operation cut short is never processed). Its bytes will not be written: n is taken
// back, for the next hand-off. (Kept pending, it would fence a healthy connection at the next
// write once its lease ended.)
func (s *fenceState) handFailed(n uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if n != s.handed {
		// Cannot happen (one goroutine hands off a relay's messages, one at a time); if it
		// did, keeping n pending is the safe side: at worst one needless reconnect.
		return
	}
	s.handed--
	if k := len(s.segs); k > 0 && s.segs[k-1].first == n {
		s.segs = s.segs[:k-1]
	}
	if s.clean >= s.handed {
		s.segs = s.segs[:0]
	}
}

// answered records that the server answered message n: it and every message handed before
// it have left the client (one connection carries them in order; the server answers in that
// order, and a connection that closed dropped what it had not sent).
func (s *fenceState) answered(n uint64) {
	s.mu.Lock()
	s.markLocked(n)
	s.mu.Unlock()
}

func (s *fenceState) markLocked(n uint64) {
	if n <= s.clean {
		return
	}
	s.clean = n
	if s.clean >= s.handed {
		s.segs = s.segs[:0]
		return
	}
	for len(s.segs) > 1 && s.segs[1].first <= s.clean+1 {
		s.segs = s.segs[1:]
	}
}

// pendingLocked reports whether handed messages may still wait in the client's buffer, and
// the lease expiry of the oldest of them (ok false once its generation ended).
func (s *fenceState) pendingLocked() (pending bool, until time.Time, ok bool) {
	if s.clean == s.handed {
		return false, time.Time{}, true
	}
	until, ok = s.expiry(s.segs[0].gen)
	return true, until, ok
}

// dropped records that the connection is gone with whatever its buffer held: nats.go does not
// carry the buffer of a closed connection over to the next one (and, with ReconnectBufSize
// -1, buffers nothing while it reconnects). A hand-off still under way may append its message
// to the next connection's buffer: it stays to be checked.
// It reports whether s can be forgotten: its relay closed and nothing of it is pending.
func (s *fenceState) dropped() (forget bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.markLocked(s.returned)
	return s.unbound && s.clean == s.handed
}

// check returns the relays whose handed messages a write now may carry under an ended lease,
// and the earliest lease expiry among the messages that may wait in the buffer (zero: none).
func (f *WriteFence) check() (stale []*fenceState, deadline time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	now := time.Now()
	for _, s := range f.relays {
		s.mu.Lock()
		pending, until, ok := s.pendingLocked()
		s.mu.Unlock()
		switch {
		case !pending:
		case !ok || !now.Before(until):
			stale = append(stale, s)
		case deadline.IsZero() || until.Before(deadline):
			deadline = until
		}
	}
	return stale, deadline
}

// closed records that connection n closed: if it is the current one, what its buffer held
// is gone. (One closed after a later dial holds nothing of the current connection's.)
func (f *WriteFence) closed(n uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if n != f.dialled {
		return
	}
	f.droppedLocked()
}

// current reports whether connection n is the latest dialled.
func (f *WriteFence) current(n uint64) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return n == f.dialled
}

// fencedConn checks every write (see WriteFence).
type fencedConn struct {
	net.Conn
	f         *WriteFence
	n         uint64 // the fence's count of dials when this connection was dialled
	closeOnce sync.Once
	// userDeadline is the write deadline the client set (nats.go's FlusherTimeout); a write
	// the fence bounds by a lease's expiry gets the earlier of the two. Only the client's
	// writer (under its lock) sets it and writes.
	userDeadline time.Time

	mu     sync.Mutex
	fenced bool        // the fence closed the connection: later writes fail without a word
	closed bool        // closed (by the client or the fence): its timer is off for good
	abort  *time.Timer // the check at the pending messages' lease expiry (see armLocked)
	armed  time.Time   // when abort fires (zero: stopped)
}

func (c *fencedConn) Write(b []byte) (int, error) {
	if h := c.f.beforeWrite; h != nil {
		h()
	}
	written := 0
	for {
		if c.isFenced() {
			return written, net.ErrClosed
		}
		stale, deadline := c.f.check()
		if len(stale) > 0 {
			c.fence(stale, len(b)-written, false)
			return written, ErrStaleWrite
		}
		if deadline.IsZero() {
			n, err := c.Conn.Write(b[written:])
			return written + n, err
		}
		// The bytes may hold messages whose lease expires at deadline: they must be with the
		// kernel by then, and the connection is checked again then (see check).
		c.arm(deadline)
		d, ours := deadline, true
		if !c.userDeadline.IsZero() && !deadline.Before(c.userDeadline) {
			d, ours = c.userDeadline, false
		}
		if err := c.Conn.SetWriteDeadline(d); err != nil {
			return written, err
		}
		n, err := c.Conn.Write(b[written:])
		written += n
		if err != nil && c.isFenced() {
			return written, ErrStaleWrite // aborted meanwhile, at the lease's expiry (checkQueued)
		}
		if rerr := c.Conn.SetWriteDeadline(c.userDeadline); err == nil && rerr != nil {
			err = rerr
		}
		if err == nil || !ours || !errors.Is(err, os.ErrDeadlineExceeded) {
			return written, err
		}
		// The lease's expiry came with the write unfinished: check again. A renewed lease
		// lets the write go on under its new expiry; an ended one fences the rest.
	}
}

func (c *fencedConn) isFenced() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.fenced
}

// arm makes sure the connection is checked at deadline, the expiry of the lease of messages
// its writes may have carried, even if nothing is written then: bytes handed to the kernel may
// wait in its send queue (a network cut off) and leave after the lease ended.
func (c *fencedConn) arm(deadline time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.armLocked(deadline)
}

func (c *fencedConn) armLocked(deadline time.Time) {
	if c.closed || (!c.armed.IsZero() && !c.armed.After(deadline)) {
		return // a check comes earlier
	}
	c.armed = deadline
	if c.abort == nil {
		c.abort = time.AfterFunc(time.Until(deadline), c.checkQueued)
	} else {
		c.abort.Reset(time.Until(deadline))
	}
}

// checkQueued runs at the lease expiry of messages the connection's writes may have carried:
// if the server has answered none of them since and the lease has ended, what the kernel has
// not sent of them must not leave: the connection is aborted.
func (c *fencedConn) checkQueued() {
	c.mu.Lock()
	c.armed = time.Time{}
	closed := c.closed
	c.mu.Unlock()
	if closed || !c.f.current(c.n) {
		// Closed, or superseded by a later dial (nats.go may leave a connection whose
		// handshake failed open): what is pending now is the current connection's.
		return
	}
	stale, deadline := c.f.check()
	if len(stale) > 0 {
		c.fence(stale, 0, true)
		return
	}
	if !deadline.IsZero() {
		c.arm(deadline) // renewed: check at the new expiry
	}
}

// fence closes the connection instead of a write (bytes, the size of the refused write) or
// because its writes may wait in the kernel's send queue (queued), and says so for each relay
// concerned. The close discards what the kernel has not sent (SO_LINGER 0).
func (c *fencedConn) fence(stale []*fenceState, bytes int, queued bool) {
	c.mu.Lock()
	first := !c.fenced
	c.fenced = true
	c.mu.Unlock()
	if !first {
		return
	}
	if tc, ok := c.Conn.(interface{ SetLinger(int) error }); ok {
		_ = tc.SetLinger(0)
	}
	_ = c.Close()
	what := "the NATS client was about to send messages handed to it under a partition lease that has ended since"
	if queued {
		what = "messages written to the NATS connection under a partition lease that has ended since have no answer from the server, and may still wait in the kernel's send queue"
	}
	for _, s := range stale {
		if s.onFence != nil {
			s.onFence()
		}
		// Not under the client's lock (Write runs under it): a slow log must not stall the
		// connection.
		go s.log.Warn("write fence: "+what+
			" (a pause of the relay between the hand-off and the write, a network cut off, or PubAcks that never came); "+
			"the connection is closed instead and reconnects, and the rows are left to the relay that holds the partitions now", "bytes", bytes)
	}
}

func (c *fencedConn) SetWriteDeadline(t time.Time) error {
	c.userDeadline = t
	return c.Conn.SetWriteDeadline(t)
}

func (c *fencedConn) SetDeadline(t time.Time) error {
	c.userDeadline = t
	return c.Conn.SetDeadline(t)
}

// Close closes the connection. With a message handed under a lease still unanswered, it
// discards what the kernel has not sent (SO_LINGER 0), as the fence does: nats.go closes a
// connection itself after a failed ping or a read error (a network cut off), and a plain close
// would leave the kernel retransmitting those bytes from the orphaned socket, to reach the
// server late, after the lease ended, if the network heals. A connection with nothing
// pending closes gracefully.
func (c *fencedConn) Close() error {
	err := net.ErrClosed
	c.closeOnce.Do(func() {
		c.mu.Lock()
		c.closed = true
		if c.abort != nil {
			c.abort.Stop()
		}
		c.armed = time.Time{}
		c.mu.Unlock()
		if stale, deadline := c.f.check(); len(stale) > 0 || !deadline.IsZero() {
			if tc, ok := c.Conn.(interface{ SetLinger(int) error }); ok {
				_ = tc.SetLinger(0)
			}
		}
		err = c.Conn.Close()
		c.f.closed(c.n)
	})
	return err
}

// serverAnswered reports whether a publish's outcome came from the server about that very
// message, which it then had: a PubAck, an API error, "no responders". A permission violation
// is not one: the server names the subject, not the message, and the relay matches it to
// publishes by subject and time (denied.go), which may pick a message the server never got.
func serverAnswered(err error) bool {
	var apiErr *jetstream.APIError
	return err == nil || errors.As(err, &apiErr) || isNoResponders(err)
}
