package bench

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/relay"
)

// drain --relays N,M,…: the same backlog drained by N relay processes, then by M, … in one
// run. For each count: a fresh schema holding the backlog and a fresh stream, the bare
// publisher's ceiling measured just before, the relays started as processes of their own
// (default settings) and timed from the moment they are told to go (so the partition shares
// forming is counted, process start-up is not), the CPU each process used during the drain
// (from /proc: the relays, the embedded nats-server, the relays' PostgreSQL backends, this
// process) and the relays' peak RSS (VmHWM). Then the usual check: nothing lost, duplicated,
// corrupted or (per key) reordered.

// parseCounts parses "1,2,3".
func parseCounts(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 || n > 16 {
			return nil, usageErr("--relays takes a comma-separated list of relay counts from 1 to 16, got %q", s)
		}
		out = append(out, n)
	}
	return out, nil
}

// relayProc is one relay child process of a scale-out drain and what it reported.
type relayProc struct {
	c      *child
	pid    int
	done   chan struct{} // its stdout reached EOF (it exited)
	mu     sync.Mutex
	held   int
	target int
	relays int
	stats  map[string]int64
}

func (p *relayProc) lease() (held, target, relays int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.held, p.target, p.relays
}

// scaleResult is one relay count's measurement.
type scaleResult struct {
	n                        int
	rate, ceil               float64
	dur, balanced            time.Duration
	cpuRelays, cpuNATS       time.Duration
	cpuPG, cpuSelf           time.Duration
	machineBusy              float64 // cores busy on the whole machine, on average
	peakRSS                  int64   // kB, the largest VmHWM of the relays
	published, dupAcks, bats int64
}

func drainRelays(ctx context.Context, r *run, o *drainOpts, counts []int) error {
	if err := r.start(ctx); err != nil {
		return err
	}
	const (
		stream, subject               = streamPrefix + "DRAIN", "bench.drain.msg"
		ceilStream, ceilSubject       = streamPrefix + "CEILING", "bench.ceiling.msg"
		relaySubjects, ceilingSubject = "bench.drain.>", "bench.ceiling.>"
	)
	set, err := newMsgSet(o.msgs, o.size, o.keys)
	if err != nil {
		return err
	}
	pool, err := r.NewPool(ctx, int32(o.loaders+1))
	if err != nil {
		return err
	}
	load0 := load1()
	var ceils []pgCeiling
	results := map[int][]scaleResult{}
	var ratios, speedups = map[int][]float64{}, map[int][]float64{}
	for rep := 1; rep <= o.repeat; rep++ {
		if o.repeat > 1 {
			r.logf("##### round %d of %d", rep, o.repeat)
		}
		var pgCeil pgCeiling
		if !o.skipCeiling {
			if pgCeil, err = ceilingWithPG(ctx, r, o, pool, set, ceilStream, ceilSubject, ceilingSubject); err != nil {
				return err
			}
			ceils = append(ceils, pgCeil)
		}
		var base float64
		for _, n := range counts {
			res, err := drainWith(ctx, r, o, pool, set, n, stream, subject, relaySubjects, ceilStream, ceilSubject, ceilingSubject)
			if err != nil {
				return err
			}
			results[n] = append(results[n], res)
			if n == 1 && base == 0 {
				base = res.rate
			}
			if res.ceil > 0 {
				ratios[n] = append(ratios[n], res.rate/res.ceil)
			}
			if base > 0 {
				speedups[n] = append(speedups[n], res.rate/base)
			}
		}
	}

	kv := []any{"msgs", o.msgs, "keys", o.keys, "relays", joinInts(counts), "repeat", o.repeat}
	if len(ceils) > 0 {
		kv = append(kv,
			"ceiling_msgs_per_s", median(ceils, func(c pgCeiling) float64 { return c.alone }),
			"ceiling_with_pg_msgs_per_s", median(ceils, func(c pgCeiling) float64 { return c.withPG }),
			"ceiling_with_pg_ratio", median(ceils, func(c pgCeiling) float64 { return c.withPG / c.alone }),
			"ceiling_cpu_us_per_msg", median(ceils, func(c pgCeiling) float64 { return c.cpuPerMsg }),
			"pg_claim_settle_cpu_us_per_msg", median(ceils, func(c pgCeiling) float64 { return c.pgCPUPerMsg }))
	}
	id := func(x float64) float64 { return x }
	for _, n := range counts {
		rs := results[n]
		p := fmt.Sprintf("r%d_", n)
		var peak int64
		for _, res := range rs {
			peak = max(peak, res.peakRSS)
		}
		kv = append(kv,
			p+"msgs_per_s", median(rs, func(x scaleResult) float64 { return x.rate }),
			p+"vs_1_relay", median(speedups[n], id))
		if len(ratios[n]) > 0 { // --skip-ceiling: no ceiling, left out rather than 0
			kv = append(kv,
				p+"ceiling_msgs_per_s", median(rs, func(x scaleResult) float64 { return x.ceil }),
				p+"ratio", median(ratios[n], id))
		}
		kv = append(kv,
			p+"balanced_s", balancedMedian(rs),
			p+"cpu_us_per_msg", median(rs, func(x scaleResult) float64 { return x.cpuPerMsg(o.msgs) }),
			p+"cpu_relays", median(rs, func(x scaleResult) float64 { return x.cpuRelays.Seconds() / x.dur.Seconds() }),
			p+"cpu_nats", median(rs, func(x scaleResult) float64 { return x.cpuNATS.Seconds() / x.dur.Seconds() }),
			p+"cpu_pg", median(rs, func(x scaleResult) float64 { return x.cpuPG.Seconds() / x.dur.Seconds() }),
			p+"machine_busy", median(rs, func(x scaleResult) float64 { return x.machineBusy }),
			p+"peak_rss_kb", peak,
			p+"dup_acks", median(rs, func(x scaleResult) float64 { return float64(x.dupAcks) }))
	}
	// Printed only when every round's check passed (a failed one returned its error).
	kv = append(kv, checkResult{}.kv()...)
	kv = append(kv, "load1_start", load0, "load1", load1())
	r.result(kv...)
	return nil
}

