package bench

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/consumer"
)

func init() {
	register(scenario{name: "consume", summary: "idempotent consumer throughput: per-message, batch mode and batch handler", flags: consumeFlags})
}

// Yardstick C defaults.
const (
	DefaultConsumeMsgs = 50000
	// DefaultConsumeConcurrency is the consumer's own default.
	DefaultConsumeConcurrency = consumer.DefaultConcurrency
	// DefaultConsumeBatchSize is batch mode's batch: below the 64 savepoints that overflow
	// PostgreSQL's per-backend subtransaction cache (consumer.Config.BatchSize).
	DefaultConsumeBatchSize = 50
	DefaultConsumeAccounts  = 1000
	// DefaultConsumeBatchHandlerSize is the batch handler's batch: consumer.NewBatch's default.
	DefaultConsumeBatchHandlerSize = consumer.DefaultBatchHandlerSize
)

type consumeOpts struct {
	msgs, size, accounts, concurrency, batchSize int
	batchHandlerSize                             int
	cpuprofile                                   string
	stall                                        time.Duration
}

// consumeFlags is the `consume` scenario of the yardstick (issue 6):
//
//	50,000 messages in the stream; the idempotent consumer with a one-row business update per
//	message, per-message mode, batch mode and the batch handler (issue 18). Final line:
//	consume msgs=50000 per_message_msgs_per_s=… batch_msgs_per_s=… batch_handler_msgs_per_s=…
//
// Each mode gets a fresh schema with an accounts table (--accounts rows at balance 0), a fresh
// stream holding the same --msgs messages (random payloads, Nats-Msg-Id set, as the relay
// publishes them) and a dead-letter stream. The consumer runs with its default settings except
// Concurrency and BatchSize (1 in per-message mode); its handler adds 1 to the balance of the
// account the message names (message i names account i mod accounts + 1) and dead-letters a
// message whose account does not exist. In the batch-handler mode (consumer.NewBatch,
// --batch-handler-size) one set-based statement per batch updates one row per message
// (UPDATE … FROM unnest(ids, counts), the ids sorted, messages naming the same account
// counted together), after the consumer recorded the batch's dedup rows in one statement. Messages arrive in stream order, so with at least as
// many accounts as messages in flight (the consumer's MaxAckPending, 1,000) concurrent
// transactions update disjoint rows, as in consumer/bench_test.go: with fewer, concurrent
// batches lock the same rows in different orders and deadlock (PostgreSQL aborts one after
// deadlock_timeout, its message backs off and retries), which measures the workload rather
// than the consumer. The clock runs from Run until the consumer's Stats
// count every message processed. Then the database must show each message's effect exactly
// once: one dedup row per message id and every balance equal to the number of messages naming
// its account; no dead letters, and nothing left unacked on the JetStream consumer.
func consumeFlags(fs *flag.FlagSet) func(context.Context, *run) error {
	o := &consumeOpts{}
	fs.IntVar(&o.msgs, "msgs", DefaultConsumeMsgs, "messages in the stream")
	fs.IntVar(&o.size, "payload", DefaultPayload, "payload bytes per message (random)")
	fs.IntVar(&o.accounts, "accounts", DefaultConsumeAccounts, "rows of the business table the messages update, round robin (fewer than the messages in flight make concurrent batches deadlock)")
	fs.IntVar(&o.concurrency, "concurrency", DefaultConsumeConcurrency, "consumer.Config.Concurrency in every mode: messages (or batches) handled at once")
	fs.IntVar(&o.batchSize, "batch-size", DefaultConsumeBatchSize, "consumer.Config.BatchSize in batch mode (per-message mode uses 1)")
	fs.IntVar(&o.batchHandlerSize, "batch-handler-size", DefaultConsumeBatchHandlerSize, "consumer.Config.BatchSize in the batch-handler mode (consumer.NewBatch, one set-based UPDATE per batch)")
	fs.StringVar(&o.cpuprofile, "cpuprofile", "", "write a CPU profile (pprof) of this process while the consumer runs, one file per mode: cpu.pprof gives cpu.per-message.pprof, cpu.batch.pprof and cpu.batch-handler.pprof")
	fs.DurationVar(&o.stall, "stall-timeout", time.Minute, "fail when the consumer processes nothing for this long")
	return func(ctx context.Context, r *run) error { return consume(ctx, r, o) }
}

