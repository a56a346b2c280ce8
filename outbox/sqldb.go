package outbox

// The producer API over database/sql: the same rules as the pgx methods, for services whose
// data layer is database/sql (sqlx, GORM, ent, bun, sqlc on database/sql) with any driver that
// speaks to PostgreSQL (pgx's stdlib driver and lib/pq are tested). Each method is its pgx
// counterpart with SQL in its name and a txoutbox.SQLDBTX (or SQLBeginner) in place of the
// pgx handle.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/dbhandle"
	"github.com/txoutbox/txoutbox/internal/store"
)

// EnqueueSQLTx is EnqueueTx for database/sql: it validates msgs and inserts them, in order,
// in the caller's transaction tx — a *sql.Tx, sqlx's *sqlx.Tx, or the Statement.ConnPool of a
// GORM transaction — in one round trip (one statement that takes the key locks and inserts the
// rows). It never begins, commits or rolls back tx. Everything EnqueueTx documents holds: the
// same validation before anything is written and the same errors (a *MessageError wrapping
// ErrInvalidSubject, ErrMessageTooLarge, ErrHeadersTooLarge, ErrInvalidHeader,
// ErrInvalidTraceparent, ErrInvalidKey, ErrInvalidDeliverAt or ErrDuplicateID;
// ErrLockTableFull), UUIDv7 ids, and the same key locks taken before the
// row ids are drawn, so that for one key id order is commit order whichever API (pgx,
// database/sql, the SQL functions) each producer uses. It returns the message ids in the order
// of msgs.
//
// tx should be a transaction: given a *sql.DB, each call commits on its own, like a
// transaction of one call.
func (c *Client) EnqueueSQLTx(ctx context.Context, tx txoutbox.SQLDBTX, msgs ...Message) ([]uuid.UUID, error) {
	if err := dbhandle.RequireArg("outbox", "tx", "the caller's transaction (a *sql.Tx)", tx); err != nil {
		return nil, err
	}
	if len(msgs) == 0 {
		return nil, nil
	}
	ctx, span := c.startEnqueue(ctx, "enqueue", msgs)
	ids, err := c.enqueue(ctx, msgs, func(rows []store.NewRow) error { return c.q.InsertMessagesSQL(ctx, tx, rows) }, store.DuplicateMessageIDSQL)
	endEnqueue(span, ids, err)
	return ids, err
}

// PrepareSQL is Prepare for database/sql: it validates msg and stores it as a half message
// through db, usually the *sql.DB, so that the half message is committed before the producer
// starts its work. Like Prepare, it captures the trace context of ctx into the message's
// headers, and with Config.EnqueueSpan it does so inside the same "prepare" span, and it
// returns the same errors: a *MessageError (Index 0) for a bad message or an id already in
// the outbox (ErrDuplicateID), a *txoutbox.ConfigError for bad options.
func (c *Client) PrepareSQL(ctx context.Context, db txoutbox.SQLDBTX, msg Message, opts *PrepareOptions) (Half, error) {
	if err := dbhandle.RequireArg("outbox", "db", "the caller's transaction, or a pool (a *sql.Tx, a *sql.DB)", db); err != nil {
		return Half{}, err
	}
	return c.prepare(ctx, msg, opts, func(ctx context.Context, a store.PrepareArgs) error { return c.q.InsertPreparedSQL(ctx, db, a) },
		func(err error) bool { _, dup := store.DuplicateMessageIDSQL(err); return dup })
}

// CommitSQL is Commit for database/sql: it commits a half message in a transaction of its own
// begun on db (a *sql.DB or *sql.Conn), taking its key lock, and rings the doorbell. When the
// message is no longer prepared it returns a *SettleError wrapping ErrRolledBack,
// ErrAlreadyCommitted or ErrNotFound; for want of room for the key lock, an error wrapping
// ErrLockTableFull.
func (c *Client) CommitSQL(ctx context.Context, db txoutbox.SQLBeginner, id uuid.UUID) error {
	if err := dbhandle.RequireArg("outbox", "db", "a pool (a *sql.DB): CommitSQL runs a transaction of its own", db); err != nil {
		return err
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("outbox: commit half message %s: begin: %w", id, err)
	}
	if err := c.commitSQL(ctx, tx, id); err != nil {
		_ = tx.Rollback()
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("outbox: commit half message %s: %w", id, err)
	}
	c.half.committed.Inc()
	c.Ring()
	return nil
}

