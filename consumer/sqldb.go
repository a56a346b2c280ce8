package consumer

// The consumer over database/sql, for services whose whole data layer is database/sql.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/dbhandle"
	"github.com/txoutbox/txoutbox/internal/store"
)

// SQLHandler is Handler for database/sql: it applies one message's business effect in tx,
// the consumer's transaction, which already holds the message's dedup row. sqlx users wrap
// it (&sqlx.Tx{Tx: tx, Mapper: db.Mapper}, with $n placeholders); GORM users open a session
// on it (gorm.Open(postgres.New(postgres.Config{Conn: tx}))). It must not commit or roll back tx:
// a *sql.Tx cannot refuse, so if it does, the consumer's commit fails with sql.ErrTxDone and
// the message is retried as a handler failure wrapping ErrTxControl (a redelivery after a
// commit the handler made finds the dedup row and is skipped). Returning an error rolls
// everything back and schedules a retry; wrap it with Permanent to dead-letter the message at
// once. msg.Payload and msg.Headers are this call's own copy.
type SQLHandler func(ctx context.Context, tx *sql.Tx, msg Message) error

// NewSQL returns a consumer of cfg.Stream that runs handler for each message in a
// transaction begun on db, a *sql.DB of any driver that speaks to PostgreSQL (pgx's stdlib
// driver and lib/pq are tested); like New otherwise. cfg.Stream and cfg.Durable are required.
//
// The guarantees are New's: for each message, in one transaction, the dedup row is inserted
// (a conflict is a duplicate: acked, handler skipped), the handler runs, the transaction
// commits, and only then is the message acked; a handler error rolls back the effect and the
// dedup row together and naks the message with backoff, up to the dead letters. A handler
// that returns nil after a statement of tx failed (the transaction is aborted) makes the
// commit fail: the message is retried as a handler failure whose error says "the handler
// returned nil but its transaction is aborted". When a commit fails, the consumer asks the
// same connection whether it is alive: if it answers, the commit was refused (a handler
// failure, an attempt counted); if not, the outcome is unknown and the message is put back
// without counting an attempt, never acked.
//
// Config.Ordered works as with New: the key's applied sequence is locked, checked and
// advanced in the same database/sql transaction as the dedup row and the handler's effect.
// A consumer made with NewSQL handles one message per transaction: Config.BatchSize above 1
// needs New or NewBatch (pgx) and is refused with a *txoutbox.ConfigError.
func NewSQL(db *sql.DB, js jetstream.JetStream, handler SQLHandler, cfg *Config) (*Consumer, error) {
	if err := dbhandle.RequireArg("consumer", "db", "a *sql.DB", db); err != nil {
		return nil, err
	}
	if err := dbhandle.RequireArg("consumer", "handler", "the function that applies a message", handler); err != nil {
		return nil, err
	}
	if cfg != nil && cfg.BatchSize > 1 {
		return nil, &txoutbox.ConfigError{Package: "consumer", Field: "Config.BatchSize",
			Reason: fmt.Sprintf("must be 1 for a consumer made with NewSQL, which handles each message in its own transaction, got %d (batch mode needs New or NewBatch on pgx)", cfg.BatchSize)}
	}
	// New builds everything else; the pgx side (db, handler) is never used in database/sql
	// mode and fails loudly if it ever were.
	c, err := New(noPgx{}, js, func(context.Context, pgx.Tx, Message) error { return errNoPgx }, cfg)
	if err != nil {
		return nil, err
	}
	c.sqlDB, c.sqlHandler = db, handler
	return c, nil
}

// errNoPgx: a path of the pgx consumer ran in a consumer made with NewSQL.
var errNoPgx = errors.New("consumer: internal error: a consumer made with NewSQL has no pgx pool")

// noPgx is the pgx Beginner of a consumer made with NewSQL.
type noPgx struct{}

func (noPgx) Begin(context.Context) (pgx.Tx, error) { return nil, errNoPgx }

// handleSQL is handle for a consumer made with NewSQL: the dedup row, the handler and the
// commit in one database/sql transaction, then the ack.
func (c *Consumer) handleSQL(ctx context.Context, it *item) result {
	if it.bad != nil {
		return c.deadLetter(ctx, it, DeadReasonMalformed, it.bad)
	}
	it.msg.Delivery = it.attempt()
	guarded := c.guarded(it)
	if guarded {
		if err := c.order.complete(ctx, it.msg.StreamSeq); err != nil {
			return c.unavailable(ctx, it, opOrderScan, err)
		}
	}
	// One connection for the transaction and, after a failed commit, the question whether it
	// is alive. It goes back to the pool before what follows the transaction (a dead letter
	// of a keyed message advances its key in a transaction of its own): a handling holds one
	// connection at a time, so a pool of Concurrency connections is enough.
	conn, err := c.sqlDB.Conn(ctx)
	if err != nil {
		return c.unavailable(ctx, it, "begin", err)
	}
	r, then := c.handleSQLConn(ctx, it, conn, guarded)
	_ = conn.Close()
	if then != nil {
		return then()
	}
	return r
}

