// Package relay publishes committed outbox rows to NATS JetStream.
//
// The loop: claim a batch of due ready rows of the partitions this relay leases, in id order;
// publish them with async JetStream publishes (Nats-Msg-Id = the message id, a bounded window
// of PubAcks in flight, a publish timeout); wait for every PubAck (a duplicate ack counts as
// success); settle the whole batch in one statement. Messages of one key are published one
// after another (the next only once the previous one's PubAck is in), so a key's messages are
// stored in order even across failures, retries and relay handovers; messages of different
// keys, and unkeyed messages, are pipelined. A key is global across subjects: a failed or
// dead message of key k on one subject holds back k's later messages on every subject, because
// a key names an aggregate (an order, an account) whose events often go to several subjects and
// whose order is what matters; put the subject in the key for order per subject only.
//
// A crash between publish and settle leaves the rows ready, so they are published again; the
// stream's duplicate window (and the idempotent consumer's dedup table beyond it) absorb that.
package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox"
	backoffpkg "github.com/txoutbox/txoutbox/internal/backoff"
	"github.com/txoutbox/txoutbox/internal/cmdline"
	"github.com/txoutbox/txoutbox/internal/dbhandle"
	"github.com/txoutbox/txoutbox/internal/fault"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsignal"
)

// Sentinel errors.
var (
	// ErrNoStream: no JetStream stream captures a subject the relay must serve.
	ErrNoStream = errors.New("relay: no stream captures subject")
	// ErrDuplicateWindow: a stream's duplicate window is shorter than the relay's worst
	// republish delay, so a republish could be stored twice.
	ErrDuplicateWindow = errors.New("relay: stream duplicate window too short")
	// ErrStreamUnusable: a stream that captures a subject the relay must serve cannot take
	// its publishes (no_ack, sealed, a mirror, a counter stream). The *StreamError wrapping
	// it names the stream, the subject and the setting.
	ErrStreamUnusable = errors.New("relay: stream unusable")
	// ErrMessageLimit: a stream that captures a subject the relay must serve (its
	// max_msg_size), or the nats-server (its max_payload), takes smaller messages than the
	// producers may enqueue (Config.MaxMessageBytes): a message between the two limits would
	// be accepted and could never be published. The *StreamError wrapping it names the
	// stream (none for the server), the setting and both limits.
	ErrMessageLimit = errors.New("relay: message limit below the producers'")
)

// The run loop's own outcomes, never returned by Run, CheckStreams or New: the loop waits
// them out. A user sees them as the relay's Health and its metrics.
var (
	// errBrokerUnavailable: NATS or JetStream did not answer (a lost connection; PubAck
	// timeouts that JetStream gives no other reason for). Rows are left
	// as they are and retried; no attempt is counted. Health: HealthNATSUnavailable.
	errBrokerUnavailable = errors.New("relay: broker unavailable")
	// errNoPartitions: the relay holds no partition lease (others hold them all). Health:
	// HealthStandby.
	errNoPartitions = errors.New("relay: no partition held")
)

// Relay publishes outbox rows. Create it with New and start it with Run.
type Relay struct {
	cfg   *Config
	pool  *pgxpool.Pool
	js    jetstream.JetStream // the caller's, for stream management
	pub   jetstream.JetStream // the relay's own publisher: async timeout and window set
	q     *store.Queries
	log   *slog.Logger
	m     *metrics
	sm    *scheduledMetrics // delayed messages (scheduled.go)
	sched scheduler
	lease *leaser
	floor *claimFloor
	wake  chan struct{}
	trace *relayTracer

	run       runControl
	closeOnce sync.Once
	health    atomic.Int32 // a healthState
	// settleShort is set while settles find fewer published rows ready than were published
	// (logged when it changes).
	settleShort atomic.Bool
	// natsDownSince is when health last became nats_unavailable (unix ns; 0 once it is ok).
	natsDownSince atomic.Int64
	failing       failingSubjects
	unusable      unusableStreams
	known         knownStreams
	windows       *windowWatch // the duplicate windows of the streams published to (windows.go)
	outages       streamOutages
	strikes       leaderStrikes
	denied        deniedSubjects
	unwatch       func()      // stops watching the connection's permission violations (see denied.go)
	fence         *fenceState // this relay's side of the connection's WriteFence, or nil
	fenceOwner    *WriteFence
	hooks         hooks
	stats         counters
	// lastWork is when a claim last returned rows (unix ns; 0: never): the membership watch
	// runs only while the relay is busy.
	lastWork    atomic.Int64
	testSignals testSignals
}

