// Package relay publishes committed outbox rows to NATS JetStream.
//
// The loop: claim a batch of due ready rows of the partitions this relay leases, in id order;
// publish them with async JetStream publishes (Nats-Msg-Id = the message id, a bounded window
// of PubAcks in flight, a publish timeout); wait for every PubAck (a duplicate ack counts as
// success); settle the whole batch in one statement. Messages of one key are published one
// after another (the next only once the previous one's PubAck is in), so a key's messages are
// stored in order even across failures, retries and relay handovers; messages of different
// keys, and unkeyed messages, are pipelined.
//
// A crash between publish and settle leaves the rows ready, so they are published again; the
// stream's duplicate window (and the idempotent consumer's dedup table beyond it) absorb that.
package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/fault"
	"github.com/txoutbox/txoutbox/internal/store"
)

// Sentinel errors.
var (
	// ErrNoStream: no JetStream stream captures a subject the relay must serve.
	ErrNoStream = errors.New("relay: no stream captures subject")
	// ErrDuplicateWindow: a stream's duplicate window is shorter than the relay's worst
	// republish delay, so a republish could be stored twice.
	ErrDuplicateWindow = errors.New("relay: stream duplicate window too short")
	// ErrBrokerUnavailable: NATS or JetStream did not answer (timeouts, lost connection).
	// Rows are left as they are and retried; no attempt is counted.
	ErrBrokerUnavailable = errors.New("relay: broker unavailable")
	// ErrNoPartitions: the relay holds no partition lease (others hold them all).
	ErrNoPartitions = errors.New("relay: no partition held")
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
	lease *leaser
	wake  chan struct{}

	health atomic.Int32 // a healthState
	hooks  hooks
	stats  Stats
}

// hooks are fault-injection points for tests.
type hooks struct {
	// afterPublish runs after every PubAck of a batch is in and before the batch is settled;
	// an error makes runOnce return it without settling, as a crash there would.
	afterPublish func(ctx context.Context, published int) error
}

// Stats are running totals, for tests and the bench command.
type Stats struct {
	Published  atomic.Int64 // rows settled as published
	Duplicates atomic.Int64 // PubAcks that reported a duplicate
	Failed     atomic.Int64 // message-level publish failures
	Dead       atomic.Int64 // rows that became dead
	Batches    atomic.Int64 // non-empty batches
}

// New returns a relay publishing rows from pool to js. cfg may be nil for all defaults.
func New(pool *pgxpool.Pool, js jetstream.JetStream, cfg *Config) (*Relay, error) {
	if pool == nil {
		return nil, errors.New("relay: pool is nil")
	}
	if js == nil {
		return nil, errors.New("relay: jetstream is nil")
	}
	c := cfg.WithDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	r := &Relay{
		cfg:  c,
		pool: pool,
		js:   js,
		q:    store.New(c.Schema),
		log:  c.Logger.With("component", "relay", "relay_id", c.ID),
		wake: make(chan struct{}, 1),
	}
	var err error
	pubOpts := []jetstream.JetStreamOpt{
		jetstream.WithPublishAsyncTimeout(c.PublishTimeout),
		jetstream.WithPublishAsyncMaxPending(c.MaxInFlight),
	}
	if prefix := js.Options().APIPrefix; prefix != "" {
		r.pub, err = jetstream.NewWithAPIPrefix(js.Conn(), prefix, pubOpts...)
	} else {
		r.pub, err = jetstream.New(js.Conn(), pubOpts...)
	}
	if err != nil {
		return nil, fmt.Errorf("relay: jetstream publisher: %w", err)
	}
	if r.m, err = newMetrics(c.Registerer); err != nil {
		return nil, err
	}
	r.lease = newLeaser(r)
	return r, nil
}

// Config returns the relay's effective configuration.
func (r *Relay) Config() Config { return *r.cfg }

// Stats returns the relay's running totals.
func (r *Relay) Stats() *Stats { return &r.stats }

// Wake makes the relay claim now instead of at its next poll (what a doorbell ring does).
func (r *Relay) Wake() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// Run checks the streams (see Config.Subjects), then publishes until ctx is cancelled. On
// cancellation it stops claiming, finishes and settles the batch in flight, releases its
// partitions and returns nil.
func (r *Relay) Run(ctx context.Context) error {
	if err := r.CheckStreams(ctx); err != nil {
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
	defer r.lease.close()

	r.log.Info("relay started", "schema", r.cfg.Schema, "partitions", r.cfg.Partitions,
		"batch_size", r.cfg.BatchSize, "retention", r.cfg.Retention.String())
	poll := r.cfg.PollMin
	outage := 0
	for {
		if ctx.Err() != nil {
			r.log.Info("relay stopped")
			return nil
		}
		n, err := r.runOnce(ctx)
		var wait time.Duration
		switch {
		case err == nil && n > 0:
			outage, poll = 0, r.cfg.PollMin
			r.setHealth(healthOK, nil)
			continue // there may be more: claim again at once
		case err == nil:
			outage = 0
			r.setHealth(healthOK, nil)
			wait, poll = poll, min(poll*2, r.cfg.PollMax)
		case errors.Is(err, ErrNoPartitions):
			r.setHealth(healthStandby, nil)
			wait = r.cfg.LeaseInterval
		case ctx.Err() != nil:
			continue
		default:
			outage++
			r.setHealth(classifyHealth(err), err)
			wait = backoff(outage, r.cfg.PollMin*10, r.cfg.BackoffMax, r.cfg.BackoffJitter)
		}
		if !r.sleep(ctx, wait) {
			continue
		}
	}
}

// sleep waits for d, a wake-up or ctx; it reports whether it was woken early.
func (r *Relay) sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-r.wake:
		return true
	case <-t.C:
		return false
	}
}

