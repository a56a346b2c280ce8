package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/cmdline"
	"github.com/txoutbox/txoutbox/internal/safetext"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/outbox"
)

// Headers of a dead letter. The original message's headers and payload are kept, except the
// Nats-* headers: its Nats-Msg-Id moves to HeaderDeadMsgID, and the dead letter gets its own
// (consumer:stream:sequence) so that a dead letter published twice is stored once.
const (
	HeaderDeadConsumer = "Txoutbox-Dead-Consumer" // the durable name
	// HeaderDeadReason says why the message was dead-lettered: DeadReasonFailed,
	// DeadReasonPermanent, DeadReasonMalformed, DeadReasonExhausted or DeadReasonOutOfOrder.
	HeaderDeadReason     = "Txoutbox-Dead-Reason"
	HeaderDeadError      = "Txoutbox-Dead-Error"      // the last error (one line, at most 1 KiB)
	HeaderDeadDeliveries = "Txoutbox-Dead-Deliveries" // attempts made
	HeaderDeadSubject    = "Txoutbox-Dead-Subject"    // the original subject
	HeaderDeadStream     = "Txoutbox-Dead-Stream"     // the original stream
	HeaderDeadStreamSeq  = "Txoutbox-Dead-Stream-Seq" // the original stream sequence
	HeaderDeadMsgID      = "Txoutbox-Dead-Msg-Id"     // the original Nats-Msg-Id
	HeaderDeadAt         = "Txoutbox-Dead-At"         // RFC 3339 time of the dead-lettering
	// HeaderDeadPayloadDropped is "true" when the payload had to be left out because the
	// dead letter would exceed the server's maximum payload: a message within the dead
	// letter's added headers (up to outbox.DeadLetterHeaderReserve) of max_payload. Its
	// headers are kept, and the original payload stays in the stream at HeaderDeadStreamSeq
	// for as long as the stream keeps it.
	HeaderDeadPayloadDropped = "Txoutbox-Dead-Payload-Dropped"
	// HeaderDeadHeadersDropped, when present, is the number of the original's header values
	// left out of the dead letter (the largest first) because its header block would
	// otherwise exceed what JetStream stores (outbox.JetStreamMaxHeaderBytes). It never
	// happens to a message package outbox accepted: its limit, outbox.MaxHeaderBytes, leaves
	// outbox.DeadLetterHeaderReserve for the Txoutbox-Dead-* headers.
	HeaderDeadHeadersDropped = "Txoutbox-Dead-Headers-Dropped"
)

// Values of HeaderDeadReason; HeaderDeadError carries the error behind each.
const (
	// DeadReasonFailed: the handler failed MaxDeliveries times (a panic is a failure, and so
	// is a nil return from a handler whose transaction is aborted).
	DeadReasonFailed = "failed"
	// DeadReasonPermanent: the handler returned a Permanent error.
	DeadReasonPermanent = "permanent"
	// DeadReasonMalformed: the message could not be decoded: no idempotency key (neither
	// Txoutbox-Biz-Key nor Nats-Msg-Id), an ambiguous one (several different values), an
	// empty Nats-Msg-Id, Txoutbox-Key or Txoutbox-Biz-Key, one PostgreSQL cannot store (longer
	// than outbox.MaxKeyLength, the producers' bound, or not valid text; in ordered mode the
	// Txoutbox-Key too), or no JetStream metadata. It is dead-lettered at once.
	DeadReasonMalformed = "malformed"
	// DeadReasonExhausted: the message arrived after MaxDeliveries deliveries without an
	// outcome (earlier deliveries timed out: a crashed or stuck consumer).
	DeadReasonExhausted = "exhausted"
	// DeadReasonOutOfOrder: in ordered mode, the message arrived after a later message of its
	// key was applied, and no dedup row says it was applied itself. It is dead-lettered,
	// never applied out of order nor dropped. It happens only when the dedup row was purged
	// before the message's last redelivery, when the stream lost the message while it was in
	// flight, or when the stream was recreated (its sequences start again) without deleting
	// the durable's rows of txoutbox_consumer_key_order.
	DeadReasonOutOfOrder = "out-of-order"
)

const (
	opDeadLetter   = "dead-letter publish"
	maxErrorHeader = 1024
	ackTimeout     = 5 * time.Second
)

type outcome uint8