// testSignals are events tests wait on instead of sleeping; their channels are nil outside
// tests (see internal/testsignal).
type testSignals struct {
	// backoff: the run loop starts waiting out a failed pass.
	backoff testsignal.Signal[backoffEvent]
}

// backoffEvent is a backoff the run loop starts: the count of consecutive failed passes and
// how long it waits.
type backoffEvent struct {
	outage int
	wait   time.Duration
}

// hooks are in-process test seams: points where this package's own tests (and only they:
// the type is unexported and nil in every relay New returns) pause the relay, observe it or
// make a step fail as a crash there would. Faults that end the process — the crash tests and
// the chaos proof, across processes — are internal/fault's named points, compiled only into
// binaries built with its build tag; that is txoutbox's one fault-injection mechanism.
type hooks struct {
	// afterPublish runs after every PubAck of a batch is in and before the batch is settled;
	// an error makes runOnce return it without settling, as a crash there would.
	afterPublish func(ctx context.Context, published int) error
	// beforePipelinedClaim runs before a claim made while a batch is in flight, given the
	// context the claim runs under (shutdown must not cancel it).
	beforePipelinedClaim func(claimCtx context.Context)
	// beforeWave runs before each publish wave of a batch (n counts from 1), before the
	// lease checks of its rows: blocking in it is a pause of the relay there.
	beforeWave func(n int)
	// afterLeaseCheck runs after a row's first lease check, before the stream checks (which
	// may ask JetStream) and the hand-off: a pause, or a lease lost, there.
	afterLeaseCheck func()
	// afterWave runs when the outcomes of a publish wave are in, before they are explained;
	// it may rewrite them (an outage met in the middle of a wave).
	afterWave func(n int, outs []outcome)
	// afterRound runs after each successful lease round, with the leaser's lock held, given
	// the round's start and what it left.
	afterRound func(start time.Time, st LeaseStatus)
}

// Stats is a snapshot of running totals, for tests and the bench command.
type Stats struct {
	Published  int64 // rows settled as published
	Duplicates int64 // PubAcks that reported a duplicate
	Failed     int64 // message-level publish failures
	Dead       int64 // rows that became dead
	Batches    int64 // non-empty batches
	Withheld   int64 // rows of a claimed batch not sent because the relay's lease had ended
	Fenced     int64 // writes the WriteFence refused (messages handed under a lease that ended before they left)
}

// counters are the running totals behind Stats.
type counters struct {
	Published  atomic.Int64
	Duplicates atomic.Int64
	Failed     atomic.Int64
	Dead       atomic.Int64
	Batches    atomic.Int64
	Withheld   atomic.Int64
	Fenced     atomic.Int64
}

func (c *counters) snapshot() Stats {
	return Stats{
		Published:  c.Published.Load(),
		Duplicates: c.Duplicates.Load(),
		Failed:     c.Failed.Load(),
		Dead:       c.Dead.Load(),
		Batches:    c.Batches.Load(),
		Withheld:   c.Withheld.Load(),
		Fenced:     c.Fenced.Load(),
	}
}

