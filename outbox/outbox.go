// Package outbox is txoutbox's producer API: it writes messages into the outbox table inside
// the caller's own Postgres transaction, so a message exists if and only if the business
// change it describes committed. The relay (package relay) later publishes committed messages
// to NATS JetStream.
//
// The client never begins or commits a transaction:
//
//	tx, err := pool.Begin(ctx)
//	if err != nil {
//		return err
//	}
//	// Rolls back on every early return; after Commit it is a no-op (pgx's idiom).
//	defer tx.Rollback(ctx)
//	if _, err := tx.Exec(ctx, `INSERT INTO orders (id, total_cents) VALUES ($1, $2)`, orderID, total); err != nil {
//		return err
//	}
//	if _, err := client.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.created", Key: orderID, Payload: body}); err != nil {
//		return err
//	}
//	if err := tx.Commit(ctx); err != nil {
//		return err
//	}
//	client.Ring() // optional: wake the relay now instead of at its next poll
//
// EnqueueTx and Prepare accept a message only if JetStream can store it under the server's
// default limits and the consumer receives it exactly as it was given: subject, Key, BizKey,
// header names (with their case) and values (several per name, in order) and payload arrive
// byte for byte. Anything the wire would drop, change, refuse or act on is refused at enqueue
// with a *MessageError (see the Err* sentinels, ValidateSubject, ValidateKey,
// ValidateHeaderValue, IsReservedHeader, MaxHeaderBytes), never normalised on the way.
//
// # Delayed messages
//
// A message with a DeliverAt commits with the transaction and is published when it falls due
// ("close this order if it is still unpaid in 30 minutes"). Until then CancelTx and
// RescheduleTx (or their business key forms) withdraw or move it inside any later
// transaction, atomically with the business change that makes it moot; once the relay has
// taken it they return ErrNotScheduled. A delayed message holds back nothing while it waits:
// the later messages of its key go out without it. When it falls due it takes its place in
// its key's order: it is published after the messages of its key that became ready before it
// and before those that become ready after it, and, like any message, a failure to publish it
// holds back the later messages of its key. An entity with several timers needs a business key
// per timer, naming its due time (for example "order:42:timeout:2026-12-03T10:30:00Z"): the
// consumer deduplicates on it, and CancelBizKeyTx cancels exactly that timer. RescheduleTx
// keeps the message's id and business key (which then names the old time: find the message
// by its id or its original key); a timer re-armed for a new time as a distinct business
// event is a cancel and a new message whose key names the new time.
//
// # Names
//
// A method whose name ends in Tx (EnqueueTx, CommitTx, CancelTx, RescheduleTx and the business
// key forms) runs its statements in the caller's transaction and is part of it: what it did
// commits or rolls back with the caller's change; it never commits. A method without the
// suffix is atomic on its own, whatever handle it is given: Prepare and Rollback are one
// statement each, so they take any handle (txoutbox.DBTX: a pool, a connection, or a
// transaction they then join), and Commit, which needs several statements to be one, takes a
// txoutbox.Beginner and begins its own transaction (a savepoint inside a pgx.Tx); CommitTx is
// the commit that joins the caller's transaction instead. SendInTransaction runs the whole
// half message protocol around the caller's function.
//
// Services on database/sql (sqlx, GORM, any PostgreSQL driver) use the twins whose names say
// SQL — EnqueueSQLTx, PrepareSQL, CommitSQL, CommitSQLTx, RollbackSQL, SendInTransactionSQL,
// CancelSQLTx, RescheduleSQLTx, CancelBizKeySQLTx, RescheduleBizKeySQLTx — with a *sql.Tx
// (txoutbox.SQLDBTX) in place of the pgx.Tx, under the same rules.
package outbox

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/dbhandle"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/migrations"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// DefaultMaxMessageBytes is NATS's default max_payload (1 MiB), which counts headers too.
const DefaultMaxMessageBytes = 1 << 20

