// Package consumer turns JetStream's at-least-once delivery into an exactly-once business
// result: an idempotent consumer whose dedup record and business effect commit in one
// PostgreSQL transaction.
//
// For every message, in one transaction: insert the dedup row (consumer name, idempotency key)
// with ON CONFLICT DO NOTHING — a conflict means the message was already processed, so it is
// acked and skipped; otherwise run the handler with that transaction, commit, and only then ack
// (with server confirmation). A crash anywhere before the commit leaves nothing behind and the
// message comes back; a crash between the commit and the ack brings it back too, and the dedup
// row makes it a duplicate.
//
// The idempotency key is the producer's business key (the Txoutbox-Biz-Key header, set by
// outbox.Message.BizKey) when there is one, else the message id (Nats-Msg-Id, the outbox
// message id the relay publishes). The business key also catches the same business event
// enqueued twice under two message ids. Keys, like everything else of a message, are used
// byte for byte as they arrived, never trimmed or normalised: two keys that differ in any byte
// are two keys. An empty one is malformed.
//
// A handler error rolls the transaction back (the dedup row with it) and naks the message with
// an exponential, jittered delay; after Config.MaxDeliveries attempts, or at once for a
// Permanent error or a message that cannot be decoded, the message is published to the
// dead-letter subject with headers saying why, then terminated. Failures of Postgres or NATS
// themselves (begin, dedup insert, commit, a dead connection) never ack and never count as an
// attempt: the message is held and retried, so an outage does not fill the dead letters.
//
// A message the consumer holds (running, queued for a worker, waiting for its ordering key or
// for an in-place retry) is kept alive with an in-progress ack every
// Config.InProgressInterval, so JetStream does not redeliver it while it is being worked on;
// a graceful stop keeps this up until its last handler returns. Messages the JetStream
// client has pulled into its buffer but the consumer has not yet taken in (it was full) get
// none: keep Config.PullMaxMessages small enough that they are taken in well within
// Config.AckWait.
//
// In batch mode (Config.BatchSize above 1) a handler can run more than once for one delivery
// (see Config.BatchSize): keep every side effect inside the transaction. A consumer made with
// NewBatch hands its BatchHandler the whole batch at once, for set-based SQL.
//
// Dedup rows must outlive every redelivery of their message: keep them several times longer
// than the longest redelivery window (MaxDeliveries × BackoffMax, plus the relay's worst
// republish delay, plus the longest outage you ride out). Purging them is the check-back's job.
package consumer

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/cmdline"
	"github.com/txoutbox/txoutbox/internal/dbhandle"
	"github.com/txoutbox/txoutbox/internal/jserr"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsignal"
)

// Handler applies one message's business effect in tx, the consumer's transaction, which
// already holds the message's dedup row. It must not commit or roll back tx (those calls
// return ErrTxControl); returning an error rolls everything back and schedules a retry.
// Wrap an error with Permanent to dead-letter the message at once. msg.Payload and msg.Headers
// are this call's own copy: changing them changes nothing else.
type Handler func(ctx context.Context, tx pgx.Tx, msg Message) error

// Sentinel errors.
var (
	// ErrNoDeadLetterStream: no JetStream stream captures Config.DeadLetterSubject. Setup and
	// Run return it.
	ErrNoDeadLetterStream = errors.New("consumer: no stream captures the dead-letter subject")
	// ErrDeadLetterLoop: the dead-letter subject would be delivered to this consumer again
	// (its stream is the consumed stream, and the consumer reads all of it). Setup and Run
	// return it.
	ErrDeadLetterLoop = errors.New("consumer: dead letters would loop back to the consumer")
	// ErrConsumeStopped: JetStream ended the subscription (connection closed, consumer
	// deleted); Run stops gracefully and returns it.
	ErrConsumeStopped = errors.New("consumer: jetstream stopped delivering")
	// ErrTxControl is what the handler's Commit and Rollback return: the consumer owns the
	// transaction.
	ErrTxControl = errors.New("consumer: the handler must not commit or roll back the consumer's transaction")
	// ErrKeyOrderTable: Config.Ordered is set and the schema lacks the key-order table, or the
	// consumer's role may not read, insert and update it. Setup and Run return it.
	ErrKeyOrderTable = errors.New("consumer: Config.Ordered needs the txoutbox_consumer_key_order table (migration 003) with SELECT, INSERT and UPDATE")
	// ErrDedupTable: the schema (Config.Schema) lacks the dedup table every consumer records
	// its messages in, or the consumer's role may not insert into it and read it: a schema
	// not migrated, or a Schema that is not the outbox's. Setup and Run return it.
	ErrDedupTable = errors.New("consumer: the consumer needs the txoutbox_consumer_dedup table (migration 001) with INSERT and SELECT")
)

