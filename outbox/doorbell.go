package outbox

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/testsignal"
)

// DefaultDoorbellSubject is the NATS subject the relay listens on for doorbell rings.
const DefaultDoorbellSubject = "txoutbox.doorbell"

// DefaultDoorbellChannel is the Postgres NOTIFY channel NewPostgresDoorbell and
// NewPostgresSQLDoorbell ring when given "". A relay listens on no channel unless told which
// (relay.Config.DoorbellChannel, relay run --doorbell-channel): set it to this one.
const DefaultDoorbellChannel = "txoutbox_doorbell"

// Doorbell wakes the relay after a commit. Ring must not block.
//
// Ring it after the business transaction commits, never inside it: a NOTIFY inside a
// transaction makes PostgreSQL take a database-wide lock at commit that serialises every
// notifying transaction.
type Doorbell interface {
	Ring()
}

// NATSDoorbell rings by publishing an empty core NATS message (no JetStream, no ack): a few
// microseconds on the producer and no database work at all. A lost ring only delays the relay
// until its next poll.
type NATSDoorbell struct {
	nc      *nats.Conn
	subject string
}

// NewNATSDoorbell returns a doorbell publishing on subject (DefaultDoorbellSubject when empty).
func NewNATSDoorbell(nc *nats.Conn, subject string) *NATSDoorbell {
	if subject == "" {
		subject = DefaultDoorbellSubject
	}
	return &NATSDoorbell{nc: nc, subject: subject}
}

// Ring publishes the ring; errors (a closed connection) are ignored, the relay polls anyway.
func (d *NATSDoorbell) Ring() { _ = d.nc.Publish(d.subject, nil) }

// PostgresDoorbell rings with pg_notify in its own short transaction, outside the business
// transaction, for producers without a NATS connection. Rings that arrive while one is being
// sent are coalesced into one more, so a burst of commits costs at most two notifies. Close it
// when the producer shuts down.
type PostgresDoorbell struct {
	notify  func(ctx context.Context, channel string) error // pg_notify through the producer's pool
	channel string
	pending atomic.Int32 // 0 idle, 1 sending, 2 sending and another ring wanted
	mu      sync.Mutex   // orders Close with the start of a send
	closed  atomic.Bool
	sending sync.WaitGroup
	closing testsignal.Signal[struct{}] // Close has refused later rings and waits for a send
}

// NewPostgresDoorbell returns a doorbell notifying channel (DefaultDoorbellChannel when
// empty) through db, typically the producer's pool.
func NewPostgresDoorbell(db txoutbox.DBTX, channel string) *PostgresDoorbell {
	if channel == "" {
		channel = DefaultDoorbellChannel
	}
	return &PostgresDoorbell{notify: func(ctx context.Context, channel string) error {
		_, err := db.Exec(ctx, "SELECT pg_notify($1, '')", channel)
		return err
	}, channel: channel}
}

// Ring sends a notify in the background. After Close it does nothing.
func (d *PostgresDoorbell) Ring() {
	if d.closed.Load() {
		return
	}
	for {
		p := d.pending.Load()
		if p == 2 {
			return
		}
		if d.pending.CompareAndSwap(p, p+1) {
			if p == 0 {
				d.mu.Lock()
				if d.closed.Load() {
					d.mu.Unlock()
					d.pending.Store(0)
					return
				}
				d.sending.Add(1)
				d.mu.Unlock()
				go d.send()
			}
			return
		}
	}
}

// Close stops the doorbell: later rings are dropped, and Close returns once a notify being
// sent has finished (each is bounded by 5s), so no goroutine of the doorbell outlives it.
func (d *PostgresDoorbell) Close() {
	d.mu.Lock()
	d.closed.Store(true)
	d.mu.Unlock()
	d.closing.Signal(struct{}{})
	d.sending.Wait()
}

func (d *PostgresDoorbell) send() {
	defer d.sending.Done()
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = d.notify(ctx, d.channel)
		cancel()
		// 1 -> 0: done; 2 -> 1: someone rang meanwhile, send once more.
		if d.pending.Add(-1) == 0 || d.closed.Load() {
			return
		}
	}
}
