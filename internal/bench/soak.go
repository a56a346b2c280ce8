package bench

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	mrand "math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/outbox"
)

func init() {
	register(scenario{name: "soak", summary: "sustained load for 20 minutes: flat latency and claim time, bounded table, index and relay memory", flags: soakFlags})
}

// Soak defaults (issue 18).
const (
	DefaultSoakRate      = 2000.0
	DefaultSoakDuration  = 20 * time.Minute
	DefaultSoakProducers = 32
	DefaultSoakKeys      = 1024
	DefaultSoakInterval  = 10 * time.Second
	DefaultSoakWindow    = 5 * time.Minute
	// SoakTolerance is the targets' bound: the last window's p99 latency, mean claim time,
	// outbox table and index size and relay RSS at most this many times the first window's.
	SoakTolerance = 1.5
	// soakSizeSlack is added to the size bound: a queue table of a few hundred kB legitimately
	// moves by a few pages with vacuum's timing.
	soakSizeSlack = 1 << 20
)

type soakOpts struct {
	rate                 float64
	duration, interval   time.Duration
	window, drainWait    time.Duration
	size, keys, producer int
	holdXmin, holdAt     time.Duration
	ownPostgres          bool
	targets              bool
}

// soakFlags is the `soak` scenario (issue 18, section 1):
//
//	Producers commit --rate transactions per second (each 1 business row + 1 message, doorbell
//	rung after commit) for --duration; the relay runs with its default settings in a process
//	of its own (so its RSS and CPU are its own, read from /proc); an ordered consumer drains the
//	stream. Every --interval one line: commit→stored p50/p99 of the messages stored in it,
//	claims and settles (count, mean and p99 per statement, from the relay's
//	txoutbox_relay_claim_seconds and _settle_seconds histograms on its metrics endpoint), the
//	outbox table's and its indexes' size, live and dead tuples and autovacuum runs
//	(pg_stat_user_tables), the relay's RSS and CPU, and the oldest open transaction's age (as
//	the relay's txoutbox_postgres_oldest_xact_age_seconds reads it, at the sample's time). At the end the first --window is
//	compared with the last: p99 latency and mean claim time within 1.5×, table+index size within
//	1.5× (+1 MiB), relay RSS within 1.5×: verdict=ok, or the targets missed. Then the check:
//	every committed message stored exactly once, intact, in commit order per key, every business
//	row there and no outbox row left.
//
// --hold-xmin D --hold-at T holds a transaction open in another session (REPEATABLE READ, a
// snapshot and a transaction id taken) from T to T+D: the known enemy of PostgreSQL queues.
// The final line then compares the D before it, the D while it is open and the D after it
// (p99 latency, mean claim time) and says how long after its end the per-second p99 latency
// stayed above 1.5× the one before it (recovery_s).
func soakFlags(fs *flag.FlagSet) func(context.Context, *run) error {
	o := &soakOpts{}
	fs.Float64Var(&o.rate, "rate", DefaultSoakRate, "transactions per second, all producers together, paced evenly (1 business row + 1 message each)")
	fs.DurationVar(&o.duration, "duration", DefaultSoakDuration, "how long the producers commit")
	fs.IntVar(&o.size, "size", DefaultPayload, "payload bytes per message (random)")
	fs.IntVar(&o.keys, "keys", DefaultSoakKeys, "ordering keys (0: unkeyed); each producer owns keys/producers of them, so commit order per key is known and checked in the stream")
	fs.IntVar(&o.producer, "producers", DefaultSoakProducers, "concurrent producer connections")
	fs.DurationVar(&o.interval, "interval", DefaultSoakInterval, "print one line this often")
	fs.DurationVar(&o.window, "window", DefaultSoakWindow, "compare the first and the last this long of the run (at most half of --duration)")
	fs.DurationVar(&o.holdXmin, "hold-xmin", 0, "hold a transaction (a snapshot and an xid) open in another session for this long during the soak (0: none)")
	fs.DurationVar(&o.holdAt, "hold-at", 5*time.Minute, "with --hold-xmin: when to open it, from the start of the producers")
	fs.BoolVar(&o.ownPostgres, "own-postgres", false, "run against a throwaway PostgreSQL cluster of its own (fsync on, default settings: autovacuum on), even when DATABASE_URL is set or 127.0.0.1:5432 answers")
	fs.BoolVar(&o.targets, "targets", true, "exit 1 when the targets are missed (false: only lost, duplicated, corrupted or misordered messages fail the run)")
	fs.DurationVar(&o.drainWait, "drain-timeout", time.Minute, "after the producers stop, fail when a committed message is not in the stream within this long")
	return func(ctx context.Context, r *run) error { return soak(ctx, r, o) }
}

