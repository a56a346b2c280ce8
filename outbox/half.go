package outbox

// Half messages (RocketMQ's transactional messages): for work that is not in the same
// transaction as the message — a call to another system, another database, a long workflow.
//
//	half, err := client.Prepare(ctx, pool, msg, &outbox.PrepareOptions{Group: "orders"})
//	// ... do the work ...
//	err = client.Commit(ctx, pool, half.ID)   // or client.Rollback(ctx, pool, half.ID)
//
// A prepared message is committed and stored but invisible to the relay. If the producer dies
// or never says, the check-back (package checkback) resolves it after its transaction timeout:
// it asks the producer group's checker (outbox/checker.Serve), or, for a message prepared with
// Fence, rolls it back under its row lock.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/dbhandle"
	"github.com/txoutbox/txoutbox/internal/prom"
	"github.com/txoutbox/txoutbox/internal/store"
)

// Sentinel errors of settling a half message that is no longer prepared. Every such error is
// a *SettleError naming the message and its state; test with errors.Is.
var (
	// ErrRolledBack: the message was rolled back (by its producer, an operator, or the
	// check-back). A CommitTx that gets it has made its transaction fail: roll it back.
	ErrRolledBack = errors.New("half message is rolled back")
	// ErrAlreadyCommitted: the message was already committed (it is ready, published or dead).
	ErrAlreadyCommitted = errors.New("half message is already committed")
	// ErrNotFound: no message has this id: it was never prepared, or it was published and
	// deleted (the relay deletes published rows unless a retention is set), or purged.
	ErrNotFound = errors.New("message not found")
)

// ErrInvalidGroup is returned by Prepare and SendInTransaction (and ValidateGroup) for a
// producer group name that is empty (without Fence) or not made of letters, digits, '-' and
// '_' (it becomes a NATS subject token and a service name). Nothing is stored.
var ErrInvalidGroup = errors.New("invalid producer group")

// SettleError says why a half message could not be settled.
type SettleError struct {
	// Op is "commit" or "rollback".
	Op string
	// ID is the message id.
	ID uuid.UUID
	// State is the row's state ("" when there is no row).
	State string
	// Err is ErrRolledBack, ErrAlreadyCommitted or ErrNotFound.
	Err error
}

func (e *SettleError) Error() string {
	if e.State == "" {
		return fmt.Sprintf("outbox: %s half message %s: %v", e.Op, e.ID, e.Err)
	}
	return fmt.Sprintf("outbox: %s half message %s: it is %s: %v", e.Op, e.ID, e.State, e.Err)
}

func (e *SettleError) Unwrap() error { return e.Err }

// LocalState is the outcome of a producer's local transaction, as the producer (or its
// checker) reports it. The zero value is StateUnknown.
type LocalState int

const (
	// StateUnknown: the outcome is not known (yet); the check-back asks again later.
	StateUnknown LocalState = iota
	// StateCommit: the local transaction committed; publish the message.
	StateCommit
	// StateRollback: the local transaction rolled back; drop the message.
	StateRollback
)

// ErrInvalidLocalState: a LocalState that is none of StateCommit, StateRollback and
// StateUnknown (a LocalState(7) returned by a LocalTxFunc or a checker's Func), or a word
// ParseLocalState does not know. Such an answer settles nothing: the half message stays
// prepared for the check-back, and the error says so.
var ErrInvalidLocalState = errors.New("outbox: not a local transaction state (COMMIT, ROLLBACK or UNKNOWN)")

// Valid reports whether s is StateCommit, StateRollback or StateUnknown.
func (s LocalState) Valid() bool { return s == StateCommit || s == StateRollback || s == StateUnknown }

// String returns COMMIT, ROLLBACK or UNKNOWN: the words checkers answer with (UNKNOWN for a
// state that is not Valid).
func (s LocalState) String() string {
	switch s {
	case StateCommit:
		return "COMMIT"
	case StateRollback:
		return "ROLLBACK"
	}
	return "UNKNOWN"
}

