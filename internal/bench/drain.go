package bench

import (
	"context"
	"flag"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/relay"
)

func init() {
	register(scenario{name: "drain", summary: "backlog drain: the relay's msgs/s beside the broker's own ceiling", flags: drainFlags})
}

// Yardstick A defaults.
const (
	DefaultDrainMsgs = 50000
	DefaultPerTx     = 100
	DefaultPayload   = 512
	// DefaultCeilingWindow is the bare publisher's window of PubAcks in flight: the relay's
	// default MaxInFlight.
	DefaultCeilingWindow = relay.DefaultMaxInFlight
)

type drainOpts struct {
	msgs, perTx, size, loaders, keys, window int
	batchSize, maxInFlight                   int // relay settings with --relays (0: the defaults)
	repeat                                   int // with --relays: rounds of measurements
	cpuprofile                               string
	relays                                   string
	skipCeiling, trace                       bool
	timeout                                  time.Duration
}

func drainFlags(fs *flag.FlagSet) func(context.Context, *run) error {
	o := &drainOpts{}
	fs.IntVar(&o.msgs, "msgs", DefaultDrainMsgs, "messages in the backlog (500000 checks that draining is linear)")
	fs.IntVar(&o.perTx, "per-tx", DefaultPerTx, "messages per enqueueing transaction (each also inserts one business row)")
	fs.IntVar(&o.size, "payload", DefaultPayload, "payload bytes per message (random)")
	fs.IntVar(&o.loaders, "loaders", 4, "concurrent transactions while building the backlog (not timed)")
	fs.IntVar(&o.keys, "keys", 0, "spread the messages over this many ordering keys (0: unkeyed, as in the yardstick); stream order is then checked per key")
	fs.IntVar(&o.window, "ceiling-window", DefaultCeilingWindow, "PubAcks in flight at most for the bare publisher")
	fs.StringVar(&o.cpuprofile, "cpuprofile", "", "write a CPU profile (pprof) of this process while the relay drains to this file (with --relays: of each relay process, to this path with .r<count>-<i> appended)")
	fs.IntVar(&o.batchSize, "relay-batch-size", 0, "with --relays: the relays' BatchSize (0: the default, 500)")
	fs.IntVar(&o.maxInFlight, "relay-max-in-flight", 0, "with --relays: the relays' MaxInFlight (0: the default, 1000)")
	fs.IntVar(&o.repeat, "repeat", 1, "with --relays: measure this many rounds (each: the ceiling alone and beside PostgreSQL's claim and settle work, then every relay count with its own ceiling) and report medians")
	fs.StringVar(&o.relays, "relays", "", "scale-out: drain the same backlog with this many relay processes, for each count of a comma-separated list (1,2,3), and report each beside one relay and the broker's ceiling")
	fs.BoolVar(&o.skipCeiling, "skip-ceiling", false, "do not measure the broker's ceiling")
	fs.BoolVar(&o.trace, "trace", false, "then drain the same backlog again with tracing on (every span sampled, a discarding exporter) and report its cost")
	fs.DurationVar(&o.timeout, "stall-timeout", time.Minute, "fail when the stream gains nothing for this long")
	return func(ctx context.Context, r *run) error { return drain(ctx, r, o) }
}