// balancedMedian is the median time the shares took to even out over the rounds where they
// did, or "never" when they did not in any round (a round where they did not is left out: its
// time is not a time).
func balancedMedian(rs []scaleResult) any {
	var even []scaleResult
	for _, x := range rs {
		if x.balanced >= 0 {
			even = append(even, x)
		}
	}
	if len(even) == 0 {
		return "never"
	}
	return median(even, func(x scaleResult) float64 { return x.balanced.Seconds() })
}

// median returns the median of f over xs (the mean of the middle two for an even count).
func median[T any](xs []T, f func(T) float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	v := make([]float64, len(xs))
	for i, x := range xs {
		v[i] = f(x)
	}
	slices.Sort(v)
	if len(v)%2 == 1 {
		return v[len(v)/2]
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2
}

// perMsg is d per message, in µs.
func perMsg(d time.Duration, msgs int) float64 { return d.Seconds() * 1e6 / float64(msgs) }

func joinInts(xs []int) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = strconv.Itoa(x)
	}
	return strings.Join(s, ",")
}

// cpuPerMsg is the CPU the relays, the nats-server and the relays' PostgreSQL backends used
// per message, in µs.
func (res *scaleResult) cpuPerMsg(msgs int) float64 {
	return (res.cpuRelays + res.cpuNATS + res.cpuPG).Seconds() * 1e6 / float64(msgs)
}

// pgCeiling is the broker's ceiling measured alone and while PostgreSQL does a drain's claim
// and settle work at the same time (on a copy of the backlog, on one connection, as a relay
// would): on a machine whose cores are all busy, the second says how much of the gap between
// the relay and the bare publisher is the database's share of the CPU.
type pgCeiling struct {
	alone, withPG float64 // msgs/s
	cpuPerMsg     float64 // µs of CPU (the publisher and the nats-server) per message, alone
	pgCPUPerMsg   float64 // µs of CPU of the PostgreSQL backend per message claimed and settled
	pgShare       float64 // the part of the publisher's time the database work covered
}