// CommitSQLTx is CommitTx for database/sql: it commits a half message inside the producer's
// business transaction tx (a *sql.Tx, sqlx's *sqlx.Tx, a GORM transaction's
// Statement.ConnPool), so that the message is published if and only if tx commits, holding
// its row lock until tx ends. tx must be a transaction.
//
// If the message is no longer prepared, CommitSQLTx returns a *SettleError wrapping
// ErrRolledBack (or ErrNotFound) and makes tx fail on the server: a later commit of tx does
// not commit (database/sql reports an error: pgx's stdlib driver pgx.ErrTxCommitRollback,
// lib/pq pq.ErrInFailedTransaction), so the business change and the message never disagree.
// ErrAlreadyCommitted leaves tx usable. ErrLockTableFull (no room for the key lock) aborts tx,
// as with CommitTx. Call Client.Ring after tx commits.
func (c *Client) CommitSQLTx(ctx context.Context, tx txoutbox.SQLDBTX, id uuid.UUID) error {
	if err := dbhandle.RequireArg("outbox", "tx", "the business transaction (a *sql.Tx)", tx); err != nil {
		return err
	}
	err := c.commitSQL(ctx, tx, id)
	if err == nil {
		c.half.committed.Inc()
	}
	if err == nil || errors.Is(err, ErrAlreadyCommitted) {
		return err
	}
	_, _ = tx.ExecContext(context.WithoutCancel(ctx), poisonSQL)
	return err
}

func (c *Client) commitSQL(ctx context.Context, tx txoutbox.SQLDBTX, id uuid.UUID) error {
	ok, state, err := c.q.SettleHalfSQL(ctx, tx, store.HalfSettle{MessageID: id, Commit: true, By: store.SettledByProducer})
	if err != nil && !errors.Is(err, store.ErrNoRow) {
		return fmt.Errorf("outbox: commit half message %s: %w", id, store.LockTableFull(err, ErrLockTableFull))
	}
	if !ok {
		return settleError("commit", id, state, err)
	}
	return nil
}

// RollbackSQL is Rollback for database/sql: the half message is never published. It returns
// a *SettleError wrapping ErrRolledBack, ErrAlreadyCommitted or ErrNotFound when the message
// is no longer prepared. db may be a transaction or the *sql.DB.
func (c *Client) RollbackSQL(ctx context.Context, db txoutbox.SQLDBTX, id uuid.UUID) error {
	if err := dbhandle.RequireArg("outbox", "db", "a pool or a transaction (a *sql.DB, a *sql.Tx)", db); err != nil {
		return err
	}
	ok, state, err := c.q.SettleHalfSQL(ctx, db, store.HalfSettle{MessageID: id, Commit: false, By: store.SettledByProducer})
	if err != nil && !errors.Is(err, store.ErrNoRow) {
		return fmt.Errorf("outbox: roll back half message %s: %w", id, err)
	}
	if !ok {
		return settleError("rollback", id, state, err)
	}
	c.half.rolledBack.Inc()
	return nil
}

// SendInTransactionSQL is SendInTransaction for database/sql: it prepares msg through db,
// runs local, and settles the message by local's answer (CommitSQL, RollbackSQL, or nothing
// for StateUnknown), with the same rules.
func (c *Client) SendInTransactionSQL(ctx context.Context, db txoutbox.SQLDB, msg Message, opts *PrepareOptions, local LocalTxFunc) (Half, LocalState, error) {
	if err := dbhandle.RequireArg("outbox", "db", "a pool (a *sql.DB)", db); err != nil {
		return Half{}, StateUnknown, err
	}
	if err := dbhandle.RequireArg("outbox", "local", "the function that runs the local transaction", local); err != nil {
		return Half{}, StateUnknown, err
	}
	h, err := c.PrepareSQL(ctx, db, msg, opts)
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
		serr = c.CommitSQL(sctx, db, h.ID)
		if errors.Is(serr, ErrAlreadyCommitted) || errors.Is(serr, ErrNotFound) {
			serr = nil
		}
	case StateRollback:
		serr = c.RollbackSQL(sctx, db, h.ID)
		if errors.Is(serr, ErrRolledBack) {
			serr = nil
		}
	case StateUnknown:
	default:
		serr = fmt.Errorf("%w: local answered LocalState(%d) for half message %s; it stays prepared for the check-back", ErrInvalidLocalState, int(st), h.ID)
	}
	return h, st, errors.Join(lerr, serr)
}