// New returns a relay publishing rows from pool to js. cfg may be nil for all defaults. A nil
// pool or js is refused with a *txoutbox.ConfigError naming it, as an invalid cfg field is.
//
// New chains an error handler onto js's connection, in front of the connection's own (which
// is still called): the server reports a publish the relay's NATS user may not make only
// there (see ErrPublishDenied). Set the connection's error handler before New; Close puts it
// back once no relay uses the connection.
//
// The relay publishes through a JetStream of its own on js's connection, with js's domain or
// API prefix, default timeout and client trace (every setting jetstream.JetStream.Options
// shows), and its own asynchronous publishing: Config.PublishTimeout and
// Config.MaxInFlight bound it, and the relay handles every outcome itself, so js's
// asynchronous publishing options (jetstream.WithPublishAsyncErrHandler and the like, which
// nats.go does not show) do not apply to the relay's publishes.
//
// The connection decides how fast the relay notices that NATS is gone: connect with
// nats.ReconnectBufSize(-1) (without it the handover and the write fence are off) and a
// keepalive shorter than Config.HandoverAfter, as relay run does (nats.PingInterval(2s),
// nats.MaxPingsOutstanding(2)): with nats.go's default, a server that stops answering without
// closing the connection is noticed after minutes, and the relay keeps its partitions
// meanwhile.
func New(pool *pgxpool.Pool, js jetstream.JetStream, cfg *Config) (*Relay, error) {
	if err := dbhandle.RequireArg("relay", "pool", "a *pgxpool.Pool", pool); err != nil {
		return nil, err
	}
	if err := dbhandle.RequireArg("relay", "js", "a jetstream.JetStream", js); err != nil {
		return nil, err
	}
	c := cfg.WithDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	r := &Relay{
		cfg:     c,
		windows: newWindowWatch(),
		pool:    pool,
		js:      js,
		q:       store.New(c.Schema),
		log:     c.Logger.With("component", "relay", "relay_id", c.ID),
		wake:    make(chan struct{}, 1),
		floor:   newClaimFloor(),
		trace:   newRelayTracer(c),
	}
	r.trace.conn = js.Conn()
	var err error
	r.pub, err = newPublisher(js, c)
	if err != nil {
		return nil, fmt.Errorf("relay: jetstream publisher: %w", err)
	}
	if r.m, err = newMetrics(c.Registerer); err != nil {
		return nil, err
	}
	if r.sm, err = newScheduledMetrics(c.Registerer); err != nil {
		return nil, err
	}
	if c.HandoverAfter != txoutbox.Off && js.Conn().Opts.ReconnectBufSize != -1 {
		// See leaser.handoverLocked: a publish buffered during a reconnect could reach the
		// stream after the relays that took over published later messages of its key.
		c.HandoverAfter = txoutbox.Off
		r.log.Info("handover off: the NATS connection buffers publishes while it reconnects (connect with nats.ReconnectBufSize(-1) to turn it on)")
	}
	r.lease = newLeaser(r)
	if wf, ok := js.Conn().Opts.CustomDialer.(*WriteFence); ok {
		if js.Conn().Opts.ReconnectBufSize != -1 {
			r.log.Info("write fence off: the NATS connection buffers publishes while it reconnects, and sends them later unchecked (connect with nats.ReconnectBufSize(-1) to turn it on)")
		} else {
			r.fenceOwner = wf
			r.fence = wf.bind(r.lease.expiry, r.log, func() { r.stats.Fenced.Add(1) })
		}
	}
	r.denied.inbox = inboxPrefix(js.Conn())
	r.unwatch = watchPermissions(js.Conn(), &r.denied)
	return r, nil
}

// Config returns the relay's effective configuration.
func (r *Relay) Config() Config { return *r.cfg }

// Stats returns the relay's running totals.
func (r *Relay) Stats() Stats { return r.stats.snapshot() }

// Wake makes the relay claim now instead of at its next poll (what a doorbell ring does).
func (r *Relay) Wake() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// Run checks the streams (see Config.Subjects and CheckStreams: a nats-server older than
// MinServerVersion is a *txoutbox.ServerVersionError, txoutbox.ErrServerTooOld; while
// JetStream or a stream cannot answer, as during a leader election, it waits and checks
// again), then publishes until ctx ends (cancelled or past its deadline: the same, whether
// ctx ends during the start-up check or after). When ctx ends it stops claiming, finishes and settles the batch in flight, releases its
// partitions and returns nil, within Config.MaxStopTime even when PostgreSQL or NATS stops
// answering (a batch whose settle does not end in time stays ready, to be published again). It returns a *PartitionMismatchError (ErrPartitionMismatch) at
// start when a live relay of the same outbox has another partition count, ErrPublishDenied
// at start when the server denies the relay's NATS user the start-up check's JetStream
// requests, the start-up check's refusals (see CheckStreams), txoutbox.ErrRunning while
// another Run of this relay has not returned, and ErrClosed after Close (which also stops a
// running Run, see Close).
func (r *Relay) Run(ctx context.Context) error {
	ctx, end, err := r.run.start(ctx)
	if err != nil {
		return fmt.Errorf("relay: Run: %w", err)
	}
	defer end()
	if err := r.checkStreamsWaiting(ctx); err != nil {
		if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
			return nil // stopped (cancelled or past its deadline) while waiting for JetStream
		}
		return err
	}
	if !r.cfg.DisableDoorbell {
		sub, err := r.js.Conn().Subscribe(r.cfg.DoorbellSubject, func(*nats.Msg) { r.Wake() })
		if err != nil {
			return fmt.Errorf("relay: subscribe to doorbell %q: %w", r.cfg.DoorbellSubject, err)
		}
		defer func() { _ = sub.Unsubscribe() }()
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	lctx, stopListen := context.WithCancel(ctx)
	defer stopListen()
	if r.cfg.DoorbellChannel != "" {
		wg.Add(1)
		go func() { defer wg.Done(); r.listen(lctx) }()
	}
	if r.cfg.Registerer != nil {
		wg.Add(1)
		go func() { defer wg.Done(); r.sampleLoop(lctx) }()
	}
	wg.Add(1)
	go func() { defer wg.Done(); r.watchMembers(lctx) }()
	wg.Add(1)
	go func() { defer wg.Done(); r.watchWindows(lctx) }()
	defer r.lease.close()
	if len(r.cfg.Subjects) == 0 {
		r.log.Warn("no subjects to check at start (Config.Subjects, --subjects): the streams are checked only once the relay " +
			"publishes to them (their duplicate window is then a warning, not a refusal); name the subjects producers write")
	}

	r.log.Info("relay started", "schema", r.cfg.Schema, "partitions", r.cfg.Partitions,
		"batch_size", r.cfg.BatchSize, "retention", retentionText(r.cfg.PublishedRetention))
	err = r.pipeline(ctx)
	r.log.Info("relay stopped")
	return err
}