// Errors of one message's handling. No call returns them: they reach the logs, the process
// span's status and a dead letter's HeaderDeadError, whose text they start (its
// HeaderDeadReason, a DeadReason… constant, says the same in one word).
var (
	// errTxAborted: the handler returned nil although a statement of its transaction failed.
	errTxAborted = errors.New("consumer: the handler returned nil but its transaction is aborted")
	// errHandlerPanic wraps a recovered handler panic.
	errHandlerPanic = errors.New("consumer: handler panicked")
	// errDeliveriesExhausted: the message arrived after MaxDeliveries deliveries without an
	// outcome (DeadReasonExhausted).
	errDeliveriesExhausted = errors.New("consumer: deliveries exhausted")
	// errOutOfOrder: in ordered mode, a message arrived after a later message of its key was
	// applied, and no dedup row says it was applied itself (DeadReasonOutOfOrder).
	errOutOfOrder = errors.New("consumer: message arrived after its key moved past it")
)

// Consumer is an idempotent JetStream consumer. Create it with New and start it with Run.
type Consumer struct {
	cfg     *Config
	db      txoutbox.Beginner
	js      jetstream.JetStream
	handler Handler
	q       *store.Queries
	log     *slog.Logger
	m       *metrics
	stats   counters
	hooks   hooks
	order   *keyOrder // ordered mode, while Run runs; set before the workers start
	trace   *consumerTracer
	// testSignals are events tests wait on; nil channels outside tests.
	testSignals testSignals

	// batchHandler, when set (NewBatch), handles batches; handler runs it on batches of one.
	batchHandler BatchHandler
	// acksBehind counts the acks of committed batches still being sent (NewBatch: see ackBehind).
	acksBehind sync.WaitGroup

	// sqlDB and sqlHandler, when set (NewSQL), replace db and handler: database/sql mode.
	sqlDB      *sql.DB
	sqlHandler SQLHandler

	running  atomic.Bool
	pgDown   atomic.Bool // for one log line per state change
	natsDown atomic.Bool
	dlqDown  atomic.Bool
	lastErr  atomic.Pointer[error] // the last consume error (errors of many types: not an atomic.Value)
}

// hooks are in-process test seams for this package's own tests (unexported, nil in every
// consumer the constructors return): observation points, and steps a test makes fail as a
// crash there would. Process crashes are internal/fault's points (see relay's hooks).
type hooks struct {
	// setupWait observes a Setup that JetStream could not answer and that Run waits out.
	setupWait func(err error)
	// beforeCommit runs just before a transaction's commit.
	beforeCommit func(ctx context.Context)
	// afterCommit runs after a transaction committed and before its messages are acked; an
	// error skips the acks, as a crash there would.
	afterCommit func(ctx context.Context, msgs []Message) error
	// onRetry observes the delay chosen after a handler failure.
	onRetry func(msg Message, delay time.Duration)
	// stopping runs when Run's graceful stop begins, before it drains the subscription.
	stopping func()
	// admitted observes a message the dispatcher took in.
	admitted func(msg Message)
	// waiting observes a keyed message found to wait for an earlier message of its key
	// (ordered mode).
	waiting func(msg Message)
}

// testSignals are events tests wait on instead of sleeping (see internal/testsignal).
type testSignals struct {
	// workerReturned: a worker stopped taking messages (the graceful stop).
	workerReturned testsignal.Signal[struct{}]
	// keptAlive: a keepalive round sent in-progress acks (how many).
	keptAlive testsignal.Signal[int]
	// stopWaits: the graceful stop waits for the running handlers.
	stopWaits testsignal.Signal[struct{}]
}