func ceilingWithPG(ctx context.Context, r *run, o *drainOpts, pool *pgxpool.Pool, set *msgSet, ceilStream, ceilSubject, ceilingSubject string) (pgCeiling, error) {
	var out pgCeiling
	schema, err := r.NewSchema(ctx)
	if err != nil {
		return out, err
	}
	defer func() {
		if !r.keep {
			r.dropSchema(schema)
		}
	}()
	client, err := outbox.NewClient(&outbox.Config{Schema: schema})
	if err != nil {
		return out, err
	}
	if _, err := enqueueBacklog(ctx, r, pool, client, schema, set, "bench.pgload.msg", o); err != nil {
		return out, err
	}
	publish := func() (time.Duration, error) {
		if _, err := r.ResetStream(ctx, ceilStream, ceilingSubject); err != nil {
			return 0, err
		}
		defer r.DeleteStream(ceilStream)
		return publishCeiling(ctx, r, "outbox-bench ceiling", set, ceilSubject, o.window)
	}
	self0, _ := procCPU(os.Getpid())
	nats0, _ := sumCPU(nonZero(r.natsPID))
	d, err := publish()
	if err != nil {
		return out, err
	}
	self1, _ := procCPU(os.Getpid())
	nats1, _ := sumCPU(nonZero(r.natsPID))
	out.alone = float64(o.msgs) / d.Seconds()
	out.cpuPerMsg = (self1 - self0 + nats1 - nats0).Seconds() * 1e6 / float64(o.msgs)
	r.logf("ceiling: %.0f msgs/s; CPU per message: publisher (this process) %.1f µs, nats-server %.1f µs",
		out.alone, perMsg(self1-self0, o.msgs), perMsg(nats1-nats0, o.msgs))

	// The same publish while one connection claims and settles the copy, batch after batch.
	pc, err := pool.Acquire(ctx)
	if err != nil {
		return out, err
	}
	conn := pc.Hijack() // set up as a relay's session: never back to the pool
	defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()
	if err := store.SetupRelaySession(ctx, conn, "outbox-bench claim-settle"); err != nil {
		return out, err
	}
	var backend int32
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&backend); err != nil {
		return out, err
	}
	q := store.New(schema)
	stop := make(chan struct{})
	type loadRes struct {
		rows int
		took time.Duration
		err  error
	}
	done := make(chan loadRes, 1)
	pg0, _ := procCPU(int(backend))
	go func() {
		var lr loadRes
		start := time.Now()
		defer func() { lr.took = time.Since(start); done <- lr }()
		for {
			select {
			case <-stop:
				return
			default:
			}
			rows, err := q.Claim(ctx, conn, store.ClaimArgs{Limit: relay.DefaultBatchSize, PartitionCount: relay.DefaultPartitions})
			if err != nil || len(rows) == 0 {
				lr.err = err
				return
			}
			pub := make([]store.Published, len(rows))
			for i, row := range rows {
				pub[i] = store.Published{ID: row.ID, Stream: ceilStream, Seq: uint64(lr.rows + i + 1)}
			}
			if _, err := q.Settle(ctx, conn, store.SettleArgs{Published: pub, MaxAttempts: relay.DefaultMaxAttempts}); err != nil {
				lr.err = err
				return
			}
			lr.rows += len(rows)
		}
	}()
	d, err = publish()
	close(stop)
	lr := <-done
	if err != nil {
		return out, err
	}
	if lr.err != nil {
		return out, fmt.Errorf("claim and settle beside the ceiling: %w", lr.err)
	}
	pg1, _ := procCPU(int(backend))
	out.withPG = float64(o.msgs) / d.Seconds()
	if lr.rows > 0 {
		out.pgCPUPerMsg = (pg1 - pg0).Seconds() * 1e6 / float64(lr.rows)
	}
	out.pgShare = min(lr.took.Seconds()/d.Seconds(), 1)
	r.logf("ceiling: %.0f msgs/s alone (%.1f µs of CPU per message: publisher and nats-server); %.0f msgs/s (%.2f of it) while one connection claims and settles a copy of the backlog "+
		"(%d rows in %s, covering %.0f%% of the publish; %.1f µs of backend CPU per row)",
		out.alone, out.cpuPerMsg, out.withPG, out.withPG/out.alone, lr.rows, lr.took.Round(time.Millisecond), 100*out.pgShare, out.pgCPUPerMsg)
	return out, nil
}