// soakSet names the soak's messages without keeping them: message i's id carries a run prefix,
// its key index and i, and its payload is derived from (seed, i), so the consumer checks each
// message from its id alone.
type soakSet struct {
	prefix uint32
	seed   uint64
	size   int
}

func (s *soakSet) id(i int, key int) uuid.UUID {
	var u uuid.UUID
	binary.BigEndian.PutUint32(u[0:4], s.prefix)
	binary.BigEndian.PutUint16(u[4:6], uint16(key+1)) // 0: unkeyed
	u[6] = 0x80                                       // version 8 (custom)
	u[8] = 0x80                                       // RFC 9562 variant
	var idx [8]byte
	binary.BigEndian.PutUint64(idx[:], uint64(i))
	copy(u[10:16], idx[2:8])
	return u
}

// decode returns the index and key index (-1: unkeyed) of an id of this run.
func (s *soakSet) decode(u uuid.UUID) (i, key int, ok bool) {
	if binary.BigEndian.Uint32(u[0:4]) != s.prefix || u[6] != 0x80 || u[8] != 0x80 {
		return 0, 0, false
	}
	var idx [8]byte
	copy(idx[2:8], u[10:16])
	return int(binary.BigEndian.Uint64(idx[:])), int(binary.BigEndian.Uint16(u[4:6])) - 1, true
}

func (s *soakSet) payload(i int) []byte {
	var seed [32]byte
	binary.LittleEndian.PutUint64(seed[0:], s.seed)
	binary.LittleEndian.PutUint64(seed[8:], uint64(i))
	b := make([]byte, s.size)
	_, _ = mrand.NewChaCha8(seed).Read(b)
	return b
}

func soakKey(k int) string {
	if k < 0 {
		return ""
	}
	return "key-" + strconv.Itoa(k)
}

// soakState is what producers, consumer and reporter share.
type soakState struct {
	set      *soakSet
	commitAt []atomic.Int64 // unix ns when the producer's Commit returned; 0: not (yet) committed
	storedAt []int64        // unix ns JetStream stored it; 0: not seen (under mu)

	committed atomic.Int64

	mu         sync.Mutex
	consumed   int64
	recent     []int32 // indexes consumed since the last report
	lastOfKey  map[int]int
	duplicates int
	unknown    int
	corrupt    int
	misordered int
}

// soakSample is one reporting interval.
type soakSample struct {
	at                   time.Duration // end of the interval, from the producers' start
	p50, p99             time.Duration
	claims, settles      float64 // statements in the interval
	claimSum, settleSum  float64 // seconds
	claimP99, settleP99  float64 // bucket upper bounds, seconds
	tableBytes, idxBytes int64
	readyIdxBytes        int64
	live, dead           int64
	autovacuum           int64
	rssKB                int64
	cpuPct               float64
	xactAge              float64
}

