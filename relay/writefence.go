package relay

import (
	"errors"
	"log/slog"
	"net"
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
// socket buffer cannot finish after it. What is left is the few instructions between the
// check and the system call that hands the bytes to the kernel.
//
// The fence is conservative: after a publish whose PubAck never came (a timeout), until the
// server answers a later one, a write once that lease ended or changed (a partition released,
// handed over) closes the connection, once, even if those bytes had left.
//
// Dial one connection through each fence (each dial is taken for that connection's
// reconnect: what the previous one held is gone), with nats.SetCustomDialer(relay.NewWriteFence(nil))
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
	for _, s := range f.relays {
		s.dropped()
	}
	return &fencedConn{Conn: c, f: f, n: f.dialled}, nil
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
	handed   uint64     // messages handed to the client (counted just before each hand-off)
	returned uint64     // hand-offs that returned (PublishMsgAsync appended the message, or failed)
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
	s.mu.Unlock()
	if pending {
		return
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
func (s *fenceState) dropped() {
	s.mu.Lock()
	s.markLocked(s.returned)
	s.mu.Unlock()
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
	for _, s := range f.relays {
		s.dropped()
	}
}

// fencedConn checks every write (see WriteFence).
type fencedConn struct {
	net.Conn
	f         *WriteFence
	n         uint64 // the fence's count of dials when this connection was dialled
	closeOnce sync.Once
	// userDeadline is the write deadline the client set (nats.go's FlusherTimeout); a write
	// the fence bounds by a lease's expiry gets the earlier of the two.
	userDeadline time.Time
}

func (c *fencedConn) Write(b []byte) (int, error) {
	if h := c.f.beforeWrite; h != nil {
		h()
	}
	stale, deadline := c.f.check()
	if len(stale) > 0 {
		c.fence(stale, len(b))
		return 0, ErrStaleWrite
	}
	if deadline.IsZero() {
		return c.Conn.Write(b)
	}
	// The bytes may hold messages whose lease expires at deadline: they must be with the
	// kernel by then.
	d := deadline
	if !c.userDeadline.IsZero() && c.userDeadline.Before(d) {
		d = c.userDeadline
	}
	if err := c.Conn.SetWriteDeadline(d); err != nil {
		return 0, err
	}
	n, err := c.Conn.Write(b)
	if rerr := c.Conn.SetWriteDeadline(c.userDeadline); err == nil && rerr != nil {
		err = rerr
	}
	if err != nil && !time.Now().Before(deadline) {
		// The lease expired with the write unfinished: send nothing more of it.
		stale, _ := c.f.check()
		c.fence(stale, len(b)-n)
		return n, ErrStaleWrite
	}
	return n, err
}

// fence closes the connection instead of a write, and says so for each relay concerned.
func (c *fencedConn) fence(stale []*fenceState, bytes int) {
	_ = c.Close()
	for _, s := range stale {
		if s.onFence != nil {
			s.onFence()
		}
		// Not under the client's lock (Write runs under it): a slow log must not stall the
		// connection.
		go s.log.Warn("write fence: the NATS client was about to send messages handed to it under a partition lease that has ended since "+
			"(a pause of the relay between the hand-off and the write, or PubAcks that never came); "+
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

func (c *fencedConn) Close() error {
	err := net.ErrClosed
	c.closeOnce.Do(func() {
		err = c.Conn.Close()
		c.f.closed(c.n)
	})
	return err
}

// serverAnswered reports whether a publish's outcome came from the server, which then had
// the message's bytes: a PubAck, an API error, "no responders", a permission violation.
func serverAnswered(err error) bool {
	var apiErr *jetstream.APIError
	return err == nil || errors.As(err, &apiErr) || isNoResponders(err) || errors.Is(err, ErrPublishDenied)
}