// New returns a consumer of cfg.Stream that runs handler for each message, in transactions
// begun on db. cfg.Stream and cfg.Durable are required.
//
// db must be safe for concurrent use (a pool, usually a *pgxpool.Pool): the workers begin
// transactions on it at once. One connection or transaction (a *pgx.Conn, a *pgxpool.Conn, a
// pgx.Tx) is refused with a *txoutbox.ConfigError naming db, and so is a nil db, js or
// handler (naming it), and an invalid cfg (naming the field, as ValidateConfig does). Every
// *txoutbox.ConfigError matches txoutbox.ErrInvalidConfig. It also fails when
// Config.Registerer refuses the consumer's metrics (a different collector of the same name).
func New(db txoutbox.Beginner, js jetstream.JetStream, handler Handler, cfg *Config) (*Consumer, error) {
	if err := dbhandle.RequireArg("consumer", "db", "a pool, such as a *pgxpool.Pool", db); err != nil {
		return nil, err
	}
	if err := dbhandle.RequirePool("consumer", "db", db); err != nil {
		return nil, err
	}
	if err := dbhandle.RequireArg("consumer", "js", "a jetstream.JetStream", js); err != nil {
		return nil, err
	}
	if err := dbhandle.RequireArg("consumer", "handler", "the function that applies a message", handler); err != nil {
		return nil, err
	}
	c := cfg.WithDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	m, err := newMetrics(c.Registerer, c.Durable)
	if err != nil {
		return nil, err
	}
	return &Consumer{
		cfg:     c,
		db:      db,
		js:      js,
		handler: handler,
		q:       store.New(c.Schema),
		log:     c.Logger.With("component", "consumer", "consumer", c.Durable, "stream", c.Stream),
		m:       m,
		trace:   newConsumerTracer(c, js.Conn()),
	}, nil
}

// Config returns the consumer's effective configuration.
func (c *Consumer) Config() Config { return *c.cfg }

// Stats returns the consumer's running totals.
func (c *Consumer) Stats() Stats { return c.stats.snapshot() }

// Setup creates the durable JetStream consumer, or updates it to the configuration (explicit
// acks, AckWait, unlimited server-side deliveries, MaxAckPending, FilterSubjects), and checks
// that a stream captures the dead-letter subject without sending it back to this consumer.
// Run calls it, and waits while JetStream cannot answer; call it yourself to fail fast at
// start-up.
//
// Its errors, in the order it checks them (the first three before it creates or updates the
// durable):
//   - a nats-server older than the configuration needs: a *txoutbox.ServerVersionError
//     (txoutbox.ErrServerTooOld; see MinServerVersion);
//   - ErrDedupTable: Config.Schema has no dedup table, or the consumer's role may not use it;
//   - ErrKeyOrderTable: with Config.Ordered, the same for the key-order table;
//   - ErrNoDeadLetterStream: no stream captures Config.DeadLetterSubject;
//   - ErrDeadLetterLoop: that stream is the consumed one, read whole by this consumer.
//
// A ctx that ends during the table check is an error wrapping ctx.Err(); JetStream's own
// errors (no such stream, a refused consumer configuration, a timeout) are returned wrapped.
// A database that does not answer the table check is not an error: it is logged, and the
// handlers wait for it like for any outage.
func (c *Consumer) Setup(ctx context.Context) (jetstream.Consumer, error) {
	if err := c.checkServerVersion(); err != nil {
		return nil, err
	}
	// The tables first: a consumer pointed at the wrong schema must not change the durable
	// the consumers that work share (its filter, ack wait, pending limit) before it refuses.
	if err := c.checkTables(ctx); err != nil {
		return nil, err
	}
	cc := jetstream.ConsumerConfig{
		Durable:       c.cfg.Durable,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       c.cfg.AckWait,
		MaxDeliver:    -1,
		MaxAckPending: c.cfg.MaxAckPending,
		DeliverPolicy: jetstream.DeliverAllPolicy,
	}
	switch len(c.cfg.FilterSubjects) {
	case 0:
	case 1:
		cc.FilterSubject = c.cfg.FilterSubjects[0]
	default:
		cc.FilterSubjects = c.cfg.FilterSubjects
	}
	cons, err := c.js.CreateOrUpdateConsumer(ctx, c.cfg.Stream, cc)
	if err != nil {
		return nil, fmt.Errorf("consumer: create or update durable %q on stream %q: %w", c.cfg.Durable, c.cfg.Stream, err)
	}
	// The server answered, so its version is known now: a connection that was not up yet at
	// the first check (nats.RetryOnFailedConnect buffers requests) let it pass unseen.
	if err := c.checkServerVersion(); err != nil {
		return nil, err
	}
	dlq, err := c.js.StreamNameBySubject(ctx, c.cfg.DeadLetterSubject)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		return nil, fmt.Errorf("%w: %q (create a stream for it)", ErrNoDeadLetterStream, c.cfg.DeadLetterSubject)
	case err != nil:
		return nil, fmt.Errorf("consumer: look up the stream of %q: %w", c.cfg.DeadLetterSubject, err)
	case dlq == c.cfg.Stream && len(c.cfg.FilterSubjects) == 0:
		return nil, fmt.Errorf("%w: stream %q captures %q and the consumer reads all of it", ErrDeadLetterLoop, dlq, c.cfg.DeadLetterSubject)
	}
	return cons, nil
}