func soak(ctx context.Context, r *run, o *soakOpts) error {
	switch {
	case o.rate <= 0 || o.duration <= 0 || o.producer < 1 || o.size < 0 || o.interval <= 0 || o.window <= 0:
		return usageErr("--rate, --duration, --producers, --interval and --window must be positive, --size not negative")
	case o.keys != 0 && (o.keys < o.producer || o.keys > 65535):
		return usageErr("--keys must be 0 or between --producers (%d) and 65535", o.producer)
	case o.holdXmin < 0 || (o.holdXmin > 0 && (o.holdAt < 0 || o.holdAt+o.holdXmin > o.duration)):
		return usageErr("--hold-at + --hold-xmin must fall within --duration")
	}
	window := min(o.window, o.duration/2)
	r.ownPostgres = o.ownPostgres
	if err := r.start(ctx); err != nil {
		return err
	}
	var autovacuum string
	if err := r.Admin.QueryRow(ctx, "SELECT current_setting('autovacuum')").Scan(&autovacuum); err != nil {
		return err
	}
	if autovacuum != "on" {
		r.logf("WARNING: autovacuum is %s on this server: dead tuples are never removed and the outbox table grows (--own-postgres runs a cluster with the defaults)", autovacuum)
	}
	schema, err := r.NewSchema(ctx)
	if err != nil {
		return err
	}
	const stream, subject, subjects = streamPrefix + "SOAK", "bench.soak.msg", "bench.soak.>"
	s, err := r.ResetStream(ctx, stream, subjects)
	if err != nil {
		return err
	}
	interval := time.Duration(float64(o.producer) * float64(time.Second) / o.rate)
	perProducer := int(o.duration/interval) + 1
	var pfx [12]byte
	_, _ = rand.Read(pfx[:])
	st := &soakState{
		set:       &soakSet{prefix: binary.BigEndian.Uint32(pfx[0:4]), seed: binary.BigEndian.Uint64(pfx[4:12]), size: o.size},
		commitAt:  make([]atomic.Int64, perProducer*o.producer),
		storedAt:  make([]int64, perProducer*o.producer),
		lastOfKey: map[int]int{},
	}

	// The relay: default settings, a process of its own, its metrics on a loopback port.
	rc, err := r.startChild([]string{relayMode, "--schema", schema, "--subjects", subjects, "--metrics-addr", "127.0.0.1:0"},
		"DATABASE_URL="+r.DSN, "NATS_URL="+r.NATSURL)
	if err != nil {
		return err
	}
	relayStopped := false
	defer func() {
		if !relayStopped {
			_ = rc.stop(30 * time.Second)
		}
	}()
	line, err := rc.readLine(60 * time.Second)
	if err != nil {
		return err
	}
	_, metricsURL, ok := strings.Cut(line, " metrics=")
	if !strings.HasPrefix(line, "ready") || !ok {
		return fmt.Errorf("relay process said %q", line)
	}
	pid := rc.cmd.Process.Pid
	r.logf("relay process %d (default settings, schema %s), metrics at %s", pid, schema, metricsURL)

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
	cc, err := cons.Consume(func(m jetstream.Msg) { st.consume(m) })
	if err != nil {
		return err
	}
	defer cc.Stop()

	pool, err := r.NewPool(ctx, int32(o.producer+1))
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
	r.logf("producing: %d producers, %.0f tx/s in total, for %s; each tx 1 business row + 1 × %d B message (%d keys), doorbell rung after commit; a line every %s",
		o.producer, o.rate, o.duration, o.size, o.keys, o.interval)
	start := time.Now().Add(50 * time.Millisecond)

	// The long transaction, if asked for.
	var holdStart, holdEnd atomic.Int64
	holdErr := make(chan error, 1)
	if o.holdXmin > 0 {
		go func() { holdErr <- holdXmin(ctx, r, start.Add(o.holdAt), o.holdXmin, &holdStart, &holdEnd) }()
	} else {
		holdErr <- nil
	}

	// The reporter.
	rep := &soakReporter{r: r, st: st, pool: r.Admin, schema: schema, pid: pid, metricsURL: metricsURL, start: start}
	if err := rep.init(ctx); err != nil {
		return err
	}
	repCtx, stopRep := context.WithCancel(ctx)
	repDone := make(chan struct{})
	go func() {
		defer close(repDone)
		t := time.NewTicker(o.interval)
		defer t.Stop()
		for {
			select {
			case <-repCtx.Done():
				return
			case <-t.C:
				rep.report(repCtx)
			}
		}
	}()

	prod := st.produce(ctx, pool, client, schema, subject, o, start, interval, perProducer)
	n := int(st.committed.Load())
	if prod.err != nil {
		stopRep()
		<-repDone
		return prod.err
	}
	if err := <-holdErr; err != nil {
		stopRep()
		<-repDone
		return fmt.Errorf("long transaction: %w", err)
	}
	r.logf("produced %d transactions in %s (%.0f tx/s, producers at most %s behind schedule); waiting for the stream",
		n, prod.elapsed.Round(time.Millisecond), float64(n)/prod.elapsed.Seconds(), prod.maxBehind.Round(time.Millisecond))
	if err := waitFor(ctx, o.drainWait, func() bool { st.mu.Lock(); defer st.mu.Unlock(); return st.consumed >= int64(n) }); err != nil {
		r.logf("only %d of %d committed messages reached the consumer within %s", st.consumedCount(), n, o.drainWait)
	}
	stopRep()
	<-repDone
	rep.report(ctx) // the tail
	time.Sleep(500 * time.Millisecond)
	cc.Stop()
	stored, err := streamMsgs(ctx, s)
	if err != nil {
		return err
	}
	if err := waitForOutboxEmpty(ctx, pool, schema, 30*time.Second); err != nil {
		r.logf("%v", err)
	}
	relayStopped = true
	relayErr := rc.stop(30 * time.Second)

	// The check.
	st.mu.Lock()
	lost := 0
	for i := 0; i < n; i++ {
		if st.storedAt[i] == 0 {
			lost++
		}
	}
	for i := n; i < len(st.storedAt); i++ {
		if st.storedAt[i] != 0 {
			st.unknown++ // never committed, yet in the stream
		}
	}
	dups, unknown, corrupt, misordered := st.duplicates, st.unknown, st.corrupt, st.misordered
	st.mu.Unlock()
	dups += max(0, int(stored)-n-dups-unknown) // stored twice, whether or not the consumer saw it
	var business, left int64
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+businessTable(schema)).Scan(&business); err != nil {
		return err
	}
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+outboxTable(schema)).Scan(&left); err != nil {
		return err
	}
	r.logf("check: committed=%d stream=%d lost=%d duplicates=%d unknown=%d corrupt=%d misordered=%d business=%d outbox_left=%d",
		n, stored, lost, dups, unknown, corrupt, misordered, business, left)

	// The verdict: first window against last.
	el := time.Duration(n) * time.Second / time.Duration(o.rate) // nominal; windows use actual commit times below
	_ = el
	first := rep.window(0, window)
	last := rep.window(prod.elapsed-window, prod.elapsed)
	first.p99 = st.latencyP99(start, 0, window)
	last.p99 = st.latencyP99(start, prod.elapsed-window, prod.elapsed)
	var missed []string
	ratio := func(a, b float64) float64 {
		if b <= 0 {
			return 0
		}
		return a / b
	}
	p99Ratio := ratio(float64(last.p99), float64(first.p99))
	claimRatio := ratio(last.claimMean(), first.claimMean())
	if p99Ratio > SoakTolerance {
		missed = append(missed, fmt.Sprintf("p99 latency %.1f× the first window's", p99Ratio))
	}
	if claimRatio > SoakTolerance {
		missed = append(missed, fmt.Sprintf("claim time %.1f× the first window's", claimRatio))
	}
	if b := int64(float64(first.maxSize)*SoakTolerance) + soakSizeSlack; last.maxSize > b {
		missed = append(missed, fmt.Sprintf("table+index size %d kB, over %d kB", last.maxSize/1024, b/1024))
	}
	if b := int64(float64(first.maxRSS) * SoakTolerance); last.maxRSS > b {
		missed = append(missed, fmt.Sprintf("relay RSS %d kB, over %d kB", last.maxRSS, b))
	}
	verdict := "ok"
	if len(missed) > 0 {
		verdict = "missed"
		r.logf("targets missed: %s", strings.Join(missed, "; "))
	}
	r.logf("first %s vs last %s: p99 %s → %s (%.2f×), claim mean %.3f → %.3f ms (%.2f×), table+index max %d → %d kB, relay RSS max %d → %d kB",
		window, window, first.p99.Round(10*time.Microsecond), last.p99.Round(10*time.Microsecond), p99Ratio,
		first.claimMean()*1000, last.claimMean()*1000, claimRatio, first.maxSize/1024, last.maxSize/1024, first.maxRSS, last.maxRSS)

	kv := []any{"tx", n,
		"rate_tx_per_s", float64(n) / prod.elapsed.Seconds(),
		"duration_s", prod.elapsed.Seconds(),
		"p50_ms", ms(st.latencyQ(start, 0, prod.elapsed, 0.50)),
		"p99_ms", ms(st.latencyQ(start, 0, prod.elapsed, 0.99)),
		"max_ms", ms(st.latencyQ(start, 0, prod.elapsed, 1)),
		"first_p99_ms", ms(first.p99), "last_p99_ms", ms(last.p99), "p99_ratio", p99Ratio,
		"first_claim_ms", first.claimMean() * 1000, "last_claim_ms", last.claimMean() * 1000, "claim_ratio", claimRatio,
		"first_settle_ms", first.settleMean() * 1000, "last_settle_ms", last.settleMean() * 1000,
		"first_size_kb", first.maxSize / 1024, "last_size_kb", last.maxSize / 1024,
		"first_rss_kb", first.maxRSS, "last_rss_kb", last.maxRSS,
		"relay_cpu_pct", rep.cpuPctTotal(),
		"autovacuum", rep.lastAutovacuum(),
	}
	if o.holdXmin > 0 {
		hs, he := time.Unix(0, holdStart.Load()).Sub(start), time.Unix(0, holdEnd.Load()).Sub(start)
		before, during, after := rep.window(hs-o.holdXmin, hs), rep.window(hs, he), rep.window(he, he+o.holdXmin)
		bp99 := st.latencyP99(start, hs-o.holdXmin, hs)
		dp99 := st.latencyP99(start, hs, he)
		ap99 := st.latencyP99(start, he, min(he+o.holdXmin, prod.elapsed))
		dmax := st.latencyQ(start, hs, he, 1)
		rec := st.recovery(start, he, min(he+o.holdXmin, prod.elapsed), time.Duration(float64(bp99)*SoakTolerance))
		r.logf("long transaction %s–%s: p99 %s before, %s while open (max %s), %s after; claim mean %.3f / %.3f / %.3f ms; per-second p99 back under %s %s after it ended",
			hs.Round(time.Second), he.Round(time.Second), bp99.Round(10*time.Microsecond), dp99.Round(10*time.Microsecond), dmax.Round(time.Millisecond),
			ap99.Round(10*time.Microsecond), before.claimMean()*1000, during.claimMean()*1000, after.claimMean()*1000,
			time.Duration(float64(bp99)*SoakTolerance).Round(10*time.Microsecond), rec)
		kv = append(kv, "hold_s", o.holdXmin.Seconds(),
			"hold_before_p99_ms", ms(bp99), "hold_during_p99_ms", ms(dp99), "hold_during_max_ms", ms(dmax), "hold_after_p99_ms", ms(ap99),
			"hold_before_claim_ms", before.claimMean()*1000, "hold_during_claim_ms", during.claimMean()*1000,
			"hold_during_claim_max_ms", during.claimP99Max*1000, "hold_after_claim_ms", after.claimMean()*1000,
			"recovery_s", rec.Seconds())
	}
	kv = append(kv, "verdict", verdict, "lost", lost, "duplicates", dups, "misordered", misordered, "load1", load1())
	r.result(kv...)

	switch {
	case lost > 0 || dups > 0 || unknown > 0 || corrupt > 0 || misordered > 0 || int(stored) != n:
		return fmt.Errorf("%w: stream %s holds %d for %d committed: lost=%d duplicates=%d unknown=%d corrupt=%d misordered=%d",
			ErrCheckFailed, stream, stored, n, lost, dups, unknown, corrupt, misordered)
	case business != int64(n):
		return fmt.Errorf("%w: %d business rows for %d committed transactions", ErrCheckFailed, business, n)
	case left != 0:
		return fmt.Errorf("%w: %d outbox rows left unsettled", ErrCheckFailed, left)
	case relayErr != nil:
		return fmt.Errorf("relay process: %w", relayErr)
	case len(missed) > 0 && o.targets:
		return fmt.Errorf("%w: targets missed: %s", ErrCheckFailed, strings.Join(missed, "; "))
	}
	return nil
}