// CancelSQLTx is CancelTx for database/sql: it withdraws the delayed message id inside the
// caller's transaction tx (a *sql.Tx, sqlx's *sqlx.Tx, a GORM transaction's
// Statement.ConnPool), with CancelTx's rules and statements: if tx commits, the message is
// never published; it succeeds only while the message is scheduled, and otherwise returns a
// *ScheduleError wrapping ErrNotScheduled (and ErrNotFound when there is no such message).
// It never begins, commits or rolls back tx.
func (c *Client) CancelSQLTx(ctx context.Context, tx txoutbox.SQLDBTX, id uuid.UUID) error {
	if err := dbhandle.RequireArg("outbox", "tx", "the caller's transaction (a *sql.Tx)", tx); err != nil {
		return err
	}
	ok, state, err := c.q.CancelScheduledSQL(ctx, tx, id)
	return c.scheduleResult("cancel", id, ok, state, err)
}

// RescheduleSQLTx is RescheduleTx for database/sql: it moves the delivery time of the delayed
// message id to at inside tx, with RescheduleTx's rules and errors (ErrInvalidDeliverAt for a
// time outside MinDeliverAt..MaxDeliverAt, a *ScheduleError when the message is not
// scheduled). The message keeps its id and its business key.
func (c *Client) RescheduleSQLTx(ctx context.Context, tx txoutbox.SQLDBTX, id uuid.UUID, at time.Time) error {
	if err := dbhandle.RequireArg("outbox", "tx", "the caller's transaction (a *sql.Tx)", tx); err != nil {
		return err
	}
	return c.reschedule(id, at, func(at time.Time) (bool, string, error) { return c.q.RescheduleScheduledSQL(ctx, tx, id, at) })
}

// CancelBizKeySQLTx is CancelBizKeyTx for database/sql: it withdraws, inside tx, every
// scheduled message whose BizKey is bizKey and returns their ids, or a *ScheduleError wrapping
// ErrNotScheduled when there is none, with the key's latest state (ErrNotFound as well when
// the key has no message), as CancelBizKeyTx.
func (c *Client) CancelBizKeySQLTx(ctx context.Context, tx txoutbox.SQLDBTX, bizKey string) ([]uuid.UUID, error) {
	if err := dbhandle.RequireArg("outbox", "tx", "the caller's transaction (a *sql.Tx)", tx); err != nil {
		return nil, err
	}
	return cancelBizKey(bizKey, func() ([]uuid.UUID, error) { return c.q.CancelScheduledBizKeySQL(ctx, tx, bizKey) },
		func() (string, error) { return c.q.ScheduledBizKeyStateSQL(ctx, tx, bizKey) })
}

// RescheduleBizKeySQLTx is RescheduleBizKeyTx for database/sql: it moves to at, inside tx, the
// delivery time of every scheduled message whose BizKey is bizKey and returns their ids; as
// CancelBizKeySQLTx and RescheduleSQLTx.
func (c *Client) RescheduleBizKeySQLTx(ctx context.Context, tx txoutbox.SQLDBTX, bizKey string, at time.Time) ([]uuid.UUID, error) {
	if err := dbhandle.RequireArg("outbox", "tx", "the caller's transaction (a *sql.Tx)", tx); err != nil {
		return nil, err
	}
	return rescheduleBizKey(bizKey, at, func(at time.Time) ([]uuid.UUID, error) { return c.q.RescheduleScheduledBizKeySQL(ctx, tx, bizKey, at) },
		func() (string, error) { return c.q.ScheduledBizKeyStateSQL(ctx, tx, bizKey) })
}

// NewPostgresSQLDoorbell is NewPostgresDoorbell for database/sql: the doorbell notifies
// channel (DefaultDoorbellChannel when empty) through db, the producer's *sql.DB. It refuses
// what NewPostgresDoorbell refuses: a nil db, one transaction or connection (a *sql.Tx, a
// *sql.Conn) and a bad channel (see PostgresDoorbell.Err).
func NewPostgresSQLDoorbell(db txoutbox.SQLDBTX, channel string) *PostgresDoorbell {
	d := newPostgresDoorbell(db, "NewPostgresSQLDoorbell", channel)
	if d.err == nil {
		d.notify = func(ctx context.Context, channel string) error { return store.NotifySQL(ctx, db, channel) }
	}
	return d
}
