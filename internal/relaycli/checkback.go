package relaycli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
	"time"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/checkback"
	"github.com/txoutbox/txoutbox/internal/redact"
)

func init() {
	register(command{name: "checkback", summary: "resolve stale half messages, report stuck rows, purge old rows (--once, or until a signal)", run: checkbackCmd})
}

const checkbackUsage = `
relay checkback: run the check-back jobs — resolve half messages left prepared past the
transaction timeout (ask their producer group's checker, or fence), report ready rows older
than a threshold, purge rows past their retention. With --once, run each job once, print what
it did and exit; otherwise run them on their schedules until SIGINT or SIGTERM.
` + "`relay run`" + ` runs the same jobs by default (see its --no-checkback).

Usage:
  relay checkback [--once] [settings]
`

// checkbackFieldFlags maps checkback.Config fields to the flags that set them.
var checkbackFieldFlags = map[string]string{
	"Schema": "schema", "TransactionTimeout": "check-transaction-timeout", "MaxChecks": "check-max",
	"RequestTimeout": "check-request-timeout", "BackoffBase": "check-backoff-base", "BackoffMax": "check-backoff-max",
	"BackoffJitter": "check-backoff-jitter", "BatchSize": "check-batch-size", "GroupConcurrency": "check-group-concurrency",
	"GroupRate": "check-group-rate", "SubjectPrefix": "check-subject-prefix", "Outbox": "check-outbox", "ResolveSchedule": "check-schedule",
	"StaleSchedule": "stale-schedule", "PurgeSchedule": "purge-schedule", "StaleReadyAfter": "stale-ready-after",
	"PublishedRetention": "retention", "RolledBackRetention": "rolled-back-retention", "DedupRetention": "dedup-retention",
	"PurgeBatchSize": "purge-batch-size",
}

// defineCheckbackFlags adds the check-back settings to s. withRetention adds --retention (relay
// run has its own, shared with the relay).
func defineCheckbackFlags(s *settings, c *checkback.Config, withRetention bool) {
	sec := s.Section("Check-back (half messages, stale rows, retention)")
	s.DurationOr(&c.TransactionTimeout, "check-transaction-timeout", "", checkback.DefaultTransactionTimeout, "off", "check a half message once it has been prepared this long (off, -1 or 0: at once)")
	sec("check-transaction-timeout")
	s.Int(&c.MaxChecks, "check-max", "", checkback.DefaultMaxChecks, "inconclusive checks before a half message is check_exhausted")
	s.Duration(&c.RequestTimeout, "check-request-timeout", "", checkback.DefaultRequestTimeout, "wait for a checker's answer at most")
	s.Duration(&c.BackoffBase, "check-backoff-base", "", checkback.DefaultBackoffBase, "delay after the first inconclusive check (doubles after each)")
	s.Duration(&c.BackoffMax, "check-backoff-max", "", checkback.DefaultBackoffMax, "longest delay between checks")
	s.FloatOr(&c.BackoffJitter, "check-backoff-jitter", "", checkback.DefaultBackoffJitter, "off", "random spread of the delay between checks, a fraction in [0, 1) (off, -1 or 0: none)")
	s.Int(&c.BatchSize, "check-batch-size", "", checkback.DefaultBatchSize, "half messages one resolve pass takes at most (per mode)")
	s.Int(&c.GroupConcurrency, "check-group-concurrency", "", checkback.DefaultGroupConcurrency, "check requests in flight per producer group at most")
	s.FloatOr(&c.GroupRate, "check-group-rate", "", checkback.DefaultGroupRate, "forever", "check requests per second per producer group at most (forever or -1: no rate limit; --check-group-concurrency still bounds them)")
	s.String(&c.SubjectPrefix, "check-subject-prefix", "", checkback.DefaultSubjectPrefix, "checkers serve <prefix>.<group>")
	s.String(&c.Outbox, "check-outbox", "", "", "name of this outbox in check requests; checkers answer only their own outbox's (default <database system identifier>/<database>/<schema>, see checker.OutboxIdentity)")
	s.String(&c.ResolveSchedule, "check-schedule", "", checkback.DefaultResolveSchedule, "when to resolve stale half messages (cron spec, @every <duration>, or off)")
	s.String(&c.StaleSchedule, "stale-schedule", "", checkback.DefaultStaleSchedule, "when to report stale ready rows (cron spec, @every <duration>, or off)")
	s.Duration(&c.StaleReadyAfter, "stale-ready-after", "", checkback.DefaultStaleReadyAfter, "report ready rows older than this")
	s.String(&c.PurgeSchedule, "purge-schedule", "", checkback.DefaultPurgeSchedule, "when to purge rows past their retention (cron spec, @every <duration>, or off)")
	if withRetention {
		s.DurationOr(&c.PublishedRetention, "retention", "", checkback.DefaultPublishedRetention, "forever", "purge published rows older than this (set it to the relay's --retention; 0, as there, keeps none: every pass purges every published row; forever or -1 leaves them alone)")
	}
	s.DurationOr(&c.RolledBackRetention, "rolled-back-retention", "", checkback.DefaultRolledBackRetention, "forever", "purge rolled back half messages older than this (forever or -1: never)")
	s.DurationOr(&c.DedupRetention, "dedup-retention", "", checkback.DefaultDedupRetention, "forever", "purge consumer dedup rows older than this (keep several times the longest redelivery window; forever or -1: never)")
	s.Int(&c.PurgeBatchSize, "purge-batch-size", "", checkback.DefaultPurgeBatchSize, "rows one purge statement deletes at most")
}