// consumeMode is one run of the consumer.
type consumeMode struct {
	name      string // per-message, batch, batch-handler
	batchSize int
	set       bool // a consumer.BatchHandler (consumer.NewBatch) with one set-based statement per batch
}

// consumeResult is one mode's measurement and check.
type consumeResult struct {
	dur            time.Duration
	processed      int64
	dedupSkips     int64 // the consumer's Stats.Duplicates: redeliveries caught by the dedup row
	retries        int64
	deadLettered   int64 // Stats.DeadLettered plus messages in the dead-letter stream
	dedupRows      int   // dedup rows of known message ids
	unknownRows    int   // dedup rows of anything else
	balanceSum     int64
	wrongAccounts  int   // accounts whose balance is not the number of messages naming them
	missingEffects int64 // Σ (expected − balance) over the accounts below expectation
	extraEffects   int64 // Σ (balance − expected) over the accounts above it
	unacked        int   // pending or unacked on the JetStream consumer after the run
}

// lost counts messages whose effect is missing: no dedup row, or a balance short of it.
func (c consumeResult) lost(msgs int) int64 {
	return max(int64(msgs-c.dedupRows), c.missingEffects)
}

func (c consumeResult) ok(msgs int) bool {
	return c.dedupRows == msgs && c.unknownRows == 0 && c.balanceSum == int64(msgs) && c.wrongAccounts == 0 &&
		c.deadLettered == 0 && c.unacked == 0
}

func (c consumeResult) String() string {
	return fmt.Sprintf("dedup rows %d (+%d unknown), balance sum %d, accounts off %d (missing %d, extra %d), dead letters %d, unacked %d; consumer stats processed=%d dedup_skips=%d retries=%d",
		c.dedupRows, c.unknownRows, c.balanceSum, c.wrongAccounts, c.missingEffects, c.extraEffects, c.deadLettered, c.unacked,
		c.processed, c.dedupSkips, c.retries)
}

func consume(ctx context.Context, r *run, o *consumeOpts) error {
	switch {
	case o.msgs < 1 || o.accounts < 1 || o.concurrency < 1 || o.size < 0:
		return usageErr("--msgs, --accounts and --concurrency must be positive, --payload not negative")
	case o.batchSize < 2 || o.batchSize > consumer.MaxBatchSize:
		return usageErr("--batch-size must be between 2 and %d", consumer.MaxBatchSize)
	case o.batchHandlerSize < 2 || o.batchHandlerSize > consumer.MaxBatchSize:
		return usageErr("--batch-handler-size must be between 2 and %d", consumer.MaxBatchSize)
	}
	if err := r.start(ctx); err != nil {
		return err
	}
	if o.accounts < consumer.DefaultMaxAckPending {
		r.logf("WARNING: %d accounts, fewer than the %d messages the consumer may hold: concurrent transactions may update the same rows, and batches may deadlock", o.accounts, consumer.DefaultMaxAckPending)
	}
	set, err := newMsgSet(o.msgs, o.size, 0)
	if err != nil {
		return err
	}
	load0 := load1()
	modes := []consumeMode{{"per-message", 1, false}, {"batch", o.batchSize, false}, {"batch-handler", o.batchHandlerSize, true}}
	results := make([]consumeResult, len(modes))
	var failed []string
	for i, m := range modes {
		res, err := consumeOnce(ctx, r, o, set, m)
		if err != nil {
			return fmt.Errorf("%s mode: %w", m.name, err)
		}
		results[i] = res
		if !res.ok(o.msgs) {
			failed = append(failed, fmt.Sprintf("%s mode: %s", m.name, res))
		}
	}
	per, batch, bh := results[0], results[1], results[2]
	perRate, batchRate := float64(o.msgs)/per.dur.Seconds(), float64(o.msgs)/batch.dur.Seconds()
	setRate := float64(o.msgs) / bh.dur.Seconds()
	var lost, dups, dead, skips, retries int64
	for _, res := range results {
		lost, dups, dead = lost+res.lost(o.msgs), dups+res.extraEffects, dead+res.deadLettered
		skips, retries = skips+res.dedupSkips, retries+res.retries
	}
	r.result("msgs", o.msgs,
		"per_message_msgs_per_s", perRate,
		"batch_msgs_per_s", batchRate,
		"batch_handler_msgs_per_s", setRate,
		"batch_speedup", batchRate/perRate,
		"batch_handler_speedup", setRate/perRate,
		"batch_handler_vs_batch", setRate/batchRate,
		"concurrency", o.concurrency,
		"batch_size", o.batchSize,
		"batch_handler_size", o.batchHandlerSize,
		"per_message_s", per.dur.Seconds(),
		"batch_s", batch.dur.Seconds(),
		"batch_handler_s", bh.dur.Seconds(),
		"accounts", o.accounts,
		"payload", o.size,
		"lost", lost,
		"duplicates", dups,
		"dead_letters", dead,
		"dedup_skips", skips,
		"retries", retries,
		"load1_start", load0,
		"load1", load1())
	if len(failed) > 0 {
		return fmt.Errorf("%w: %s", ErrCheckFailed, strings.Join(failed, "; "))
	}
	return nil
}