// drainWith drains set with n relay processes: see the top of this file.
func drainWith(ctx context.Context, r *run, o *drainOpts, pool *pgxpool.Pool, set *msgSet, n int,
	stream, subject, relaySubjects, ceilStream, ceilSubject, ceilingSubject string) (scaleResult, error) {
	res := scaleResult{n: n}
	r.logf("=== %d relay process(es); load average %s", n, loadAvg())
	schema, err := r.NewSchema(ctx)
	if err != nil {
		return res, err
	}
	defer func() {
		if !r.keep {
			r.dropSchema(schema)
		}
	}()
	client, err := outbox.NewClient(&outbox.Config{Schema: schema})
	if err != nil {
		return res, err
	}
	enqDur, err := enqueueBacklog(ctx, r, pool, client, schema, set, subject, o)
	if err != nil {
		return res, err
	}
	r.logf("enqueued %d messages in %s (relays stopped)", o.msgs, enqDur.Round(time.Millisecond))
	rank, err := outboxOrder(ctx, pool, schema, set)
	if err != nil {
		return res, err
	}
	if !o.skipCeiling {
		if _, err := r.ResetStream(ctx, ceilStream, ceilingSubject); err != nil {
			return res, err
		}
		d, err := publishCeiling(ctx, r, "outbox-bench ceiling", set, ceilSubject, o.window)
		if err != nil {
			return res, err
		}
		res.ceil = float64(o.msgs) / d.Seconds()
		cres, err := checkStream(ctx, r.JS, ceilStream, set, nil)
		if err != nil {
			return res, err
		}
		if !cres.ok() {
			return res, fmt.Errorf("%w: ceiling stream %s: %s", ErrCheckFailed, ceilStream, cres)
		}
		r.DeleteStream(ceilStream)
		r.logf("ceiling: bare async publisher, window %d: %.0f msgs/s", o.window, res.ceil)
	}
	drainStream, err := r.ResetStream(ctx, stream, relaySubjects)
	if err != nil {
		return res, err
	}

	// The relays: started, ready (connected, streams not yet checked), then told to go at once.
	procs := make([]*relayProc, n)
	defer func() {
		for _, p := range procs {
			if p != nil {
				stopRelayProc(r, p, 30*time.Second)
			}
		}
	}()
	for i := range procs {
		args := []string{relayMode, "--schema", schema, "--subjects", relaySubjects,
			"--id", fmt.Sprintf("%s-r%d", schema, i+1), "--wait-go", "--report"}
		if o.batchSize > 0 {
			args = append(args, "--batch-size", strconv.Itoa(o.batchSize))
		}
		if o.maxInFlight > 0 {
			args = append(args, "--max-in-flight", strconv.Itoa(o.maxInFlight))
		}
		if o.cpuprofile != "" {
			args = append(args, "--cpuprofile", fmt.Sprintf("%s.r%d-%d", o.cpuprofile, n, i+1))
		}
		c, err := r.startChild(args, "DATABASE_URL="+r.DSN, "NATS_URL="+r.NATSURL)
		if err != nil {
			return res, err
		}
		line, err := c.readLine(60 * time.Second)
		if err != nil || !strings.HasPrefix(line, "ready") {
			_ = c.stop(5 * time.Second)
			return res, fmt.Errorf("relay process %d: %q %v", i+1, line, err)
		}
		p := &relayProc{c: c, pid: c.cmd.Process.Pid, done: make(chan struct{}), stats: map[string]int64{}}
		procs[i] = p
	}
	var t0 time.Time
	var t0mu sync.Mutex
	since := func() time.Duration { t0mu.Lock(); defer t0mu.Unlock(); return time.Since(t0) }
	for i, p := range procs {
		go readRelayProc(r, i+1, p, since)
	}
	pids := make([]int, n)
	for i, p := range procs {
		pids[i] = p.pid
	}
	relay0, _ := sumCPU(pids)
	nats0, _ := sumCPU(nonZero(r.natsPID))
	self0, _ := procCPU(os.Getpid())
	busy0, total0 := machineCPU()
	t0mu.Lock()
	t0 = time.Now()
	t0mu.Unlock()
	for _, p := range procs {
		if _, err := fmt.Fprintln(p.c.stdin, "go"); err != nil {
			return res, fmt.Errorf("relay process: %w", err)
		}
	}
	r.logf("%d relay process(es) told to go (schema %s)", n, schema)

	// Shares formed: every relay sees n relays and holds its target.
	balanced := make(chan time.Duration, 1)
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	go func() {
		t := time.NewTicker(5 * time.Millisecond)
		defer t.Stop()
		for {
			ok, sum := true, 0
			for _, p := range procs {
				h, tg, rl := p.lease()
				sum += h
				ok = ok && rl == n && h == tg
			}
			if ok && sum == relay.DefaultPartitions {
				balanced <- since()
				return
			}
			select {
			case <-watchCtx.Done():
				return
			case <-t.C:
			}
		}
	}()
	runErr := make(chan error, n)
	for i, p := range procs {
		go func() {
			select {
			case <-p.done:
				runErr <- fmt.Errorf("relay process %d exited", i+1)
			case <-watchCtx.Done():
			}
		}()
	}
	dur, err := waitForStream(ctx, r, drainStream, uint64(o.msgs), t0, o.timeout, runErr)
	if err != nil {
		return res, err
	}
	// CPU and memory, read before anything else happens.
	relay1, err := sumCPU(pids)
	if err != nil {
		return res, err
	}
	nats1, _ := sumCPU(nonZero(r.natsPID))
	self1, _ := procCPU(os.Getpid())
	busy1, total1 := machineCPU()
	pgPIDs, err := relayBackends(ctx, r, schema)
	if err != nil {
		return res, err
	}
	res.cpuPG, _ = sumCPU(pgPIDs)
	for _, p := range procs {
		res.peakRSS = max(res.peakRSS, procHWM(p.pid))
	}
	res.dur = dur
	res.rate = float64(o.msgs) / dur.Seconds()
	res.cpuRelays, res.cpuNATS, res.cpuSelf = relay1-relay0, nats1-nats0, self1-self0
	if total1 > total0 {
		// Ticks of all CPUs over wall ticks: cores busy.
		res.machineBusy = float64(busy1-busy0) / float64(total1-total0) * float64(cpus())
	}
	select {
	case res.balanced = <-balanced:
	default:
		res.balanced = -1
		r.logf("the partition shares had not evened out when the drain ended")
	}
	stopWatch()
	wall := dur.Seconds()
	r.logf("%d relay(s): %d messages stored in %s (%.0f msgs/s); shares even after %s", n, o.msgs, dur.Round(time.Millisecond), res.rate, res.balanced.Round(time.Millisecond))
	r.logf("%d relay(s): CPU during the drain, in cores: relays %.2f, nats-server %.2f (%s), relays' PostgreSQL backends %.2f (%d), this process %.2f; whole machine busy %.2f of %d cores",
		n, res.cpuRelays.Seconds()/wall, res.cpuNATS.Seconds()/wall, natsWhere(r), res.cpuPG.Seconds()/wall, len(pgPIDs), res.cpuSelf.Seconds()/wall, res.machineBusy, cpus())
	r.logf("%d relay(s): %.1f µs of CPU per message (relays %.1f, nats-server %.1f, PostgreSQL backends %.1f); peak RSS (VmHWM) of the relay processes: %d kB",
		n, res.cpuPerMsg(o.msgs), perMsg(res.cpuRelays, o.msgs), perMsg(res.cpuNATS, o.msgs), perMsg(res.cpuPG, o.msgs), res.peakRSS)

	if err := waitForOutboxEmpty(ctx, pool, schema, 30*time.Second); err != nil {
		return res, err
	}
	for i, p := range procs {
		stopRelayProc(r, p, 30*time.Second)
		procs[i] = nil
		p.mu.Lock()
		res.published += p.stats["published"]
		res.dupAcks += p.stats["duplicates"]
		res.bats += p.stats["batches"]
		if p.stats["dead"] != 0 {
			p.mu.Unlock()
			return res, fmt.Errorf("%w: relay process %d made %d rows dead", ErrCheckFailed, i+1, p.stats["dead"])
		}
		p.mu.Unlock()
	}
	chk, err := checkStream(ctx, r.JS, stream, set, rank)
	if err != nil {
		return res, err
	}
	var business int64
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+businessTable(schema)).Scan(&business); err != nil {
		return res, err
	}
	wantBusiness := int64((o.msgs + o.perTx - 1) / o.perTx)
	r.logf("%d relay(s): check: %s; business rows %d (want %d); relays settled %d published in %d batches, %d duplicate PubAcks",
		n, chk, business, wantBusiness, res.published, res.bats, res.dupAcks)
	switch {
	case !chk.ok():
		return res, fmt.Errorf("%w: %d relays: stream %s: %s", ErrCheckFailed, n, stream, chk)
	case business != wantBusiness:
		return res, fmt.Errorf("%w: %d business rows, want %d", ErrCheckFailed, business, wantBusiness)
	case res.published != int64(o.msgs):
		return res, fmt.Errorf("%w: %d relays settled %d rows as published, want %d", ErrCheckFailed, n, res.published, o.msgs)
	}
	return res, nil
}

