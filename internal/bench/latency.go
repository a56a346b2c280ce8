package bench

import (
	"context"
	"flag"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/relay"
)

func init() {
	register(scenario{name: "latency", summary: "steady load: commit → stored-in-stream latency at 1,000 tx/s", flags: latencyFlags})
}

// Yardstick B defaults.
const (
	DefaultLatencyRate      = 1000.0
	DefaultLatencyDuration  = 20 * time.Second
	DefaultLatencyProducers = 4
)

type latencyOpts struct {
	rate       float64
	duration   time.Duration
	producers  int
	size       int
	cpuprofile string
	drainWait  time.Duration
}

func latencyFlags(fs *flag.FlagSet) func(context.Context, *run) error {
	o := &latencyOpts{}
	fs.Float64Var(&o.rate, "rate", DefaultLatencyRate, "transactions per second, all producers together, paced evenly")
	fs.DurationVar(&o.duration, "duration", DefaultLatencyDuration, "how long the producers commit")
	fs.IntVar(&o.producers, "producers", DefaultLatencyProducers, "concurrent producers")
	fs.IntVar(&o.size, "payload", DefaultPayload, "payload bytes per message (random)")
	fs.StringVar(&o.cpuprofile, "cpuprofile", "", "write a CPU profile (pprof) of this process (producers, relay, consumer) to this file")
	fs.DurationVar(&o.drainWait, "drain-timeout", 30*time.Second, "after the producers stop, fail when a committed message is not in the stream within this long")
	return func(ctx context.Context, r *run) error { return latency(ctx, r, o) }
}

// received is one stream message as the consumer saw it.
type received struct {
	index  int
	stored time.Time // JetStream's timestamp: when the stream stored it
	recv   time.Time // when the consumer received it
}