// ParseLocalState parses COMMIT, ROLLBACK or UNKNOWN (case-insensitive, surrounding space
// ignored). Any other text is an error wrapping ErrInvalidLocalState, with StateUnknown.
func ParseLocalState(s string) (LocalState, error) {
	switch strings.ToUpper(strings.TrimSpace(s)) {
	case "COMMIT":
		return StateCommit, nil
	case "ROLLBACK":
		return StateRollback, nil
	case "UNKNOWN":
		return StateUnknown, nil
	}
	if len(s) > 64 {
		s = s[:64] + "…"
	}
	return StateUnknown, fmt.Errorf("%w: %q", ErrInvalidLocalState, s)
}

// MaxGroupLength bounds producer group names.
const MaxGroupLength = 128

// ValidateGroup reports whether g is a valid producer group name: 1 to MaxGroupLength letters,
// digits, '-' and '_'. The check-back asks a group's checker on the NATS subject
// <prefix>.<group>, served by a NATS micro service of that name. Errors wrap ErrInvalidGroup.
func ValidateGroup(g string) error {
	if g == "" {
		return fmt.Errorf("%w: empty", ErrInvalidGroup)
	}
	if len(g) > MaxGroupLength {
		return fmt.Errorf("%w: %d bytes, the limit is %d", ErrInvalidGroup, len(g), MaxGroupLength)
	}
	for i := 0; i < len(g); {
		c, size := utf8.DecodeRuneInString(g[i:])
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			what := fmt.Sprintf("%q", c) // the character, not its first byte
			if c == utf8.RuneError && size == 1 {
				what = fmt.Sprintf("the byte 0x%02x (not UTF-8)", g[i])
			}
			return fmt.Errorf("%w: %q has %s at byte %d; use ASCII letters, digits, '-' and '_'", ErrInvalidGroup, g, what, i)
		}
		i += size
	}
	return nil
}

// PrepareOptions say how the check-back resolves a half message its producer never settles.
type PrepareOptions struct {
	// Group is the producer group: the check-back asks the checker this group serves with
	// checker.Serve. Required unless Fence is set.
	Group string

	// Fence is for work in this same database, settled with CommitTx inside the business
	// transaction: no checker is asked; a message still prepared after the check-back's
	// transaction timeout is rolled back under its row lock, and a CommitTx that comes later
	// fails (making its business transaction fail too). A CommitTx in flight holds the row
	// lock, so the check-back skips the row until it ends.
	Fence bool

	// CheckImmunity delays the first check of this message: it is not checked before
	// CheckImmunity has passed, nor before the check-back's transaction timeout (RocketMQ's
	// CHECK_IMMUNITY_TIME_IN_SECONDS). Use it for local transactions known to take longer
	// than the timeout. Defaults to 0: no delay beyond the transaction timeout. It has no
	// txoutbox.Off or txoutbox.Forever value (a message that must never be checked is not a
	// half message): a negative one is refused, as a *txoutbox.ConfigError naming
	// PrepareOptions.CheckImmunity.
	CheckImmunity time.Duration
}

// prepareOptions returns *opts (zero when nil), validated: CheckImmunity, then the group.
func prepareOptions(opts *PrepareOptions) (PrepareOptions, error) {
	var o PrepareOptions
	if opts != nil {
		o = *opts
	}
	// CheckImmunity first, as txoutbox_prepare checks check_immunity before producer_group.
	if o.CheckImmunity < 0 {
		return o, &txoutbox.ConfigError{Package: "outbox", Field: "PrepareOptions.CheckImmunity",
			Reason: fmt.Sprintf("must not be negative (0: checked from the transaction timeout on), got %s", o.CheckImmunity)}
	}
	if !o.Fence || o.Group != "" {
		if err := ValidateGroup(o.Group); err != nil {
			return o, &txoutbox.ConfigError{Package: "outbox", Field: "PrepareOptions.Group",
				Reason: fmt.Sprintf("is invalid: %v (a group is required unless Fence is set)", err), Err: err}
		}
	}
	return o, nil
}

// Half is a prepared half message.
type Half struct {
	// ID is the message id: settle the message with it.
	ID      uuid.UUID
	Subject string
	Key     string
	Group   string
	Fence   bool
}