// checkCheckbackFlags refuses zero values that checkback.Config would silently replace by its
// defaults, then validates the configuration.
func checkCheckbackFlags(c *checkback.Config) error {
	// --retention 0 is literal, as relay run's: keep no published row, so every pass purges
	// every published row (checkback.Config reads 0 as its default, forever; the shortest
	// positive age is the same as none).
	if c.PublishedRetention == 0 {
		c.PublishedRetention = time.Nanosecond
	}
	for name, v := range map[string]int64{
		"check-max":             int64(c.MaxChecks),
		"check-request-timeout": int64(c.RequestTimeout), "check-backoff-base": int64(c.BackoffBase),
		"check-backoff-max": int64(c.BackoffMax), "check-batch-size": int64(c.BatchSize),
		"check-group-concurrency": int64(c.GroupConcurrency), "stale-ready-after": int64(c.StaleReadyAfter),
		"rolled-back-retention": posOrForever(c.RolledBackRetention), "dedup-retention": posOrForever(c.DedupRetention),
		"retention":        posOrForever(c.PublishedRetention),
		"purge-batch-size": int64(c.PurgeBatchSize),
	} {
		if v <= 0 {
			return usageErr("invalid --%s: must be positive", name)
		}
	}
	if c.GroupRate <= 0 && c.GroupRate != float64(txoutbox.Forever) {
		return usageErr("invalid --check-group-rate: must be positive, or forever (-1) for no rate limit")
	}
	// Command-line values are literal: 0 means none (txoutbox.Off) where checkback.Config
	// would read it as "the default".
	if c.TransactionTimeout == 0 {
		c.TransactionTimeout = txoutbox.Off
	}
	if c.BackoffJitter == 0 {
		c.BackoffJitter = txoutbox.Off
	}
	return checkbackConfigErr(checkback.ValidateConfig(c))
}

// posOrForever maps txoutbox.Forever to 1 for the positive check: it is allowed.
func posOrForever(d time.Duration) int64 {
	if d == txoutbox.Forever {
		return 1
	}
	return int64(d)
}

// checkbackConfigErr turns a checkback configuration error into a usage error naming the flag.
func checkbackConfigErr(err error) error {
	var ce *txoutbox.ConfigError
	if errors.As(err, &ce) {
		if name, ok := checkbackFieldFlags[strings.TrimPrefix(ce.Field, "Config.")]; ok {
			return usageErr("invalid --%s: %s", name, ce.Reason)
		}
	}
	return err
}