func latency(ctx context.Context, r *run, o *latencyOpts) error {
	if o.rate <= 0 || o.duration <= 0 || o.producers < 1 || o.size < 0 {
		return usageErr("--rate, --duration and --producers must be positive, --payload not negative")
	}
	if err := r.start(ctx); err != nil {
		return err
	}
	schema, err := r.NewSchema(ctx)
	if err != nil {
		return err
	}
	const stream, subject, subjects = streamPrefix + "LATENCY", "bench.latency.msg", "bench.latency.>"
	s, err := r.ResetStream(ctx, stream, subjects)
	if err != nil {
		return err
	}
	interval := time.Duration(float64(o.producers) * float64(time.Second) / o.rate)
	perProducer := int(o.duration/interval) + 1
	set, err := newMsgSet(perProducer*o.producers, o.size, 0)
	if err != nil {
		return err
	}

	// The relay: in process, its own pool and NATS connection, default settings.
	rl, err := r.newRelay(ctx, schema, subjects)
	if err != nil {
		return err
	}
	rctx, stopRelay := context.WithCancel(ctx)
	defer stopRelay()
	runErr := make(chan error, 1)
	go func() { runErr <- rl.Run(rctx) }()
	if err := waitFor(ctx, 30*time.Second, func() bool { return len(rl.Partitions()) == relay.DefaultPartitions }); err != nil {
		return fmt.Errorf("relay did not take its partitions: %w", err)
	}

	// The consumer: an ordered consumer on the stream, its own connection.
	cnc, err := r.ConnectNATS("outbox-bench consumer")
	if err != nil {
		return err
	}
	cjs, err := jetstream.New(cnc)
	if err != nil {
		return err
	}
	cons, err := cjs.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return err
	}
	var mu sync.Mutex
	chk := newChecker(set, nil, 0)
	var got []received
	var firstSeen atomic.Int64
	cc, err := cons.Consume(func(m jetstream.Msg) {
		now := time.Now()
		meta, err := m.Metadata()
		if err != nil {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		if i, first := chk.add(m.Headers(), m.Data()); first {
			got = append(got, received{index: i, stored: meta.Timestamp, recv: now})
			firstSeen.Add(1)
		}
	})
	if err != nil {
		return err
	}
	defer cc.Stop()

	// The producers.
	pool, err := r.NewPool(ctx, int32(o.producers+1))
	if err != nil {
		return err
	}
	pnc, err := r.ConnectNATS("outbox-bench producers")
	if err != nil {
		return err
	}
	client, err := outbox.NewClient(&outbox.Config{Schema: schema, Doorbell: outbox.NewNATSDoorbell(pnc, "")})
	if err != nil {
		return err
	}
	stopProfile, err := startProfile(o.cpuprofile)
	if err != nil {
		return err
	}
	defer stopProfile()
	r.logf("producing: %d producers, %.0f tx/s in total (one every %s each), for %s; each tx 1 business row + 1 × %d B message, doorbell rung after commit",
		o.producers, o.rate, interval, o.duration, o.size)
	prod := produceSteady(ctx, r, pool, client, schema, set, subject, o, interval, perProducer, &firstSeen)
	if prod.err != nil {
		return prod.err
	}
	n := int(prod.committed.Load())
	r.logf("produced %d transactions in %s (%.0f tx/s); waiting for the stream", n, prod.elapsed.Round(time.Millisecond), float64(n)/prod.elapsed.Seconds())

	// Wait for every committed message, then a little longer for any duplicate.
	if err := waitFor(ctx, o.drainWait, func() bool { return firstSeen.Load() >= int64(n) }); err != nil {
		r.logf("only %d of %d committed messages reached the consumer within %s", firstSeen.Load(), n, o.drainWait)
	}
	time.Sleep(500 * time.Millisecond)
	cc.Stop()
	stopProfile()
	stored, err := streamMsgs(ctx, s)
	if err != nil {
		return err
	}
	if err := waitForOutboxEmpty(ctx, pool, schema, 10*time.Second); err != nil {
		r.logf("%v", err)
	}
	stopRelay()
	if err := <-runErr; err != nil {
		return fmt.Errorf("relay: %w", err)
	}

	mu.Lock()
	// Only the first n indexes were committed: a later one in the stream was never sent.
	for _, s := range chk.seen[n:] {
		if s {
			chk.res.Unknown++
		}
	}
	chk.res.Expected = n
	chk.seen = chk.seen[:n]
	res := chk.result()
	mu.Unlock()
	storedLat := make([]time.Duration, 0, len(got))
	recvLat := make([]time.Duration, 0, len(got))
	for _, g := range got {
		if g.index >= n {
			continue
		}
		storedLat = append(storedLat, g.stored.Sub(prod.commitAt[g.index]))
		recvLat = append(recvLat, g.recv.Sub(prod.commitAt[g.index]))
	}
	sortDurations(storedLat)
	sortDurations(recvLat)
	sortDurations(prod.txDur)
	var business int64
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+businessTable(schema)).Scan(&business); err != nil {
		return err
	}
	var left int64
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+outboxTable(schema)).Scan(&left); err != nil {
		return err
	}
	// A message stored twice under different stream sequences is a duplicate even if the
	// consumer missed it.
	dups := res.Duplicates + max(0, int(stored)-n-res.Duplicates-res.Unknown)
	r.logf("check: %s; stream holds %d; business rows %d (want %d); outbox rows left %d; relay duplicate_acks=%d",
		res, stored, business, n, left, rl.Stats().Duplicates)
	r.result("tx", n,
		"p50_ms", ms(percentile(storedLat, 0.50)),
		"p90_ms", ms(percentile(storedLat, 0.90)),
		"p99_ms", ms(percentile(storedLat, 0.99)),
		"max_ms", ms(percentile(storedLat, 1)),
		"lost", res.Lost,
		"duplicates", dups,
		"recv_p50_ms", ms(percentile(recvLat, 0.50)),
		"recv_p99_ms", ms(percentile(recvLat, 0.99)),
		"recv_max_ms", ms(percentile(recvLat, 1)),
		"rate_tx_per_s", float64(n)/prod.elapsed.Seconds(),
		"commit_p50_ms", ms(percentile(prod.txDur, 0.50)),
		"commit_p99_ms", ms(percentile(prod.txDur, 0.99)),
		"behind_max_ms", ms(prod.maxBehind),
		"load1", load1())
	switch {
	case !res.ok() || dups > 0 || int(stored) != n:
		return fmt.Errorf("%w: stream %s holds %d for %d committed: %s", ErrCheckFailed, stream, stored, n, res)
	case business != int64(n):
		return fmt.Errorf("%w: %d business rows for %d committed transactions", ErrCheckFailed, business, n)
	case left != 0:
		return fmt.Errorf("%w: %d outbox rows left unsettled", ErrCheckFailed, left)
	}
	return nil
}