// retentionText is Config.PublishedRetention as the logs show it: "none" (rows deleted as they are
// published), "forever" (txoutbox.Forever) or the duration.
func retentionText(d time.Duration) string {
	switch {
	case d == txoutbox.Forever:
		return "forever"
	case d == 0:
		return "none"
	}
	return d.String()
}

// inflight is a claimed batch whose publishes are under way.
type inflight struct {
	conn *pgx.Conn
	rows []store.Claimed
	res  *batchResult
	done chan struct{}
}

func (b *inflight) ids() []int64 {
	if b == nil {
		return nil
	}
	ids := make([]int64, len(b.rows))
	for i := range b.rows {
		ids[i] = b.rows[i].ID
	}
	return ids
}

// startPublish publishes rows in the background; rows of the held keys are left alone.
func (r *Relay) startPublish(ctx context.Context, conn *pgx.Conn, gen uint64, rows []store.Claimed, held map[string]int64) *inflight {
	b := &inflight{conn: conn, rows: rows, done: make(chan struct{})}
	go func() {
		defer close(b.done)
		b.res = r.publish(ctx, rows, held, gen)
	}()
	return b
}

// pipeline is Run's loop. Database work and publishing overlap: while batch N's publishes
// are in flight, batch N+1 is claimed (excluding N's rows); once N's PubAcks are all in,
// N+1's publishes start and N is settled. Per-key order holds across batches: N+1's rows are
// sent only after every PubAck of N is in, and N+1 leaves alone the keys that failed in N
// (the claim after N's settle sees them as blocked). While it waits for a batch's publishing
// to end, lease rounds that fall due run (see awaitBatch).
func (r *Relay) pipeline(ctx context.Context) error {
	// A claimed batch is published and settled after ctx is cancelled too, within the drain
	// bound: its PubAcks (PublishTimeout) and then DrainSettleTimeout for the database.
	bctx, stopDrain := drainContext(ctx, addSat(r.cfg.PublishTimeout, DrainSettleTimeout))
	defer stopDrain()
	poll := r.cfg.PollMin
	outage := 0
	streamWait := 0 // batches in a row that only met streams without a leader
	var cur *inflight
	for {
		stopping := ctx.Err() != nil
		var (
			conn *pgx.Conn
			gen  uint64
			next []store.Claimed
			err  error
		)
		if !stopping {
			// With a batch in flight the claim must not be cancelled by shutdown: pgx closes a
			// connection whose query is cancelled, and with it would go the leases and the
			// settle of the batch in flight. A claim is short; shutdown waits for it.
			cctx := ctx
			if cur != nil {
				cctx = bctx
				if h := r.hooks.beforePipelinedClaim; h != nil {
					h(cctx)
				}
			}
			cctx, cancel := context.WithTimeout(cctx, claimTimeout)
			conn, gen, next, err = r.claim(cctx, cur.ids())
			cancel()
		}
		progressed := false // a batch was published and settled in this iteration
		if cur != nil {
			r.awaitBatch(ctx, bctx, cur)
			if cur.res.brokerErr != nil {
				next = nil // the broker is gone: publish nothing more, leave the rows ready
			}
			if len(next) > 0 && !r.lease.valid(gen) {
				// A round during the wait released or lost partitions (a rebalance): next was
				// claimed under the old lease generation and would be withheld row by row.
				// Its rows stay ready; the next claim takes them under the new one.
				next = nil
			}
			var nb *inflight
			if len(next) > 0 && ctx.Err() == nil { // stopping: claimed rows stay ready, unsent
				nb = r.startPublish(bctx, conn, gen, next, cur.res.heldKeys)
			}
			serr := r.finish(bctx, cur)
			progressed = serr == nil
			if serr != nil && nb != nil && !errors.Is(serr, errStreamUnavailable) {
				// The settle failed (its rows stay ready and are republished later); do not
				// run ahead of it: finish what is in flight first.
				r.awaitBatch(ctx, bctx, nb)
				_ = r.finish(bctx, nb)
				nb = nil
			}
			if err == nil {
				err = serr
			}
			cur = nb
		} else if len(next) > 0 {
			cur = r.startPublish(bctx, conn, gen, next, nil)
		}
		if stopping {
			if cur == nil {
				return nil
			}
			continue
		}
		if cur != nil && err == nil {
			// Work in flight: claim the next batch at once. Only a batch that went through
			// ends an outage; one merely started (after a backoff) proves nothing yet.
			if progressed {
				outage, streamWait, poll = 0, 0, r.cfg.PollMin
				r.setHealth(healthOK, nil)
			}
			continue
		}
		if cur != nil {
			// An error with a batch in flight: finish it before backing off.
			r.awaitBatch(ctx, bctx, cur)
			_ = r.finish(bctx, cur)
			cur = nil
		}
		var wait time.Duration
		switch {
		case err == nil:
			outage, streamWait = 0, 0
			r.setIdleHealth(healthOK)
			wait, poll = poll, min(mulSat(2, poll), r.cfg.PollMax)
			wait = r.capWait(wait) // wake when the next delayed message falls due
		case errors.Is(err, errStreamUnavailable):
			// A stream without a leader, and nothing else to publish: its rows wait (no
			// attempt); look again soon, since an election usually takes seconds. Not a broker
			// outage: health and the handover are left alone.
			streamWait++
			wait = backoff(streamWait, 50*time.Millisecond, outageRecheck, r.cfg.BackoffJitter)
		case errors.Is(err, errNoPartitions):
			r.setIdleHealth(healthStandby)
			wait = r.cfg.LeaseInterval
		case errors.Is(err, ErrPartitionMismatch):
			return err
		case ctx.Err() != nil:
			continue
		default:
			outage++
			r.setHealth(classifyHealth(err), err)
			wait = backoff(outage, mulSat(10, r.cfg.PollMin), r.cfg.BackoffMax, r.cfg.BackoffJitter)
			r.testSignals.backoff.Signal(backoffEvent{outage: outage, wait: wait})
		}
		wasDown := !r.pub.Conn().IsConnected()
		if r.sleep(ctx, wait) {
			poll = r.cfg.PollMin // a doorbell: work is likely to follow
		}
		if wasDown && r.pub.Conn().IsConnected() {
			outage = 0 // NATS reconnected: the backoff starts over (JetStream may need a moment)
		}
	}
}