func drain(ctx context.Context, r *run, o *drainOpts) error {
	if o.msgs < 1 || o.perTx < 1 || o.size < 0 || o.loaders < 1 || o.keys < 0 || o.window < 1 {
		return usageErr("--msgs, --per-tx, --loaders and --ceiling-window must be positive; --payload and --keys not negative")
	}
	if o.relays == "" && (o.batchSize != 0 || o.maxInFlight != 0 || o.repeat != 1) {
		return usageErr("--relay-batch-size, --relay-max-in-flight and --repeat go with --relays (the relay processes' settings and rounds); without it one relay in this process drains with its defaults")
	}
	if o.relays != "" {
		if o.repeat < 1 {
			return usageErr("--repeat must be positive")
		}
		counts, err := parseCounts(o.relays)
		if err != nil {
			return err
		}
		return drainRelays(ctx, r, o, counts)
	}
	if err := r.start(ctx); err != nil {
		return err
	}
	schema, err := r.NewSchema(ctx)
	if err != nil {
		return err
	}
	const (
		stream, subject               = streamPrefix + "DRAIN", "bench.drain.msg"
		ceilStream, ceilSubject       = streamPrefix + "CEILING", "bench.ceiling.msg"
		relaySubjects, ceilingSubject = "bench.drain.>", "bench.ceiling.>"
	)
	drainStream, err := r.ResetStream(ctx, stream, relaySubjects)
	if err != nil {
		return err
	}
	set, err := newMsgSet(o.msgs, o.size, o.keys)
	if err != nil {
		return err
	}

	// 1. The backlog, with the relay stopped.
	pool, err := r.NewPool(ctx, int32(o.loaders+1))
	if err != nil {
		return err
	}
	client, err := outbox.NewClient(&outbox.Config{Schema: schema})
	if err != nil {
		return err
	}
	r.logf("enqueueing %d × %d B messages, %d per transaction, %d loaders (relay stopped)", o.msgs, o.size, o.perTx, o.loaders)
	enqDur, err := enqueueBacklog(ctx, r, pool, client, schema, set, subject, o)
	if err != nil {
		return err
	}
	enqRate := float64(o.msgs) / enqDur.Seconds()
	r.logf("enqueued in %s (%.0f msgs/s)", enqDur.Round(time.Millisecond), enqRate)
	rank, err := outboxOrder(ctx, pool, schema, set)
	if err != nil {
		return err
	}

	// 2. The broker's ceiling: a bare async publisher of the same messages into a fresh stream.
	var ceilRate float64
	var ceilDur time.Duration
	if !o.skipCeiling {
		if _, err := r.ResetStream(ctx, ceilStream, ceilingSubject); err != nil {
			return err
		}
		r.logf("ceiling: bare JetStream async publisher, window %d, into %s", o.window, ceilStream)
		if ceilDur, err = publishCeiling(ctx, r, "outbox-bench ceiling", set, ceilSubject, o.window); err != nil {
			return err
		}
		ceilRate = float64(o.msgs) / ceilDur.Seconds()
		r.logf("ceiling: %d messages stored in %s (%.0f msgs/s); checking the stream", o.msgs, ceilDur.Round(time.Millisecond), ceilRate)
		res, err := checkStream(ctx, r.JS, ceilStream, set, nil)
		if err != nil {
			return err
		}
		if !res.ok() {
			return fmt.Errorf("%w: ceiling stream %s: %s", ErrCheckFailed, ceilStream, res)
		}
		if !r.keep {
			r.DeleteStream(ceilStream) // give the relay the same fresh broker the publisher had
		}
	}

	// 3. The relay: start it and time until the stream holds every message.
	sqlt := newSQLTimer()
	rl, err := r.newRelay(ctx, schema, relaySubjects, sqlt)
	if err != nil {
		return err
	}
	stopProfile, err := startProfile(o.cpuprofile)
	if err != nil {
		return err
	}
	defer stopProfile()
	rctx, stopRelay := context.WithCancel(ctx)
	defer stopRelay()
	runErr := make(chan error, 1)
	r.logf("relay: starting (default settings, schema %s, subjects %s)", schema, relaySubjects)
	t0 := time.Now()
	go func() { runErr <- rl.Run(rctx) }()
	relayDur, err := waitForStream(ctx, r, drainStream, uint64(o.msgs), t0, o.timeout, runErr)
	if err != nil {
		return err
	}
	if path := stopProfile(); path != "" {
		r.logf("relay: CPU profile written to %s", path)
	}
	relayRate := float64(o.msgs) / relayDur.Seconds()
	claim, settle := sqlt.get("claim"), sqlt.get("settle")
	r.logf("relay: %d messages stored in %s (%.0f msgs/s, %.2f µs/msg, %d batches)", o.msgs, relayDur.Round(time.Millisecond),
		relayRate, relayDur.Seconds()*1e6/float64(o.msgs), rl.Stats().Batches)
	r.logf("relay: wall time in claim queries %s; in settle statements %s; the rest (publishing, awaiting PubAcks, the loop) %s",
		claim, settle, (relayDur - claim.total - settle.total).Round(time.Millisecond))

	// Let the relay settle its last batch, then stop it and check everything.
	if err := waitForOutboxEmpty(ctx, pool, schema, 30*time.Second); err != nil {
		return err
	}
	stopRelay()
	if err := <-runErr; err != nil {
		return fmt.Errorf("relay: %w", err)
	}
	res, err := checkStream(ctx, r.JS, stream, set, rank)
	if err != nil {
		return err
	}
	var business int64
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+businessTable(schema)).Scan(&business); err != nil {
		return err
	}
	wantBusiness := int64((o.msgs + o.perTx - 1) / o.perTx)
	r.logf("check: %s; business rows %d (want %d); relay stats published=%d duplicate_acks=%d failed=%d dead=%d",
		res, business, wantBusiness, rl.Stats().Published, rl.Stats().Duplicates, rl.Stats().Failed, rl.Stats().Dead)

	var traced *tracedDrain
	if o.trace {
		if traced, err = drainTraced(ctx, r, set, o); err != nil {
			return err
		}
	}
	kv := []any{"msgs", o.msgs, "relay_msgs_per_s", relayRate}
	if ceilRate > 0 { // not measured with --skip-ceiling: left out, not 0
		kv = append(kv, "ceiling_msgs_per_s", ceilRate, "ratio", relayRate/ceilRate)
	}
	kv = append(kv,
		"relay_us_per_msg", relayDur.Seconds()*1e6/float64(o.msgs),
		"relay_s", relayDur.Seconds())
	if ceilRate > 0 {
		kv = append(kv, "ceiling_s", ceilDur.Seconds())
	}
	kv = append(kv,
		"enqueue_msgs_per_s", enqRate,
		"batches", rl.Stats().Batches,
		"claim_s", claim.total.Seconds(),
		"settle_s", settle.total.Seconds(),
		"keys", o.keys)
	kv = append(kv, res.kv()...)
	kv = append(kv, "load1", load1())
	r.result(append(kv, traceResult(traced, o.msgs, relayRate, ceilRate)...)...)
	switch {
	case traced != nil && !traced.check.ok():
		return fmt.Errorf("%w: traced stream: %s", ErrCheckFailed, traced.check)
	case !res.ok():
		return fmt.Errorf("%w: stream %s: %s", ErrCheckFailed, stream, res)
	case business != wantBusiness:
		return fmt.Errorf("%w: %d business rows, want %d", ErrCheckFailed, business, wantBusiness)
	case rl.Stats().Published != int64(o.msgs) || rl.Stats().Dead != 0:
		return fmt.Errorf("%w: relay settled %d published and %d dead rows, want %d and 0", ErrCheckFailed,
			rl.Stats().Published, rl.Stats().Dead, o.msgs)
	}
	return nil
}

