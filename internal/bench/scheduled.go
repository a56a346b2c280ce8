package bench

import (
	"context"
	"flag"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/outbox"
)

func init() {
	register(scenario{name: "scheduled", summary: "delayed messages: lateness (due → stored) of messages due within a minute; drain of due rows with and without a far-future scheduled backlog", flags: scheduledFlags})
}

// Defaults of the scheduled scenario (issue 17's measurements).
const (
	DefaultScheduledMsgs   = 10000
	DefaultScheduledWindow = time.Minute
	DefaultFarRows         = 1000000
)

type scheduledOpts struct {
	msgs          int
	window, lead  time.Duration
	drainMsgs     int
	far, farBytes int
	lateFar       int
	size, perTx   int
	skipLateness  bool
	skipDrain     bool
	rounds        int
	stall         time.Duration
}

func scheduledFlags(fs *flag.FlagSet) func(context.Context, *run) error {
	o := &scheduledOpts{}
	fs.IntVar(&o.msgs, "msgs", DefaultScheduledMsgs, "lateness: delayed messages, due spread evenly over --window")
	fs.DurationVar(&o.window, "window", DefaultScheduledWindow, "lateness: the messages fall due within this long")
	fs.DurationVar(&o.lead, "lead", 5*time.Second, "lateness: the first message falls due this long after the enqueueing ends")
	fs.IntVar(&o.drainMsgs, "drain-msgs", DefaultDrainMsgs, "drain: due (immediate) messages in each backlog")
	fs.IntVar(&o.far, "far", DefaultFarRows, "drain: scheduled rows due a day or more ahead in the second outbox")
	fs.IntVar(&o.lateFar, "late-far", 0, "lateness: also hold this many scheduled rows due a day or more ahead in the lateness outbox (0: none), to measure lateness beside a large far-future backlog")
	fs.IntVar(&o.farBytes, "far-payload", 16, "drain: payload bytes of each far-future row (they are never published; small keeps the table in memory on a shared machine)")
	fs.IntVar(&o.size, "payload", DefaultPayload, "payload bytes per published message (random)")
	fs.IntVar(&o.perTx, "per-tx", DefaultPerTx, "messages per enqueueing transaction (each also inserts one business row)")
	fs.IntVar(&o.rounds, "rounds", 2, "drain: rounds; each drains a fresh backlog in both outboxes, alternating which goes first")
	fs.BoolVar(&o.skipLateness, "skip-lateness", false, "do not measure lateness")
	fs.BoolVar(&o.skipDrain, "skip-drain", false, "do not measure the drain with and without the far-future backlog")
	fs.DurationVar(&o.stall, "stall-timeout", 2*time.Minute, "fail when the stream gains nothing for this long")
	return func(ctx context.Context, r *run) error { return scheduledBench(ctx, r, o) }
}

func scheduledBench(ctx context.Context, r *run, o *scheduledOpts) error {
	if o.msgs < 1 || o.window <= 0 || o.lead < 0 || o.drainMsgs < 1 || o.far < 0 || o.lateFar < 0 || o.farBytes < 0 || o.size < 0 || o.perTx < 1 || o.rounds < 1 {
		return usageErr("--msgs, --window, --drain-msgs, --per-tx and --rounds must be positive; --lead, --far, --late-far, --far-payload and --payload not negative")
	}
	if o.skipLateness && o.skipDrain {
		return usageErr("--skip-lateness and --skip-drain together leave nothing to measure")
	}
	if err := r.start(ctx); err != nil {
		return err
	}
	kv := []any{}
	failed := []string{}
	if !o.skipLateness {
		res, err := schedLateness(ctx, r, o)
		if err != nil {
			return err
		}
		kv = append(kv, res.kv...)
		failed = append(failed, res.failed...)
	}
	if !o.skipDrain {
		res, err := schedDrain(ctx, r, o)
		if err != nil {
			return err
		}
		kv = append(kv, res.kv...)
		failed = append(failed, res.failed...)
	}
	r.result(append(kv, "load1", load1())...)
	if len(failed) > 0 {
		return fmt.Errorf("%w: %v", ErrCheckFailed, failed)
	}
	return nil
}

type partResult struct {
	kv     []any
	failed []string
}