// consume checks one stream message: a message of this run, not seen before, intact, and
// not before an earlier message of its key.
func (st *soakState) consume(m jetstream.Msg) {
	meta, err := m.Metadata()
	st.mu.Lock()
	defer st.mu.Unlock()
	id, perr := uuid.Parse(m.Headers().Get(outbox.HeaderMsgID))
	i, key, ok := st.set.decode(id)
	if err != nil || perr != nil || !ok || i >= len(st.storedAt) {
		st.unknown++
		return
	}
	if st.storedAt[i] != 0 {
		st.duplicates++
		return
	}
	st.storedAt[i] = meta.Timestamp.UnixNano()
	st.consumed++
	st.recent = append(st.recent, int32(i))
	if m.Headers().Get(outbox.HeaderKey) != soakKey(key) || string(m.Data()) != string(st.set.payload(i)) {
		st.corrupt++
	}
	if key >= 0 {
		if last, ok := st.lastOfKey[key]; ok && i < last {
			st.misordered++
		}
		st.lastOfKey[key] = max(st.lastOfKey[key], i)
	}
}

func (st *soakState) consumedCount() int64 {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.consumed
}

type soakProduced struct {
	elapsed   time.Duration
	maxBehind time.Duration
	err       error
}

// produce runs the producers: each commits one transaction every interval (staggered so that
// together they commit evenly) until the duration ends. Producer w owns keys w, w+producers,
// …, so one key's messages are committed one after another by one producer, in index order.
func (st *soakState) produce(ctx context.Context, pool *pgxpool.Pool, client *outbox.Client, schema, subject string,
	o *soakOpts, start time.Time, interval time.Duration, perProducer int) *soakProduced {
	p := &soakProduced{}
	var next atomic.Int64
	var mu sync.Mutex
	insert := "INSERT INTO " + businessTable(schema) + " (producer, seq, note) VALUES ($1, $2, 'soak')"
	end := start.Add(o.duration)
	keysPer := o.keys / o.producer
	var wg sync.WaitGroup
	errc := make(chan error, o.producer)
	for w := 0; w < o.producer; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var behind time.Duration
			defer func() {
				mu.Lock()
				p.maxBehind = max(p.maxBehind, behind)
				mu.Unlock()
			}()
			first := start.Add(time.Duration(w) * interval / time.Duration(o.producer))
			for k := 0; k < perProducer; k++ {
				target := first.Add(time.Duration(k) * interval)
				if !target.Before(end) || !time.Now().Before(end) || ctx.Err() != nil {
					return // the run ends on time: a producer behind its schedule drops the rest
				}
				if d := time.Until(target); d > 0 {
					time.Sleep(d) // pacing the open-loop schedule
				} else {
					behind = max(behind, -d)
				}
				key := -1
				if keysPer > 0 {
					key = w + o.producer*(k%keysPer)
				}
				i := int(next.Add(1) - 1)
				msg := outbox.Message{ID: st.set.id(i, key), Subject: subject, Key: soakKey(key), Payload: st.set.payload(i)}
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, insert, w, k); err != nil {
						return err
					}
					_, err := client.EnqueueTx(ctx, tx, msg)
					return err
				})
				if err != nil {
					errc <- fmt.Errorf("producer %d, transaction %d: %w", w, k, err)
					return
				}
				st.commitAt[i].Store(time.Now().UnixNano())
				st.committed.Add(1)
				client.Ring()
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
	if p.err == nil && next.Load() != st.committed.Load() {
		p.err = fmt.Errorf("internal: %d indexes handed out, %d committed", next.Load(), st.committed.Load())
	}
	return p
}