// enqueueBacklog commits set in transactions of o.perTx messages, each with one business row,
// from o.loaders concurrent transactions. It returns the time it took.
func enqueueBacklog(ctx context.Context, r *run, pool *pgxpool.Pool, client *outbox.Client, schema string, set *msgSet, subject string, o *drainOpts) (time.Duration, error) {
	txs := (len(set.ids) + o.perTx - 1) / o.perTx
	var next, done atomic.Int64
	var wg sync.WaitGroup
	errc := make(chan error, o.loaders)
	insert := "INSERT INTO " + businessTable(schema) + " (producer, seq, note) VALUES ($1, $2, $3)"
	start := time.Now()
	stopProgress := progress(r, 2*time.Second, func() string {
		return fmt.Sprintf("enqueued %d/%d", min(int(done.Load())*o.perTx, len(set.ids)), len(set.ids))
	})
	for w := 0; w < o.loaders; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			msgs := make([]outbox.Message, 0, o.perTx)
			for {
				t := int(next.Add(1) - 1)
				if t >= txs || ctx.Err() != nil {
					return
				}
				msgs = msgs[:0]
				for i := t * o.perTx; i < min((t+1)*o.perTx, len(set.ids)); i++ {
					msgs = append(msgs, set.message(i, subject))
				}
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, insert, w, t, "drain"); err != nil {
						return err
					}
					_, err := client.EnqueueTx(ctx, tx, msgs...)
					return err
				})
				if err != nil {
					errc <- fmt.Errorf("enqueue transaction %d: %w", t, err)
					return
				}
				done.Add(1)
			}
		}()
	}
	wg.Wait()
	stopProgress()
	close(errc)
	if err := <-errc; err != nil {
		return 0, err
	}
	return time.Since(start), ctx.Err()
}

// outboxOrder reads the backlog back in row id order (the order the relay publishes in):
// it checks that every message is there once and returns each message's rank in that order.
func outboxOrder(ctx context.Context, pool *pgxpool.Pool, schema string, set *msgSet) ([]int32, error) {
	rows, err := pool.Query(ctx, "SELECT message_id FROM "+outboxTable(schema)+" WHERE state = 'ready' ORDER BY id")
	if err != nil {
		return nil, err
	}
	rank := make([]int32, len(set.ids))
	for i := range rank {
		rank[i] = -1
	}
	n := int32(0)
	var id uuid.UUID
	_, err = pgx.ForEachRow(rows, []any{&id}, func() error {
		i, ok := set.index[id]
		if !ok || rank[i] >= 0 {
			return fmt.Errorf("%w: outbox holds an unknown or repeated message id %s", ErrCheckFailed, id)
		}
		rank[i] = n
		n++
		return nil
	})
	if err != nil {
		return nil, err
	}
	if int(n) != len(set.ids) {
		return nil, fmt.Errorf("%w: outbox holds %d ready messages after enqueueing %d", ErrCheckFailed, n, len(set.ids))
	}
	return rank, nil
}

