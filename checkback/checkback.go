// Package checkback settles what the outbox cannot settle alone. Three jobs, scheduled with
// robfig/cron/v3 (a run still going when the next is due is skipped):
//
//   - resolve: half messages prepared longer than the transaction timeout whose next check is
//     due are resolved. A message prepared with a producer group is checked: the group's
//     checker (see checker.Serve in package outbox/checker) is asked over NATS request/reply whether the local transaction
//     committed. Only an explicit COMMIT or ROLLBACK settles it; anything else (UNKNOWN, an
//     error reply, a timeout, no responders, a malformed reply) counts a check and schedules
//     the next with exponential backoff and jitter, and after MaxChecks the row becomes
//     check_exhausted: counted, logged, listed by `relay prepared list` and resumable, never
//     dropped. A message prepared with Fence (its producer's work is in this database) is
//     rolled back under its row lock, so that a CommitTx in flight either wins first or fails
//     afterwards.
//   - stale: ready rows older than a threshold (a stuck relay, a failing subject) are counted
//     and logged with the oldest age; prepared and check_exhausted rows are counted. Read-only.
//   - purge: published rows, rolled back rows and consumer dedup rows past their retention are
//     deleted in short bounded batches.
//
// `relay run` runs the jobs by default; `relay checkback --once` runs each once.
package checkback

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/robfig/cron/v3"
	"github.com/txoutbox/txoutbox"
	backoffpkg "github.com/txoutbox/txoutbox/internal/backoff"
	"github.com/txoutbox/txoutbox/internal/dbhandle"
	"github.com/txoutbox/txoutbox/internal/store"
	"golang.org/x/time/rate"
)

// CheckBack runs the check-back jobs. Create it with New; run it with Run, or RunOnce.
type CheckBack struct {
	running atomic.Bool
	cfg     *Config
	db      txoutbox.DB
	nc      *nats.Conn
	q       *store.Queries
	log     *slog.Logger
	m       *metrics

	limMu    sync.Mutex
	limiters map[string]*groupLimit

	// busy are the groups an earlier pass is still asking; bg counts those passes' units.
	busyMu sync.Mutex
	busy   map[string]bool
	bg     sync.WaitGroup

	stale    staleState
	natsDown atomic.Bool
	hooks    hooks

	// jobFailures are the jobs whose last run failed, groupFailures the producer groups whose
	// last checks a scheduled resolve pass could not record (see recordedGroup).
	jobFailures   failures
	groupFailures failures

	// inconclusive are the groups whose checks end inconclusively (see inconclusiveGroups).
	inconclusive inconclusiveGroups

	// outboxID is the outbox's identity sent with each check (see outbox).
	outboxMu sync.Mutex
	outboxID string

	trace *checkTracer
}

// hooks are fault-injection points for tests.
type hooks struct {
	// afterFenceLock runs while the fence pass holds the row locks of the rows it is about to
	// roll back, before it does.
	afterFenceLock func(ctx context.Context, ids []int64)
}

// groupLimit bounds the checks sent to one producer group.
type groupLimit struct {
	rate *rate.Limiter
	sem  chan struct{}
}

// New returns a CheckBack over db that asks checkers over nc. cfg may be nil for all
// defaults. nc may be nil when only fence-mode half messages are used: checker-mode rows are
// then counted as checks with no responders.
//
// db must be safe for concurrent use (a pool, usually a *pgxpool.Pool): the jobs and the
// checks of several producer groups use it at once. One connection or transaction (a
// *pgx.Conn, a *pgxpool.Conn, a pgx.Tx) is refused with a *txoutbox.ConfigError naming db,
// and so is a nil db.
func New(db txoutbox.DB, nc *nats.Conn, cfg *Config) (*CheckBack, error) {
	if err := dbhandle.RequireArg("checkback", "db", "a pool, such as a *pgxpool.Pool", db); err != nil {
		return nil, err
	}
	if err := dbhandle.RequirePool("checkback", "db", db); err != nil {
		return nil, err
	}
	c := cfg.WithDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	m, err := newMetrics(c.Registerer)
	if err != nil {
		return nil, err
	}
	return &CheckBack{
		cfg:      c,
		db:       db,
		nc:       nc,
		q:        store.New(c.Schema),
		log:      c.Logger.With("component", "checkback"),
		m:        m,
		limiters: map[string]*groupLimit{},
		busy:     map[string]bool{},
		trace:    newCheckTracer(c),
	}, nil
}

// Config returns the effective configuration.
func (c *CheckBack) Config() Config { return *c.cfg }

// Report is what one run of every job did.
type Report struct {
	Resolve ResolveResult
	Stale   StaleResult
	Purge   PurgeResult
}

type job struct {
	name string
	spec string
	run  func(ctx context.Context) error
}

// jobs lists the jobs. With wait false (the scheduler) a resolve run does not wait for slow
// checkers (see resolve).
func (c *CheckBack) jobs(rep *Report, wait bool) []job {
	if rep == nil {
		rep = &Report{}
	}
	return []job{
		{"resolve", c.cfg.ResolveSchedule, func(ctx context.Context) (err error) { rep.Resolve, err = c.resolve(ctx, wait); return }},
		{"stale", c.cfg.StaleSchedule, func(ctx context.Context) (err error) { rep.Stale, err = c.staleOnce(ctx); return }},
		{"purge", c.cfg.PurgeSchedule, func(ctx context.Context) (err error) { rep.Purge, err = c.purgeOnce(ctx); return }},
	}
}

