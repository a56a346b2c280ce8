package outbox

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"
)

// DefaultDoorbellSubject is the NATS subject the relay listens on for doorbell rings.
const DefaultDoorbellSubject = "txoutbox.doorbell"

// DefaultDoorbellChannel is the Postgres NOTIFY channel the relay listens on when its
// Postgres doorbell is enabled.
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

// Execer runs a statement; *pgxpool.Pool satisfies it.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// PostgresDoorbell rings with pg_notify in its own short transaction, outside the business
// transaction, for producers without a NATS connection. Rings that arrive while one is being
// sent are coalesced into one more, so a burst of commits costs at most two notifies.
type PostgresDoorbell struct {
	db      Execer
	channel string
	pending atomic.Int32 // 0 idle, 1 sending, 2 sending and another ring wanted
}

// NewPostgresDoorbell returns a doorbell notifying channel (DefaultDoorbellChannel when
// empty) through db, typically the producer's pool.
func NewPostgresDoorbell(db Execer, channel string) *PostgresDoorbell {
	if channel == "" {
		channel = DefaultDoorbellChannel
	}
	return &PostgresDoorbell{db: db, channel: channel}
}

// Ring sends a notify in the background.
func (d *PostgresDoorbell) Ring() {
	for {
		p := d.pending.Load()
		if p == 2 {
			return
		}
		if d.pending.CompareAndSwap(p, p+1) {
			if p == 0 {
				go d.send()
			}
			return
		}
	}
}

func (d *PostgresDoorbell) send() {
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, _ = d.db.Exec(ctx, "SELECT pg_notify($1, '')", d.channel)
		cancel()
		// 1 -> 0: done; 2 -> 1: someone rang meanwhile, send once more.
		if d.pending.Add(-1) == 0 {
			return
		}
	}
}
