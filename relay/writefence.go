package relay

import (
	"errors"
	"log/slog"
	"net"
	"sync"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// ErrStaleWrite is what a connection dialled through a WriteFence returns, instead of
// writing, when the bytes about to leave may hold messages a relay handed to the NATS client
// under a lease that has ended since. The fence closes the connection with it: nats.go drops
// the unwritten bytes and reconnects, the messages' PubAcks never come, and their rows stay
// ready for the relay that holds the partitions now.
var ErrStaleWrite = errors.New("relay: write fence: the bytes to send hold messages handed to the NATS client under a partition lease that has ended since; the connection is closed instead")

// WriteFence is a nats.CustomDialer for the NATS connection a relay publishes on. It closes
// the one gap the relay's lease check leaves (see the README's "Paused relays"): the check
// runs before a message is handed to the NATS client, and the client writes the message's
// bytes to its socket later, from its flusher goroutine. A relay paused between the two (a
// SIGSTOP, a VM pause, CPU starvation) would send the message when it wakes, however late,
// after another relay took its partitions and published the message, past the duplicate
// window. Through a WriteFence every write to the socket checks first whether it may carry a
// message handed under a lease that has ended since; if so, the connection is closed instead
// (ErrStaleWrite): what the check leaves is then a few instructions between that check and
// the write system call, not the client's buffering.
//
// Dial the connection with nats.SetCustomDialer(relay.NewWriteFence(nil)) and
// nats.ReconnectBufSize(-1) (a connection that buffers publishes while it reconnects sends
// them later, unchecked: New leaves the fence off for it and says so), then pass it to New,
// which finds the fence in the connection's options. relay run does this. One fence serves
// every relay that publishes on its connection.
type WriteFence struct {
	dialer nats.CustomDialer

	mu     sync.Mutex
	relays []*fenceState

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

// Dial implements nats.CustomDialer.
func (f *WriteFence) Dial(network, address string) (net.Conn, error) {
	c, err := f.dialer.Dial(network, address)
	if err != nil {
		return nil, err
	}
	return &fencedConn{Conn: c, f: f}, nil
}

// fenceState is one relay's side of a WriteFence: messages it handed to the client that may
// not have been written yet, and the lease generation of the oldest of them.
type fenceState struct {
	valid   func(gen uint64) bool
	log     *slog.Logger
	onFence func()

	mu       sync.Mutex
	handed   uint64 // messages handed to the client (counted just before each hand-off)
	returned uint64 // hand-offs that returned (PublishMsgAsync appended the message, or failed)
	clean    uint64 // handed messages known written: answered by the server, or dropped with their connection
	gen      uint64 // the lease generation of the oldest handed message not known written
	lastGen  uint64 // the lease generation of the latest handed message
}

func (f *WriteFence) bind(valid func(uint64) bool, log *slog.Logger, onFence func()) *fenceState {
	s := &fenceState{valid: valid, log: log, onFence: onFence}
	f.mu.Lock()
	f.relays = append(f.relays, s)
	f.mu.Unlock()
	return s
}

func (f *WriteFence) unbind(s *fenceState) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, x := range f.relays {
		if x == s {
			f.relays = append(f.relays[:i], f.relays[i+1:]...)
			return
		}
	}
}

// handing records that a message claimed under lease generation gen is about to be handed
// to the client. It runs after the lease check and before PublishMsgAsync.
func (s *fenceState) handing(gen uint64) {
	s.mu.Lock()
	if s.handed == s.clean {
		s.gen = gen
	}
	s.handed++
	s.lastGen = gen
	s.mu.Unlock()
}

// handedOff records that the latest hand-off returned. The relay hands off one message at a
// time, so the first returned messages are the ones whose hand-off returned.
func (s *fenceState) handedOff() {
	s.mu.Lock()
	s.returned++
	s.mu.Unlock()
}

// handedSoFar returns how many messages were handed so far.
func (s *fenceState) handedSoFar() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.handed
}

// written records that the first n handed messages have left the client: the server
// answered each one (a PubAck or an error of its own), so none of their bytes waits in the
// client's buffer.
func (s *fenceState) written(n uint64) {
	s.mu.Lock()
	if n > s.clean {
		s.clean = n
	}
	s.mu.Unlock()
}

// stale reports whether a write now may carry a message handed under a lease that has ended.
func (s *fenceState) stale() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.handed != s.clean && !s.valid(s.gen)
}

// dropped records that the connection is gone with whatever its buffer held: nats.go does not
// carry the buffer of a closed connection over to the next one (and, with ReconnectBufSize
// -1, buffers nothing while it reconnects). A hand-off still under way may append its message
// to the next connection's buffer: it stays to be checked.
func (s *fenceState) dropped() {
	s.mu.Lock()
	if s.returned > s.clean {
		s.clean = s.returned
		if s.clean != s.handed {
			s.gen = s.lastGen
		}
	}
	s.mu.Unlock()
}

// check returns the relays whose handed messages a write now may carry under an ended lease.
func (f *WriteFence) check() []*fenceState {
	f.mu.Lock()
	defer f.mu.Unlock()
	var stale []*fenceState
	for _, s := range f.relays {
		if s.stale() {
			stale = append(stale, s)
		}
	}
	return stale
}

func (f *WriteFence) dropAll() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, s := range f.relays {
		s.dropped()
	}
}

// fencedConn checks every write (see WriteFence).
type fencedConn struct {
	net.Conn
	f *WriteFence
}

func (c *fencedConn) Write(b []byte) (int, error) {
	if h := c.f.beforeWrite; h != nil {
		h()
	}
	if stale := c.f.check(); len(stale) > 0 {
		_ = c.Close()
		for _, s := range stale {
			s.log.Warn("write fence: the NATS client was about to send messages handed to it under a partition lease that has ended since "+
				"(the relay was paused between the hand-off and the write); the connection is closed instead and reconnects, "+
				"and the rows are left to the relay that holds the partitions now", "bytes", len(b))
			if s.onFence != nil {
				s.onFence()
			}
		}
		return 0, ErrStaleWrite
	}
	return c.Conn.Write(b)
}

func (c *fencedConn) Close() error {
	c.f.dropAll()
	return c.Conn.Close()
}

// serverAnswered reports whether a publish's outcome came from the server, which then had
// the message's bytes: a PubAck, an API error, "no responders", a permission violation.
func serverAnswered(err error) bool {
	var apiErr *jetstream.APIError
	return err == nil || errors.As(err, &apiErr) || isNoResponders(err) || errors.Is(err, ErrPublishDenied)
}