// Prepare validates msg (as EnqueueTx does) and stores it as a half message: state prepared,
// invisible to the relay until it is committed. db is usually the pool, so that the half
// message is committed before the producer starts its work. It takes no key lock: the message
// draws its place in its key's order when it is committed.
//
// Like EnqueueTx, it captures the trace context of ctx into the message's headers; the
// check-back's checks of the message and its publishing continue that trace.
//
// A bad message is refused before anything is written with a *MessageError (Index 0) wrapping
// one of the sentinels EnqueueTx lists, ErrDuplicateID included for an id already in the
// outbox. Bad options are refused with a *txoutbox.ConfigError naming
// PrepareOptions.CheckImmunity or PrepareOptions.Group (wrapping ErrInvalidGroup).
func (c *Client) Prepare(ctx context.Context, db txoutbox.DBTX, msg Message, opts *PrepareOptions) (Half, error) {
	if err := dbhandle.RequireArg("outbox", "db", "the caller's transaction, or a pool (a pgx.Tx, a *pgxpool.Pool)", db); err != nil {
		return Half{}, err
	}
	return c.prepare(ctx, msg, opts, func(ctx context.Context, a store.PrepareArgs) error { return c.q.InsertPrepared(ctx, db, a) },
		store.UniqueViolation)
}

// prepare is Prepare and PrepareSQL: the optional enqueue span around the validation and
// insert (the pgx or the database/sql statement), and the trace context captured from within it;
// dup says whether insert's error is a duplicate message id.
func (c *Client) prepare(ctx context.Context, msg Message, opts *PrepareOptions,
	insert func(context.Context, store.PrepareArgs) error, dup func(error) bool) (Half, error) {
	ctx, span := c.startEnqueue(ctx, "prepare", []Message{msg})
	h, err := c.prepareRowAndInsert(ctx, msg, opts, insert, dup)
	var ids []uuid.UUID
	if err == nil {
		ids = []uuid.UUID{h.ID}
	}
	endEnqueue(span, ids, err)
	return h, err
}

func (c *Client) prepareRowAndInsert(ctx context.Context, msg Message, opts *PrepareOptions,
	insert func(context.Context, store.PrepareArgs) error, dup func(error) bool) (Half, error) {
	o, err := prepareOptions(opts)
	if err != nil {
		return Half{}, err
	}
	row, err := c.traceRow(ctx, 0, &msg)
	if err != nil {
		return Half{}, err
	}
	mode := store.CheckModeChecker
	if o.Fence {
		mode = store.CheckModeFence
	}
	err = insert(ctx, store.PrepareArgs{Row: row, Group: o.Group, Mode: mode, Immunity: o.CheckImmunity})
	if err != nil {
		if dup(err) {
			return Half{}, &MessageError{Index: 0, ID: row.MessageID, Subject: msg.Subject, Err: ErrDuplicateID,
				Detail: fmt.Sprintf("a message with this id is already in the outbox (%v)", err)}
		}
		return Half{}, fmt.Errorf("outbox: prepare: %w", err)
	}
	c.half.prepared.Inc()
	return Half{ID: row.MessageID, Subject: msg.Subject, Key: msg.Key, Group: o.Group, Fence: o.Fence}, nil
}

// Commit commits a half message on its own and rings the doorbell: the relay publishes it. It runs in a transaction
// of its own begun on db (a savepoint when db is a pgx.Tx): it takes the message's key lock and
// gives the message a new place in its key's order, after every message of that key committed
// before it. A message the check-back gave up on (check_exhausted) can still be committed.
// When the message is no longer prepared it returns a *SettleError wrapping ErrRolledBack,
// ErrAlreadyCommitted or ErrNotFound; when PostgreSQL's lock table has no room for the key
// lock, an error wrapping ErrLockTableFull (nothing is committed).
func (c *Client) Commit(ctx context.Context, db txoutbox.Beginner, id uuid.UUID) error {
	if err := dbhandle.RequireArg("outbox", "db", "a pool (a *pgxpool.Pool): Commit runs a transaction of its own", db); err != nil {
		return err
	}
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error { return c.commit(ctx, tx, id) })
	if err == nil {
		c.half.committed.Inc() // counted once its transaction committed
		c.Ring()               // the message is ready: wake the relay instead of waiting for its poll
	}
	return err
}