// latencies returns the sorted commit→stored latencies of the messages committed between
// from and to (offsets from start) and stored.
func (st *soakState) latencies(start time.Time, from, to time.Duration) []time.Duration {
	lo, hi := start.Add(from).UnixNano(), start.Add(to).UnixNano()
	st.mu.Lock()
	defer st.mu.Unlock()
	var out []time.Duration
	for i := range st.storedAt {
		c := st.commitAt[i].Load()
		if c == 0 || c < lo || c >= hi || st.storedAt[i] == 0 {
			continue
		}
		out = append(out, time.Duration(st.storedAt[i]-c))
	}
	sortDurations(out)
	return out
}

func (st *soakState) latencyQ(start time.Time, from, to time.Duration, q float64) time.Duration {
	return percentile(st.latencies(start, from, to), q)
}

func (st *soakState) latencyP99(start time.Time, from, to time.Duration) time.Duration {
	return st.latencyQ(start, from, to, 0.99)
}

// recovery is how long after from the per-second p99 latency (by commit second) last
// exceeded bound, up to to: 0 when it never did.
func (st *soakState) recovery(start time.Time, from, to time.Duration, bound time.Duration) time.Duration {
	var rec time.Duration
	for s := from; s < to; s += time.Second {
		if st.latencyP99(start, s, s+time.Second) > bound {
			rec = s + time.Second - from
		}
	}
	return rec
}