// MaxMessageBytesLimit is the largest Config.MaxMessageBytes: JetStream's file store refuses a
// message record over 32 MiB, and a record holds, besides payload and headers, 34 bytes of
// framing and the subject (at most MaxSubjectLength bytes).
const MaxMessageBytesLimit = 32<<20 - 34 - MaxSubjectLength

// Config configures a Client. The zero value is usable.
type Config struct {
	// Schema is the Postgres schema holding the outbox table: at most 63 bytes, no NUL byte.
	// Defaults to txoutbox.DefaultSchema ("public").
	Schema string

	// MaxMessageBytes bounds payload plus headers, counted as NATS counts them (including the
	// headers the relay adds). Keep it at or below the NATS server's max_payload and the
	// stream's max_msg_size. Defaults to DefaultMaxMessageBytes (1 MiB); at least 1024, at
	// most MaxMessageBytesLimit. The header block alone is bounded by MaxHeaderBytes.
	MaxMessageBytes int

	// Doorbell, when set, is rung by Client.Ring to wake the relay right after a commit.
	// Defaults to none: the relay finds new rows at its next poll. A doorbell whose
	// constructor refused its arguments (NewNATSDoorbell, NewPostgresDoorbell: see their Err
	// methods) and a nil pointer in the interface are refused.
	Doorbell Doorbell

	// Registerer, when set, registers the client's half-message counters
	// (txoutbox_outbox_half_prepared_total, _committed_total, _rolled_back_total). Clients
	// sharing a registry share the counters. Defaults to none.
	Registerer prometheus.Registerer

	// TracerProvider provides the tracer of the optional enqueue span (EnqueueSpan). Defaults
	// to the global provider (otel.GetTracerProvider), which records nothing until the
	// application sets one.
	TracerProvider trace.TracerProvider

	// Propagator captures the trace context of the ctx given to EnqueueTx and Prepare into
	// each message's headers (traceparent and tracestate with the W3C propagator), unless the
	// message's own headers carry a valid trace context as the propagator reads it (then
	// they are published as given): the relay and the consumer continue that trace. Headers
	// of the propagator's that the message has without a trace context (baggage or
	// tracestate alone) are kept as given, and the others are added. Defaults to the global propagator (otel.GetTextMapPropagator), which
	// captures nothing until the application sets one, for example with
	// otel.SetTextMapPropagator(propagation.TraceContext{}).
	Propagator propagation.TextMapPropagator

	// EnqueueSpan, when set, makes EnqueueTx and Prepare start a span of their own ("enqueue
	// <subject>" or "prepare <subject>", kind producer, messaging.operation.type create)
	// inside the caller's, and the messages capture it instead of the caller's span. Defaults
	// to false: the enqueue is part of the caller's span.
	EnqueueSpan bool
}

// WithDefaults returns a copy of c with Schema and MaxMessageBytes set to their defaults when
// unset. The other fields keep their zero value, which is their default: no Doorbell, no
// Registerer, EnqueueSpan false, and a nil TracerProvider and Propagator, which mean
// OpenTelemetry's global provider and propagator (otel.GetTracerProvider,
// otel.GetTextMapPropagator), taken by NewClient, not filled in here. c may be nil.
func (c *Config) WithDefaults() *Config {
	out := Config{}
	if c != nil {
		out = *c
	}
	out.Schema = cmp.Or(out.Schema, txoutbox.DefaultSchema)
	out.MaxMessageBytes = cmp.Or(out.MaxMessageBytes, DefaultMaxMessageBytes)
	return &out
}