// awaitBatch waits until the publishing of batch b ends, running the lease rounds that fall
// due meanwhile, or that the membership watch asks for (leaser.recheck), as a claim or the
// relay's sleep would. A batch can take long: a hot key's rows go out one wave after another,
// each after the previous PubAck, and waves wait out PublishTimeout and a probe while a
// stream elects a leader. Without rounds then, the relay would take no partition freed
// meanwhile, its own lease would expire (it withholds the rest of its batch), and its peers
// would fence it, live, after fenceFactor lease intervals. A round here may release
// partitions: that bumps the lease generation, and b sends nothing more (leaser.valid), as
// after a round at a claim.
//
// The lease connection is idle while the pipeline waits here: the claim is done and the
// settle has not started, and the publishing goroutine never touches it. Rounds run under
// dctx, the drain context (shutdown must not cancel a query on the lease connection: pgx
// closes a connection whose query is cancelled), each bounded by claimTimeout, and only on a
// lease connection that is up: reconnecting is left to the next claim. A failed round ends
// the rounds of this wait, not the wait: b's settle and the next claim deal with a broken
// connection as they would have. One timer per wait, woken when a round falls due and every
// memberWatchEvery to look at the recheck flag. Once ctx (Run's) is done the relay is
// stopping: it runs no more rounds (it would take partitions it never claims, or have
// partitions released to it, until Run returns) and only waits for b.
func (r *Relay) awaitBatch(ctx, dctx context.Context, b *inflight) {
	select {
	case <-b.done:
		return
	default:
	}
	l := r.lease
	round := func() bool {
		l.mu.Lock()
		defer l.unlock() // Relay.Lease shows what the round changed
		if l.conn == nil || l.conn.IsClosed() {
			return false
		}
		mctx, cancel := context.WithTimeout(dctx, claimTimeout)
		defer cancel()
		return l.maintainLocked(mctx) == nil
	}
	every := memberWatchEvery(r.cfg.LeaseInterval)
	t := time.NewTimer(min(max(l.untilRound(), 0), every))
	defer t.Stop()
	for {
		select {
		case <-b.done:
			return
		case <-t.C:
		}
		if ctx.Err() != nil || !round() {
			<-b.done
			return
		}
		t.Reset(min(max(l.untilRound(), 0), every))
	}
}