// soakReporter prints the interval lines and keeps their samples.
type soakReporter struct {
	r          *run
	st         *soakState
	pool       *pgxpool.Pool
	schema     string
	pid        int
	metricsURL string
	start      time.Time

	table, readyIdx string // regclass texts
	prevMetrics     map[string]float64
	prevCPU         time.Duration
	prevAt          time.Time
	cpu0            time.Duration
	at0             time.Time
	samples         []soakSample
}

func (rp *soakReporter) init(ctx context.Context) error {
	rp.table = outboxTable(rp.schema)
	rp.readyIdx = pgx.Identifier{rp.schema, "txoutbox_messages_ready_idx"}.Sanitize()
	m, err := scrape(ctx, rp.metricsURL)
	if err != nil {
		return fmt.Errorf("relay metrics: %w", err)
	}
	rp.prevMetrics = m
	cpu, err := procCPU(rp.pid)
	if err != nil {
		return err
	}
	rp.prevCPU, rp.cpu0 = cpu, cpu
	rp.prevAt, rp.at0 = time.Now(), time.Now()
	return nil
}

func (rp *soakReporter) report(ctx context.Context) {
	now := time.Now()
	smp := soakSample{at: now.Sub(rp.start)}
	rp.st.mu.Lock()
	recent := rp.st.recent
	rp.st.recent = nil
	consumed := rp.st.consumed
	lat := make([]time.Duration, 0, len(recent))
	for _, i := range recent {
		if c := rp.st.commitAt[i].Load(); c != 0 {
			lat = append(lat, time.Duration(rp.st.storedAt[i]-c))
		}
	}
	rp.st.mu.Unlock()
	sortDurations(lat)
	smp.p50, smp.p99 = percentile(lat, 0.5), percentile(lat, 0.99)

	if m, err := scrape(ctx, rp.metricsURL); err == nil {
		d := func(k string) float64 { return m[k] - rp.prevMetrics[k] }
		smp.claims, smp.claimSum = d("txoutbox_relay_claim_seconds_count"), d("txoutbox_relay_claim_seconds_sum")
		smp.settles, smp.settleSum = d("txoutbox_relay_settle_seconds_count"), d("txoutbox_relay_settle_seconds_sum")
		smp.claimP99 = histQuantile(m, rp.prevMetrics, "txoutbox_relay_claim_seconds", 0.99)
		smp.settleP99 = histQuantile(m, rp.prevMetrics, "txoutbox_relay_settle_seconds", 0.99)
		rp.prevMetrics = m
	} else if ctx.Err() == nil {
		rp.r.logf("relay metrics: %v", err)
	}
	err := rp.pool.QueryRow(ctx, `SELECT pg_table_size(c.oid), pg_indexes_size(c.oid), pg_relation_size($2::regclass),
       coalesce(s.n_live_tup, 0), coalesce(s.n_dead_tup, 0), coalesce(s.autovacuum_count, 0)
FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid WHERE c.oid = $1::regclass`, rp.table, rp.readyIdx).
		Scan(&smp.tableBytes, &smp.idxBytes, &smp.readyIdxBytes, &smp.live, &smp.dead, &smp.autovacuum)
	if err != nil && ctx.Err() == nil {
		rp.r.logf("table statistics: %v", err)
	}
	// The oldest transaction's age now, read as the relay's gauge reads it (its gauge is
	// sampled on its own schedule and would lag a sample behind).
	if h, err := store.New(rp.schema).XminHorizon(ctx, rp.pool); err == nil {
		smp.xactAge = h.OldestXact.Seconds()
	} else if ctx.Err() == nil {
		rp.r.logf("oldest transaction: %v", err)
	}
	smp.rssKB = procRSS(rp.pid)
	if cpu, err := procCPU(rp.pid); err == nil {
		smp.cpuPct = 100 * (cpu - rp.prevCPU).Seconds() / now.Sub(rp.prevAt).Seconds()
		rp.prevCPU = cpu
	}
	rp.prevAt = now
	rp.samples = append(rp.samples, smp)
	per := func(sum, n float64) float64 {
		if n == 0 {
			return 0
		}
		return sum / n * 1000
	}
	rp.r.logf("t=%4.0fs committed=%d consumed=%d lat_p50=%s lat_p99=%s claims=%.0f claim_avg=%.2fms claim_p99<=%.1fms settles=%.0f settle_avg=%.2fms settle_p99<=%.1fms table=%dkB indexes=%dkB ready_idx=%dkB live=%d dead=%d autovacuum=%d relay_rss=%dkB relay_cpu=%.0f%% oldest_xact=%.0fs load=%s",
		smp.at.Seconds(), rp.st.committed.Load(), consumed, smp.p50.Round(10*time.Microsecond), smp.p99.Round(10*time.Microsecond),
		smp.claims, per(smp.claimSum, smp.claims), smp.claimP99*1000, smp.settles, per(smp.settleSum, smp.settles), smp.settleP99*1000,
		smp.tableBytes/1024, smp.idxBytes/1024, smp.readyIdxBytes/1024, smp.live, smp.dead, smp.autovacuum, smp.rssKB, smp.cpuPct, smp.xactAge, load1())
}