func (c *Config) validate() error {
	if err := migrations.ValidateSchemaName(c.Schema); err != nil {
		return &txoutbox.ConfigError{Package: "outbox", Field: "Config.Schema", Reason: err.Error()}
	}
	if c.MaxMessageBytes < 1024 || c.MaxMessageBytes > MaxMessageBytesLimit {
		return &txoutbox.ConfigError{Package: "outbox", Field: "Config.MaxMessageBytes",
			Reason: fmt.Sprintf("must be between 1024 and %d (what JetStream's file store keeps), got %d", MaxMessageBytesLimit, c.MaxMessageBytes)}
	}
	if c.Doorbell != nil {
		if err := dbhandle.RequireArg("outbox", "Config.Doorbell", "a doorbell (or leave the field unset)", c.Doorbell); err != nil {
			return err
		}
		if d, ok := c.Doorbell.(interface{ Err() error }); ok && d.Err() != nil {
			return &txoutbox.ConfigError{Package: "outbox", Field: "Config.Doorbell", Reason: "is invalid: " + d.Err().Error(), Err: d.Err()}
		}
	}
	return nil
}

// ValidateConfig reports whether cfg, with defaults applied, is valid; errors are
// *txoutbox.ConfigError values naming the field. NewClient returns the same errors.
func ValidateConfig(cfg *Config) error { return cfg.WithDefaults().validate() }

// Client writes messages into the outbox. It is safe for concurrent use.
type Client struct {
	cfg   *Config
	q     *store.Queries
	half  *halfMetrics
	trace *tracer
}

// NewClient returns a Client for cfg (nil means all defaults). An invalid cfg is refused with
// a *txoutbox.ConfigError naming the field (ValidateConfig's errors; it matches
// txoutbox.ErrInvalidConfig), a Config.Doorbell whose constructor refused its arguments
// included. It also fails when Config.Registerer refuses the client's counters (a different
// collector of the same name).
func NewClient(cfg *Config) (*Client, error) {
	c := cfg.WithDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	m, err := newHalfMetrics(c.Registerer)
	if err != nil {
		return nil, err
	}
	return &Client{cfg: c, q: store.New(c.Schema), half: m, trace: newTracer(c)}, nil
}

// Config returns the client's effective configuration.
func (c *Client) Config() Config { return *c.cfg }

// Message is one event to publish.
type Message struct {
	// ID is the message id, used as JetStream's Nats-Msg-Id. Defaults to a new UUIDv7. An id
	// names one message for good: never give a second message the id of an earlier one, even
	// after the first was published and its row purged (EnqueueTx can refuse a reuse only while
	// the first row is in the outbox, ErrDuplicateID). JetStream drops the second as a
	// duplicate within its duplicate window, and a consumer's dedup row drops it after.
	ID uuid.UUID
	// Subject is the NATS subject to publish to. Required; must be a literal subject.
	Subject string
	// Key, when set, orders messages: messages of one key reach JetStream in commit order and
	// a message that cannot be published holds back the later messages of its key only.
	// Typically an aggregate id. A key is global across subjects: a message of key k that
	// cannot be published holds back k's later messages on every subject, since one
	// aggregate's events often go to several subjects and their order is the aggregate's (put
	// the subject in the key, "orders.created:42", for order per subject only). Sent as the
	// Txoutbox-Key header. It must pass ValidateKey (no control characters, no white space at
	// either end, at most MaxKeyLength bytes, not the text Nats-Msg-Id: see HeaderMsgID).
	Key string
	// BizKey is an optional business idempotency key (for example "order:42:created"). When
	// set, idempotent consumers deduplicate on it instead of the message id, byte for byte:
	// two BizKeys that differ in any byte are two events. Sent as the Txoutbox-Biz-Key header.
	// It must pass ValidateKey, as Key.
	BizKey string
	// Headers are sent with the message and arrive exactly as given: names with their case
	// (names differing only in case are distinct headers), every value of a name in order, an
	// empty value as empty. Names must be RFC 7230 tokens, not reserved (IsReservedHeader:
	// Nats-*, Txoutbox-*, Status, Description), with at least one value each; values must pass
	// ValidateHeaderValue; neither a name nor a value may hold the text Nats-Msg-Id (see
	// HeaderMsgID: nats-server would take it for the message id). A traceparent header (any case) must be a valid W3C trace context
	// (ValidateTraceparent; else ErrInvalidTraceparent) and travels as it is: when Headers
	// carry no valid trace context, EnqueueTx and Prepare add the trace context of their ctx
	// (the propagator's headers Headers lacks, to a copy: Headers itself is never changed).
	Headers map[string][]string
	// Payload is the message body.
	Payload []byte
	// DeliverAt, when set, delays the message until that time (a delayed or scheduled
	// message): it is committed with the transaction as any message, stored scheduled, and
	// published when due, within the relay's poll interval (at once when the relay knows the
	// time: it wakes for the next due message). Until the relay takes it, CancelTx and
	// RescheduleTx can withdraw or move it inside any transaction. A time already past makes
	// it due at once, but it is still stored scheduled and takes its key's order when the
	// relay promotes it: after the ready messages of its key from the same transaction, even
	// those after it in the call, and past-dated messages of one key in the order of their
	// times (leave DeliverAt zero for a message that must keep its place in the call). The
	// zero time means not delayed. It is compared with the database's clock and stored to the
	// microsecond, PostgreSQL's precision, rounded up, never down: 2030-01-01T00:00:00.999999999Z
	// is stored as 2030-01-01T00:00:01Z, so the message is never due before DeliverAt. It must
	// lie between MinDeliverAt and MaxDeliverAt (ErrInvalidDeliverAt); those are whole
	// seconds, so a time within them stays within them rounded. A delayed message takes its
	// place in its key's order when it falls due, not when it is enqueued (see the package
	// documentation, "Delayed messages"). The business key of delayed work should name its
	// due time (see BizKey and the order-timeout example).
	DeliverAt time.Time
}