// reconnectCheck is how often a relay sleeping with its NATS connection down looks whether it
// is back.
const reconnectCheck = 250 * time.Millisecond

// claimTimeout bounds a claim (with its lease round): a connection that stops answering must
// not hang the relay.
const claimTimeout = 30 * time.Second

// DrainSettleTimeout bounds the stop of Run: once its context is cancelled, the database work
// of the batch in flight (the claim of the next batch that overlaps its publishes, then its
// settle) must end within PublishTimeout + DrainSettleTimeout, however long a claim or a
// settle may take while the relay runs (30 s each). A PostgreSQL that stops answering then costs the rows of the
// batch their settle: they stay ready and are published again (JetStream drops the
// duplicates within its window), by this relay's successor.
const DrainSettleTimeout = 5 * time.Second

// ReleaseTimeout bounds the release of the partitions when Run returns: the relay's
// membership row is deleted and its lease session closed within it, or left to the
// server, which ends the session when it notices the connection gone.
const ReleaseTimeout = time.Second

// MaxStopTime is the longest Run takes to return once its context is cancelled, with
// PostgreSQL or NATS not answering: the drain (PublishTimeout + DrainSettleTimeout, see
// DrainSettleTimeout) and the release of the partitions (ReleaseTimeout). The
// configuration's defaults apply to unset fields. A supervisor's grace period (a
// Kubernetes pod's termination grace period, a systemd unit's stop timeout) must be longer,
// with what the process adds to close its connections.
func (c *Config) MaxStopTime() time.Duration {
	return addSat(c.WithDefaults().PublishTimeout, DrainSettleTimeout+ReleaseTimeout)
}

// drainContext returns a context that ctx's cancellation does not reach at once: it is
// cancelled bound after ctx is, or by stop.
func drainContext(ctx context.Context, bound time.Duration) (dctx context.Context, stop func()) {
	dctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	go func() {
		select {
		case <-ctx.Done():
		case <-dctx.Done():
			return
		}
		t := time.NewTimer(bound)
		defer t.Stop()
		select {
		case <-t.C:
			cancel()
		case <-dctx.Done():
		}
	}()
	return dctx, cancel
}

// settleTimeout bounds a settle while the relay runs.
const settleTimeout = 30 * time.Second

// finish runs the fault hook, settles a published batch and reports a broker outage.
func (r *Relay) finish(ctx context.Context, b *inflight) error {
	if r.hooks.afterPublish != nil {
		if err := r.hooks.afterPublish(ctx, len(b.res.published)); err != nil {
			return err
		}
	}
	fault.Point(fault.RelayBeforeSettle) // crash tests: every PubAck is in, nothing settled yet
	if err := r.settle(ctx, b.conn, b.rows, b.res); err != nil {
		return err
	}
	if b.res.brokerErr != nil {
		return fmt.Errorf("%w: %v", errBrokerUnavailable, b.res.brokerErr)
	}
	if b.res.streamErr != nil && len(b.res.published) == 0 {
		// Nothing went out: every row sent was of a stream without a leader (or held behind
		// one). The caller waits a little before claiming them again.
		return b.res.streamErr
	}
	return nil
}

// sleep waits for d, a wake-up or ctx; it reports whether it was woken early. Lease rounds
// that fall due meanwhile run (no batch is in flight while the relay sleeps), and a standby
// that gains partitions in one wakes at once.
func (r *Relay) sleep(ctx context.Context, d time.Duration) bool {
	deadline := time.Now().Add(d)
	rounds := true
	// A relay backing off from a NATS outage wakes as soon as its connection is back, rather
	// than sleeping out a backoff that may have grown to BackoffMax.
	nc := r.pub.Conn()
	disconnected := !nc.IsConnected()
	for {
		wait := time.Until(deadline)
		if wait <= 0 {
			return false
		}
		round, check := false, false
		if u := r.lease.untilRound(); rounds && u < wait {
			wait, round = max(u, 0), true
		}
		if disconnected && wait > reconnectCheck {
			wait, round, check = reconnectCheck, false, true
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return false
		case <-r.wake:
			t.Stop()
			return true
		case <-t.C:
		}
		if disconnected && nc.IsConnected() {
			return true
		}
		if check {
			continue
		}
		if !round {
			return false
		}
		mctx, cancel := context.WithTimeout(ctx, claimTimeout)
		gained, err := r.lease.maintain(mctx)
		cancel()
		if gained {
			return true
		}
		if err != nil {
			// The next claim reports the problem; sleep out the backoff without more rounds.
			rounds = false
		}
	}
}