// CommitTx commits a half message inside the producer's business transaction tx, so that the
// message is published if and only if tx commits. It holds the message's row lock until tx
// ends: the check-back's fence waits for (skips) it. tx must be a transaction: a pgx.Tx, or a
// *pgx.Conn or *pgxpool.Conn inside a BEGIN of its own; it takes a txoutbox.DBTX, as the
// other …Tx methods do, because it only runs statements in tx (on a pool, each statement would
// commit on its own and the message would be published whatever the business change).
//
// If the message is no longer prepared — typically the check-back fenced it because tx ran
// past the transaction timeout — CommitTx returns a *SettleError wrapping ErrRolledBack (or
// ErrNotFound) and makes tx fail: a later tx.Commit returns pgx.ErrTxCommitRollback, so the
// business change and the message never disagree. ErrAlreadyCommitted leaves tx usable (the
// message will be published either way). ErrNotFound also fails tx, although it may mean the
// message was committed, published and (without a retention) deleted: do not CommitTx a
// message twice. Under REPEATABLE READ or SERIALIZABLE, a fence that committed after tx took
// its snapshot surfaces as the server's serialization failure (SQLSTATE 40001) instead of
// ErrRolledBack: tx fails all the same. When PostgreSQL's lock table has no room for the key
// lock it returns an error wrapping ErrLockTableFull, and tx is aborted (as EnqueueTx's is).
// Call Client.Ring after tx commits.
func (c *Client) CommitTx(ctx context.Context, tx txoutbox.DBTX, id uuid.UUID) error {
	if err := dbhandle.RequireArg("outbox", "tx", "the business transaction (a pgx.Tx)", tx); err != nil {
		return err
	}
	err := c.commit(ctx, tx, id)
	if err == nil {
		c.half.committed.Inc() // tx may still roll back: the counter cannot know
	}
	if err == nil || errors.Is(err, ErrAlreadyCommitted) {
		return err
	}
	// Fail the transaction on the server, whatever the caller does next — also when ctx is
	// already done (pgx would not even send the statement on it).
	_, _ = tx.Exec(context.WithoutCancel(ctx), poisonSQL)
	return err
}

// poisonSQL aborts the transaction it runs in.
const poisonSQL = `DO $$BEGIN RAISE EXCEPTION 'txoutbox: the half message this transaction commits is no longer prepared (rolled back by the check-back?); this transaction must roll back' USING ERRCODE = 'P0001'; END$$`

func (c *Client) commit(ctx context.Context, tx txoutbox.DBTX, id uuid.UUID) error {
	ok, state, err := c.q.SettleHalf(ctx, tx, store.HalfSettle{MessageID: id, Commit: true, By: store.SettledByProducer})
	if err != nil && !errors.Is(err, store.ErrNoRow) {
		return fmt.Errorf("outbox: commit half message %s: %w", id, store.LockTableFull(err, ErrLockTableFull))
	}
	if !ok {
		return settleError("commit", id, state, err)
	}
	return nil
}

// Rollback rolls back a half message: it is never published. It returns a *SettleError
// wrapping ErrRolledBack, ErrAlreadyCommitted or ErrNotFound when the message is no longer
// prepared. It may run inside a transaction (db a pgx.Tx) or on its own (a pool).
func (c *Client) Rollback(ctx context.Context, db txoutbox.DBTX, id uuid.UUID) error {
	if err := dbhandle.RequireArg("outbox", "db", "a pool or a transaction (a *pgxpool.Pool, a pgx.Tx)", db); err != nil {
		return err
	}
	ok, state, err := c.q.SettleHalf(ctx, db, store.HalfSettle{MessageID: id, Commit: false, By: store.SettledByProducer})
	if err != nil && !errors.Is(err, store.ErrNoRow) {
		return fmt.Errorf("outbox: roll back half message %s: %w", id, err)
	}
	if !ok {
		return settleError("rollback", id, state, err)
	}
	c.half.rolledBack.Inc()
	return nil
}