// Key lock limits (see EnqueueTx).
const (
	// KeyLockBudget is how many distinct keys one transaction locks exactly; past it, calls
	// lock the buckets of their keys.
	KeyLockBudget = 256
	// KeyLockBuckets is the number of buckets keys fall into (by hash) for bucket locks.
	KeyLockBuckets = 256
)

// ErrLockTableFull is returned (wrapped, with the server's error) by EnqueueTx, CommitTx and
// Commit (and their database/sql twins EnqueueSQLTx, CommitSQLTx and CommitSQL) when PostgreSQL's shared lock table has no room for a key lock (SQLSTATE 53200,
// "out of shared memory"): the transaction is aborted and nothing was written. The lock
// table has max_locks_per_transaction × (max_connections + max_prepared_transactions)
// entries (6,400 with PostgreSQL's defaults) shared by every session; a transaction
// enqueueing keys uses at most KeyLockBuckets + KeyLockBudget (512) of them per outbox, so N
// such transactions at once need up to N × 512 besides every other lock held. Raise
// max_locks_per_transaction (it takes a server restart), or run fewer bulk keyed transactions
// at once and commit them sooner. The error says so.
var ErrLockTableFull = errors.New("outbox: no room for a key lock")

// EnqueueTx validates msgs and inserts them, in order, in the caller's transaction tx, in one
// round trip. It never begins, commits or rolls back tx. Validation happens before anything
// is written: if one message is invalid, none is written and the error (a *MessageError
// wrapping ErrInvalidSubject, ErrMessageTooLarge, ErrHeadersTooLarge, ErrInvalidHeader,
// ErrInvalidTraceparent, ErrInvalidKey, ErrInvalidDeliverAt or ErrDuplicateID) names the
// message. (One exception: an id already in the outbox, found by the insert, when the server
// does not say which id and the call has several messages — PostgreSQL leaves the id out of
// the error for a role that cannot read the outbox — is an error wrapping ErrDuplicateID
// that names no message.) When PostgreSQL's lock table has no room for a key lock it returns
// an error wrapping ErrLockTableFull. A message it accepts can be stored by
// JetStream under the server's default limits and reaches the consumer byte for byte (see
// the package documentation). It returns the message ids in the order of msgs.
//
// Each message captures the trace context of ctx into its headers (see Config.Propagator),
// unless its headers carry a valid trace context of their own (a traceparent header that is
// not a valid W3C one is refused: ErrInvalidTraceparent); captured headers count towards the limits like
// the caller's. A message valid without them that they would make invalid (over a limit, by a
// byte) is stored without them rather than refused, and the span of ctx gets an event saying
// so: tracing never fails an enqueue.
//
// A keyed message locks its key (transaction-scoped advisory locks) before its row id is
// drawn, so concurrent transactions enqueueing one key serialise and, for one key, id order
// is commit order. There is no limit on the number of keys, in one call or in one
// transaction: a transaction locks up to KeyLockBudget distinct keys exactly (each key, plus a
// shared lock on its bucket, its hash modulo KeyLockBuckets), and a call that would take it past
// that budget locks the buckets of its keys exclusively instead. A transaction so holds at
// most KeyLockBuckets + 2×KeyLockBudget advisory locks per outbox, in KeyLockBuckets +
// KeyLockBudget entries of PostgreSQL's lock table shared by all sessions
// (max_locks_per_transaction × (max_connections + max_prepared_transactions) entries); when
// that table is full, EnqueueTx fails with ErrLockTableFull, saying how to make room. Until it
// commits or rolls back, a transaction that locked buckets also blocks every other
// transaction enqueueing a key of those buckets — one call with a few thousand keys covers
// them all: keep bulk enqueues short. Half messages committed with Commit or CommitTx take
// their key's lock the same way.
//
// Within one call, locks are taken in one order, so concurrent calls cannot deadlock on them.
// A transaction that enqueues keys in several calls can deadlock with another one, as with
// row locks (PostgreSQL detects it and aborts one of them, SQLSTATE 40P01), and once past its
// budget even without a common key (a common bucket suffices): within one transaction,
// enqueue keys in a consistent order, bulk in one call.
func (c *Client) EnqueueTx(ctx context.Context, tx txoutbox.DBTX, msgs ...Message) ([]uuid.UUID, error) {
	if err := dbhandle.RequireArg("outbox", "tx", "the caller's transaction (a pgx.Tx)", tx); err != nil {
		return nil, err
	}
	if len(msgs) == 0 {
		return nil, nil
	}
	ctx, span := c.startEnqueue(ctx, "enqueue", msgs)
	ids, err := c.enqueueTx(ctx, tx, msgs)
	endEnqueue(span, ids, err)
	return ids, err
}