// readRelayProc reads a relay process's stdout (lease and stats lines) until it exits.
func readRelayProc(r *run, i int, p *relayProc, since func() time.Duration) {
	defer close(p.done)
	for p.c.lines.Scan() {
		line := p.c.lines.Text()
		kind, rest, _ := strings.Cut(line, " ")
		vals := map[string]int64{}
		for _, f := range strings.Fields(rest) {
			k, v, _ := strings.Cut(f, "=")
			x, _ := strconv.ParseInt(v, 10, 64)
			vals[k] = x
		}
		p.mu.Lock()
		switch kind {
		case "lease":
			p.held, p.target, p.relays = int(vals["held"]), int(vals["target"]), int(vals["relays"])
		case "stats":
			p.stats = vals
		}
		p.mu.Unlock()
		if kind == "lease" {
			r.logf("relay %d at %s: %s", i, since().Round(time.Millisecond), line)
		}
	}
}

// stopRelayProc closes the relay's stdin (it finishes its batch, releases its partitions and
// prints its totals) and waits for it to exit, killing it after timeout.
func stopRelayProc(r *run, p *relayProc, timeout time.Duration) {
	_ = p.c.stdin.Close()
	select {
	case <-p.done:
	case <-time.After(timeout):
		r.logf("relay process %d did not stop within %s; killed", p.pid, timeout)
		_ = p.c.cmd.Process.Kill()
		<-p.done
	}
	_ = p.c.cmd.Wait()
}