// handleSQLConn is handleSQL's transaction on conn. It returns the outcome, or what to do once
// conn is back in the pool (the message failed or goes to the dead letters).
func (c *Consumer) handleSQLConn(ctx context.Context, it *item, conn *sql.Conn, guarded bool) (result, func() result) {
	failed := func(err error) func() result { return func() result { return c.failed(ctx, it, err) } }
	tx, err := conn.BeginTx(ctx, nil)
	if err != nil {
		return c.unavailable(ctx, it, "begin", err), nil
	}
	defer func() { _ = tx.Rollback() }()
	if guarded {
		// checkTurn's own dead letter (out of order) comes after sqlTurn's rollback, which
		// gives conn back.
		if r, done := c.checkTurn(ctx, sqlTurn{c.q, tx, conn}, it); done {
			return r, nil
		}
	}
	inserted, err := c.q.InsertDedupSQL(ctx, tx, it.dedupRow(c.cfg.Durable))
	if err == nil && guarded {
		// Its turn: the key's new applied sequence with the dedup row. A duplicate moves the
		// key past it too, or the key's later messages would wait for it.
		err = c.q.AdvanceKeyOrderSQL(ctx, tx, c.cfg.Durable, it.msg.Stream, it.orderKey, it.msg.StreamSeq)
	}
	if err != nil {
		return c.unavailable(ctx, it, "dedup insert", err), nil
	}
	c.pgUp()
	if !inserted {
		if guarded {
			if err := tx.Commit(); err != nil {
				return c.unavailable(ctx, it, "commit", err), nil
			}
			c.order.settled(it.orderKey, it.msg.StreamSeq)
		}
		_ = tx.Rollback()
		c.countDuplicate()
		c.ack(ctx, it)
		return result{outcome: outcomeDuplicate}, nil
	}
	if it.attempt() > c.cfg.MaxDeliveries {
		_ = tx.Rollback()
		return result{}, func() result {
			return c.deadLetter(ctx, it, DeadReasonExhausted,
				fmt.Errorf("%w: delivered %d times without an outcome", errDeliveriesExhausted, it.attempt()-1))
		}
	}
	if herr := c.callSQLHandler(ctx, tx, it); herr != nil {
		// A rollback the server answers means the session is alive: the message failed.
		rerr := tx.Rollback()
		if ctx.Err() != nil || (rerr != nil && !errors.Is(rerr, sql.ErrTxDone)) {
			return c.unavailable(ctx, it, "handler", herr), nil
		}
		return result{}, failed(herr)
	}
	if h := c.hooks.beforeCommit; h != nil {
		h(ctx)
	}
	if err := tx.Commit(); err != nil {
		switch {
		case ctx.Err() != nil:
			return c.unavailable(ctx, it, "commit", err), nil
		case errors.Is(err, sql.ErrTxDone):
			// The handler committed or rolled back tx itself.
			return result{}, failed(fmt.Errorf("%w: commit: %w", ErrTxControl, err))
		case store.SQLState(err) != "":
			if sqlRejected(err) {
				// A deferred constraint, a serialization failure: the server rolled back.
				return result{}, failed(fmt.Errorf("commit: %w", err))
			}
			return c.unavailable(ctx, it, "commit", err), nil
		case store.Alive(ctx, conn) == nil:
			// The driver refused the commit of an aborted transaction (pgx's stdlib
			// pgx.ErrTxCommitRollback, lib/pq's ErrInFailedTransaction) on a live session.
			return result{}, failed(fmt.Errorf("%w: commit: %w", errTxAborted, err))
		default:
			// The outcome is unknown: never ack. If it committed, the redelivery finds the
			// dedup row.
			return c.unavailable(ctx, it, "commit", err), nil
		}
	}
	if guarded {
		c.order.settled(it.orderKey, it.msg.StreamSeq)
	}
	c.countProcessed(1)
	if h := c.hooks.afterCommit; h != nil && h(ctx, []Message{it.msg}) != nil {
		return result{outcome: outcomeProcessed}, nil
	}
	c.ack(ctx, it)
	return result{outcome: outcomeProcessed}, nil
}

// sqlTurn is checkTurn's transaction in a consumer made with NewSQL; its rollback also gives
// the transaction's connection back to the pool, before checkTurn's dead letter needs one.
type sqlTurn struct {
	q    *store.Queries
	tx   *sql.Tx
	conn *sql.Conn
}

func (t sqlTurn) lockKeyOrder(ctx context.Context, consumer, stream, key string) (uint64, error) {
	return t.q.LockKeyOrderSQL(ctx, t.tx, consumer, stream, key)
}

func (t sqlTurn) insertDedup(ctx context.Context, r store.DedupRow) (bool, error) {
	return t.q.InsertDedupSQL(ctx, t.tx, r)
}

func (t sqlTurn) rollback(context.Context) {
	_ = t.tx.Rollback()
	_ = t.conn.Close()
}

// advanceKeySQL is advanceKeyTx for a consumer made with NewSQL.
func (c *Consumer) advanceKeySQL(ctx context.Context, it *item) error {
	tx, err := c.sqlDB.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	if err := c.q.AdvanceKeyOrderSQL(ctx, tx, c.cfg.Durable, it.msg.Stream, it.orderKey, it.msg.StreamSeq); err != nil {
		return err
	}
	return tx.Commit()
}

// callSQLHandler runs the database/sql handler, turning a panic into an error.
func (c *Consumer) callSQLHandler(ctx context.Context, tx *sql.Tx, it *item) (err error) {
	start := time.Now()
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: %v", errHandlerPanic, r)
		}
		c.observeHandler(time.Since(start))
	}()
	return c.sqlHandler(it.spanCtx(ctx), tx, it.msg.handlerCopy())
}

// sqlRejected is rejected for any driver whose errors carry the SQLSTATE: the server answered
// the commit with an error (so it rolled back), as opposed to a failure of the connection,
// the server's resources or the server itself, after which the outcome is unknown.
func sqlRejected(err error) bool {
	code := store.SQLState(err)
	if len(code) < 2 {
		return false
	}
	switch code[:2] {
	case "08", "53", "57", "58", "XX":
		return false
	}
	return true
}
