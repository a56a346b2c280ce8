package consumer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/dbhandle"
	"github.com/txoutbox/txoutbox/internal/store"
)

// DefaultBatchHandlerSize is Config.BatchSize's default for a consumer made with NewBatch.
// A batch handler runs without savepoints, so the 64-savepoint advice of Config.BatchSize does
// not apply to it.
const DefaultBatchHandlerSize = 100

// BatchHandler applies the business effects of a batch of messages in tx, the consumer's
// transaction, with set-based SQL (UPDATE … FROM unnest(…), COPY, INSERT … SELECT). When it
// runs, tx already holds the dedup rows of every message of msgs, recorded in one statement;
// msgs holds only messages seen for the first time (duplicates were acked and left out, and
// no two share an idempotency key), in delivery order. It must not commit or roll back tx
// (those calls return ErrTxControl).
//
// Returning nil commits the batch. Returning an error rolls it all back (nothing of it is
// applied), and the consumer finds the message at fault by handling the batch again in
// smaller transactions (see NewBatch): return a *BatchError to name that message yourself,
// which spares the search. Wrap an error with Permanent to dead-letter the message at fault
// at once when it is handled alone.
//
// The handler can run several times for one delivery of a message (see NewBatch): keep every
// side effect inside tx. Each call gets its own copy of every message's Payload and Headers.
type BatchHandler func(ctx context.Context, tx pgx.Tx, msgs []Message) error

// BatchError is what a BatchHandler returns to name the message that made the batch fail:
// msgs[Index] fails with Err, and only it counts the attempt (retried with backoff, or
// dead-lettered when Err is Permanent or its deliveries are used up); the other messages are
// handled again at once, in a new transaction, without it.
type BatchError struct {
	Index int   // the index in the batch handler's msgs
	Err   error // the message's error; Permanent dead-letters it at once
}

func (e *BatchError) Error() string {
	return fmt.Sprintf("consumer: message %d of the batch: %v", e.Index, e.Err)
}

func (e *BatchError) Unwrap() error { return e.Err }

// errBatchIndex: a BatchHandler returned a *BatchError whose Index is outside its batch, or
// whose Err is nil; the batch is treated as failed without a named message.
var errBatchIndex = errors.New("consumer: BatchError names no message of the batch")

// NewBatch returns a consumer of cfg.Stream that applies messages in batches with handler, in
// transactions begun on db; like New otherwise. Config.BatchSize bounds the batch and
// defaults to DefaultBatchHandlerSize here.
//
// For each batch the consumer, in one transaction: records the dedup rows of all its messages
// in one statement; acks and leaves out the messages already processed (and any message whose
// idempotency key comes earlier in the same batch); runs handler once with the rest; commits;
// then acks them (in the background: the worker goes on with its next batch meanwhile, and Run
// waits for these acks before it returns). When handler fails, the transaction is rolled back — nothing of it is
// applied — and the batch is split: a *BatchError's message fails alone and the others run
// again as one batch without it; any other error splits the batch in halves, each handled
// again (dedup rows included) in a transaction of its own, down to a message handled alone.
// Only a message that fails alone counts an attempt, so a poison message is retried and
// dead-lettered by itself, as in per-message mode, while the others commit once. When the
// server refuses a batch's commit (a deferred constraint, a serialization failure), each of
// its messages is handled again on its own, in its own transaction.
//
// So in one delivery, the handler runs with a given message in its batch up to
// 1 + ⌈log₂ BatchSize⌉ times when its errors name no message, once more for every other
// message it names with a *BatchError, and once more, alone, when a commit is refused; yet
// only one of these transactions commits. Everything it does must therefore stay inside tx:
// nothing it does outside the transaction is undone with it.
//
// Malformed messages, messages out of deliveries, and, in ordered mode (Config.Ordered),
// keyed messages are handled one per transaction: handler gets a batch of one.
//
// db must be safe for concurrent use, as New's: one connection or transaction is refused with
// a *txoutbox.ConfigError naming db.
func NewBatch(db txoutbox.Beginner, js jetstream.JetStream, handler BatchHandler, cfg *Config) (*Consumer, error) {
	if err := dbhandle.RequireArg("consumer", "handler", "the function that applies a batch", handler); err != nil {
		return nil, err
	}
	c := Config{}
	if cfg != nil {
		c = *cfg
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchHandlerSize
	}
	cons, err := New(db, js, oneOfBatch(handler), &c)
	if err != nil {
		return nil, err
	}
	cons.batchHandler = handler
	return cons, nil
}

// oneOfBatch runs a batch handler on a batch of one message, for the paths that handle
// messages one per transaction. A *BatchError naming the message stands for its error.
func oneOfBatch(h BatchHandler) Handler {
	return func(ctx context.Context, tx pgx.Tx, msg Message) error {
		err := h(ctx, tx, []Message{msg})
		var be *BatchError
		if errors.As(err, &be) && be.Index == 0 && be.Err != nil {
			return be.Err
		}
		return err
	}
}

// stateRepeat: the message's idempotency key comes earlier in the same batch.
const stateRepeat batchState = 100

// handleSetBatch runs a batch with the batch handler (see NewBatch).
func (c *Consumer) handleSetBatch(ctx context.Context, items []*item) []result {
	results := make([]result, len(items))
	live := make([]int, 0, len(items))
	for i, it := range items {
		switch {
		case it.bad != nil:
			results[i] = c.deadLetter(ctx, it, DeadReasonMalformed, it.bad)
		case it.attempt() > c.cfg.MaxDeliveries:
			results[i] = c.handle(ctx, it) // a duplicate, or dead-lettered as exhausted
		default:
			it.msg.Delivery = it.attempt()
			live = append(live, i)
		}
	}
	c.runSet(ctx, items, live, results)
	return results
}