// settleError maps the state of a message that could not be settled to its sentinel.
func settleError(op string, id uuid.UUID, state string, err error) error {
	e := &SettleError{Op: op, ID: id, State: state}
	switch {
	case errors.Is(err, store.ErrNoRow):
		e.Err = ErrNotFound
	case state == store.StateRolledBack:
		e.Err = ErrRolledBack
	default: // ready, published, dead
		e.Err = ErrAlreadyCommitted
	}
	return e
}

// LocalTxFunc runs the producer's local transaction for a prepared half message and reports
// its outcome. Return StateRollback (with or without an error) when the local transaction is
// known not to have committed; an error with StateUnknown leaves the message to the
// check-back, as RocketMQ does with an exception.
type LocalTxFunc func(ctx context.Context, h Half) (LocalState, error)

// settleTimeout bounds SendInTransaction's settle once the local transaction has answered.
const settleTimeout = 30 * time.Second

// SendInTransaction is the one-call form of a half message, after RocketMQ's
// sendMessageInTransaction: it prepares msg, runs local, and settles the message by its
// answer: StateCommit commits it, StateRollback rolls it back, StateUnknown leaves it prepared
// for the check-back. It settles even when ctx was cancelled after local answered (bounded by
// 30s), so that a committed local transaction does not wait for the check-back. A local that
// already settled the message (CommitTx in its own transaction) is fine: the "already" errors
// are ignored, and so is ErrNotFound after a commit (the relay published and deleted it).
//
// It returns the half message, local's answer, and local's error joined with any settle error
// (and ErrInvalidLocalState when the answer is none of the three states: nothing is settled).
// If local panics, the message stays prepared and the check-back resolves it.
func (c *Client) SendInTransaction(ctx context.Context, db txoutbox.DB, msg Message, opts *PrepareOptions, local LocalTxFunc) (Half, LocalState, error) {
	if err := dbhandle.RequireArg("outbox", "db", "a pool (a *pgxpool.Pool)", db); err != nil {
		return Half{}, StateUnknown, err
	}
	if err := dbhandle.RequireArg("outbox", "local", "the function that runs the local transaction", local); err != nil {
		return Half{}, StateUnknown, err
	}
	h, err := c.Prepare(ctx, db, msg, opts)
	if err != nil {
		return Half{}, StateUnknown, err
	}
	st, lerr := local(ctx, h)
	if lerr != nil {
		lerr = fmt.Errorf("outbox: local transaction of half message %s (%s): %w", h.ID, st, lerr)
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
	defer cancel()
	var serr error
	switch st {
	case StateCommit:
		serr = c.Commit(sctx, db, h.ID)
		if errors.Is(serr, ErrAlreadyCommitted) || errors.Is(serr, ErrNotFound) {
			serr = nil
		}
	case StateRollback:
		serr = c.Rollback(sctx, db, h.ID)
		if errors.Is(serr, ErrRolledBack) {
			serr = nil
		}
	case StateUnknown:
	default:
		serr = fmt.Errorf("%w: local answered LocalState(%d) for half message %s; it stays prepared for the check-back", ErrInvalidLocalState, int(st), h.ID)
	}
	return h, st, errors.Join(lerr, serr)
}

// halfMetrics count what producers do with half messages (the check-back counts the rest).
type halfMetrics struct {
	prepared, committed, rolledBack prometheus.Counter
}

func newHalfMetrics(reg prometheus.Registerer) (*halfMetrics, error) {
	counter := func(name, help string) prometheus.Counter {
		return prometheus.NewCounter(prometheus.CounterOpts{Namespace: "txoutbox", Subsystem: "outbox", Name: name, Help: help})
	}
	m := &halfMetrics{
		prepared:   counter("half_prepared_total", "Half messages prepared by this process."),
		committed:  counter("half_committed_total", "Half messages this process committed (Commit, SendInTransaction once their transaction committed; CommitTx when it succeeded, before the caller's transaction ends)."),
		rolledBack: counter("half_rolled_back_total", "Half messages this process rolled back."),
	}
	// Several clients on one registry share the counters.
	if err := prom.Register(reg, "outbox", prom.Of(&m.prepared), prom.Of(&m.committed), prom.Of(&m.rolledBack)); err != nil {
		return nil, err
	}
	return m, nil
}