func checkbackCmd(ctx context.Context, env *Env, args []string) error {
	var dsn, natsURL, schema, metricsAddr, logFormat, level string
	var once bool
	var cfg checkback.Config
	var auth natsAuth
	s := newSettings("checkback", checkbackUsage, env.Stderr, env.Getenv)
	sec := s.Section("Connections")
	s.String(&dsn, "database-url", "DATABASE_URL", "", "PostgreSQL connection URL (required)")
	sec("database-url")
	s.String(&natsURL, "nats-url", "NATS_URL", DefaultNATSURL, "NATS server URL (checkers are asked over it)")
	s.String(&schema, "schema", "", txoutbox.DefaultSchema, "Postgres schema holding the outbox tables")
	defineNATSAuthFlags(s, &auth)
	sec = s.Section("Mode")
	s.Bool(&once, "once", "", false, "run each job once (those not scheduled off), print what they did, and exit")
	sec("once")
	defineCheckbackFlags(s, &cfg, true)
	defineMetricsAddr(s, &metricsAddr)
	s.String(&logFormat, "log-format", "", "text", "log format: text or json")
	s.String(&level, "log-level", "", "info", "log level: debug, info, warn or error")
	if err := parseSettings(s, env, args); err != nil {
		return err
	}
	if len(s.Args()) > 0 {
		return usageErr("unexpected arguments %q", s.Args())
	}
	if err := checkNATSURL(natsURL); err != nil {
		return err
	}
	natsOpts, err := auth.options(natsURL)
	if err != nil {
		return err
	}
	if dsn == "" {
		return usageErr("no database: set DATABASE_URL or --database-url")
	}
	cfg.Schema = schema
	if err := checkCheckbackFlags(&cfg); err != nil {
		return err
	}
	if err := checkMetricsAddr(metricsAddr); err != nil {
		return err
	}
	log, err := newLogger(env.Stderr, logFormat, level)
	if err != nil {
		return err
	}
	cfg.Logger = log
	tr, err := setupTracing(ctx, env, log, defaultServiceName)
	if err != nil {
		return err
	}
	defer closeTracing(ctx, tr, log)
	cfg.TracerProvider, cfg.Propagator = tr.tp, tr.prop
	if metricsAddr != "" && once {
		log.Info("--metrics-addr is ignored with --once")
	}
	reg := newRegistry()
	waiting := &waitState{}
	var target *opsTarget
	if metricsAddr != "" && !once {
		cfg.Registerer = reg
		// Served from the start: /healthz answers and /readyz says what the check-back waits for.
		srv, t, err := startOpsEarly(metricsAddr, reg, "", schema, waiting, log)
		if err != nil {
			return err
		}
		defer srv.Close()
		target = t
	}
	c, err := connect(ctx, connectOptions{DSN: dsn, NATSURL: natsURL, NeedNATS: true, NATSAuth: natsOpts, Schema: schema, Log: log,
		AppName: "txoutbox-checkback", Wait: !once, Waiting: waiting})
	if err != nil {
		return err
	}
	defer c.Close()
	if err := checkSchema(ctx, c.Pool, schema); err != nil {
		return err
	}
	cb, err := checkback.New(c.Pool, c.NC, &cfg)
	if err != nil {
		return checkbackConfigErr(err)
	}
	if !once {
		if target != nil {
			target.attachCheckback(c, schema)
		}
		// A NATS connection nats.go gives up on for good (credentials refused after a
		// rotation) ends the daemon with exit status 1, so that its supervisor restarts it.
		ctx, stopWatching := c.untilNATSLost(ctx)
		defer stopWatching()
		return c.withNATSLost(cb.Run(ctx))
	}
	rep, err := cb.RunOnce(ctx)
	eff := cb.Config() // the schedules as the check-back reads them (" off" is off)
	printReport(env.Stdout, rep, &eff)
	if err != nil {
		return err
	}
	return uncheckedErr(rep, c)
}