// schedLateness enqueues o.msgs delayed messages due evenly over o.window while a relay with
// the default settings runs, and measures for each the time from its delivery time to its
// timestamp in the stream.
func schedLateness(ctx context.Context, r *run, o *scheduledOpts) (partResult, error) {
	var out partResult
	schema, err := r.NewSchema(ctx)
	if err != nil {
		return out, err
	}
	const stream, subjects, subject = streamPrefix + "SCHED", "bench.sched.>", "bench.sched.msg"
	s, err := r.ResetStream(ctx, stream, subjects)
	if err != nil {
		return out, err
	}
	set, err := newMsgSet(o.msgs, o.size, 0)
	if err != nil {
		return out, err
	}
	pool, err := r.NewPool(ctx, 4)
	if err != nil {
		return out, err
	}
	client, err := outbox.NewClient(&outbox.Config{Schema: schema})
	if err != nil {
		return out, err
	}
	if o.lateFar > 0 {
		if err := insertFarRows(ctx, r, pool, schema, "lateness", o.lateFar, o.farBytes); err != nil {
			return out, err
		}
	}
	rl, err := r.newRelay(ctx, schema, subjects)
	if err != nil {
		return out, err
	}
	rctx, stopRelay := context.WithCancel(ctx)
	defer stopRelay()
	runErr := make(chan error, 1)
	go func() { runErr <- rl.Run(rctx) }()

	// Due times from a moment after the enqueueing ends (estimated generously), evenly spread.
	enqueueBudget := time.Duration(o.msgs/o.perTx+1) * 20 * time.Millisecond
	first := time.Now().Add(enqueueBudget + o.lead)
	step := o.window / time.Duration(o.msgs)
	due := make([]time.Time, o.msgs)
	for i := range due {
		due[i] = first.Add(time.Duration(i) * step)
	}
	r.logf("lateness: enqueueing %d delayed messages due from %s over %s (relay running, default settings, schema %s)",
		o.msgs, first.Format(time.RFC3339Nano), o.window, schema)
	start := time.Now()
	for t := 0; t*o.perTx < o.msgs; t++ {
		msgs := make([]outbox.Message, 0, o.perTx)
		for i := t * o.perTx; i < min((t+1)*o.perTx, o.msgs); i++ {
			m := set.message(i, subject)
			m.DeliverAt = due[i]
			msgs = append(msgs, m)
		}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "INSERT INTO "+businessTable(schema)+" (producer, seq, note) VALUES (0, $1, 'sched')", t); err != nil {
				return err
			}
			_, err := client.EnqueueTx(ctx, tx, msgs...)
			return err
		}); err != nil {
			return out, fmt.Errorf("enqueue transaction %d: %w", t, err)
		}
	}
	r.logf("lateness: enqueued in %s; first due in %s", time.Since(start).Round(time.Millisecond), time.Until(first).Round(time.Millisecond))
	if time.Now().After(first) {
		r.logf("lateness: WARNING: enqueueing ended after the first due time; the first messages' lateness includes it")
	}
	if _, err := waitForStream(ctx, r, s, uint64(o.msgs), time.Now(), o.window+o.stall, runErr); err != nil {
		return out, err
	}
	stopRelay()
	if err := <-runErr; err != nil {
		return out, fmt.Errorf("relay: %w", err)
	}

	c := newChecker(set, nil, 0)
	late := make([]time.Duration, 0, o.msgs)
	early := 0
	err = readStream(ctx, r.JS, stream, func(m jetstream.Msg) {
		i, first := c.add(m.Headers(), m.Data())
		if !first {
			return
		}
		md, err := m.Metadata()
		if err != nil {
			return
		}
		d := md.Timestamp.Sub(due[i])
		if d < 0 {
			early++
		}
		late = append(late, d)
	})
	if err != nil {
		return out, err
	}
	res := c.result()
	sortDurations(late)
	p50, p99, pmax := percentile(late, 0.50), percentile(late, 0.99), late[len(late)-1]
	r.logf("lateness: %s; due → stored p50 %s p99 %s max %s; stored before due: %d", res, ms(p50), ms(p99), ms(pmax), early)
	out.kv = []any{"late_msgs", o.msgs, "late_far_rows", o.lateFar, "late_window_s", o.window.Seconds(),
		"late_p50_ms", p50.Seconds() * 1000, "late_p99_ms", p99.Seconds() * 1000, "late_max_ms", pmax.Seconds() * 1000,
		"late_early", early, "late_lost", res.Lost, "late_duplicates", res.Duplicates}
	if !res.ok() {
		out.failed = append(out.failed, "lateness stream: "+res.String())
	}
	if early > 0 {
		out.failed = append(out.failed, fmt.Sprintf("%d messages stored before their delivery time", early))
	}
	return out, nil
}