// setupWaiting runs Setup until JetStream answers. While JetStream or the stream cannot
// answer (a cluster or the stream electing a leader, JetStream restarting or out of reach:
// jserr.Waitable) it waits, logging one warning with the error, then debug lines, and one
// info line once Setup passes; an answer that says the configuration is wrong (no such
// stream, no dead-letter stream, a refused request) ends it with that error at once. Each
// pass is bounded by AckWait within [2s, 10s]. In ordered mode a pass also looks the stream up
// (the key order is read back from it), so that lookup waits out an election the same way.
func (c *Consumer) setupWaiting(ctx context.Context) (jetstream.Consumer, jetstream.Stream, error) {
	waited := false
	for pass := 1; ; pass++ {
		sctx, cancel := context.WithTimeout(ctx, min(max(c.cfg.AckWait, 2*time.Second), 10*time.Second))
		cons, err := c.Setup(sctx)
		var stream jetstream.Stream
		if err == nil && c.cfg.Ordered {
			if stream, err = c.js.Stream(sctx, c.cfg.Stream); err != nil {
				err = fmt.Errorf("consumer: stream %q: %w", c.cfg.Stream, err)
			}
		}
		cancel()
		switch {
		case err == nil:
			if waited {
				c.log.Info("consumer set up: JetStream answers")
			}
			return cons, stream, nil
		case ctx.Err() != nil:
			return nil, nil, ctx.Err()
		case !jserr.Waitable(err):
			return nil, nil, err
		case !waited && errors.Is(err, errTablesUnanswered):
			waited = true
			c.log.Warn("waiting for PostgreSQL to answer the check of the consumer's tables", "err", err,
				"why", "the database slow or out of reach; tried again until it answers")
		case !waited:
			waited = true
			c.log.Warn("waiting for JetStream to set the consumer up", "err", err,
				"why", "the stream or the cluster electing a leader, JetStream starting or out of reach; tried again until it answers")
		default:
			c.log.Debug("still waiting for JetStream to set the consumer up", "err", err)
		}
		if h := c.hooks.setupWait; h != nil {
			h(err)
		}
		t := time.NewTimer(c.cfg.setupDelay(pass))
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, nil, ctx.Err()
		case <-t.C:
		}
	}
}

// errTablesUnanswered: the check of the consumer's tables ran out of time (its Setup pass's,
// or Run's); setupWaiting says it waits for PostgreSQL, not JetStream.
var errTablesUnanswered = errors.New("consumer: PostgreSQL did not answer the check of the dedup and key-order tables")

