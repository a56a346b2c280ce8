package checkback

import (
	"cmp"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/robfig/cron/v3"
	"github.com/txoutbox/txoutbox"
	backoffpkg "github.com/txoutbox/txoutbox/internal/backoff"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/outbox/checker"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Defaults for Config.
const (
	// DefaultTransactionTimeout is RocketMQ's: a half message is first checked 6s after it was
	// prepared.
	DefaultTransactionTimeout = 6 * time.Second
	// DefaultMaxChecks is RocketMQ's: after 15 inconclusive checks a row is check_exhausted.
	DefaultMaxChecks = 15
	// DefaultRequestTimeout is checker.DefaultRequestTimeout, the one value the check-back and
	// the checkers share (a checker bounds a request that does not say its timeout by it).
	DefaultRequestTimeout = checker.DefaultRequestTimeout
	DefaultBackoffBase    = 5 * time.Second
	DefaultBackoffMax     = time.Minute
	DefaultBackoffJitter  = 0.2
	DefaultBatchSize      = 100
	// DefaultGroupConcurrency and DefaultGroupRate bound the checks one check-back instance
	// sends to one producer group: at most 4 in flight and 20 per second.
	DefaultGroupConcurrency = 4
	DefaultGroupRate        = 20.0
	// DefaultSubjectPrefix is checker.DefaultSubjectPrefix, the one value the check-back and
	// the checkers share; it has this name too so that every Config default is in its package.
	DefaultSubjectPrefix = checker.DefaultSubjectPrefix

	DefaultResolveSchedule = "@every 1s"
	DefaultStaleSchedule   = "@every 30s"
	DefaultPurgeSchedule   = "@every 1m"
	DefaultStaleReadyAfter = time.Minute

	// DefaultRolledBackRetention keeps rolled back half messages a day, for inspection.
	DefaultRolledBackRetention = 24 * time.Hour
	// DefaultDedupRetention keeps consumer dedup rows a week. The rule: several times the
	// longest window in which a message can be delivered again (the consumer's ack wait ×
	// max deliveries plus its backoff, and the relay's worst republish delay); a dedup row
	// purged earlier lets a late redelivery apply twice.
	DefaultDedupRetention = 7 * 24 * time.Hour
	DefaultPurgeBatchSize = 1000
	// DefaultPublishedRetention leaves published rows alone: a check-back that does not know
	// the relay's retention must not cut it short.
	DefaultPublishedRetention = txoutbox.Forever
)

// ScheduleOff, as a schedule, disables a job.
const ScheduleOff = "off"

// Config configures a CheckBack. The zero value, given a pool and a NATS connection, is usable.
type Config struct {
	// Schema is the Postgres schema holding the outbox tables: at most 63 bytes, no NUL byte.
	// Defaults to txoutbox.DefaultSchema ("public").
	Schema string

	// TransactionTimeout is how long a half message may stay prepared before it is checked
	// (RocketMQ's transaction timeout). A per-message PrepareOptions.CheckImmunity can only
	// delay the first check further. txoutbox.Off: rows are checked as soon as the resolve
	// job runs. Defaults to 6s.
	TransactionTimeout time.Duration

	// MaxChecks is how many inconclusive checks (UNKNOWN, an error reply, a timeout, no
	// responders, a malformed reply) make a row check_exhausted: a terminal state that is
	// counted, logged and listed, and that `relay prepared resume|commit|rollback` leaves.
	// It has no off or forever value (-1 is refused): a half message nobody can answer for
	// must end somewhere an operator sees it. Defaults to 15.
	MaxChecks int

	// RequestTimeout bounds one check request to a producer group's checker. At least 1ms.
	// Defaults to 3s.
	RequestTimeout time.Duration

	// BackoffBase, BackoffMax and BackoffJitter space the checks of one row: after check n
	// the next is due BackoffBase·2^(n-1) later, capped at BackoffMax, times a random factor
	// in [1-BackoffJitter, 1+BackoffJitter]; a jittered delay above BackoffMax is reflected
	// below it, so none exceeds BackoffMax. Both durations are at most 24h, and BackoffMax at
	// least BackoffBase. BackoffJitter is in (0, 1), or txoutbox.Off for no jitter (0 is the
	// default). Defaults to 5s, max(1m, BackoffBase) (BackoffBase alone may be set above 1m)
	// and 0.2.
	BackoffBase   time.Duration
	BackoffMax    time.Duration
	BackoffJitter float64

	// BatchSize bounds the rows one resolve pass takes, for each of the two modes (checker
	// and fence). At most 10000. Defaults to 100.
	BatchSize int

	// GroupConcurrency and GroupRate bound the check requests this instance sends to one
	// producer group: at most GroupConcurrency in flight and GroupRate per second, so that
	// many stale rows never become a request storm. GroupRate txoutbox.Forever: no rate
	// limit (GroupConcurrency still bounds the requests); otherwise a finite positive rate
	// (NaN and +Inf are refused). GroupConcurrency has no off or
	// forever value (-1 is refused). Defaults to 4 and 20.
	GroupConcurrency int
	GroupRate        float64

	// Outbox identifies this outbox in every check request; a checker (checker.Serve) answers only
	// the requests of the outbox it is given as checker.Config.Outbox, so that two services
	// using the same producer group name on one NATS never settle each other's messages.
	// Set it to an explicit name (the same on both sides) to decouple it from the database.
	// Defaults to checker.OutboxIdentity of the pool and Schema:
	// "<system identifier>/<database>/<schema>".
	Outbox string

	// SubjectPrefix: a producer group's checker is asked on SubjectPrefix + "." + group.
	// checker.Serve must use the same prefix. A valid subject without wildcards. Defaults to
	// "txoutbox.check".
	SubjectPrefix string

	// Schedules of the three jobs: a robfig/cron spec (five fields, or six with seconds
	// first), a descriptor such as "@hourly", "@every <duration>" (at least 10ms: sub-second
	// durations allowed), or ScheduleOff ("off"); white space around it is ignored (WithDefaults trims
	// it, so Config() shows " off" as "off"). A run that is still going when the next is due
	// is skipped.
	// ResolveSchedule resolves stale prepared rows; StaleSchedule reports ready rows older
	// than StaleReadyAfter and counts prepared and exhausted rows; PurgeSchedule deletes rows
	// past their retention. Defaults to "@every 1s", "@every 30s" and "@every 1m"
	// (DefaultResolveSchedule, DefaultStaleSchedule, DefaultPurgeSchedule).
	ResolveSchedule string
	StaleSchedule   string
	PurgeSchedule   string

	// StaleReadyAfter: ready rows older than this (the relay is stuck, or a subject keeps
	// failing) are counted and logged with the oldest age. Positive. Defaults to 1m.
	StaleReadyAfter time.Duration

	// PublishedRetention: published rows (kept by a relay with a retention) older than this
	// are purged. Set it to the relay's retention; `relay run` does. Defaults to
	// txoutbox.Forever: published rows are not purged (a relay without a retention deletes
	// them as it publishes, so there are none; a check-back that does not know the relay's
	// retention must not cut it short).
	PublishedRetention time.Duration

	// RolledBackRetention: rolled back half messages older than this are purged;
	// txoutbox.Forever keeps them. Defaults to 24h.
	RolledBackRetention time.Duration

	// DedupRetention: consumer dedup rows processed longer ago than this are purged. Keep it
	// several times the longest redelivery window (see DefaultDedupRetention);
	// txoutbox.Forever keeps them. Defaults to 7 days.
	DedupRetention time.Duration

	// PurgeBatchSize bounds the rows one DELETE removes (each batch is its own short
	// transaction, skipping locked rows). At most 100000. Defaults to 1000.
	PurgeBatchSize int

	// Logger receives structured logs, one line per state change. Defaults to slog.Default().
	Logger *slog.Logger

	// Registerer, when set, registers the check-back's Prometheus metrics. Check-backs
	// sharing a registry share the collectors. Defaults to none.
	Registerer prometheus.Registerer

	// TracerProvider provides the tracer of the check spans: one per check request ("check
	// <group>", kind client), a child of the trace context the half message captured when it
	// was prepared, ended with the check's outcome. The request carries the span's context in
	// its headers, and the checker (checker.Serve) continues it. Defaults to the global
	// provider (otel.GetTracerProvider), which records nothing until the application sets one.
	TracerProvider trace.TracerProvider

	// Propagator reads the half message's trace context from its headers and writes the check
	// span's into the request. Defaults to the global propagator (otel.GetTextMapPropagator),
	// which does nothing until the application sets one.
	Propagator propagation.TextMapPropagator
}

// WithDefaults returns a copy of c with every unset field set to its default, and the
// schedules trimmed of surrounding white space, except: Outbox stays empty (its default, the
// database's identity, is read at the first check: see CheckBack.OutboxIdentity); Registerer
// stays nil (no metrics, its default); and a nil TracerProvider and Propagator stay nil: they
// mean OpenTelemetry's global provider and propagator (otel.GetTracerProvider,
// otel.GetTextMapPropagator), taken by New, not filled in here. c may be nil.
func (c *Config) WithDefaults() *Config {
	out := Config{}
	if c != nil {
		out = *c
	}
	out.Schema = cmp.Or(out.Schema, txoutbox.DefaultSchema)
	out.TransactionTimeout = cmp.Or(out.TransactionTimeout, DefaultTransactionTimeout)
	out.MaxChecks = cmp.Or(out.MaxChecks, DefaultMaxChecks)
	out.RequestTimeout = cmp.Or(out.RequestTimeout, DefaultRequestTimeout)
	out.BackoffBase = cmp.Or(out.BackoffBase, DefaultBackoffBase)
	out.BackoffMax = cmp.Or(out.BackoffMax, max(DefaultBackoffMax, out.BackoffBase))
	out.BackoffJitter = cmp.Or(out.BackoffJitter, DefaultBackoffJitter)
	out.BatchSize = cmp.Or(out.BatchSize, DefaultBatchSize)
	out.GroupConcurrency = cmp.Or(out.GroupConcurrency, DefaultGroupConcurrency)
	out.GroupRate = cmp.Or(out.GroupRate, DefaultGroupRate)
	out.SubjectPrefix = cmp.Or(out.SubjectPrefix, DefaultSubjectPrefix)
	// Trimmed after the default: a schedule of white space alone stays invalid.
	out.ResolveSchedule = strings.TrimSpace(cmp.Or(out.ResolveSchedule, DefaultResolveSchedule))
	out.StaleSchedule = strings.TrimSpace(cmp.Or(out.StaleSchedule, DefaultStaleSchedule))
	out.PurgeSchedule = strings.TrimSpace(cmp.Or(out.PurgeSchedule, DefaultPurgeSchedule))
	out.StaleReadyAfter = cmp.Or(out.StaleReadyAfter, DefaultStaleReadyAfter)
	out.PublishedRetention = cmp.Or(out.PublishedRetention, DefaultPublishedRetention)
	out.RolledBackRetention = cmp.Or(out.RolledBackRetention, DefaultRolledBackRetention)
	out.DedupRetention = cmp.Or(out.DedupRetention, DefaultDedupRetention)
	out.PurgeBatchSize = cmp.Or(out.PurgeBatchSize, DefaultPurgeBatchSize)
	if out.Logger == nil {
		out.Logger = slog.Default()
	}
	return &out
}

// transactionTimeout is TransactionTimeout as the queries take it.
func (c *Config) transactionTimeout() time.Duration {
	if c.TransactionTimeout == txoutbox.Off {
		return 0
	}
	return c.TransactionTimeout
}

func (c *Config) validate() error {
	bad := func(field, format string, args ...any) error {
		return &txoutbox.ConfigError{Package: "checkback", Field: "Config." + field, Reason: fmt.Sprintf(format, args...)}
	}
	// badErr is bad for a failure with an error behind it (a validation sentinel), kept as Err.
	badErr := func(field string, err error, format string, args ...any) error {
		return &txoutbox.ConfigError{Package: "checkback", Field: "Config." + field, Reason: fmt.Sprintf(format, args...), Err: err}
	}
	if err := migrations.ValidateSchemaName(c.Schema); err != nil {
		return bad("Schema", "is invalid: %v", err)
	}
	switch {
	case c.TransactionTimeout < 0 && c.TransactionTimeout != txoutbox.Off:
		return bad("TransactionTimeout", "must be positive, or txoutbox.Off (-1), got %s", c.TransactionTimeout)
	case c.MaxChecks < 1:
		return bad("MaxChecks", "must be at least 1, got %d", c.MaxChecks)
	case c.RequestTimeout < time.Millisecond:
		return bad("RequestTimeout", "must be at least 1ms, got %s", c.RequestTimeout)
	case c.BackoffBase <= 0 || c.BackoffBase > backoffpkg.MaxDelay:
		return bad("BackoffBase", "must be positive and at most %s, got %s", backoffpkg.MaxDelay, c.BackoffBase)
	case c.BackoffMax < c.BackoffBase:
		return bad("BackoffMax", "must be at least BackoffBase (%s), got %s", c.BackoffBase, c.BackoffMax)
	case c.BackoffMax > backoffpkg.MaxDelay:
		return bad("BackoffMax", "must be at most %s, got %s", backoffpkg.MaxDelay, c.BackoffMax)
	case c.BackoffJitter != txoutbox.Off && !(c.BackoffJitter > 0 && c.BackoffJitter < 1): // NaN too
		return bad("BackoffJitter", "must be in (0, 1), or txoutbox.Off (-1) for no jitter (0 is the default), got %g", c.BackoffJitter)
	case c.BatchSize < 1 || c.BatchSize > 10000:
		return bad("BatchSize", "must be between 1 and 10000, got %d", c.BatchSize)
	case c.GroupConcurrency < 1:
		return bad("GroupConcurrency", "must be at least 1, got %d", c.GroupConcurrency)
	case c.GroupRate != txoutbox.Forever && !(c.GroupRate > 0 && !math.IsInf(c.GroupRate, 1)): // NaN too
		return bad("GroupRate", "must be a finite positive rate, or txoutbox.Forever (-1) for no limit, got %g", c.GroupRate)
	case c.StaleReadyAfter <= 0:
		return bad("StaleReadyAfter", "must be positive, got %s", c.StaleReadyAfter)
	case c.PublishedRetention <= 0 && c.PublishedRetention != txoutbox.Forever:
		return bad("PublishedRetention", "must be positive, or txoutbox.Forever (-1), got %s", c.PublishedRetention)
	case c.RolledBackRetention <= 0 && c.RolledBackRetention != txoutbox.Forever:
		return bad("RolledBackRetention", "must be positive, or txoutbox.Forever (-1), got %s", c.RolledBackRetention)
	case c.DedupRetention <= 0 && c.DedupRetention != txoutbox.Forever:
		return bad("DedupRetention", "must be positive, or txoutbox.Forever (-1), got %s", c.DedupRetention)
	case c.PurgeBatchSize < 1 || c.PurgeBatchSize > 100000:
		return bad("PurgeBatchSize", "must be between 1 and 100000, got %d", c.PurgeBatchSize)
	}
	if err := outbox.ValidateSubject(c.SubjectPrefix); err != nil {
		return badErr("SubjectPrefix", err, "is invalid: %v", err)
	}
	// In the fields' order, so that of several invalid schedules the same one is reported
	// every time (a map's order is random).
	for _, s := range []struct{ field, spec string }{
		{"ResolveSchedule", c.ResolveSchedule}, {"StaleSchedule", c.StaleSchedule}, {"PurgeSchedule", c.PurgeSchedule},
	} {
		if _, err := parseSchedule(s.spec); err != nil {
			return bad(s.field, "is invalid: %v", err)
		}
	}
	return nil
}

// ValidateConfig reports whether cfg, with defaults applied, is valid; errors are
// *txoutbox.ConfigError values naming the field.
func ValidateConfig(cfg *Config) error { return cfg.WithDefaults().validate() }

var cronParser = cron.NewParser(cron.SecondOptional | cron.Minute | cron.Hour | cron.Dom | cron.Month | cron.Dow | cron.Descriptor)

// every fires every d, sub-second durations included (cron's own @every rounds to seconds).
type every time.Duration

func (e every) Next(t time.Time) time.Time { return t.Add(time.Duration(e)) }

// parseSchedule parses a job schedule, as WithDefaults left it (trimmed): "off" (nil, nil),
// "@every <duration>" (at least 10ms), or any robfig/cron spec with optional seconds and
// descriptors.
func parseSchedule(spec string) (cron.Schedule, error) {
	if spec == ScheduleOff {
		return nil, nil
	}
	if rest, ok := strings.CutPrefix(spec, "@every "); ok {
		d, err := time.ParseDuration(strings.TrimSpace(rest))
		if err != nil {
			return nil, fmt.Errorf("%q: %v", spec, err)
		}
		if d < 10*time.Millisecond {
			return nil, fmt.Errorf("%q: the interval must be at least 10ms", spec)
		}
		return every(d), nil
	}
	s, err := cronParser.Parse(spec)
	if err != nil {
		return nil, fmt.Errorf("%q: %v", spec, err)
	}
	return s, nil
}