// soakWindow sums the samples of an interval of the run.
type soakWindow struct {
	claims, claimSum, settles, settleSum float64
	claimP99Max                          float64
	maxSize, maxRSS                      int64
	p99                                  time.Duration
}

func (w soakWindow) claimMean() float64 {
	if w.claims == 0 {
		return 0
	}
	return w.claimSum / w.claims
}

func (w soakWindow) settleMean() float64 {
	if w.settles == 0 {
		return 0
	}
	return w.settleSum / w.settles
}

// window sums the samples whose interval lies within [from, to] (a sample covers the
// interval before its time).
func (rp *soakReporter) window(from, to time.Duration) soakWindow {
	var w soakWindow
	prev := time.Duration(0)
	for _, s := range rp.samples {
		begin := prev
		prev = s.at
		if begin < from-time.Second || s.at > to+time.Second {
			continue
		}
		w.claims += s.claims
		w.claimSum += s.claimSum
		w.settles += s.settles
		w.settleSum += s.settleSum
		w.claimP99Max = max(w.claimP99Max, s.claimP99)
		w.maxSize = max(w.maxSize, s.tableBytes+s.idxBytes)
		w.maxRSS = max(w.maxRSS, s.rssKB)
	}
	return w
}

func (rp *soakReporter) cpuPctTotal() float64 {
	cpu, err := procCPU(rp.pid)
	if err != nil {
		cpu = rp.prevCPU
	}
	return 100 * (cpu - rp.cpu0).Seconds() / time.Since(rp.at0).Seconds()
}