// runSet handles items[live] in one transaction with the batch handler, or splits them when it
// fails.
func (c *Consumer) runSet(ctx context.Context, items []*item, live []int, results []result) {
	if len(live) == 0 {
		return
	}
	putBack := func(op string, err error) {
		for _, i := range live {
			results[i] = c.unavailable(ctx, items[i], op, err)
		}
	}
	tx, err := c.db.Begin(ctx)
	if err != nil {
		putBack("begin", err)
		return
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()

	states := make([]batchState, len(items))
	first := make(map[string]bool, len(live))
	rows := make([]store.DedupRow, 0, len(live))
	for _, i := range live {
		k := items[i].msg.IdempotencyKey
		if first[k] {
			states[i] = stateRepeat
			continue
		}
		first[k] = true
		rows = append(rows, items[i].dedupRow(c.cfg.Durable))
	}
	inserted, err := c.q.InsertDedupMany(ctx, tx, c.cfg.Durable, rows)
	if err != nil {
		putBack("dedup insert", err)
		return
	}
	c.pgUp()
	fresh := make([]int, 0, len(rows))
	msgs := make([]Message, 0, len(rows))
	for _, i := range live {
		switch {
		case states[i] != 0:
		case inserted[items[i].msg.IdempotencyKey]:
			states[i] = stateOK
			fresh = append(fresh, i)
			msgs = append(msgs, items[i].msg.handlerCopy()) // each run its own (see handlerCopy)
		default:
			states[i] = stateDuplicate
		}
	}
	if len(fresh) > 0 {
		if herr := c.callBatchHandler(ctx, tx, msgs); herr != nil {
			if broken(ctx, tx) {
				putBack("handler", herr)
				return
			}
			_ = tx.Rollback(ctx)
			c.splitSet(ctx, items, live, states, fresh, herr, results)
			return
		}
	}
	for _, i := range live {
		if states[i] == stateRepeat {
			states[i] = stateDuplicate // its key's first message committed with this batch
		}
	}
	c.commitBatch(ctx, tx, items, live, states, make([]error, len(items)), results)
}

// splitSet follows a batch handler failure, its transaction rolled back: the messages found
// already processed are acked, the message the handler named (or the only one that ran) fails
// alone, and the others are handled again — without it, or in halves.
func (c *Consumer) splitSet(ctx context.Context, items []*item, live []int, states []batchState, fresh []int, herr error, results []result) {
	rest := make([]int, 0, len(live))
	var dups []*item
	for _, i := range live {
		if states[i] == stateDuplicate {
			// Processed by a committed transaction (an insert conflicting with an uncommitted
			// one waits for it): acked now.
			results[i] = result{outcome: outcomeDuplicate}
			c.countDuplicate()
			dups = append(dups, items[i])
			continue
		}
		rest = append(rest, i)
	}
	var wg sync.WaitGroup
	for _, it := range dups {
		wg.Add(1)
		go func() { defer wg.Done(); c.ack(ctx, it) }()
	}
	defer wg.Wait()

	culprit, cerr := -1, herr
	var be *BatchError
	switch {
	case errors.As(herr, &be) && be.Index >= 0 && be.Index < len(fresh) && be.Err != nil:
		culprit, cerr = fresh[be.Index], be.Err
	case errors.As(herr, &be):
		herr = fmt.Errorf("%w (index %d of %d, error %v): %w", errBatchIndex, be.Index, len(fresh), be.Err, herr)
		cerr = herr
		if len(fresh) == 1 {
			culprit = fresh[0]
		}
	case len(fresh) == 1:
		culprit = fresh[0]
	}
	if culprit >= 0 {
		results[culprit] = c.failed(ctx, items[culprit], cerr)
		others := rest[:0:0]
		for _, i := range rest {
			if i != culprit {
				others = append(others, i)
			}
		}
		c.runSet(ctx, items, others, results)
		return
	}
	c.log.Debug("batch handler failed; splitting the batch", "messages", len(fresh), "err", herr)
	half := len(rest) / 2
	c.runSet(ctx, items, rest[:half], results)
	c.runSet(ctx, items, rest[half:], results)
}

// callBatchHandler runs the batch handler like callHandler runs the per-message one.
func (c *Consumer) callBatchHandler(ctx context.Context, tx pgx.Tx, msgs []Message) (err error) {
	start := time.Now()
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: %v", errHandlerPanic, r)
		}
		c.observeHandler(time.Since(start))
	}()
	err = c.batchHandler(ctx, handlerTx{tx}, msgs)
	if err == nil && tx.Conn().PgConn().TxStatus() == 'E' {
		err = errTxAborted
	}
	return err
}

// ackBehind sends the acks of a committed batch in the background, so that the worker goes on
// with its next batch meanwhile, and reports true; Run waits for them before it returns. Only
// with a batch handler, and only for messages Run's dispatcher holds (a message released
// before its ack lands is safe: its dedup row is committed, so a redelivery is a duplicate).
func (c *Consumer) ackBehind(ctx context.Context, toAck []*item) bool {
	if c.batchHandler == nil {
		return false
	}
	for _, it := range toAck {
		if !it.managed {
			return false
		}
	}
	c.acksBehind.Add(len(toAck))
	for _, it := range toAck {
		go func() { defer c.acksBehind.Done(); c.ack(ctx, it) }()
	}
	return true
}