// claim takes the next batch of due ready rows of the leased partitions, excluding rows in
// flight; gen is the lease generation it was claimed under.
func (r *Relay) claim(ctx context.Context, exclude []int64) (conn *pgx.Conn, gen uint64, rows []store.Claimed, err error) {
	conn, parts, gen, err := r.lease.acquireGen(ctx)
	if err != nil {
		return nil, 0, nil, err
	}
	args := store.ClaimArgs{Limit: r.cfg.BatchSize, PartitionCount: int32(r.cfg.Partitions), Exclude: exclude}
	// Rows held back for a stream outage stay out of the claim while it lasts (outage.go).
	r.askOutages()
	if ids, keys := r.outages.exclusions(gen); len(ids)+len(keys) > 0 {
		args.Exclude = append(slices.Clip(exclude), ids...)
		args.ExcludeKeys = keys
	}
	if len(parts) < r.cfg.Partitions {
		args.Partitions = parts
	}
	t0 := time.Now()
	args.After = r.floor.bound(parts, gen)
	rows, err = r.claimPromoting(ctx, conn, args) // delayed messages that fell due first (scheduled.go)
	r.m.claimDur.Observe(time.Since(t0).Seconds())
	if err != nil {
		r.lease.broken(err)
		return nil, 0, nil, fmt.Errorf("relay: claim: %w", err)
	}
	r.floor.claimed(rows)
	if len(rows) == 0 {
		r.checkFloor(ctx, conn) // nothing to publish: the check delays nothing
	}
	if p, g, after, ok := r.floor.probeDue(time.Now()); ok {
		r.run.goBackground(claimTimeout, func(ctx context.Context) { r.probeFloor(ctx, p, g, after) })
	}
	if len(rows) > 0 {
		r.lastWork.Store(time.Now().UnixNano())
	}
	return conn, gen, rows, nil
}

// runOnce claims one batch, publishes it and settles it, without pipelining: the steps that
// pipeline overlaps (claim, publish, finish), one after another. It returns how many rows it
// claimed. Once rows are claimed, cancelling ctx no longer interrupts the batch: it is
// published and settled (bounded by the publish timeout).
func (r *Relay) runOnce(ctx context.Context) (int, error) {
	conn, gen, rows, err := r.claim(ctx, nil)
	if err != nil || len(rows) == 0 {
		return 0, err
	}
	bctx := context.WithoutCancel(ctx)
	b := &inflight{conn: conn, rows: rows, res: r.publish(bctx, rows, nil, gen)}
	return len(rows), r.finish(bctx, b)
}

func (r *Relay) settle(ctx context.Context, conn store.DBTX, rows []store.Claimed, res *batchResult) error {
	if len(res.published) == 0 && len(res.failed) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, settleTimeout)
	defer cancel()
	t0 := time.Now()
	out, err := r.q.Settle(ctx, conn, store.SettleArgs{
		Published:   res.published,
		Failed:      res.failed,
		MaxAttempts: r.cfg.MaxAttempts,
		Retain:      r.cfg.PublishedRetention != 0, // positive or Forever
	})
	r.m.settleDur.Observe(time.Since(t0).Seconds())
	if err != nil {
		// The rows stay ready and are published again; JetStream drops the duplicates.
		r.lease.broken(err)
		return fmt.Errorf("relay: settle: %w", err)
	}
	r.checkFloor(ctx, conn) // the batch is out: the check delays no publish
	if n := int64(len(res.published)); out.Published < n {
		// Rows this relay published that its settle did not find ready: another relay settled
		// them after taking this one's partitions over (rare), or the relay's role cannot see
		// or change them (row-level security without the relay's policy: the rows stay ready
		// and are published again and again, so the line is logged once until a settle finds
		// every row again; the counter counts them all).
		r.m.unsettled.Add(float64(n - out.Published))
		if r.settleShort.CompareAndSwap(false, true) {
			r.log.Warn("settle found fewer of the published rows ready than were published: taken over by another relay, or hidden from this role (row-level security: re-run "+cmdline.Command(r.cfg.Schema, "relay migrate grants --role relay")+"); logged once until settles find every row again (txoutbox_relay_unsettled_total counts them)",
				"published", n, "settled", out.Published)
		}
	} else if len(res.published) > 0 && r.settleShort.CompareAndSwap(true, false) {
		r.log.Info("settle finds every published row ready again")
	}
	r.stats.Batches.Add(1)
	r.stats.Published.Add(out.Published)
	r.stats.Failed.Add(int64(len(res.failed)))
	r.stats.Dead.Add(int64(len(out.Dead)))
	r.m.published.Add(float64(out.Published))
	r.m.batchSize.Observe(float64(len(rows)))
	r.m.dead.Add(float64(len(out.Dead)))
	for _, id := range out.Dead {
		if slices.Contains(res.permanent, id) {
			r.log.Error("message is dead: it can never be published as it is (see its last_error)", "message_id", id.String())
			continue
		}
		r.log.Error("message is dead: publishing failed too many times", "message_id", id.String(), "max_attempts", r.cfg.MaxAttempts)
	}
	return nil
}