const (
	outcomeProcessed    outcome = iota + 1 // committed (and acked, unless a test hook stopped it)
	outcomeDuplicate                       // already processed: acked, handler skipped
	outcomeRetry                           // handler failed: nak'ed with a delay
	outcomeRetryLocal                      // handler failed (ordered key): retry in place after delay
	outcomeDeadLettered                    // published to the dead-letter subject and terminated
	outcomeUnavailable                     // Postgres or NATS failed: put back after delay, no attempt counted
	outcomeWaiting                         // an earlier message of its key is unsettled: put back after delay, no attempt counted
	outcomeStopped                         // the stop timeout cancelled its handling: nak'ed at once, no attempt counted, no outage
)

func (o outcome) String() string {
	return [...]string{"?", "processed", "duplicate", "retry", "retry-local", "dead-lettered", "unavailable", "waiting", "stopped"}[o]
}

// result is what happened to one message.
type result struct {
	outcome outcome
	delay   time.Duration // before the retry, for the retry outcomes
	err     error         // the handler's or the infrastructure's error
	reason  string        // the DeadReason, for outcomeDeadLettered
}

// handleOne handles one delivered message in its own transaction, outside any dispatcher
// (a failed keyed message is nak'ed even in ordered mode; an unavailable outcome leaves the
// message to JetStream's ack timeout). Tests drive the consumer's logic with it.
func (c *Consumer) handleOne(ctx context.Context, raw jetstream.Msg) result {
	return c.handle(ctx, newItem(raw, false))
}