// checkTables fails when the schema lacks the dedup table (migration 001) or, in ordered
// mode, the key-order table (migration 003), or the consumer's role cannot use them: a
// consumer pointed at a schema that was not migrated, or at the wrong schema, would otherwise
// put every message back as if the database were down. A database that does not answer is
// not a configuration error: the handlers wait for it like for any outage. A done ctx
// (cancelled, or past its deadline) is returned, wrapped, and not logged.
func (c *Consumer) checkTables(ctx context.Context) error {
	check := func(ctx context.Context, tx pgx.Tx) error {
		if err := c.q.CheckDedupTable(ctx, tx); err != nil || !c.cfg.Ordered {
			return err
		}
		return c.q.CheckKeyOrderTable(ctx, tx)
	}
	var err error
	if c.sqlDB != nil {
		if err = c.q.CheckDedupTableSQL(ctx, c.sqlDB); err == nil && c.cfg.Ordered {
			err = c.q.CheckKeyOrderTableSQL(ctx, c.sqlDB)
		}
	} else {
		// A transaction only because the handle begins them; rolled back, never committed
		// (the application's Beginner may act on commits).
		var tx pgx.Tx
		if tx, err = c.db.Begin(ctx); err == nil {
			err = check(ctx, tx)
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			_ = tx.Rollback(rctx)
			cancel()
		}
	}
	grants := cmdline.Command(c.cfg.Schema, "relay migrate grants --role consumer")
	switch {
	case errors.Is(err, store.ErrNoDedupTable):
		return fmt.Errorf("%w: schema %q has no such table (run the migrations, or set Config.Schema to the outbox's schema)", ErrDedupTable, c.cfg.Schema)
	case errors.Is(err, store.ErrDedupPrivileges):
		return fmt.Errorf("%w: the consumer's role lacks them in schema %q (%s)", ErrDedupTable, c.cfg.Schema, grants)
	case errors.Is(err, store.ErrNoKeyOrderTable):
		return fmt.Errorf("%w: schema %q has no such table (run the migrations)", ErrKeyOrderTable, c.cfg.Schema)
	case errors.Is(err, store.ErrKeyOrderPrivileges):
		return fmt.Errorf("%w: the consumer's role lacks them in schema %q (%s)", ErrKeyOrderTable, c.cfg.Schema, grants)
	case err != nil && ctx.Err() != nil: // stopped (cancelled, or its deadline passed): not the database's fault
		return fmt.Errorf("%w: %w", errTablesUnanswered, ctx.Err())
	case err != nil:
		c.log.Warn("could not check the consumer's tables; the database does not answer", "err", err)
	}
	return nil
}