func (rp *soakReporter) lastAutovacuum() int64 {
	if len(rp.samples) == 0 {
		return 0
	}
	return rp.samples[len(rp.samples)-1].autovacuum
}

// holdXmin opens a transaction at `at` in a session of its own that holds a snapshot and a
// transaction id (what a long report, an idle-in-transaction session or a forgotten psql
// does), keeps it open for d, then commits it.
func holdXmin(ctx context.Context, r *run, at time.Time, d time.Duration, started, ended *atomic.Int64) error {
	cfg, err := pgx.ParseConfig(r.DSN)
	if err != nil {
		return err
	}
	cfg.RuntimeParams["application_name"] = "outbox-bench xmin-holder"
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(time.Until(at)):
	}
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	var xid int64
	if err := tx.QueryRow(ctx, "SELECT txid_current()").Scan(&xid); err != nil {
		return err
	}
	started.Store(time.Now().UnixNano())
	r.logf("long transaction: opened (xid %d, REPEATABLE READ snapshot, pid %d); holding it %s", xid, conn.PgConn().PID(), d)
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	ended.Store(time.Now().UnixNano())
	r.logf("long transaction: committed after %s", time.Duration(ended.Load()-started.Load()).Round(time.Millisecond))
	return nil
}

// scrape reads a Prometheus text exposition into name{labels} → value (untyped lines only;
// comments skipped).
func scrape(ctx context.Context, url string) (map[string]float64, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s: %s", url, resp.Status)
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			continue
		}
		out[line[:i]] = v
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, errors.New("no metrics")
	}
	return out, nil
}

// histQuantile estimates the q-quantile of a histogram's observations between two scrapes:
// the upper bound of the bucket it falls in (0 without observations).
func histQuantile(cur, prev map[string]float64, name string, q float64) float64 {
	type bucket struct{ le, n float64 }
	var bs []bucket
	for k, v := range cur {
		rest, ok := strings.CutPrefix(k, name+`_bucket{le="`)
		if !ok {
			continue
		}
		le, err := strconv.ParseFloat(strings.TrimSuffix(rest, `"}`), 64)
		if err != nil {
			continue
		}
		bs = append(bs, bucket{le, v - prev[k]})
	}
	if len(bs) == 0 {
		return 0
	}
	for i := 1; i < len(bs); i++ {
		for j := i; j > 0 && bs[j].le < bs[j-1].le; j-- {
			bs[j], bs[j-1] = bs[j-1], bs[j]
		}
	}
	total := bs[len(bs)-1].n // +Inf
	if total <= 0 {
		return 0
	}
	for _, b := range bs {
		if b.n >= q*total {
			return b.le
		}
	}
	return bs[len(bs)-1].le
}
