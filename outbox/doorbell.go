package outbox

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/dbhandle"
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
	err     error // the constructor's refusal of its arguments
}

// NewNATSDoorbell returns a doorbell publishing on subject (DefaultDoorbellSubject when empty).
//
// It refuses a nil nc and a subject that is not a literal NATS subject (ValidateSubject) with
// a *txoutbox.ConfigError naming the argument, which Err returns and NewClient returns for a
// Config.Doorbell that has one; such a doorbell never rings.
func NewNATSDoorbell(nc *nats.Conn, subject string) *NATSDoorbell {
	if subject == "" {
		subject = DefaultDoorbellSubject
	}
	d := &NATSDoorbell{nc: nc, subject: subject}
	if err := dbhandle.RequireArg("outbox", "nc", "the producer's NATS connection (a *nats.Conn) to NewNATSDoorbell", nc); err != nil {
		d.err = err
	} else if err := ValidateSubject(subject); err != nil {
		d.err = &txoutbox.ConfigError{Package: "outbox", Field: "subject",
			Reason: fmt.Sprintf("of NewNATSDoorbell is invalid: %v (the doorbell publishes on it: a literal subject the relay's Config.DoorbellSubject matches)", err), Err: err}
	}
	return d
}

// Err returns the *txoutbox.ConfigError with which NewNATSDoorbell refused its arguments, or
// nil. A doorbell with an error never rings.
func (d *NATSDoorbell) Err() error { return d.err }

// Ring publishes the ring; errors (a closed connection) are ignored, the relay polls anyway.
func (d *NATSDoorbell) Ring() {
	if d.err != nil || d.nc == nil {
		return
	}
	_ = d.nc.Publish(d.subject, nil)
}

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
	err     error                       // the constructor's refusal of its arguments
}

// NewPostgresDoorbell returns a doorbell notifying channel (DefaultDoorbellChannel when
// empty) through db, the producer's pool.
//
// It refuses, with a *txoutbox.ConfigError naming the argument (which Err returns, and
// NewClient returns for a Config.Doorbell that has one; such a doorbell never rings): a nil
// db; a db that is one transaction or one connection (a pgx.Tx, a *pgx.Conn, a
// *pgxpool.Conn), which the doorbell would use from a goroutine of its own while the caller
// uses it, and which as the business transaction would put the NOTIFY inside it (see
// Doorbell); and a channel ValidateDoorbellChannel refuses.
func NewPostgresDoorbell(db txoutbox.DBTX, channel string) *PostgresDoorbell {
	d := newPostgresDoorbell(db, "NewPostgresDoorbell", channel)
	if d.err == nil {
		d.notify = func(ctx context.Context, channel string) error {
			_, err := db.Exec(ctx, "SELECT pg_notify($1, '')", channel)
			return err
		}
	}
	return d
}

// newPostgresDoorbell is the part of NewPostgresDoorbell and NewPostgresSQLDoorbell before
// the notify: the channel's default and the checks of db (the argument of fn) and channel.
func newPostgresDoorbell(db any, fn, channel string) *PostgresDoorbell {
	if channel == "" {
		channel = DefaultDoorbellChannel
	}
	d := &PostgresDoorbell{channel: channel}
	if err := dbhandle.RequireArg("outbox", "db", "the producer's pool to "+fn, db); err != nil {
		d.err = err
	} else if what := dbhandle.SingleConnection(db); what != "" {
		d.err = &txoutbox.ConfigError{Package: "outbox", Field: "db",
			Reason: "of " + fn + " must be a pool (a *pgxpool.Pool, a *sql.DB), got a " + what +
				": the doorbell notifies from a goroutine of its own, outside the business transaction (a NOTIFY inside it serialises every notifying commit)"}
	} else if err := ValidateDoorbellChannel(channel); err != nil {
		d.err = &txoutbox.ConfigError{Package: "outbox", Field: "channel", Reason: "of " + fn + " " + err.Error()}
	}
	return d
}

// MaxDoorbellChannelLength is the longest Postgres NOTIFY channel name, in bytes: PostgreSQL's
// identifier limit (NAMEDATALEN - 1). LISTEN cuts a longer name to it, and pg_notify refuses
// one, so a producer and a relay given a longer name would never meet.
const MaxDoorbellChannelLength = 63

// ValidateDoorbellChannel reports whether channel can name a doorbell's Postgres NOTIFY
// channel: 1 to MaxDoorbellChannelLength bytes of valid UTF-8 without NUL.
func ValidateDoorbellChannel(channel string) error {
	switch {
	case channel == "":
		return fmt.Errorf("must not be empty")
	case len(channel) > MaxDoorbellChannelLength:
		return fmt.Errorf("is %d bytes, the limit is %d (PostgreSQL's identifier length: LISTEN would cut it, pg_notify refuses it)", len(channel), MaxDoorbellChannelLength)
	case !utf8.ValidString(channel):
		return fmt.Errorf("is not valid UTF-8")
	case strings.IndexByte(channel, 0) >= 0:
		return fmt.Errorf("holds a NUL byte")
	}
	return nil
}

// Err returns the *txoutbox.ConfigError with which NewPostgresDoorbell or
// NewPostgresSQLDoorbell refused its arguments, or nil. A doorbell with an error never rings.
func (d *PostgresDoorbell) Err() error { return d.err }

// Ring sends a notify in the background. After Close it does nothing.
func (d *PostgresDoorbell) Ring() {
	if d.err != nil || d.notify == nil || d.closed.Load() {
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