// Run consumes until ctx is cancelled, then stops gracefully: it stops pulling, naks the
// messages it holds that no handler has started (so another instance gets them at once),
// lets running handlers finish (their context is cancelled after Config.StopTimeout), acks
// what committed, and returns nil. It sets the consumer up first (Setup), waiting — one
// warning — while JetStream, the stream or PostgreSQL cannot answer (a leader election, a
// restart), and returns Setup's error when the answer says the configuration is wrong: a
// *txoutbox.ServerVersionError (txoutbox.ErrServerTooOld), ErrDedupTable, ErrKeyOrderTable,
// ErrNoDeadLetterStream or ErrDeadLetterLoop, or JetStream's refusal (no such stream, say).
// A ctx cancelled while it waits makes it return nil. It returns an error wrapping
// ErrConsumeStopped when JetStream stops delivering, and txoutbox.ErrRunning while another
// Run of this consumer has not returned.
func (c *Consumer) Run(ctx context.Context) error {
	if !c.running.CompareAndSwap(false, true) {
		return fmt.Errorf("consumer: Run: %w", txoutbox.ErrRunning)
	}
	defer c.running.Store(false)
	cons, stream, err := c.setupWaiting(ctx)
	if err != nil {
		if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
			return nil // stopped while waiting for JetStream
		}
		return err
	}

	c.order = nil
	rctx, stopRefresh := context.WithCancel(ctx)
	var refreshing sync.WaitGroup
	defer func() { stopRefresh(); refreshing.Wait() }() // Run returns after it
	if c.cfg.Ordered {
		c.order = newKeyOrder(c.js, stream, cons, c.cfg.FilterSubjects)
		refreshing.Add(1)
		go func() { defer refreshing.Done(); c.refreshOrder(rctx, c.order) }()
	}

	workCtx, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	d := newDispatcher(c)
	var workers sync.WaitGroup
	for range c.cfg.Concurrency {
		workers.Add(1)
		go func() { defer workers.Done(); d.work(workCtx) }()
	}
	keepDone := make(chan struct{})
	go func() { defer close(keepDone); d.keepalive() }()

	stopping := make(chan struct{})
	cc, err := cons.Consume(func(m jetstream.Msg) { d.admit(m, stopping) },
		jetstream.PullMaxMessages(c.cfg.PullMaxMessages),
		jetstream.PullHeartbeat(c.cfg.PullHeartbeat),
		jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) { c.consumeError(err) }),
	)
	if err != nil {
		d.shutdown()
		workers.Wait()
		<-keepDone
		return fmt.Errorf("consumer: consume: %w", err)
	}
	c.log.Info("consumer started", "concurrency", c.cfg.Concurrency, "batch_size", c.cfg.BatchSize,
		"ordered", c.cfg.Ordered, "dead_letter_subject", c.cfg.DeadLetterSubject)

	var runErr error
	select {
	case <-ctx.Done():
	case <-cc.Closed():
		runErr = ErrConsumeStopped
		var last error
		if p := c.lastErr.Load(); p != nil {
			last = *p
		}
		if last != nil {
			runErr = fmt.Errorf("%w: %w", ErrConsumeStopped, last)
		}
		c.log.Error("jetstream stopped delivering; stopping", "err", last)
	}

	// Graceful stop: no new pulls, messages still arriving are nak'ed at once, and no handler
	// starts any more (the workers return after their current batch; the messages they leave
	// queued are nak'ed by shutdown). The keepalive goes on until shutdown.
	close(stopping)
	d.quit()
	if h := c.hooks.stopping; h != nil {
		h()
	}
	cc.Drain()
	stopCtx, cancelStop := context.WithCancel(context.Background())
	if c.cfg.StopTimeout != txoutbox.Forever {
		stopCtx, cancelStop = context.WithTimeout(context.Background(), c.cfg.StopTimeout)
	}
	defer cancelStop()
	select {
	case <-cc.Closed():
	case <-stopCtx.Done():
	}
	done := make(chan struct{})
	go func() { workers.Wait(); close(done) }()
	c.testSignals.stopWaits.Signal(struct{}{})
	select {
	case <-done:
	case <-stopCtx.Done():
		c.log.Warn("handlers still running after the stop timeout; cancelling them", "stop_timeout", c.cfg.StopTimeout)
		cancelWork()
		<-done
	}
	d.shutdown()
	<-keepDone
	c.acksBehind.Wait()
	c.log.Info("consumer stopped")
	return runErr
}

func (c *Consumer) consumeError(err error) {
	c.lastErr.Store(&err)
	if !c.natsDown.Swap(true) {
		c.log.Warn("jetstream delivery interrupted", "err", err)
	}
}

func (c *Consumer) natsUp() {
	if c.natsDown.Load() && c.natsDown.Swap(false) {
		c.log.Info("jetstream delivery resumed")
	}
}

func (c *Consumer) pgUp() {
	if c.pgDown.Load() && c.pgDown.Swap(false) {
		c.log.Info("postgres available again")
	}
}

// refreshOrder keeps the ordered mode's view of the durable's ack floor fresh (every
// InProgressInterval), so that what it settles is forgotten and not read back from the
// stream, until ctx ends (Run ends it and waits for it before it returns).
func (c *Consumer) refreshOrder(ctx context.Context, o *keyOrder) {
	t := time.NewTicker(c.cfg.InProgressInterval)
	defer t.Stop()
	for {
		if err := o.refresh(ctx); err != nil && ctx.Err() == nil {
			c.log.Debug("could not read the durable's ack floor", "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