func (c *Client) enqueueTx(ctx context.Context, tx txoutbox.DBTX, msgs []Message) ([]uuid.UUID, error) {
	return c.enqueue(ctx, msgs, func(rows []store.NewRow) error { return c.q.InsertMessages(ctx, tx, rows) }, store.DuplicateMessageID)
}

// enqueue is EnqueueTx and EnqueueSQLTx past their handle: it validates msgs (and captures the
// trace context) into rows, refuses ids repeated in the call, inserts the rows with insert and
// names the message behind a duplicate id the insert reports (dupID reads it from the error).
func (c *Client) enqueue(ctx context.Context, msgs []Message, insert func([]store.NewRow) error, dupID func(error) (uuid.UUID, bool)) ([]uuid.UUID, error) {
	rows := make([]store.NewRow, len(msgs))
	ids := make([]uuid.UUID, len(msgs))
	seen := make(map[uuid.UUID]int, len(msgs))
	for i := range msgs {
		m := &msgs[i]
		row, err := c.traceRow(ctx, i, m)
		if err != nil {
			return nil, err
		}
		if j, dup := seen[row.MessageID]; dup {
			return nil, &MessageError{Index: i, ID: row.MessageID, Subject: m.Subject, Err: ErrDuplicateID,
				Detail: fmt.Sprintf("message %d of this call has the same id", j)}
		}
		seen[row.MessageID] = i
		rows[i] = row
		ids[i] = row.MessageID
	}
	if err := insert(rows); err != nil {
		if id, dup := dupID(err); dup {
			if i, ok := seen[id]; ok {
				return nil, &MessageError{Index: i, ID: id, Subject: msgs[i].Subject, Err: ErrDuplicateID,
					Detail: "a message with this id is already in the outbox"}
			}
			if len(msgs) == 1 { // the server did not say which id, but there is only one
				// Its error is kept: on a driver that names no constraint, a unique violation
				// is taken for the id's, and the text lets a user see if it was something else.
				return nil, &MessageError{Index: 0, ID: ids[0], Subject: msgs[0].Subject, Err: ErrDuplicateID,
					Detail: fmt.Sprintf("a message with this id is already in the outbox (%v)", err)}
			}
			return nil, fmt.Errorf("outbox: %w: a message with one of these ids is already in the outbox: %v", ErrDuplicateID, err)
		}
		return nil, fmt.Errorf("outbox: enqueue: %w", store.LockTableFull(err, ErrLockTableFull))
	}
	return ids, nil
}