// relayBackends returns the PostgreSQL backend pids of the relays of schema (their lease
// sessions are named "txoutbox-relay <id>", the ids "<schema>-r<i>").
func relayBackends(ctx context.Context, r *run, schema string) ([]int, error) {
	rows, err := r.Admin.Query(ctx, "SELECT pid FROM pg_stat_activity WHERE application_name LIKE $1",
		"txoutbox-relay "+schema+"-r%")
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var pids []int
	for rows.Next() {
		var pid int32
		if err := rows.Scan(&pid); err != nil {
			return nil, err
		}
		pids = append(pids, int(pid))
	}
	return pids, rows.Err()
}

func natsWhere(r *run) string {
	if r.natsPID != 0 {
		return "embedded, child process"
	}
	return "not measured: " + r.natsDesc
}

func nonZero(pid int) []int {
	if pid == 0 {
		return nil
	}
	return []int{pid}
}

// sumCPU adds up the CPU time of processes.
func sumCPU(pids []int) (time.Duration, error) {
	var sum time.Duration
	for _, pid := range pids {
		d, err := procCPU(pid)
		if err != nil {
			return 0, err
		}
		sum += d
	}
	return sum, nil
}

// machineCPU returns the busy and total ticks of all CPUs, from /proc/stat.
func machineCPU() (busy, total int64) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 5 || f[0] != "cpu" {
		return 0, 0
	}
	for i, v := range f[1:] {
		x, _ := strconv.ParseInt(v, 10, 64)
		if i >= 8 { // guest and guest_nice are already in user and nice
			break
		}
		total += x
		if i != 3 && i != 4 { // idle, iowait
			busy += x
		}
	}
	return busy, total
}

// cpus is the number of CPUs /proc/stat lists.
func cpus() int {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 1
	}
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "cpu") && !strings.HasPrefix(line, "cpu ") {
			n++
		}
	}
	return max(n, 1)
}

// procHWM returns a process's peak resident set size (VmHWM) in kB (0 if unknown).
func procHWM(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			n, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return n
		}
	}
	return 0
}