// schedDrain times the relay draining backlogs of due messages in two outboxes, the second
// also holding o.far scheduled rows due a day or more ahead; the ratio of the drain rates says
// what the far-future rows cost. The two alternate over o.rounds rounds (without, with; then
// with, without; ...), each round draining a fresh backlog, so that neither profits from a
// warmer broker or database.
func schedDrain(ctx context.Context, r *run, o *scheduledOpts) (partResult, error) {
	var out partResult
	type outboxRun struct {
		name   string
		far    int
		schema string
		dur    time.Duration
	}
	runs := []*outboxRun{{name: "without", far: 0}, {name: "with", far: o.far}}
	pool, err := r.NewPool(ctx, 5)
	if err != nil {
		return out, err
	}
	const subject, subjects = "bench.scheddrain.msg", "bench.scheddrain.>"
	for _, x := range runs {
		if x.schema, err = r.NewSchema(ctx); err != nil {
			return out, err
		}
		if x.far == 0 {
			continue
		}
		if err := insertFarRows(ctx, r, pool, x.schema, "drain "+x.name, x.far, o.farBytes); err != nil {
			return out, err
		}
	}
	for round := 0; round < o.rounds; round++ {
		order := []*outboxRun{runs[0], runs[1]}
		if round%2 == 1 {
			order[0], order[1] = order[1], order[0]
		}
		for _, x := range order {
			set, err := newMsgSet(o.drainMsgs, o.size, 0)
			if err != nil {
				return out, err
			}
			client, err := outbox.NewClient(&outbox.Config{Schema: x.schema})
			if err != nil {
				return out, err
			}
			r.logf("drain %s, round %d: enqueueing %d due messages (relay stopped)", x.name, round+1, o.drainMsgs)
			if _, err := enqueueBacklog(ctx, r, pool, client, x.schema, set, subject, &drainOpts{perTx: o.perTx, loaders: 4}); err != nil {
				return out, err
			}
			rank, err := outboxOrder(ctx, pool, x.schema, set)
			if err != nil {
				return out, err
			}
			if _, err := pool.Exec(ctx, "VACUUM ANALYZE "+outboxTable(x.schema)); err != nil {
				return out, err
			}
			stream := streamPrefix + "SCHEDDRAIN"
			s, err := r.ResetStream(ctx, stream, subjects)
			if err != nil {
				return out, err
			}
			rl, err := r.newRelay(ctx, x.schema, subjects)
			if err != nil {
				return out, err
			}
			rctx, stopRelay := context.WithCancel(ctx)
			runErr := make(chan error, 1)
			t0 := time.Now()
			go func() { runErr <- rl.Run(rctx) }()
			dur, err := waitForStream(ctx, r, s, uint64(o.drainMsgs), t0, o.stall, runErr)
			if err == nil {
				err = waitForReadyEmpty(ctx, pool, x.schema, 30*time.Second)
			}
			stopRelay()
			if rerr := <-runErr; err == nil && rerr != nil {
				err = fmt.Errorf("relay: %w", rerr)
			}
			if err != nil {
				return out, err
			}
			x.dur += dur
			res, err := checkStream(ctx, r.JS, stream, set, rank)
			if err != nil {
				return out, err
			}
			var left int64
			if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+outboxTable(x.schema)+" WHERE state = 'scheduled'").Scan(&left); err != nil {
				return out, err
			}
			r.logf("drain %s, round %d: %d due messages stored in %s (%.0f msgs/s); %s; %d scheduled rows left (want %d); relay published=%d",
				x.name, round+1, o.drainMsgs, dur.Round(time.Millisecond), float64(o.drainMsgs)/dur.Seconds(), res, left, x.far, rl.Stats().Published)
			if !res.ok() {
				out.failed = append(out.failed, "drain "+x.name+": "+res.String())
			}
			if left != int64(x.far) {
				out.failed = append(out.failed, fmt.Sprintf("drain %s: %d scheduled rows left, want %d (a far-future row was published)", x.name, left, x.far))
			}
			if rl.Stats().Published != int64(o.drainMsgs) {
				out.failed = append(out.failed, fmt.Sprintf("drain %s: relay published %d rows, want %d", x.name, rl.Stats().Published, o.drainMsgs))
			}
			if !r.keep {
				r.DeleteStream(stream)
			}
		}
	}
	total := float64(o.drainMsgs * o.rounds)
	without, with := total/runs[0].dur.Seconds(), total/runs[1].dur.Seconds()
	r.logf("drain: %.0f msgs/s with %d far-future scheduled rows, %.0f without (%d rounds each): ratio %.2f", with, o.far, without, o.rounds, with/without)
	out.kv = []any{"drain_msgs", o.drainMsgs, "drain_rounds", o.rounds, "far_rows", o.far,
		"drain_without_msgs_per_s", without, "drain_with_msgs_per_s", with, "drain_ratio", with / without}
	return out, nil
}

// waitForReadyEmpty waits until the relay has settled every ready row of schema.
func waitForReadyEmpty(ctx context.Context, pool *pgxpool.Pool, schema string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		var n int64
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+outboxTable(schema)+" WHERE state = 'ready'").Scan(&n); err != nil {
			return err
		}
		if n == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w: %d ready rows still unsettled %s after the stream held every message", ErrCheckFailed, n, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// insertFarRows inserts n scheduled rows due 1 to 2 days ahead (never published by a run)
// into schema's outbox, as a large far-future backlog.
func insertFarRows(ctx context.Context, r *run, pool *pgxpool.Pool, schema, what string, n, payloadBytes int) error {
	r.logf("%s: inserting %d scheduled rows due 1 to 2 days ahead (%d B payloads) in %s", what, n, payloadBytes, schema)
	t0 := time.Now()
	if _, err := pool.Exec(ctx, `INSERT INTO `+outboxTable(schema)+` (message_id, subject, partition_key, payload, state, deliver_at)
SELECT gen_random_uuid(), 'bench.scheddrain.far', (g % 2147483647)::int4, convert_to(repeat('x', $2), 'UTF8'), 'scheduled',
       now() + interval '1 day' + g * (interval '1 day' / $1)
FROM generate_series(1, $1) g`, n, payloadBytes); err != nil {
		return fmt.Errorf("insert far-future rows: %w", err)
	}
	r.logf("%s: inserted in %s", what, time.Since(t0).Round(time.Millisecond))
	return nil
}