// prepareRow validates m and turns it into a row.
func (c *Client) prepareRow(i int, m *Message) (store.NewRow, error) {
	fail := func(sentinel error, detail string) (store.NewRow, error) {
		return store.NewRow{}, &MessageError{Index: i, ID: m.ID, Subject: m.Subject, Err: sentinel, Detail: detail}
	}
	if detail := subjectProblem(m.Subject); detail != "" {
		return fail(ErrInvalidSubject, detail)
	}
	if what := checkKey(m.Key); what != "" {
		return fail(ErrInvalidKey, "Key "+what)
	}
	if what := checkKey(m.BizKey); what != "" {
		return fail(ErrInvalidKey, "BizKey "+what)
	}
	hsize, what := validateHeaders(m.Headers)
	if what != "" {
		return fail(ErrInvalidHeader, what)
	}
	if what := traceparentProblem(m.Headers); what != "" {
		return fail(ErrInvalidTraceparent, what)
	}
	block := headerOverhead + hsize + relayHeaderSize(m)
	if block > MaxHeaderBytes {
		return fail(ErrHeadersTooLarge, fmt.Sprintf("the header block NATS stores (the headers, the relay's %s, %s and %s, and framing) is %d bytes, the limit is %d bytes (nats-server stores at most %d whatever the payload, and a consumer's dead letter of the message adds up to %d)",
			HeaderMsgID, HeaderKey, HeaderBizKey, block, MaxHeaderBytes, JetStreamMaxHeaderBytes, DeadLetterHeaderReserve))
	}
	if size := len(m.Payload) + block; size > c.cfg.MaxMessageBytes {
		return fail(ErrMessageTooLarge, fmt.Sprintf("payload %d bytes + headers = %d bytes, over the limit of %d bytes (NATS counts headers, including the relay's)",
			len(m.Payload), size, c.cfg.MaxMessageBytes))
	}
	var deliverAt *time.Time
	if !m.DeliverAt.IsZero() {
		if detail := deliverAtProblem(m.DeliverAt); detail != "" {
			return fail(ErrInvalidDeliverAt, "DeliverAt "+detail)
		}
		at := ceilMicrosecond(m.DeliverAt)
		deliverAt = &at
	}
	id := m.ID
	var err error
	if id == uuid.Nil {
		if id, err = uuid.NewV7(); err != nil {
			return store.NewRow{}, fmt.Errorf("outbox: new message id: %w", err)
		}
	}
	var hdr []byte
	if len(m.Headers) > 0 || m.BizKey != "" {
		h := make(map[string][]string, len(m.Headers)+1)
		for k, v := range m.Headers {
			h[k] = v
		}
		if m.BizKey != "" {
			h[HeaderBizKey] = []string{m.BizKey}
		}
		if hdr, err = json.Marshal(h); err != nil {
			return store.NewRow{}, fmt.Errorf("outbox: encode headers: %w", err)
		}
	}
	return store.NewRow{MessageID: id, Subject: m.Subject, Key: m.Key, Headers: hdr, Payload: m.Payload, DeliverAt: deliverAt}, nil
}

// Ring wakes the relay through the configured Doorbell, if any. Call it after the
// transaction that enqueued messages has committed; it never blocks.
func (c *Client) Ring() {
	if c.cfg.Doorbell != nil {
		c.cfg.Doorbell.Ring()
	}
}