// RunOnce runs each job whose schedule is not "off" once, in order (resolve, stale, purge), and
// reports what they did. It returns the first error, after running every job. A nats-server
// older than MinServerVersion is refused (a *txoutbox.ServerVersionError, txoutbox.ErrServerTooOld) before any job runs.
func (c *CheckBack) RunOnce(ctx context.Context) (*Report, error) {
	rep := &Report{}
	if err := c.checkServerVersion(); err != nil {
		return rep, err
	}
	var first error
	for _, j := range c.jobs(rep, true) {
		if j.spec == ScheduleOff {
			continue
		}
		if err := c.runJob(ctx, j); err != nil && first == nil {
			first = fmt.Errorf("checkback: %s: %w", j.name, err)
		}
	}
	return rep, first
}

// runJob runs one job, timing it and counting its errors. A job that starts failing is
// logged once as a warning, the failed runs that follow at debug level, and the first run
// that succeeds again at info level (an outage is one line, not one per tick). Cancellation
// is not logged.
func (c *CheckBack) runJob(ctx context.Context, j job) error {
	start := time.Now()
	err := j.run(ctx)
	c.m.jobDuration.WithLabelValues(j.name).Observe(time.Since(start).Seconds())
	if err != nil && ctx.Err() != nil {
		return err
	}
	n := c.jobFailures.record(j.name, err != nil)
	switch {
	case err != nil && n == 0:
		c.m.jobErrors.WithLabelValues(j.name).Inc()
		c.log.Warn("check-back job failed; retrying at its next runs (further failures are logged at debug level until one succeeds)", "job", j.name, "err", err)
	case err != nil:
		c.m.jobErrors.WithLabelValues(j.name).Inc()
		c.log.Debug("check-back job failed again", "job", j.name, "failed_runs", n+1, "err", err)
	case n > 0:
		c.log.Info("check-back job succeeds again", "job", j.name, "failed_runs", n)
	}
	return err
}

// failures counts, per key (a job, a producer group), the runs that failed in a row, so that a
// failure that lasts is logged when it starts and when it ends, not once per run.
type failures struct {
	mu   sync.Mutex
	n    map[string]int
	last map[string]time.Time // when each failing key last failed (recordAt)
}

// record notes a run of key as failed or not, and returns how many runs of key had failed in
// a row before it (0: key was not failing).
func (f *failures) record(key string, failed bool) int {
	return f.recordAt(key, failed, time.Time{}, 0)
}

// recordAt is record for a key whose runs are irregular, at now: a producer group has a run
// only while it has due checks, so a failing group whose rows were settled meanwhile has no
// run that succeeds. A failure more than gap after the key's previous one starts a new series
// (0 returned: logged as a new failure, not as the old one going on). gap 0: no such rule.
func (f *failures) recordAt(key string, failed bool, now time.Time, gap time.Duration) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := f.n[key]
	if failed && n > 0 && gap > 0 && now.Sub(f.last[key]) > gap {
		n = 0
	}
	switch {
	case failed:
		if f.n == nil {
			f.n, f.last = map[string]int{}, map[string]time.Time{}
		}
		f.n[key], f.last[key] = n+1, now
	default:
		delete(f.n, key)
		delete(f.last, key)
	}
	return n
}

// Run schedules the jobs and runs them until ctx is cancelled; then it waits for the runs in
// progress to end (they see the cancellation) and returns nil. It refuses at start a
// nats-server older than MinServerVersion (a *txoutbox.ServerVersionError, txoutbox.ErrServerTooOld), and
// returns txoutbox.ErrRunning while another Run of this check-back has not returned.
func (c *CheckBack) Run(ctx context.Context) error {
	if !c.running.CompareAndSwap(false, true) {
		return fmt.Errorf("checkback: Run: %w", txoutbox.ErrRunning)
	}
	defer c.running.Store(false)
	if err := c.checkServerVersion(); err != nil {
		return err
	}
	logger := cronLogger{c.log}
	cr := cron.New(cron.WithLogger(logger), cron.WithChain(cron.Recover(logger), cron.SkipIfStillRunning(logger)))
	for _, j := range c.jobs(nil, false) {
		sched, err := parseSchedule(j.spec)
		if err != nil {
			return err
		}
		if sched == nil {
			continue
		}
		cr.Schedule(sched, cron.FuncJob(func() { _ = c.runJob(ctx, j) }))
	}
	c.log.Info("check-back started", "schema", c.cfg.Schema, "transaction_timeout", c.cfg.transactionTimeout().String(),
		"max_checks", c.cfg.MaxChecks, "resolve", c.cfg.ResolveSchedule, "stale", c.cfg.StaleSchedule, "purge", c.cfg.PurgeSchedule)
	cr.Start()
	<-ctx.Done()
	<-cr.Stop().Done()
	c.bg.Wait() // checks still in flight see the cancellation, give their rows back and end
	c.log.Info("check-back stopped")
	return nil
}

// cronLogger adapts slog to cron.Logger. Cron's info lines (schedule, skips) go to debug.
type cronLogger struct{ l *slog.Logger }

func (l cronLogger) Info(msg string, kv ...any) { l.l.Debug("cron: "+msg, kv...) }
func (l cronLogger) Error(err error, msg string, kv ...any) {
	l.l.Error("cron: "+msg, append(kv, "err", err)...)
}

// backoff is backoff.Exponential: base·2^(n-1) times a random factor in [1-jitter, 1+jitter],
// capped at max (the cap holds after the jitter).
var backoff = backoffpkg.Exponential