// publishCeiling publishes set with a bare JetStream async publisher (Nats-Msg-Id set, at most
// window PubAcks in flight, like the relay) on a NATS connection of its own named connName, and
// returns the time from the first publish to the last PubAck. Messages are built before the
// clock starts.
func publishCeiling(ctx context.Context, r *run, connName string, set *msgSet, subject string, window int) (time.Duration, error) {
	nc, err := r.ConnectNATS(connName)
	if err != nil {
		return 0, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(window), jetstream.WithPublishAsyncTimeout(relay.DefaultPublishTimeout))
	if err != nil {
		return 0, err
	}
	msgs := make([]*nats.Msg, len(set.ids))
	for i := range msgs {
		msgs[i] = set.natsMsg(i, subject)
	}
	futs := make([]jetstream.PubAckFuture, 0, window)
	var failed error
	dups := 0
	await := func(f jetstream.PubAckFuture) {
		select {
		case ack := <-f.Ok():
			if ack.Duplicate {
				dups++
			}
		case err := <-f.Err():
			if failed == nil {
				failed = err
			}
		case <-ctx.Done():
			if failed == nil {
				failed = ctx.Err()
			}
		}
	}
	start := time.Now()
	for _, m := range msgs {
		if len(futs) >= window {
			await(futs[0])
			futs = futs[1:]
		}
		f, err := js.PublishMsgAsync(m)
		if err != nil {
			return 0, fmt.Errorf("ceiling publish: %w", err)
		}
		futs = append(futs, f)
	}
	for _, f := range futs {
		await(f)
	}
	elapsed := time.Since(start)
	if failed != nil {
		return 0, fmt.Errorf("ceiling publish: %w", failed)
	}
	if dups > 0 {
		return 0, fmt.Errorf("%w: ceiling: %d PubAcks reported duplicates in a fresh stream", ErrCheckFailed, dups)
	}
	return elapsed, nil
}

// waitForStream polls the stream until it holds want messages and returns the time from t0
// to when the last of them was stored (the stream's own timestamp of its last message: the
// server runs on this machine's clock). It polls every 50 ms, not faster: each poll is a
// JetStream API request the nats-server answers while it stores the relay's messages, and at
// 5 ms the polls cost the relay's side a few percent of two cores. It fails when the stream
// gains nothing for stall, or when the relay stops.
func waitForStream(ctx context.Context, r *run, s jetstream.Stream, want uint64, t0 time.Time, stall time.Duration, runErr <-chan error) (time.Duration, error) {
	var have atomic.Uint64
	stopProgress := progress(r, 2*time.Second, func() string { return fmt.Sprintf("relay: %d/%d in the stream", have.Load(), want) })
	defer stopProgress()
	lastGain := time.Now()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		info, err := s.Info(ctx)
		if err != nil {
			return 0, fmt.Errorf("stream info: %w", err)
		}
		if n := info.State.Msgs; n >= want {
			if last := info.State.LastTime; last.After(t0) && time.Since(last) >= 0 {
				return last.Sub(t0), nil
			}
			return time.Since(t0), nil
		} else if n > have.Load() {
			have.Store(n)
			lastGain = time.Now()
		} else if time.Since(lastGain) > stall {
			return 0, fmt.Errorf("%w: the stream holds %d of %d messages and gained nothing for %s", ErrCheckFailed, n, want, stall)
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case err := <-runErr:
			return 0, fmt.Errorf("relay stopped early: %v", err)
		case <-tick.C:
		}
	}
}

// waitForOutboxEmpty waits until the relay has settled every row (published rows are deleted).
func waitForOutboxEmpty(ctx context.Context, pool *pgxpool.Pool, schema string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		var n int64
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+outboxTable(schema)).Scan(&n); err != nil {
			return err
		}
		if n == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w: %d outbox rows still unsettled %s after the stream held every message", ErrCheckFailed, n, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// progress prints what() every interval until the returned function is called.
func progress(r *run, interval time.Duration, what func() string) func() {
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				r.logf("%s", what())
			}
		}
	}()
	var once sync.Once
	return func() { once.Do(func() { close(stop); <-done }) }
}