// handle runs the per-message mode: dedup row, handler and commit in one transaction, then
// the ack.
func (c *Consumer) handle(ctx context.Context, it *item) result {
	if c.sqlDB != nil {
		return c.handleSQL(ctx, it) // NewSQL: database/sql mode (sqldb.go)
	}
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
	tx, err := c.db.Begin(ctx)
	if err != nil {
		return c.unavailable(ctx, it, "begin", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if guarded {
		if r, done := c.checkTurn(ctx, pgxTurn{c.q, tx}, it); done {
			return r
		}
	}
	var inserted bool
	if guarded {
		// Its turn: the dedup row and the key's new applied sequence in one round trip. A
		// duplicate moves the key past it too, or the key's later messages would wait for it.
		inserted, err = c.insertDedupAdvance(ctx, tx, it)
	} else {
		inserted, err = c.q.InsertDedup(ctx, tx, it.dedupRow(c.cfg.Durable))
	}
	if err != nil {
		return c.unavailable(ctx, it, "dedup insert", err)
	}
	c.pgUp()
	if !inserted {
		if guarded {
			if err := tx.Commit(ctx); err != nil {
				return c.unavailable(ctx, it, "commit", err)
			}
			c.order.settled(it.orderKey, it.msg.StreamSeq)
		}
		_ = tx.Rollback(ctx)
		c.countDuplicate()
		c.ack(ctx, it)
		return result{outcome: outcomeDuplicate}
	}
	if it.attempt() > c.cfg.MaxDeliveries {
		_ = tx.Rollback(ctx)
		return c.deadLetter(ctx, it, DeadReasonExhausted,
			fmt.Errorf("%w: delivered %d times without an outcome", errDeliveriesExhausted, it.attempt()-1))
	}
	if herr := c.callHandler(ctx, tx, it); herr != nil {
		isBroken := broken(ctx, tx) // before the rollback hands the connection back to the pool
		_ = tx.Rollback(ctx)
		if isBroken {
			return c.unavailable(ctx, it, "handler", herr)
		}
		return c.failed(ctx, it, herr)
	}
	if h := c.hooks.beforeCommit; h != nil {
		h(ctx)
	}
	if err := tx.Commit(ctx); err != nil {
		if rejected(err) {
			// The server refused the commit (a deferred constraint, a serialization failure):
			// it rolled back, and the message failed like a handler error.
			return c.failed(ctx, it, fmt.Errorf("commit: %w", err))
		}
		// The outcome is unknown (the commit may have happened): never ack. If it did commit,
		// the redelivery finds the dedup row.
		return c.unavailable(ctx, it, "commit", err)
	}
	if guarded {
		c.order.settled(it.orderKey, it.msg.StreamSeq)
	}
	c.countProcessed(1)
	if h := c.hooks.afterCommit; h != nil && h(ctx, []Message{it.msg}) != nil {
		return result{outcome: outcomeProcessed}
	}
	c.ack(ctx, it)
	return result{outcome: outcomeProcessed}
}

// batchState is where one message of a batch stands before the commit.
type batchState uint8

const (
	stateOK batchState = iota + 1
	stateDuplicate
	stateFailed
	stateExhausted
)

// handleBatch runs the batch mode: one transaction for the batch, one commit, then the acks
// (in parallel) and the naks or dead letters of the messages that failed. It first tries the
// fast path (every dedup row in one statement, the handlers one after another, no savepoints);
// if a handler fails there, that transaction is rolled back — nothing of it is applied — and
// the batch is handled again with a savepoint per message, so that a failing message rolls
// back only its own savepoint, its dedup row included. The other messages' handlers thus run
// twice, and all of them run again (one transaction each) when the batch commit is refused.
func (c *Consumer) handleBatch(ctx context.Context, items []*item) []result {
	if c.batchHandler != nil {
		return c.handleSetBatch(ctx, items)
	}
	results := make([]result, len(items))
	live := make([]int, 0, len(items))
	for i, it := range items {
		if it.bad != nil {
			results[i] = c.deadLetter(ctx, it, DeadReasonMalformed, it.bad)
			continue
		}
		it.msg.Delivery = it.attempt()
		live = append(live, i)
	}
	if len(live) == 0 {
		return results
	}
	done, failed, ferr := c.fastBatch(ctx, items, live, results)
	if done {
		return results
	}
	return c.savepointBatch(ctx, items, live, results, failed, ferr)
}

// fastBatch is handleBatch's fast path. It reports done=false, having applied nothing, when
// the batch needs the savepoint path: a message is out of deliveries (failed = -1), or the
// handler of items[failed] returned ferr — that message counts as failed without running its
// handler again; the handlers of the others run again in the savepoint path.
func (c *Consumer) fastBatch(ctx context.Context, items []*item, live []int, results []result) (done bool, failed int, ferr error) {
	for _, i := range live {
		if items[i].attempt() > c.cfg.MaxDeliveries {
			return false, -1, nil
		}
	}
	putBack := func(op string, err error) (bool, int, error) {
		for _, i := range live {
			results[i] = c.unavailable(ctx, items[i], op, err)
		}
		return true, -1, nil
	}
	tx, err := c.db.Begin(ctx)
	if err != nil {
		return putBack("begin", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()

	states := make([]batchState, len(items))
	first := make(map[string]bool, len(live))
	rows := make([]store.DedupRow, 0, len(live))
	for _, i := range live {
		k := items[i].msg.IdempotencyKey
		if first[k] {
			states[i] = stateDuplicate // the same key twice in one batch
			continue
		}
		first[k] = true
		rows = append(rows, items[i].dedupRow(c.cfg.Durable))
	}
	inserted, err := c.q.InsertDedupMany(ctx, tx, c.cfg.Durable, rows)
	if err != nil {
		return putBack("dedup insert", err)
	}
	for _, i := range live {
		if states[i] != 0 {
			continue
		}
		if !inserted[items[i].msg.IdempotencyKey] {
			states[i] = stateDuplicate
			continue
		}
		if herr := c.callHandler(ctx, tx, items[i]); herr != nil {
			if broken(ctx, tx) {
				return putBack("handler", herr)
			}
			return false, i, herr
		}
		states[i] = stateOK
	}
	c.commitBatch(ctx, tx, items, live, states, make([]error, len(items)), results)
	return true, -1, nil
}

// savepointBatch is handleBatch's careful path: a savepoint per message. items[failed] (when
// failed >= 0) already failed with ferr in the fast path: it is settled as failed without
// running its handler again.
func (c *Consumer) savepointBatch(ctx context.Context, items []*item, live []int, results []result, failed int, ferr error) []result {
	putBack := func(op string, err error, except int) []result {
		for _, i := range live {
			if i != except {
				results[i] = c.unavailable(ctx, items[i], op, err)
			}
		}
		return results
	}
	tx, err := c.db.Begin(ctx)
	if err != nil {
		return putBack("begin", err, -1)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()

	states := make([]batchState, len(items))
	errs := make([]error, len(items))
	savepoint := false
	for _, i := range live {
		it := items[i]
		if i == failed {
			states[i], errs[i] = stateFailed, ferr
			continue
		}
		// One round trip: release the previous message's savepoint, open this one's, insert
		// its dedup row.
		b := &pgx.Batch{}
		if savepoint {
			b.Queue(store.ReleaseSavepointSQL)
		}
		b.Queue(store.SavepointSQL)
		c.q.QueueInsertDedup(b, it.dedupRow(c.cfg.Durable))
		tag, err := execBatch(ctx, tx, b)
		if err != nil {
			return putBack("dedup insert", err, -1)
		}
		savepoint = true
		if tag.RowsAffected() == 0 {
			states[i] = stateDuplicate
			continue
		}
		if it.attempt() > c.cfg.MaxDeliveries {
			if _, err := tx.Exec(ctx, store.RollbackToSavepointSQL); err != nil {
				return putBack("rollback to savepoint", err, -1)
			}
			states[i] = stateExhausted
			continue
		}
		herr := c.callHandler(ctx, tx, it)
		if herr == nil {
			states[i] = stateOK
			continue
		}
		if broken(ctx, tx) {
			return putBack("handler", herr, -1)
		}
		if _, err := tx.Exec(ctx, store.RollbackToSavepointSQL); err != nil {
			// The transaction cannot go on: this message failed, the others go back.
			_ = tx.Rollback(ctx)
			results[i] = c.failed(ctx, it, herr)
			return putBack("rollback to savepoint", err, i)
		}
		states[i], errs[i] = stateFailed, herr
	}
	return c.commitBatch(ctx, tx, items, live, states, errs, results)
}

// commitBatch commits a batch transaction and settles each message by its state: acks for the
// processed and the duplicates, naks or dead letters for the others.
func (c *Consumer) commitBatch(ctx context.Context, tx pgx.Tx, items []*item, live []int, states []batchState, errs []error, results []result) []result {
	putBack := func(op string, err error, except int) []result {
		for _, i := range live {
			if i != except {
				results[i] = c.unavailable(ctx, items[i], op, err)
			}
		}
		return results
	}
	if h := c.hooks.beforeCommit; h != nil {
		h(ctx)
	}
	if err := tx.Commit(ctx); err != nil {
		if rejected(err) {
			// The server refused the commit (a deferred constraint, a serialization failure):
			// nothing was applied and no message is known to be the culprit, so each one is
			// handled again on its own, in its own transaction.
			c.log.Debug("batch commit refused; handling its messages one by one", "messages", len(live), "err", err)
			for _, i := range live {
				results[i] = c.handle(ctx, items[i])
			}
			return results
		}
		return putBack("commit", err, -1)
	}
	c.pgUp()

	var committed []Message
	var toAck []*item
	for _, i := range live {
		switch states[i] {
		case stateOK:
			results[i] = result{outcome: outcomeProcessed}
			committed = append(committed, items[i].msg)
			toAck = append(toAck, items[i])
		case stateDuplicate:
			results[i] = result{outcome: outcomeDuplicate}
			c.countDuplicate()
			toAck = append(toAck, items[i])
		}
	}
	c.countProcessed(len(committed))
	skipAcks := false
	if h := c.hooks.afterCommit; h != nil && h(ctx, committed) != nil {
		skipAcks = true
	}
	if !skipAcks && c.ackBehind(ctx, toAck) {
		skipAcks = true
	}
	if !skipAcks {
		var wg sync.WaitGroup
		for _, it := range toAck {
			wg.Add(1)
			go func() { defer wg.Done(); c.ack(ctx, it) }()
		}
		wg.Wait()
	}
	for _, i := range live {
		switch states[i] {
		case stateFailed:
			results[i] = c.failed(ctx, items[i], errs[i])
		case stateExhausted:
			results[i] = c.deadLetter(ctx, items[i], DeadReasonExhausted,
				fmt.Errorf("%w: delivered %d times without an outcome", errDeliveriesExhausted, items[i].attempt()-1))
		}
	}
	return results
}

// execBatch runs b on tx and returns the last statement's command tag.
func execBatch(ctx context.Context, tx pgx.Tx, b *pgx.Batch) (pgconn.CommandTag, error) {
	br := tx.SendBatch(ctx, b)
	var tag pgconn.CommandTag
	var err error
	for range b.Len() {
		if tag, err = br.Exec(); err != nil {
			break
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return tag, err
}

// handlerTx is the transaction the handler sees: everything but Commit and Rollback.
type handlerTx struct{ pgx.Tx }

func (handlerTx) Commit(context.Context) error   { return ErrTxControl }
func (handlerTx) Rollback(context.Context) error { return ErrTxControl }

// callHandler runs the handler, turning a panic into an error and a swallowed statement
// failure (the transaction is aborted though the handler returned nil) into errTxAborted.
func (c *Consumer) callHandler(ctx context.Context, tx pgx.Tx, it *item) (err error) {
	start := time.Now()
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: %v", errHandlerPanic, r)
		}
		c.observeHandler(time.Since(start))
	}()
	err = c.handler(it.spanCtx(ctx), handlerTx{tx}, it.msg.handlerCopy())
	if err == nil && tx.Conn().PgConn().TxStatus() == 'E' {
		err = errTxAborted
	}
	return err
}

// rejected reports whether the server answered a commit with an error (so it rolled back),
// as opposed to a lost connection, after which the outcome is unknown.
func rejected(err error) bool {
	if errors.Is(err, pgx.ErrTxCommitRollback) {
		return true
	}
	var pgErr *pgconn.PgError
	// SeverityUnlocalized: Severity is translated by the server's lc_messages ("FEHLER").
	if !errors.As(err, &pgErr) || cmp.Or(pgErr.SeverityUnlocalized, pgErr.Severity) != "ERROR" || len(pgErr.Code) < 2 {
		return false // FATAL or PANIC: the session is gone
	}
	switch pgErr.Code[:2] {
	case "08", "53", "57", "58", "XX": // connection, resources, operator intervention, system, internal
		return false
	}
	return true
}

// broken reports whether a handler error came from the infrastructure (a lost connection, a
// cancelled context) rather than from the message.
func broken(ctx context.Context, tx pgx.Tx) bool {
	return ctx.Err() != nil || tx.Conn().IsClosed()
}

// failed decides what follows a handler error: a delayed redelivery, an in-place retry
// (ordered keys), or the dead letters.
func (c *Consumer) failed(ctx context.Context, it *item, herr error) result {
	attempt := it.attempt()
	var perm *PermanentError
	if errors.As(herr, &perm) {
		return c.deadLetter(ctx, it, DeadReasonPermanent, herr)
	}
	if attempt >= c.cfg.MaxDeliveries {
		return c.deadLetter(ctx, it, DeadReasonFailed, herr)
	}
	delay := c.cfg.backoff(attempt)
	c.countRetry()
	if h := c.hooks.onRetry; h != nil {
		h(it.msg, delay)
	}
	c.log.Debug("handler failed; will retry", "subject", it.msg.Subject, "stream_seq", it.msg.StreamSeq,
		"idempotency_key", it.msg.IdempotencyKey, "attempt", attempt, "delay", delay, "err", herr)
	if it.orderKey != "" && it.managed {
		it.retries++
		return result{outcome: outcomeRetryLocal, delay: delay, err: herr}
	}
	if err := it.final(func() error { return it.raw.NakWithDelay(delay) }); err != nil {
		c.log.Debug("nak failed; the ack wait will redeliver", "stream_seq", it.msg.StreamSeq, "err", err)
	}
	return result{outcome: outcomeRetry, delay: delay, err: herr}
}

// unavailable puts a message back after a Postgres or NATS failure, without counting an
// attempt and without acking. A failure that is the cancellation of ctx (the stop timeout
// cancelled the handlers) is no outage: the message is stopped, neither counted nor logged.
func (c *Consumer) unavailable(ctx context.Context, it *item, op string, err error) result {
	if ctx.Err() != nil {
		return result{outcome: outcomeStopped, err: fmt.Errorf("%s: %w", op, err)}
	}
	it.outages++
	c.countUnavailable(1)
	down := &c.pgDown
	if op == opDeadLetter {
		down = &c.dlqDown
	}
	if !down.Swap(true) {
		if store.SQLState(err) == "42501" { // pgx's and lib/pq's errors alike
			// Waiting can fix it (a grant, a policy), and nothing is lost meanwhile: retried
			// the same, but the line says what to do.
			c.log.Warn("message put back: PostgreSQL refuses the consumer's role (a missing privilege, or a row-level security policy): grant what `"+
				cmdline.Command(c.cfg.Schema, "relay migrate grants --role consumer")+"` prints; retrying without counting an attempt", "op", op, "err", err)
		} else {
			c.log.Warn("message put back: the database or the broker failed; retrying without counting an attempt", "op", op, "err", err)
		}
	}
	delay := c.cfg.backoff(it.outages)
	return result{outcome: outcomeUnavailable, delay: delay, err: fmt.Errorf("%s: %w", op, err)}
}

// ack acks with server confirmation. A failure is counted, not retried: the message comes
// back and its dedup row makes it a duplicate.
func (c *Consumer) ack(ctx context.Context, it *item) {
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ackTimeout)
	defer cancel()
	if err := it.final(func() error { return it.raw.DoubleAck(actx) }); err != nil {
		c.stats.AckFailures.Add(1)
		c.log.Debug("ack not confirmed; the message will come back as a duplicate",
			"stream_seq", it.msg.StreamSeq, "err", err)
	}
}

// deadLetter publishes the message to the dead-letter subject and terminates it. What
// JetStream could never store is left out rather than retried forever, and the dead letter
// says so: the largest of the original's headers when the header block would exceed
// JetStream's limit (HeaderDeadHeadersDropped), the payload when the whole would exceed the
// server's max_payload or the dead-letter stream's max_msg_size (HeaderDeadPayloadDropped).
func (c *Consumer) deadLetter(ctx context.Context, it *item, reason string, cause error) result {
	out := nats.NewMsg(c.cfg.DeadLetterSubject)
	var copied []string // the original's header names, copied as they were
	for k, v := range it.raw.Headers() {
		if strings.HasPrefix(strings.ToLower(k), "nats-") {
			continue
		}
		k = escapeMsgIDText(k)
		out.Header[k] = append(out.Header[k], v...)
		copied = append(copied, k)
	}
	c.traceDeadLetter(ctx, it, out.Header)
	out.Header.Set(HeaderDeadConsumer, c.cfg.Durable)
	out.Header.Set(HeaderDeadReason, reason)
	out.Header.Set(HeaderDeadError, headerValue(cause.Error()))
	out.Header.Set(HeaderDeadDeliveries, strconv.Itoa(it.attempt()))
	out.Header.Set(HeaderDeadSubject, it.raw.Subject())
	if it.msg.Stream != "" {
		out.Header.Set(HeaderDeadStream, it.msg.Stream)
		out.Header.Set(HeaderDeadStreamSeq, strconv.FormatUint(it.msg.StreamSeq, 10))
	}
	if id := it.raw.Headers().Get(outbox.HeaderMsgID); id != "" {
		out.Header.Set(HeaderDeadMsgID, headerValue(id))
	}
	out.Header.Set(HeaderDeadAt, time.Now().UTC().Format(time.RFC3339Nano))
	for _, vs := range out.Header {
		for i, v := range vs {
			vs[i] = escapeMsgIDText(v)
		}
	}
	out.Data = it.raw.Data()
	if it.msg.Stream != "" {
		// The dead letter's own id, so that a dead letter published twice is stored once.
		out.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("%s:%s:%d", c.cfg.Durable, it.msg.Stream, it.msg.StreamSeq))
	}
	fitHeaders(out.Header, copied, outbox.JetStreamMaxHeaderBytes, false)
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ackTimeout)
	defer cancel()
	_, err := c.js.PublishMsg(pctx, out)
	// JetStream counts the header block otherwise than here: leave every copied header out.
	if isHeaderTooLarge(err) {
		fitHeaders(out.Header, copied, outbox.JetStreamMaxHeaderBytes, true)
		_, err = c.js.PublishMsg(pctx, out)
	}
	// Too big for the connection, or for the dead-letter stream's max_msg_size: send the
	// headers alone rather than retry the same publish forever.
	if errors.Is(err, nats.ErrMaxPayload) || errors.Is(err, jetstream.ErrStreamMessageExceedsMaximum) {
		out.Data = nil
		out.Header.Set(HeaderDeadPayloadDropped, "true")
		_, err = c.js.PublishMsg(pctx, out)
		if errors.Is(err, nats.ErrMaxPayload) || errors.Is(err, jetstream.ErrStreamMessageExceedsMaximum) {
			// A limit below the headers themselves: the Txoutbox-Dead-* headers alone.
			fitHeaders(out.Header, copied, outbox.JetStreamMaxHeaderBytes, true)
			_, err = c.js.PublishMsg(pctx, out)
		}
	}
	if err != nil {
		return c.unavailable(ctx, it, opDeadLetter, err)
	}
	if c.guarded(it) {
		// The dead letter stands in for the message: its key moves past it before the term,
		// or the key's later messages would wait for it forever. Had this failed, the message
		// comes back and is dead-lettered again (the dead letter's Nats-Msg-Id stores it once).
		if err := c.advanceKeyTx(ctx, it); err != nil {
			return c.unavailable(ctx, it, "key order update", err)
		}
		c.order.settled(it.orderKey, it.msg.StreamSeq)
	}
	if c.dlqDown.Load() && c.dlqDown.Swap(false) {
		c.log.Info("dead-letter publishing works again")
	}
	if err := it.final(func() error {
		if termTakesReason(c.js.Conn()) {
			return it.raw.TermWithReason(reason + ": " + headerValue(cause.Error()))
		}
		return it.raw.Term() // a server before 2.10.4 ignores a terminate with a reason
	}); err != nil {
		c.log.Debug("term failed; the message will come back and be dead-lettered again", "stream_seq", it.msg.StreamSeq, "err", err)
	}
	c.countDeadLettered(reason == DeadReasonMalformed)
	c.log.Warn("message dead-lettered", "reason", reason, "subject", it.raw.Subject(),
		"stream_seq", it.msg.StreamSeq, "attempts", it.attempt(), "dead_letter_subject", c.cfg.DeadLetterSubject, "err", cause)
	return result{outcome: outcomeDeadLettered, err: cause, reason: reason}
}

// headerBlockSize is the size of the header block NATS sends for h: "NATS/1.0\r\n", a
// "Name: value\r\n" line per value, and a final "\r\n" (an upper bound: NATS may trim values).
func headerBlockSize(h nats.Header) int {
	n := len("NATS/1.0\r\n") + len("\r\n")
	for k, vs := range h {
		for _, v := range vs {
			n += len(k) + len(": ") + len(v) + len("\r\n")
		}
	}
	return n
}

// fitHeaders leaves out of h the values of the copied header names, the largest line first,
// until h's header block is at most limit bytes (all of them when all is set), and records in
// HeaderDeadHeadersDropped how many values it left out.
func fitHeaders(h nats.Header, copied []string, limit int, all bool) {
	size := headerBlockSize(h)
	if size <= limit && !all {
		return
	}
	type line struct {
		name string
		i, n int
	}
	var lines []line
	for _, k := range copied {
		if deadLetterOwn[k] {
			continue // replaced by the dead letter's own value: never left out
		}
		for i, v := range h[k] {
			lines = append(lines, line{k, i, len(k) + len(": ") + len(v) + len("\r\n")})
		}
	}
	sort.SliceStable(lines, func(a, b int) bool { return lines[a].n > lines[b].n })
	drop := map[string]map[int]bool{}
	dropped := 0
	marker := len(HeaderDeadHeadersDropped) + len(": ") + 10 + len("\r\n")
	if prev := h.Get(HeaderDeadHeadersDropped); prev != "" { // a second pass: counted already
		dropped, _ = strconv.Atoi(prev)
		marker = 0
	}
	for _, l := range lines {
		if !all && size+marker <= limit {
			break
		}
		if drop[l.name] == nil {
			drop[l.name] = map[int]bool{}
		}
		drop[l.name][l.i] = true
		size -= l.n
		dropped++
	}
	for name, idx := range drop {
		var keep []string
		for i, v := range h[name] {
			if !idx[i] {
				keep = append(keep, v)
			}
		}
		if len(keep) == 0 {
			delete(h, name)
		} else {
			h[name] = keep
		}
	}
	if dropped > 0 {
		h.Set(HeaderDeadHeadersDropped, strconv.Itoa(dropped))
	}
}

// deadLetterOwn are the headers a dead letter sets itself.
var deadLetterOwn = map[string]bool{
	HeaderDeadConsumer: true, HeaderDeadReason: true, HeaderDeadError: true, HeaderDeadDeliveries: true,
	HeaderDeadSubject: true, HeaderDeadStream: true, HeaderDeadStreamSeq: true, HeaderDeadMsgID: true,
	HeaderDeadAt: true, HeaderDeadPayloadDropped: true, HeaderDeadHeadersDropped: true, jetstream.MsgIDHeader: true,
}

// isHeaderTooLarge reports JetStream's refusal of a header block over 64 KiB.
func isHeaderTooLarge(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == 10097
}

// headerValue makes s, which may quote a handler or the server, a header value that arrives
// as sent: valid UTF-8, one line, at most maxErrorHeader bytes cut on a character boundary.
func headerValue(s string) string { return safetext.Header(s, maxErrorHeader) }

// escapeMsgIDText writes the text Nats-Msg-Id as Nats-Msg-ID in a dead letter's header names
// and values (the original's headers from any publisher, the handler's error, the subject):
// nats-server finds a message's id by searching the raw header block for that text, case
// for case, and may miss the dead letter's own Nats-Msg-Id behind an earlier occurrence
// (nats-server 2.9 looks at the first only), storing a dead letter published twice twice.
// The producer refuses the text in what it accepts (outbox.ValidateHeaderValue); messages
// from other publishers may hold it.
func escapeMsgIDText(s string) string {
	if !strings.Contains(s, outbox.HeaderMsgID) {
		return s
	}
	return strings.ReplaceAll(s, outbox.HeaderMsgID, "Nats-Msg-ID")
}

func (it *item) dedupRow(consumer string) store.DedupRow {
	return store.DedupRow{
		Consumer:       consumer,
		IdempotencyKey: it.msg.IdempotencyKey,
		MessageID:      it.msg.ID,
		StreamSeq:      it.msg.StreamSeq,
	}
}

const opOrderScan = "key order scan"

// guarded reports whether it goes through the per-key applied-order check: a keyed message
// handled by Run's dispatcher in ordered mode.
func (c *Consumer) guarded(it *item) bool {
	return c.order != nil && it.orderKey != "" && it.managed && it.bad == nil
}

// checkTurn locks the key's row in tx and decides whether it may be applied now. done=false:
// go on (its turn). done=true: r is the outcome, and tx was rolled back or must be.
func (c *Consumer) checkTurn(ctx context.Context, tx turnTx, it *item) (r result, done bool) {
	applied, err := tx.lockKeyOrder(ctx, c.cfg.Durable, it.msg.Stream, it.orderKey)
	if err != nil {
		return c.unavailable(ctx, it, "key order lock", err), true
	}
	c.pgUp()
	seq := it.msg.StreamSeq
	if seq <= applied {
		// The key already moved past this message. Normally it was applied, and its dedup
		// row says so; without one (a purged dedup row, a message the stream lost while it
		// was in flight, a recreated stream) applying it now would break the key's order and
		// acking it would drop it: it goes to the dead letters.
		inserted, err := tx.insertDedup(ctx, it.dedupRow(c.cfg.Durable))
		if err != nil {
			return c.unavailable(ctx, it, "dedup insert", err), true
		}
		tx.rollback(ctx)
		c.order.settled(it.orderKey, seq)
		if !inserted {
			c.countDuplicate()
			c.ack(ctx, it)
			return result{outcome: outcomeDuplicate}, true
		}
		return c.deadLetter(ctx, it, DeadReasonOutOfOrder,
			fmt.Errorf("%w: stream sequence %d of key %q, which is already at %d", errOutOfOrder, seq, it.orderKey, applied)), true
	}
	if c.order.blocked(it.orderKey, applied, seq) {
		tx.rollback(ctx)
		it.waits++
		if h := c.hooks.waiting; h != nil {
			h(it.msg)
		}
		if it.waits == 1 {
			c.log.Debug("message waits for an earlier message of its key", "stream_seq", seq, "key_applied_seq", applied)
		}
		return result{outcome: outcomeWaiting, delay: waitDelay(it.waits)}, true
	}
	it.waits = 0
	return result{}, false
}

// turnTx is what checkTurn needs of the consumer's transaction: a pgx.Tx (pgxTurn) or a
// *sql.Tx (sqlTurn, NewSQL).
type turnTx interface {
	lockKeyOrder(ctx context.Context, consumer, stream, key string) (uint64, error)
	insertDedup(ctx context.Context, r store.DedupRow) (bool, error)
	rollback(ctx context.Context)
}

type pgxTurn struct {
	q  *store.Queries
	tx pgx.Tx
}

func (t pgxTurn) lockKeyOrder(ctx context.Context, consumer, stream, key string) (uint64, error) {
	return t.q.LockKeyOrder(ctx, t.tx, consumer, stream, key)
}

func (t pgxTurn) insertDedup(ctx context.Context, r store.DedupRow) (bool, error) {
	return t.q.InsertDedup(ctx, t.tx, r)
}

func (t pgxTurn) rollback(ctx context.Context) { _ = t.tx.Rollback(ctx) }

// waitDelay is how long a message waiting for an earlier one of its key waits before its
// next check: 10ms, doubling up to 1s.
func waitDelay(waits int) time.Duration {
	return min(10*time.Millisecond<<min(waits-1, 7), time.Second)
}

// insertDedupAdvance inserts it's dedup row and records it as its key's highest applied
// message, in tx and one round trip. It reports whether the dedup row was inserted.
func (c *Consumer) insertDedupAdvance(ctx context.Context, tx pgx.Tx, it *item) (bool, error) {
	b := &pgx.Batch{}
	c.q.QueueInsertDedup(b, it.dedupRow(c.cfg.Durable))
	c.q.QueueAdvanceKeyOrder(b, c.cfg.Durable, it.msg.Stream, it.orderKey, it.msg.StreamSeq)
	br := tx.SendBatch(ctx, b)
	tag, err := br.Exec()
	if err == nil {
		_, err = br.Exec()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return tag.RowsAffected() == 1, err
}

// advanceKeyTx records it as its key's highest applied message, in a transaction of its own.
func (c *Consumer) advanceKeyTx(ctx context.Context, it *item) error {
	if c.sqlDB != nil {
		return c.advanceKeySQL(ctx, it)
	}
	return pgx.BeginFunc(ctx, c.db, func(tx pgx.Tx) error {
		return c.q.AdvanceKeyOrder(ctx, tx, c.cfg.Durable, it.msg.Stream, it.orderKey, it.msg.StreamSeq)
	})
}