// consumeOnce runs one mode on a fresh schema and fresh streams and checks its effects.
func consumeOnce(ctx context.Context, r *run, o *consumeOpts, set *msgSet, m consumeMode) (consumeResult, error) {
	const (
		stream, subject         = streamPrefix + "CONSUME", "bench.consume.msg"
		deadStream, deadSubject = streamPrefix + "CONSUME_DEAD", "bench.consume.dead"
	)
	durable := "bench-consume-" + m.name
	var res consumeResult

	// 1. A fresh schema with its accounts, a fresh stream holding every message, an empty
	// dead-letter stream.
	schema, err := r.NewSchema(ctx)
	if err != nil {
		return res, err
	}
	accounts := pgx.Identifier{schema, "bench_accounts"}.Sanitize()
	if _, err := r.Admin.Exec(ctx, "CREATE TABLE "+accounts+" (id integer PRIMARY KEY, balance bigint NOT NULL)"); err != nil {
		return res, fmt.Errorf("create accounts table: %w", err)
	}
	if _, err := r.Admin.Exec(ctx, "INSERT INTO "+accounts+" SELECT g, 0 FROM generate_series(1, $1::integer) g", o.accounts); err != nil {
		return res, fmt.Errorf("fill accounts table: %w", err)
	}
	if _, err := r.Admin.Exec(ctx, "ANALYZE "+accounts); err != nil {
		return res, err
	}
	s, err := r.ResetStream(ctx, stream, subject)
	if err != nil {
		return res, err
	}
	dead, err := r.ResetStream(ctx, deadStream, deadSubject)
	if err != nil {
		return res, err
	}
	fillDur, err := publishCeiling(ctx, r, "outbox-bench consume fill", set, subject, DefaultCeilingWindow)
	if err != nil {
		return res, fmt.Errorf("fill stream %s: %w", stream, err)
	}
	stored, err := streamMsgs(ctx, s)
	if err != nil {
		return res, err
	}
	if stored != uint64(o.msgs) {
		return res, fmt.Errorf("%w: stream %s holds %d messages after publishing %d", ErrCheckFailed, stream, stored, o.msgs)
	}
	r.logf("%s: %d × %d B messages in %s (published in %s, %.0f msgs/s); schema %s, %d accounts",
		m.name, o.msgs, o.size, stream, fillDur.Round(time.Millisecond), float64(o.msgs)/fillDur.Seconds(), schema, o.accounts)

	// 2. The consumer: a pool and a NATS connection of its own, as a separate service has.
	pool, err := r.NewPool(ctx, int32(o.concurrency+1))
	if err != nil {
		return res, err
	}
	defer pool.Close()
	nc, err := r.ConnectNATS("outbox-bench consumer")
	if err != nil {
		return res, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return res, err
	}
	update := "UPDATE " + accounts + " SET balance = balance + 1 WHERE id = $1"
	setUpdate := "UPDATE " + accounts + " AS a SET balance = a.balance + u.n FROM unnest($1::integer[], $2::bigint[]) AS u(id, n) WHERE a.id = u.id"
	handler := func(ctx context.Context, tx pgx.Tx, msg consumer.Message) error {
		acct, err := accountOf(set, msg.ID, o.accounts)
		if err != nil {
			return consumer.Permanent(err)
		}
		tag, err := tx.Exec(ctx, update, acct)
		if err != nil {
			return err
		}
		if tag.RowsAffected() != 1 {
			return consumer.Permanent(fmt.Errorf("account %d does not exist", acct))
		}
		return nil
	}
	// The batch handler: the messages' accounts, counted and sorted (concurrent batches then
	// lock their rows in one order), in one UPDATE … FROM unnest.
	batchHandler := func(ctx context.Context, tx pgx.Tx, msgs []consumer.Message) error {
		counts := make(map[int32]int64, len(msgs))
		for i, msg := range msgs {
			acct, err := accountOf(set, msg.ID, o.accounts)
			if err != nil {
				return &consumer.BatchError{Index: i, Err: consumer.Permanent(err)}
			}
			counts[int32(acct)]++
		}
		ids := slices.Sorted(maps.Keys(counts))
		ns := make([]int64, len(ids))
		for i, id := range ids {
			ns[i] = counts[id]
		}
		tag, err := tx.Exec(ctx, setUpdate, ids, ns)
		if err != nil {
			return err
		}
		if tag.RowsAffected() != int64(len(ids)) {
			// Splitting the batch finds the message whose account is missing.
			return consumer.Permanent(fmt.Errorf("%d of %d accounts exist", tag.RowsAffected(), len(ids)))
		}
		return nil
	}
	cfg := &consumer.Config{
		Stream:            stream,
		Durable:           durable,
		Schema:            schema,
		Concurrency:       o.concurrency,
		BatchSize:         m.batchSize,
		DeadLetterSubject: deadSubject,
		Logger:            relayLogger(r.env.Stderr),
	}
	var c *consumer.Consumer
	if m.set {
		c, err = consumer.NewBatch(pool, js, batchHandler, cfg)
	} else {
		c, err = consumer.New(pool, js, handler, cfg)
	}
	if err != nil {
		return res, err
	}
	if _, err := c.Setup(ctx); err != nil {
		return res, err
	}
	eff := c.Config()
	r.logf("%s: consumer %s: concurrency %d, batch size %d, max ack pending %d, pull buffer %d",
		m.name, durable, eff.Concurrency, eff.BatchSize, eff.MaxAckPending, eff.PullMaxMessages)

	// 3. Run it; time until every message is processed.
	stopProfile, err := startProfile(profilePath(o.cpuprofile, m.name))
	if err != nil {
		return res, err
	}
	defer stopProfile()
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	var runErr error
	runDone := make(chan struct{})
	t0 := time.Now()
	go func() { runErr = c.Run(runCtx); close(runDone) }()
	res.dur, err = waitForConsumer(ctx, r, m.name, c.Stats, int64(o.msgs), t0, o.stall, runDone)
	if err != nil {
		stop()
		<-runDone
		if runErr != nil {
			err = fmt.Errorf("%w (consumer: %v)", err, runErr)
		}
		return res, err
	}
	if path := stopProfile(); path != "" {
		r.logf("%s: CPU profile written to %s", m.name, path)
	}
	r.logf("%s: %d messages processed in %s (%.0f msgs/s, %.1f µs/msg)", m.name, o.msgs, res.dur.Round(time.Millisecond),
		float64(o.msgs)/res.dur.Seconds(), res.dur.Seconds()*1e6/float64(o.msgs))
	stop()
	<-runDone
	if runErr != nil {
		return res, fmt.Errorf("consumer: %w", runErr)
	}

	// 4. Check: every message took effect exactly once, nothing dead, nothing unacked.
	st := c.Stats()
	res.processed, res.dedupSkips, res.retries = st.Processed, st.Duplicates, st.Retries
	deadMsgs, err := streamMsgs(ctx, dead)
	if err != nil {
		return res, err
	}
	res.deadLettered = max(st.DeadLettered, int64(deadMsgs))
	cons, err := r.JS.Consumer(ctx, stream, durable)
	if err != nil {
		return res, err
	}
	info, err := cons.Info(ctx)
	if err != nil {
		return res, err
	}
	res.unacked = int(info.NumPending) + info.NumAckPending
	if err := checkEffects(ctx, pool, schema, accounts, durable, set, o.accounts, &res); err != nil {
		return res, err
	}
	r.logf("%s: check: %s", m.name, res)
	return res, nil
}