// newPublisher returns a JetStream like js — its domain or API prefix, default timeout and
// client trace — whose async publishes time out after PublishTimeout and are bounded by
// MaxInFlight. The caller's js keeps its own settings for everything else the relay asks.
func newPublisher(js jetstream.JetStream, c *Config) (jetstream.JetStream, error) {
	o := js.Options()
	opts := []jetstream.JetStreamOpt{
		jetstream.WithPublishAsyncTimeout(c.PublishTimeout),
		jetstream.WithPublishAsyncMaxPending(c.MaxInFlight),
	}
	if o.DefaultTimeout > 0 {
		opts = append(opts, jetstream.WithDefaultTimeout(o.DefaultTimeout))
	}
	if o.ClientTrace != nil {
		opts = append(opts, jetstream.WithClientTrace(o.ClientTrace))
	}
	switch {
	case o.Domain != "":
		return jetstream.NewWithDomain(js.Conn(), o.Domain, opts...)
	case o.APIPrefix != "":
		return jetstream.NewWithAPIPrefix(js.Conn(), o.APIPrefix, opts...)
	}
	return jetstream.New(js.Conn(), opts...)
}

// backoff is backoff.Exponential: base·2^(n-1) times a random factor in [1-jitter, 1+jitter],
// capped at max (the cap holds after the jitter).
var backoff = backoffpkg.Exponential

// Health is a relay's state, as Relay.Health reports it and /readyz serves it.
type Health string

// A relay's states.
const (
	HealthStarting            Health = "starting"             // not publishing yet: no round has ended
	HealthOK                  Health = "ok"                   // publishing
	HealthStandby             Health = "standby"              // every partition is held by another relay
	HealthPostgresUnavailable Health = "postgres_unavailable" // backing off: PostgreSQL fails
	HealthNATSUnavailable     Health = "nats_unavailable"     // backing off: NATS or JetStream fails
)

// healthState indexes healthStates; it is what the relay stores atomically.
type healthState int32

const (
	healthStarting healthState = iota
	healthOK
	healthStandby
	healthPostgresDown
	healthNATSDown
)

var healthStates = [...]Health{HealthStarting, HealthOK, HealthStandby, HealthPostgresUnavailable, HealthNATSUnavailable}

func (h healthState) String() string { return string(healthStates[h]) }

func classifyHealth(err error) healthState {
	if errors.Is(err, errBrokerUnavailable) {
		return healthNATSDown
	}
	return healthPostgresDown
}

// setIdleHealth sets h, the state of a relay that had nothing to publish (ok, or standby
// without partitions), unless its NATS connection is down: then nothing could have been
// published either, and the relay is not ready (/readyz, the health gauge); the handover
// clock starts then, not at the first row that fails to go out.
func (r *Relay) setIdleHealth(h healthState) {
	if nc := r.pub.Conn(); !nc.IsConnected() {
		r.setHealth(healthNATSDown, fmt.Errorf("%w: NATS connection %s", errBrokerUnavailable, nc.Status()))
		return
	}
	r.setHealth(h, nil)
}

// setHealth logs state changes only, never each retry.
func (r *Relay) setHealth(h healthState, err error) {
	prev := healthState(r.health.Swap(int32(h)))
	if prev == h {
		return
	}
	r.m.setHealth(h)
	if h == healthNATSDown {
		r.natsDownSince.Store(time.Now().UnixNano())
	} else {
		r.natsDownSince.Store(0)
	}
	switch {
	case h == healthOK && prev == healthStarting:
		r.log.Info("relay publishing")
	case h == healthOK:
		r.log.Info("relay healthy", "previous", prev.String())
	case h == healthStandby:
		r.log.Info("relay on standby: every partition is held by another relay")
	case errors.Is(err, context.Canceled):
	default:
		r.log.Warn("relay degraded; backing off and retrying", "state", h.String(), "err", err)
	}
}

// Health reports the relay's state: HealthStarting until its first round ends, then HealthOK,
// HealthStandby, HealthPostgresUnavailable or HealthNATSUnavailable. While Run waits at its
// start-up stream check it is HealthNATSUnavailable or HealthPostgresUnavailable (what the
// check waits for), and HealthStarting again once the wait ends.
func (r *Relay) Health() Health { return healthStates[r.health.Load()] }