// uncheckedErr is the failure of a `checkback --once` that left half messages due for a check
// without an answer from their checker, so that a cron job sees it: rows given back unchecked
// (NATS did not answer, or the pass ran out of time), and checks nobody answered (no
// responders: no checker serves the group; a timeout) or answered with an error or a malformed
// reply. An UNKNOWN answer is an answer (the producer does not know yet) and fails nothing;
// nothing due is not a failure, whether NATS answers or not.
func uncheckedErr(rep *checkback.Report, c *conns) error {
	if rep == nil {
		return nil
	}
	if n := rep.Resolve.Released; n > 0 {
		why := "the pass ran out of time (see --check-request-timeout, --check-group-concurrency and --check-group-rate)"
		if !c.NC.IsConnected() {
			why = "NATS at " + redact.NATS(c.NATSURL) + " does not answer"
			if err := c.NATSDown; err != nil {
				why += " (" + err.Error() + ")"
			}
		}
		return fmt.Errorf("could not check %d %s due for a check: %s; %s prepared, to be checked at a later run",
			n, plural(n, "half message", "half messages"), why, plural(n, "it stays", "they stay"))
	}
	var parts []string
	failed := 0
	for _, o := range []string{checkback.OutcomeNoResponders, checkback.OutcomeTimeout, checkback.OutcomeError, checkback.OutcomeMalformed} {
		if n := rep.Resolve.Checks[o]; n > 0 {
			failed += n
			parts = append(parts, fmt.Sprintf("%s %d", o, n))
		}
	}
	if failed == 0 {
		return nil
	}
	what, counts := fmt.Sprintf("%d checks of half messages got no answer from their checker", failed), "each counts a check, and the rows stay prepared"
	if failed == 1 {
		what, counts = "1 check of a half message got no answer from its checker", "it counts a check, and the row stays prepared"
	}
	return fmt.Errorf("%s (%s): no checker serves the group (no_responders), it did not reply in --check-request-timeout (timeout), or it failed (error, malformed); %s, to be asked again at a later run until --check-max", what, strings.Join(parts, ", "), counts)
}

// printReport prints what one run of each job did.
func printReport(w io.Writer, r *checkback.Report, cfg *checkback.Config) {
	if r == nil {
		return
	}
	if cfg.ResolveSchedule != checkback.ScheduleOff {
		inconclusive := 0
		var parts []string
		keys := make([]string, 0, len(r.Resolve.Checks))
		for k := range r.Resolve.Checks {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			if k != checkback.OutcomeCommit && k != checkback.OutcomeRollback {
				inconclusive += r.Resolve.Checks[k]
				parts = append(parts, fmt.Sprintf("%s %d", k, r.Resolve.Checks[k]))
			}
		}
		detail := ""
		if len(parts) > 0 {
			detail = " (" + strings.Join(parts, ", ") + ")"
		}
		fmt.Fprintf(w, "resolve: fenced %d, committed %d, rolled back %d, inconclusive checks %d%s, exhausted %d, not checked %d\n",
			r.Resolve.Fenced, r.Resolve.Committed, r.Resolve.RolledBack, inconclusive, detail, r.Resolve.Exhausted, r.Resolve.Released)
	}
	if cfg.StaleSchedule != checkback.ScheduleOff {
		oldest := "none" // no ready row (checkback.StaleResult.OldestReady is 0)
		if r.Stale.OldestReady > 0 {
			oldest = r.Stale.OldestReady.Round(time.Millisecond).String()
		}
		fmt.Fprintf(w, "stale:   ready rows older than %s: %d, oldest ready row: %s, prepared: %d, check_exhausted: %d\n",
			cfg.StaleReadyAfter, r.Stale.StaleReady, oldest, r.Stale.Prepared, r.Stale.Exhausted)
	}
	if cfg.PurgeSchedule != checkback.ScheduleOff {
		fmt.Fprintf(w, "purge:   published %d, rolled back %d, dedup %d\n", r.Purge.Published, r.Purge.RolledBack, r.Purge.Dedup)
	}
}