// accountOf is the account message id names: message i names account i mod accounts + 1.
func accountOf(set *msgSet, id string, accounts int) (int, error) {
	u, err := uuid.Parse(id)
	if err != nil {
		return 0, fmt.Errorf("message id %q: %w", id, err)
	}
	i, ok := set.index[u]
	if !ok {
		return 0, fmt.Errorf("message id %s was never sent", id)
	}
	return int(i)%accounts + 1, nil
}

// waitForConsumer polls the consumer's stats until want messages are processed (or dead) and
// returns the time since t0. It fails when nothing happens for stall, or when Run returns.
func waitForConsumer(ctx context.Context, r *run, mode string, stats func() consumer.Stats, want int64, t0 time.Time, stall time.Duration, runDone <-chan struct{}) (time.Duration, error) {
	done := func() int64 { st := stats(); return st.Processed + st.DeadLettered }
	stopProgress := progress(r, 2*time.Second, func() string {
		st := stats()
		return fmt.Sprintf("%s: %d/%d processed (retries %d, dead letters %d)", mode, st.Processed, want, st.Retries, st.DeadLettered)
	})
	defer stopProgress()
	last, lastGain := int64(0), time.Now()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for {
		n := done()
		if n >= want {
			return time.Since(t0), nil
		}
		if n > last {
			last, lastGain = n, time.Now()
		} else if time.Since(lastGain) > stall {
			return 0, fmt.Errorf("%w: the consumer processed %d of %d messages and nothing more for %s", ErrCheckFailed, n, want, stall)
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-runDone:
			return 0, errors.New("consumer stopped early")
		case <-tick.C:
		}
	}
}