// runOnce claims one batch, publishes it and settles it. It returns how many rows it claimed.
// Once rows are claimed, cancelling ctx no longer interrupts the batch: it is published and
// settled (bounded by the publish timeout) so that shutdown leaves nothing half done.
func (r *Relay) runOnce(ctx context.Context) (int, error) {
	conn, parts, err := r.lease.acquire(ctx)
	if err != nil {
		return 0, err
	}
	args := store.ClaimArgs{Limit: r.cfg.BatchSize, PartitionCount: int32(r.cfg.Partitions)}
	if len(parts) < r.cfg.Partitions {
		args.Partitions = parts
	}
	rows, err := r.q.Claim(ctx, conn, args)
	if err != nil {
		r.lease.broken(err)
		return 0, fmt.Errorf("relay: claim: %w", err)
	}
	if len(rows) == 0 {
		return 0, nil
	}
	bctx := context.WithoutCancel(ctx)
	res := r.publish(bctx, rows)
	if r.hooks.afterPublish != nil {
		if err := r.hooks.afterPublish(bctx, len(res.published)); err != nil {
			return len(rows), err
		}
	}
	fault.Point(fault.RelayBeforeSettle)
	if err := r.settle(bctx, conn, rows, res); err != nil {
		return len(rows), err
	}
	if res.brokerErr != nil {
		return len(rows), fmt.Errorf("%w: %v", ErrBrokerUnavailable, res.brokerErr)
	}
	return len(rows), nil
}

func (r *Relay) settle(ctx context.Context, conn store.DBTX, rows []store.Claimed, res *batchResult) error {
	if len(res.published) == 0 && len(res.failed) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	out, err := r.q.Settle(ctx, conn, store.SettleArgs{
		Published:   res.published,
		Failed:      res.failed,
		MaxAttempts: r.cfg.MaxAttempts,
		Retain:      r.cfg.Retention > 0,
	})
	if err != nil {
		// The rows stay ready and are published again; JetStream drops the duplicates.
		r.lease.broken(err)
		return fmt.Errorf("relay: settle: %w", err)
	}
	r.stats.Batches.Add(1)
	r.stats.Published.Add(out.Published)
	r.stats.Failed.Add(int64(len(res.failed)))
	r.stats.Dead.Add(int64(len(out.Dead)))
	r.m.published.Add(float64(out.Published))
	r.m.batchSize.Observe(float64(len(rows)))
	r.m.dead.Add(float64(len(out.Dead)))
	for _, id := range out.Dead {
		r.log.Error("message is dead: publishing failed too many times", "message_id", id.String(), "max_attempts", r.cfg.MaxAttempts)
	}
	return nil
}

// backoff is base·2^(n-1) capped at max, times a random factor in [1-jitter, 1+jitter].
func backoff(n int, base, max time.Duration, jitter float64) time.Duration {
	d := base
	for i := 1; i < n && d < max; i++ {
		d *= 2
	}
	if d > max {
		d = max
	}
	if jitter > 0 {
		d = time.Duration(float64(d) * (1 + jitter*(2*rand.Float64()-1)))
	}
	return d
}

type healthState int32

const (
	healthOK healthState = iota
	healthStandby
	healthPostgresDown
	healthNATSDown
)

func (h healthState) String() string {
	switch h {
	case healthOK:
		return "ok"
	case healthStandby:
		return "standby"
	case healthPostgresDown:
		return "postgres_unavailable"
	case healthNATSDown:
		return "nats_unavailable"
	}
	return "unknown"
}

func classifyHealth(err error) healthState {
	if errors.Is(err, ErrBrokerUnavailable) {
		return healthNATSDown
	}
	return healthPostgresDown
}

// setHealth logs state changes only, never each retry.
func (r *Relay) setHealth(h healthState, err error) {
	prev := healthState(r.health.Swap(int32(h)))
	if prev == h {
		return
	}
	switch {
	case h == healthOK:
		r.log.Info("relay healthy", "previous", prev.String())
	case h == healthStandby:
		r.log.Info("relay on standby: every partition is held by another relay")
	case errors.Is(err, context.Canceled):
	default:
		r.log.Warn("relay degraded; backing off and retrying", "state", h.String(), "err", err)
	}
}

// Health reports the relay's state: "ok", "standby", "postgres_unavailable" or
// "nats_unavailable".
func (r *Relay) Health() string { return healthState(r.health.Load()).String() }