type produced struct {
	committed atomic.Int64
	commitAt  []time.Time     // by message index: when Commit returned
	txDur     []time.Duration // BEGIN → Commit returned, per transaction
	maxBehind time.Duration   // the latest a transaction started after its scheduled time
	elapsed   time.Duration
	err       error
}

// produceSteady runs o.producers producers, each committing one transaction every interval
// (staggered so that together they commit evenly), for o.duration. Message indexes are handed
// out in commit-attempt order, so the committed messages are exactly indexes [0, committed).
func produceSteady(ctx context.Context, r *run, pool *pgxpool.Pool, client *outbox.Client, schema string, set *msgSet, subject string,
	o *latencyOpts, interval time.Duration, perProducer int, seen *atomic.Int64) *produced {
	p := &produced{commitAt: make([]time.Time, len(set.ids))}
	var next atomic.Int64
	var mu sync.Mutex
	insert := "INSERT INTO " + businessTable(schema) + " (producer, seq, note) VALUES ($1, $2, $3)"
	start := time.Now().Add(50 * time.Millisecond)
	end := start.Add(o.duration)
	stopProgress := progress(r, 2*time.Second, func() string {
		return fmt.Sprintf("committed %d, consumer has %d", p.committed.Load(), seen.Load())
	})
	defer stopProgress()
	var wg sync.WaitGroup
	errc := make(chan error, o.producers)
	for w := 0; w < o.producers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			durs := make([]time.Duration, 0, perProducer)
			var behind time.Duration
			defer func() {
				mu.Lock()
				p.txDur = append(p.txDur, durs...)
				p.maxBehind = max(p.maxBehind, behind)
				mu.Unlock()
			}()
			first := start.Add(time.Duration(w) * interval / time.Duration(o.producers))
			for k := 0; k < perProducer; k++ {
				target := first.Add(time.Duration(k) * interval)
				if !target.Before(end) || ctx.Err() != nil {
					return
				}
				if d := time.Until(target); d > 0 {
					time.Sleep(d)
				} else {
					behind = max(behind, -d)
				}
				i := int(next.Add(1) - 1)
				msg := set.message(i, subject)
				begin := time.Now()
				tx, err := pool.Begin(ctx)
				if err == nil {
					if _, err = tx.Exec(ctx, insert, w, k, "latency"); err == nil {
						if _, err = client.EnqueueTx(ctx, tx, msg); err == nil {
							err = tx.Commit(ctx)
						}
					}
					if err != nil {
						_ = tx.Rollback(context.WithoutCancel(ctx))
					}
				}
				if err != nil {
					errc <- fmt.Errorf("producer %d, transaction %d: %w", w, k, err)
					return
				}
				committed := time.Now()
				client.Ring()
				p.commitAt[i] = committed
				durs = append(durs, committed.Sub(begin))
				p.committed.Add(1)
			}
		}()
	}
	wg.Wait()
	p.elapsed = time.Since(start)
	close(errc)
	p.err = <-errc
	if p.err == nil && ctx.Err() != nil {
		p.err = ctx.Err()
	}
	if p.err == nil && int(next.Load()) != int(p.committed.Load()) {
		p.err = fmt.Errorf("internal: %d indexes handed out, %d committed", next.Load(), p.committed.Load())
	}
	return p
}

// waitFor polls cond every 5ms until it holds, ctx ends or timeout passes.
func waitFor(ctx context.Context, timeout time.Duration, cond func() bool) error {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return fmt.Errorf("not within %s", timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
	return nil
}