// checkEffects reads the dedup rows and the balances into res.
func checkEffects(ctx context.Context, pool *pgxpool.Pool, schema, accounts, durable string, set *msgSet, nAccounts int, res *consumeResult) error {
	dedup := pgx.Identifier{schema, "txoutbox_consumer_dedup"}.Sanitize()
	rows, err := pool.Query(ctx, "SELECT consumer, idempotency_key FROM "+dedup)
	if err != nil {
		return err
	}
	seen := make([]bool, len(set.ids))
	var cons, key string
	_, err = pgx.ForEachRow(rows, []any{&cons, &key}, func() error {
		u, err := uuid.Parse(key)
		i, ok := set.index[u]
		if err != nil || !ok || cons != durable || seen[i] {
			res.unknownRows++
			return nil
		}
		seen[i] = true
		res.dedupRows++
		return nil
	})
	if err != nil {
		return fmt.Errorf("read dedup rows: %w", err)
	}
	want := make([]int64, nAccounts+1)
	for i := range set.ids {
		want[i%nAccounts+1]++
	}
	rows, err = pool.Query(ctx, "SELECT id, balance FROM "+accounts)
	if err != nil {
		return err
	}
	var id int
	var bal int64
	got := make([]bool, nAccounts+1)
	_, err = pgx.ForEachRow(rows, []any{&id, &bal}, func() error {
		res.balanceSum += bal
		if id < 1 || id > nAccounts {
			return fmt.Errorf("%w: unexpected account %d", ErrCheckFailed, id)
		}
		got[id] = true
		if d := bal - want[id]; d != 0 {
			res.wrongAccounts++
			if d > 0 {
				res.extraEffects += d
			} else {
				res.missingEffects -= d
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("read balances: %w", err)
	}
	for a := 1; a <= nAccounts; a++ {
		if !got[a] {
			return fmt.Errorf("%w: account %d is missing", ErrCheckFailed, a)
		}
	}
	return nil
}

// profilePath inserts mode before base's extension (cpu.pprof → cpu.batch.pprof); "" stays "".
func profilePath(base, mode string) string {
	if base == "" {
		return ""
	}
	ext := filepath.Ext(base)
	return strings.TrimSuffix(base, ext) + "." + mode + ext
}
